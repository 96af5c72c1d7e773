"""PPO's critic (learner/critic.py) with a seeded, non-zero value head: its values position by
position and its clipped value loss, each against an independent computation.

A fresh critic's head is 0, so V = 0 everywhere and a read one position off would still agree;
these tests seed the head first."""

import pytest
import torch

from learner.batch import build_batch
from learner.trainer import Learner
from pipeline.assets.tiny_policy import build_tiny_policy
from pipeline.config.schema import LearnerConfig
from tests.learner.test_trainer import TEXTS, groups


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny", TEXTS, vocab_size=500)


def seeded_critic(policy, value_clip):
    """A GAE learner's critic whose head is drawn from a fixed seed (V differs at every position)."""
    config = LearnerConfig(
        micro_batch_size=3,
        zero_stage=0,
        max_steps=5,
        advantage={"type": "gae", "value_clip": value_clip},
    )
    critic = Learner(policy, config, group_size=4, dtype="float32").critic
    draw = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in critic.model.score.parameters():
            p.copy_(torch.randn(p.shape, generator=draw).to(p))
    return critic


def members(seed: int):
    """Trajectories of different lengths and masks, so packed offsets and padding both matter."""
    return [t for g in groups(seed, tokens=lambda g, i: 9 + 5 * i + 3 * g) for t in g.members]


def one_by_one(critic, trajectories, width: int) -> torch.Tensor:
    """V of each trained token from the critic's model run on its trajectory alone (no padding,
    no packing), read at the position before the token: [b, width], 0 where not trained."""
    on = next(critic.model.parameters()).device
    out = torch.zeros(len(trajectories), width)
    with torch.no_grad():
        for row, t in enumerate(trajectories):
            ids = [*t.prompt_token_ids.tolist(), *t.token_ids.tolist()]
            scores = critic.model(input_ids=torch.tensor([ids], device=on)).logits[0, :, 0]
            p = len(t.prompt_token_ids)
            for j, trained in enumerate(t.loss_mask.tolist()):
                if trained:
                    out[row, j] = float(scores[p - 1 + j])
    return out


@pytest.mark.parametrize("packed", [True, False])
def test_values_are_read_at_the_position_before_each_trained_token(policy, packed):
    critic = seeded_critic(policy, 0.5)
    trajectories = members(3)
    batch = build_batch(trajectories, torch.zeros(len(trajectories)), 0)
    got, _ = critic.values(batch, packed)
    want = one_by_one(critic, trajectories, got.shape[1])
    trained = batch.response_mask[:, : got.shape[1]] > 0
    assert want[trained].abs().min() > 1e-4  # a non-zero head: a shifted read cannot agree
    assert (want[trained][1:] - want[trained][:-1]).abs().max() > 1e-2
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


def loop_value_loss(values, old, returns, mask, clip):
    """0.5 * max((V - G)^2, (V_old + clip(V - V_old, -c, c) - G)^2) summed over trained tokens,
    one token at a time in Python floats; and how many tokens the clipped term won."""
    total, won = 0.0, 0
    for v, o, g, m in zip(
        values.flatten().tolist(),
        old.flatten().tolist(),
        returns.flatten().tolist(),
        mask.flatten().tolist(),
        strict=True,
    ):
        if not m:
            continue
        plain = (v - g) ** 2
        if clip is None:
            total += 0.5 * plain
            continue
        bounded = o + min(max(v - o, -clip), clip)
        clipped = (bounded - g) ** 2
        won += clipped > plain
        total += 0.5 * max(plain, clipped)
    return total, won


@pytest.mark.parametrize("clip", [0.2, None])
def test_the_value_loss_is_ppos_clipped_loss_token_by_token(policy, clip):
    critic = seeded_critic(policy, clip)
    trajectories = members(4)
    batch = build_batch(trajectories, torch.zeros(len(trajectories)), 0)
    values, _ = critic.values(batch, True)
    values = values.detach().cpu()
    width = values.shape[1]
    mask = batch.response_mask[:, :width]
    draw = torch.Generator().manual_seed(11)
    # old values within and beyond the clip of V, returns on both sides: both branches of max
    old = values + torch.empty(values.shape).uniform_(-0.6, 0.6, generator=draw)
    returns = values + torch.empty(values.shape).uniform_(-1.0, 1.0, generator=draw)
    loss, stats = critic.loss(batch, old, returns, True)
    want, won = loop_value_loss(values, old, returns, mask, clip)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-4)
    assert stats["value_loss_sum"] == pytest.approx(want, rel=1e-4)
    assert stats["value_clip_frac_sum"] == won
    if clip is not None:
        assert 0 < won < int(mask.sum())  # the clipped term won on some tokens, not all
        unclipped, _ = loop_value_loss(values, old, returns, mask, None)
        assert want > unclipped * 1.05
