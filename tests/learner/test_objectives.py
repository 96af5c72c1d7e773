"""CISPO, the entropy bonus and DAPO's overlong filter and soft punishment, each against a plain
computation from its paper's equation."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.agent import AgentSettings, overlong_penalty
from buffers.records import Group
from buffers.testing import synthetic_trajectory
from learner.algorithm import plan_step
from learner.logprobs import token_logprobs
from learner.losses import policy_loss
from pipeline.config.schema import LearnerConfig, StrataConfig


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0.05, 4.0), min_size=6, max_size=6),
    st.floats(-2, 2),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
)
def test_cispo_weighs_every_tokens_gradient_by_the_clipped_ratio(ratios, advantage, low, high):
    """d loss / d log pi_t = -sg(clip(r_t, 1 - low, 1 + high)) A / T (token mean): MiniMax-M1's
    CISPO, eq. 4, written as a loop; no token's gradient is zero unless A is."""
    behaviour = torch.zeros(1, 6, dtype=torch.float64)
    logp = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 6)
    loss, metrics = policy_loss(
        logp,
        behaviour,
        torch.tensor([advantage], dtype=torch.float64),
        mask,
        clip_low=low,
        clip_high=high,
        dual_clip=None,
        surrogate="cispo",
    )
    loss.backward()
    for t, r in enumerate(ratios):
        weight = min(max(r, 1 - low), 1 + high)
        assert float(logp.grad[0, t]) == pytest.approx(-weight * advantage / 6, abs=1e-12)
    outside = sum(1 for r in ratios if not (1 - low <= r <= 1 + high))
    assert metrics["clip_fraction"] == pytest.approx(outside / 6)


def test_ppo_zeroes_the_gradient_cispo_keeps():
    logp = torch.tensor([[math.log(1.5)]], dtype=torch.float64, requires_grad=True)
    args = (logp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([1.0]), torch.ones(1, 1))
    policy_loss(*args, dual_clip=None)[0].backward()
    assert float(logp.grad) == 0.0  # PPO: the ratio left the range in A's direction
    logp.grad = None
    policy_loss(*args, dual_clip=None, surrogate="cispo")[0].backward()
    assert float(logp.grad) == pytest.approx(-1.2)  # CISPO: weight clip(1.5) = 1.2, A = 1


def test_cispo_refuses_what_it_has_no_use_for():
    lp = torch.zeros(1, 2)
    args = (lp, lp, torch.ones(1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="has no dual clip"):
        policy_loss(*args, surrogate="cispo")
    with pytest.raises(ValueError, match="weighs each token"):
        policy_loss(*args, surrogate="cispo", dual_clip=None, ratio_level="sequence")
    with pytest.raises(ValueError, match="unknown surrogate 'trpo'"):
        policy_loss(*args, surrogate="trpo")
    for bad, match in [
        ({"surrogate": "cispo"}, "set learner.dual_clip: null with it"),
        (
            {"surrogate": "cispo", "dual_clip": None, "ratio": "sequence"},
            "surrogate cispo weighs each token",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            LearnerConfig(**bad)
    LearnerConfig(surrogate="cispo", dual_clip=None)
    with pytest.raises(ValueError, match="overlong_buffer 512 must be below max_response_tokens"):
        StrataConfig.model_validate({"actors": {"overlong_buffer": 512}})


def test_the_entropy_gradient_of_the_chunked_path_equals_the_full_softmax():
    torch.manual_seed(0)
    logits = torch.randn(300, 50, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (300,))
    logp, entropy = token_logprobs(logits, targets, temperature=0.7, chunk=64, entropy_grad=True)
    (logp.sum() + 3 * entropy.sum()).backward()
    got = logits.grad.clone()
    logits.grad = None
    full = torch.log_softmax(logits / 0.7, -1)
    want_entropy = -(full.exp() * full).sum(-1)
    (full.gather(-1, targets[:, None]).sum() + 3 * want_entropy.sum()).backward()
    # the chunked path computes in float32 (the logits' float), the reference in float64
    torch.testing.assert_close(entropy, want_entropy.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, logits.grad, rtol=1e-5, atol=1e-5)
    _, telemetry = token_logprobs(logits, targets, chunk=64)  # no bonus: entropy is telemetry
    assert not telemetry.requires_grad


@pytest.mark.parametrize(
    "length, want", [(0, 0.0), (384, 0.0), (385, 1 / 128), (448, 0.5), (512, 1.0)]
)
def test_soft_overlong_punishment_is_dapos_linear_ramp(length, want):
    """DAPO eq. 13 with L_max 512, L_cache 128: 0 up to 384 tokens, then (length - 384) / 128."""
    settings_ = AgentSettings(max_response_tokens=512, overlong_buffer=128)
    assert overlong_penalty(length, settings_) == pytest.approx(want)
    assert overlong_penalty(length, AgentSettings(max_response_tokens=512)) == 0.0


def test_the_overlong_filter_keeps_cut_trajectories_in_the_statistics_not_the_loss():
    members = [synthetic_trajectory("p", i, tokens=8, seed=i) for i in range(4)]
    for t, reward, finish in zip(
        members, [1.0, 0.0, 0.0, 1.0], ["answer", "length", "answer", "length"], strict=True
    ):
        t.reward, t.finish_reason = reward, finish
    groups = [Group("p", members)]
    plain = plan_step(groups, LearnerConfig(advantage={"type": "grpo"}))
    filtered = plan_step(groups, LearnerConfig(advantage={"type": "grpo"}, overlong_filter=True))
    assert torch.equal(plain.advantages, filtered.advantages)  # same group statistics
    assert plain.keep.tolist() == [True] * 4
    assert filtered.keep.tolist() == [True, False, True, False]
    assert plain.metrics["overlong_share"] == filtered.metrics["overlong_share"] == 0.5
