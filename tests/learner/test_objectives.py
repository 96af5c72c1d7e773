"""CISPO, the entropy bonus and DAPO's overlong filter and soft punishment, each against a plain
computation from its paper's equation."""

import math
import re
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.agent import AgentSettings, overlong_penalty
from buffers.records import Group
from buffers.testing import synthetic_trajectory
from learner import surrogates
from learner.algorithm import plan_step
from learner.logprobs import token_logprobs
from learner.losses import policy_loss
from learner.surrogates import (
    SURROGATES,
    Registered,
    clip_cov,
    covariance,
    kl_cov,
    ppo_clip,
    register_surrogate,
    surrogate_params,
)
from pipeline.config.algorithm import SURROGATES as SECTIONS
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
    with pytest.raises(ValueError, match="weighs or chooses tokens"):
        policy_loss(*args, surrogate="cispo", dual_clip=None, ratio_level="sequence")
    with pytest.raises(ValueError, match="unknown surrogate 'trpo'"):
        policy_loss(*args, surrogate="trpo")
    for bad, match in [
        ({"surrogate": {"type": "cispo"}}, r"no dual clip \(its weight is capped"),
        ({"surrogate": {"type": "kl_cov"}}, r"no dual clip \(it does not clip\)"),
        ({"surrogate": {"type": "clip_cov"}}, r"surrogate clip_cov has no dual clip \(Clip-Cov"),
        (
            {"surrogate": {"type": "cispo"}, "dual_clip": None, "ratio": "sequence"},
            "surrogate cispo weighs or chooses tokens",
        ),
        ({"surrogate": {"type": "ppo_clip", "share": 0.1}}, "share"),  # a key it does not have
    ]:
        with pytest.raises(ValueError, match=match):
            LearnerConfig(**bad)
    LearnerConfig(surrogate={"type": "cispo"}, dual_clip=None)
    LearnerConfig(surrogate={"type": "clip_cov"}, dual_clip=None)
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


def test_each_surrogate_section_holds_its_functions_parameters():
    from learner.surrogates import SURROGATES
    from pipeline.config.algorithm import SURROGATES as SECTIONS

    assert {s.model_fields["type"].default for s in SECTIONS} == set(SURROGATES)
    for section in SECTIONS:
        fields = set(section.model_fields) - {"type"}
        assert fields == set(SURROGATES[section.model_fields["type"].default].params)
        chosen = section(**{f: 0.5 for f in fields})  # every value away from its default
        assert surrogate_params(chosen) == dict.fromkeys(fields, 0.5)


@pytest.mark.parametrize("section", [s for s in SECTIONS if s.no_dual_clip])
def test_a_surrogate_without_dual_clip_refuses_one_saying_why_as_its_section_does(section):
    name = section.model_fields["type"].default
    lp = torch.zeros(1, 2)
    params = surrogate_params(section())
    why = re.escape(f"surrogate {name} has no dual clip: {section.no_dual_clip}")
    with pytest.raises(ValueError, match=f"^{why}$"):
        policy_loss(
            lp, lp, torch.ones(1), torch.ones(1, 2), surrogate=name, surrogate_params=params
        )


