"""PPO's critic (learner/critic.py) with a seeded, non-zero value head: its values position by
position and its clipped value loss, each against an independent computation.

A fresh critic's head is 0, so V = 0 everywhere and a read one position off would still agree;
these tests seed the head first."""

import pytest
import torch
from transformers.utils import logging as hf_logging

from learner.batch import build_batch
from learner.critic import Critic
from learner.schedule import step_schedule
from learner.trainer import Learner, init_distributed
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
    # the head has no dropout: a training-mode read (the critic's own step) is the same values
    critic.engine.train()
    torch.testing.assert_close(critic.values(batch, packed)[0].cpu(), want, atol=1e-4, rtol=1e-4)


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
    assert stats["value_mean_sum"] == pytest.approx(float((values * mask).sum()), abs=1e-4)
    if clip is not None:
        assert 0 < won < int(mask.sum())  # the clipped term won on some tokens, not all
        unclipped, _ = loop_value_loss(values, old, returns, mask, None)
        assert want > unclipped * 1.05


def test_the_critic_is_built_as_its_sections_say(policy):
    """Every setting away from its default, each read back from the built critic: one zeroed
    scalar head, the dtype and attention asked for, checkpointing without re-entrance, the
    critic's own learning rate with the learner's weight decay and schedule."""
    init_distributed()
    config = LearnerConfig(
        micro_batch_size=3,
        zero_stage=0,
        max_steps=5,
        warmup_steps=2,
        schedule="linear",  # None would read as cosine: linear tells them apart
        lr=3e-4,
        weight_decay=0.05,
        advantage={"type": "gae", "critic_lr": 0.125},
    )
    ds_config = {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 0}}
    verbosity = hf_logging.get_verbosity()
    critic = Critic(
        policy,
        config.advantage,
        config,
        dtype=torch.float64,
        attention={"attn_implementation": "eager"},  # the model's own default is sdpa
        ds_config=ds_config,
        gradient_checkpointing=True,
    )
    model = critic.model
    assert hf_logging.get_verbosity() == verbosity  # quietened for the load only
    assert model.config.num_labels == 1 and model.score.out_features == 1
    assert all(float(p.detach().abs().max()) == 0 for p in model.score.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert model.config._attn_implementation == "eager"
    checkpointed = [
        m._gradient_checkpointing_func
        for m in model.modules()
        if getattr(m, "_gradient_checkpointing_func", None) is not None
    ]
    assert checkpointed  # every decoder layer's
    assert all(f.keywords == {"use_reentrant": False} for f in checkpointed)
    group = critic.engine.optimizer.param_groups[0]
    assert (group["initial_lr"], group["weight_decay"]) == (0.125, 0.05)
    factor, want = critic.engine.lr_scheduler.lr_lambdas[0], step_schedule(2, 5, "linear")
    assert [factor(k) for k in range(7)] == [want(k) for k in range(7)]
    assert len({want(k) for k in range(7)}) > 3  # warm-up and decay both show


def test_without_its_own_rate_the_critic_takes_the_learners_and_an_empty_step_is_zero(policy):
    critic = seeded_critic(policy, 0.5)
    assert critic.engine.optimizer.param_groups[0]["initial_lr"] == LearnerConfig().lr
    # a rank with no rows left: a loss of exactly 0 through the (non-zero) head, with a graph
    loss = critic.empty_step(pad_id=0)
    assert loss.requires_grad and float(loss) == 0.0