def covariances(advantages, logprobs):
    """(A - mean A)(log pi - mean log pi) over every token, as a loop."""
    flat = [(a, lp) for a, row in zip(advantages, logprobs, strict=True) for lp in row]
    mean_a = sum(a for a, _ in flat) / len(flat)
    mean_l = sum(lp for _, lp in flat) / len(flat)
    return [
        [(a - mean_a) * (lp - mean_l) for lp in row]
        for a, row in zip(advantages, logprobs, strict=True)
    ]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_kl_cov_penalises_the_top_covariance_tokens_and_clips_nothing(seed):
    """KL-Cov (arXiv 2505.22617, eq. 11) as a loop: -A r everywhere, + coef |log r| on the
    share k = max(int(share N), 1) of tokens with the largest covariance."""
    g = torch.Generator().manual_seed(seed)
    logp = (torch.rand(3, 5, generator=g, dtype=torch.float64) * -3).requires_grad_(True)
    behaviour = torch.rand(3, 5, generator=g, dtype=torch.float64) * -3
    adv = torch.randn(3, generator=g, dtype=torch.float64)
    loss, metrics = policy_loss(
        logp,
        behaviour,
        adv,
        torch.ones(3, 5),
        dual_clip=None,
        surrogate="kl_cov",
        surrogate_params={"share": 0.2, "coef": 0.5},
    )
    cov = covariances(adv.tolist(), logp.detach().tolist())
    ranked = sorted(
        ((c, i, t) for i, row in enumerate(cov) for t, c in enumerate(row)), reverse=True
    )
    top = {(i, t) for _, i, t in ranked[:3]}  # int(0.2 * 15) = 3
    want = 0.0
    for i in range(3):
        for t in range(5):
            log_r = float(logp[i, t].detach() - behaviour[i, t])
            want += -float(adv[i]) * math.exp(log_r) + (0.5 * abs(log_r) if (i, t) in top else 0)
    assert float(loss) == pytest.approx(want / 15, rel=1e-9)
    assert metrics["cov_selected_fraction"] == pytest.approx(3 / 15)
    assert metrics["clip_fraction"] == 0.0


def test_clip_cov_leaves_out_a_random_share_of_the_eligible_tokens_only():
    """Clip-Cov (eq. 10): tokens with covariance in (low, high) and not clipped by PPO are the
    candidates; int(share N) of them (at least one) carry neither loss nor gradient."""
    torch.manual_seed(0)
    logp = torch.log(
        torch.tensor([[0.9, 0.8, 0.05, 0.5], [0.9, 0.1, 0.7, 0.6]], dtype=torch.float64)
    )
    logp.requires_grad_(True)
    adv = torch.tensor([2.0, -2.0], dtype=torch.float64)
    args = (logp, logp.detach().clone(), adv, torch.ones(2, 4))  # r = 1: PPO clips nothing
    params = {"share": 0.25, "low_cov": 0.5, "high_cov": 5.0}
    no_dual = {"dual_clip": None}
    with pytest.raises(ValueError, match="surrogate clip_cov has no dual clip"):
        policy_loss(*args, surrogate="clip_cov", surrogate_params=params)  # dual_clip 3.0
    loss, metrics = policy_loss(*args, surrogate="clip_cov", surrogate_params=params, **no_dual)
    loss.backward()
    cov = covariances(adv.tolist(), logp.detach().tolist())
    eligible = {(i, t) for i in range(2) for t in range(4) if 0.5 < cov[i][t] < 5.0}
    silenced = {(i, t) for i in range(2) for t in range(4) if logp.grad[i, t] == 0}
    assert len(silenced) == 2 and silenced <= eligible  # int(0.25 * 8) = 2 of the eligible
    assert metrics["cov_selected_fraction"] == pytest.approx(2 / 8)
    plain = sum(-float(adv[i]) for i in range(2) for t in range(4) if (i, t) not in silenced)
    assert float(loss) == pytest.approx(plain / 8)
    again, _ = policy_loss(*args, surrogate="clip_cov", surrogate_params=params, **no_dual)
    assert float(again) == float(loss)  # the same step chooses the same tokens


def test_clip_cov_has_no_dual_clip_a_negative_advantage_far_above_the_range_pays_in_full():
    """As Clip-Cov's paper and verl: max(-A r, -A clip(r)) with no cap at -A dual_clip, so a token
    of A = -1 and r = 5 costs 5 (PPO's dual clip 3 would cap it at 3); a dual clip is refused."""
    logp = torch.log(torch.tensor([[0.5, 0.1]], dtype=torch.float64))
    base = logp - torch.log(torch.tensor([[5.0, 1.0]], dtype=torch.float64))  # r = 5, 1
    params = {"share": 1e-9, "low_cov": 1e9, "high_cov": 2e9}  # nothing eligible
    args = (logp, base, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 2))
    loss, metrics = policy_loss(
        *args, surrogate="clip_cov", surrogate_params=params, dual_clip=None
    )
    assert float(loss) == pytest.approx((5.0 + 1.0) / 2)
    assert metrics["dual_clip_fraction"] == 0.0
    capped, _ = policy_loss(*args, surrogate="ppo_clip", dual_clip=3.0)
    assert float(capped) == pytest.approx((3.0 + 1.0) / 2)


def test_a_surrogate_registers_once_under_its_name_with_its_parameters(monkeypatch):
    monkeypatch.setattr(surrogates, "SURROGATES", dict(SURROGATES))

    def probe(ratio, log_ratio, advantages, logprobs, mask, clip_low, clip_high, dual_clip, **p):
        return None

    register_surrogate("probe", probe, "share", "coef")
    assert surrogates.SURROGATES["probe"] == Registered(probe, ("share", "coef"))
    with pytest.raises(ValueError, match="surrogate 'cispo' is registered twice"):
        register_surrogate("cispo", probe)
    assert surrogates.SURROGATES["cispo"] == SURROGATES["cispo"]


def clip_cov_inputs():
    """Two rows of six tokens at r = 1 (PPO clips nothing), advantages of both signs, the last
    two tokens of each row masked out."""
    g = torch.Generator().manual_seed(5)
    logprobs = -torch.rand(2, 6, generator=g, dtype=torch.float64) * 3
    advantages = torch.tensor([[1.5], [-0.5]], dtype=torch.float64)
    mask = torch.ones(2, 6, dtype=torch.float64)
    mask[:, 4:] = 0
    ratio = torch.ones_like(logprobs)
    return ratio, torch.zeros_like(logprobs), advantages, logprobs, mask


def run_clip_cov(share, low_cov, high_cov):
    ratio, log_ratio, advantages, logprobs, mask = clip_cov_inputs()
    out = clip_cov(
        ratio,
        log_ratio,
        advantages,
        logprobs,
        mask,
        0.2,
        0.2,
        None,
        share=share,
        low_cov=low_cov,
        high_cov=high_cov,
    )
    return out, covariance(advantages, logprobs, mask), mask


def test_clip_cov_chooses_among_the_trained_tokens_strictly_inside_the_bounds():
    """With share 1 every candidate is chosen: the chosen set is the candidates. Bounds set to
    two tokens' own covariances leave those two out (the interval is open); a masked token,
    whatever its covariance, is never a candidate."""
    _, cov, mask = run_clip_cov(1.0, -1e9, 1e9)
    trained = sorted(float(c) for c in cov[mask > 0])
    low, high = trained[1], trained[-2]
    out, cov, mask = run_clip_cov(1.0, low, high)
    want = (mask > 0) & (cov > low) & (cov < high)
    assert out.selected.tolist() == want.tolist() and int(want.sum()) == 4
    assert ((mask == 0) & (cov > low) & (cov < high)).any()  # a masked token inside the bounds
    assert (out.loss[out.selected] == 0).all() and (out.loss[~out.selected] != 0).all()


def test_clip_cov_draws_its_share_the_same_whatever_the_global_random_state():
    """The choice is seeded by the candidates' positions, not by torch's global generator: the
    same inputs choose the same tokens after any reseed; these inputs choose these."""
    chosen = []
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        out, _, _ = run_clip_cov(0.25, -1e9, 1e9)  # int(0.25 * 8) = 2 of the 8 trained tokens
        chosen.append(out.selected.nonzero().tolist())
    assert chosen[0] == chosen[1] == chosen[2] == [[0, 3], [1, 3]]


def test_clip_cov_and_kl_cov_choose_at_least_one_token():
    ratio, log_ratio, advantages, logprobs, mask = clip_cov_inputs()
    share = {"share": 0.01}  # int(0.01 * 8) = 0 of the 8 trained tokens: one all the same
    out, _, _ = run_clip_cov(0.01, -1e9, 1e9)
    assert int(out.selected.sum()) == 1
    out = kl_cov(ratio, log_ratio, advantages, logprobs, mask, 0.2, 0.2, None, coef=1.0, **share)
    assert int(out.selected.sum()) == 1


def test_the_covariance_takes_its_means_over_the_trained_tokens_only():
    _, _, advantages, logprobs, mask = clip_cov_inputs()
    logprobs[1, 4:] = -50.0  # masked out: must not move the means
    got = covariance(advantages, logprobs, mask)
    a = advantages.expand_as(logprobs)
    trained = [(float(a[i, t]), float(logprobs[i, t])) for i, t in (mask > 0).nonzero().tolist()]
    mean_a = statistics.fmean(x for x, _ in trained)
    mean_l = statistics.fmean(y for _, y in trained)
    want = [
        [(float(x) - mean_a) * (float(y) - mean_l) for x, y in zip(ra, rl, strict=True)]
        for ra, rl in zip(a, logprobs, strict=True)
    ]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))
    alone = torch.zeros_like(mask)
    alone[0, 2] = 1
    assert float(covariance(advantages, logprobs, alone)[0, 2]) == 0.0  # its own mean


def test_kl_cov_chooses_only_trained_tokens_and_none_when_there_are_none():
    """The masked tokens of row 1 have the largest covariance ((A - mean)(log pi - mean) with
    A below the mean and log pi = -50): they are never chosen. Choices and flags are bool."""
    ratio, _, advantages, logprobs, mask = clip_cov_inputs()
    logprobs[1, 4:] = -50.0
    log_ratio = torch.linspace(-0.5, 0.5, 12, dtype=torch.float64).view(2, 6)
    ratio = log_ratio.exp()
    cov = covariance(advantages, logprobs, mask)
    assert set(cov.flatten().topk(2).indices.tolist()) == {10, 11}  # the masked ones
    out = kl_cov(ratio, log_ratio, advantages, logprobs, mask, 0.2, 0.2, None, share=0.25, coef=1.0)
    top = cov.masked_fill(mask == 0, -math.inf).flatten().topk(2).indices.tolist()
    assert sorted(out.selected.flatten().nonzero().squeeze(-1).tolist()) == sorted(top)
    assert out.selected.dtype == out.clipped.dtype == out.dual_clipped.dtype == torch.bool
    none = kl_cov(
        ratio, log_ratio, advantages, logprobs, mask * 0, 0.2, 0.2, None, share=0.25, coef=1.0
    )
    assert not none.selected.any()
    torch.testing.assert_close(none.loss, -advantages * ratio)


def test_ppo_clip_caps_a_negative_advantage_at_the_dual_clip_and_flags_only_what_it_capped():
    """Per token: A = -1 at r = 3 (the loss -A r equals the cap -A 3: not capped) and r = 4
    (capped at 3); A = 0.5 and A = 0 (never capped, never flagged); the flags are bool."""
    ratio = torch.tensor([[3.0, 4.0, 1.0, 1.0, 5.0]], dtype=torch.float64)
    advantages = torch.tensor([[-1.0, -1.0, 0.5, 0.0, 0.0]], dtype=torch.float64)
    zeros = torch.zeros_like(ratio)
    out = ppo_clip(ratio, ratio.log(), advantages, zeros, zeros + 1, 0.2, 0.2, 3.0)
    assert out.loss.tolist() == [[3.0, 3.0, -0.5, 0.0, 0.0]]
    assert out.dual_clipped.tolist() == [[False, True, False, False, False]]
    plain = ppo_clip(ratio, ratio.log(), advantages, zeros, zeros + 1, 0.2, 0.2, None)
    assert plain.loss.tolist() == [[3.0, 4.0, -0.5, 0.0, 0.0]]
    assert plain.dual_clipped.dtype == plain.clipped.dtype == torch.bool
    assert not plain.dual_clipped.any()
