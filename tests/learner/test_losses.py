import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.corrections import Correction
from learner.losses import aggregate, kept_by_importance, kl_penalty, policy_loss


def logs(ratios):
    return torch.tensor([[math.log(r) for r in row] for row in ratios], dtype=torch.float64)


def zeros(b, t):
    return torch.zeros(b, t, dtype=torch.float64)


def test_ppo_clip_and_dual_clip_hand_computed():
    # Row 0 has A = +1, row 1 has A = -1; ratios chosen to hit every branch with clip 0.2, dual 3.
    #   A=+1: r=1.0 -> -1.0; r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped); r=0.5 -> max(-0.5, -0.8) = -0.5
    #   A=-1: r=1.0 -> 1.0;  r=4.0 -> max(4, 1.2) = 4 -> dual cap 3;  r=0.5 -> max(0.5, 0.8) = 0.8 (clipped)
    lp = logs([[1.0, 1.5, 0.5], [1.0, 4.0, 0.5]])
    mask = torch.ones(2, 3)
    loss, m = policy_loss(lp, zeros(2, 3), torch.tensor([1.0, -1.0]), mask)
    per_token = [-1.0, -1.2, -0.5, 1.0, 3.0, 0.8]
    assert loss.item() == pytest.approx(sum(per_token) / 6)
    # The clipped branch is active at (0,1) and (1,2). At (1,1) PPO does not clip (A < 0, r high):
    # only the dual clip bounds it.
    assert m["clip_fraction"] == pytest.approx(2 / 6)
    assert m["dual_clip_fraction"] == pytest.approx(1 / 6)
    assert m["ratio_max"] == pytest.approx(4.0)
    assert m["ratio_mean"] == pytest.approx((1 + 1.5 + 0.5 + 1 + 4 + 0.5) / 6)

    no_dual, _ = policy_loss(lp, zeros(2, 3), torch.tensor([1.0, -1.0]), mask, dual_clip=None)
    assert no_dual.item() == pytest.approx((sum(per_token) - 3.0 + 4.0) / 6)


def test_asymmetric_clip():
    lp = logs([[1.5, 0.5]])
    loss, _ = policy_loss(
        lp, zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), clip_low=0.1, clip_high=0.3
    )
    # r=1.5 -> max(-1.5, -1.3) = -1.3; r=0.5 -> max(-0.5, -0.9) = -0.5
    assert loss.item() == pytest.approx((-1.3 - 0.5) / 2)


def test_masked_tokens_carry_no_loss_and_aggregations():
    lp = logs([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([[2.0, 4.0, 100.0], [6.0, 100.0, 100.0]])
    # Per-token loss is -A (ratio 1); masked-in tokens: -2, -4 | -6.
    token_mean, _ = policy_loss(lp, zeros(2, 3), adv, mask)
    assert token_mean.item() == pytest.approx(-12 / 3)
    seq_mean, _ = policy_loss(lp, zeros(2, 3), adv, mask, agg="seq-mean-token-mean")
    assert seq_mean.item() == pytest.approx((-3 + -6) / 2)
    seq_sum, _ = policy_loss(lp, zeros(2, 3), adv, mask, agg="seq-mean-token-sum")
    assert seq_sum.item() == pytest.approx((-6 + -6) / 2)


def test_sequences_without_tokens_do_not_dilute_seq_means():
    lp = logs([[1.0, 1.0], [1.0, 1.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    loss, _ = policy_loss(
        lp, zeros(2, 2), torch.tensor([1.0, 5.0]), mask, agg="seq-mean-token-mean"
    )
    assert loss.item() == pytest.approx(-1.0)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_empty_mask_gives_zero_loss_with_a_graph(agg):
    lp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    loss, m = policy_loss(lp, zeros(2, 3), torch.tensor([1.0, -1.0]), torch.zeros(2, 3), agg=agg)
    assert loss.item() == 0.0 and not math.isnan(loss.item())
    loss.backward()
    assert lp.grad is not None and lp.grad.abs().sum().item() == 0.0
    assert m["tokens"] == 0.0 and m["clip_fraction"] == 0.0


def test_gradient_is_minus_advantage_times_ratio_inside_the_trust_region():
    lp = logs([[1.1, 0.9]]).requires_grad_(True)
    loss, _ = policy_loss(lp, zeros(1, 2), torch.tensor([2.0]), torch.ones(1, 2))
    loss.backward()
    # d/dlp of -A * exp(lp - base) / n, n = 2.
    torch.testing.assert_close(
        lp.grad, torch.tensor([[-2.0 * 1.1 / 2, -2.0 * 0.9 / 2]], dtype=torch.float64)
    )


def test_clipped_tokens_have_no_gradient():
    lp = logs([[1.5]]).requires_grad_(True)
    loss, _ = policy_loss(lp, zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1))
    loss.backward()
    assert lp.grad.item() == 0.0


def test_proximal_policy_is_the_ratio_base():
    lp = logs([[1.0, 1.0]])
    prox = logs([[1.0 / 1.1, 1.0 / 1.5]])  # ratio to proximal: 1.1 and 1.5
    behav = logs([[0.25, 0.25]])  # far away: would clip everything if it were the base
    loss, m = policy_loss(lp, behav, torch.tensor([1.0]), torch.ones(1, 2), proximal_logprobs=prox)
    assert loss.item() == pytest.approx((-1.1 - 1.2) / 2)
    assert m["ratio_max"] == pytest.approx(1.5)
    assert m["importance_weight_mean"] == 1.0  # importance="none": no extra weight


def test_truncated_importance_sampling():
    lp = logs([[1.0, 1.0, 1.0]])
    prox = zeros(1, 3)  # ratio 1 to proximal everywhere: per-token loss -A = -1
    behav = logs([[1.0, 0.5, 0.25]])  # prox/behav weights 1, 2, 4 -> truncated at 1.5: 1, 1.5, 1.5
    loss, m = policy_loss(
        lp,
        behav,
        torch.tensor([1.0]),
        torch.ones(1, 3),
        proximal_logprobs=prox,
        correction=Correction("tis", {"cap": 1.5}),
    )
    assert loss.item() == pytest.approx(-(1 + 1.5 + 1.5) / 3)
    assert m["importance_weight_max"] == pytest.approx(4.0)
    assert m["importance_weight_mean"] == pytest.approx(7 / 3)
    assert m["mask_drop_fraction"] == 0.0


def test_importance_mask_drops_tokens_over_the_cap():
    lp = zeros(1, 3)
    prox = zeros(1, 3)
    behav = logs([[1.0, 0.5, 0.25]])  # weights 1, 2, 4; cap 1.5 drops the last two
    adv = torch.tensor([[1.0, 10.0, 10.0]])
    loss, m = policy_loss(
        lp,
        behav,
        adv,
        torch.ones(1, 3),
        proximal_logprobs=prox,
        correction=Correction("mask", {"cap": 1.5}),
    )
    assert loss.item() == pytest.approx(-1.0)
    assert m["mask_drop_fraction"] == pytest.approx(2 / 3)
    assert m["tokens"] == 1.0


def test_importance_weights_carry_no_gradient():
    lp = zeros(1, 2).requires_grad_(True)
    prox = zeros(1, 2).requires_grad_(True)
    behav = logs([[0.5, 0.5]]).requires_grad_(True)
    loss, _ = policy_loss(
        lp,
        behav,
        torch.tensor([1.0]),
        torch.ones(1, 2),
        proximal_logprobs=prox,
        correction=Correction("tis"),
    )
    loss.backward()
    assert prox.grad is None and behav.grad is None
    assert lp.grad is not None


def test_advantage_per_sequence_equals_broadcast_per_token():
    lp = logs([[1.3, 0.7, 1.0], [0.6, 1.6, 1.1]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    per_seq, _ = policy_loss(lp, zeros(2, 3), torch.tensor([0.5, -2.0]), mask)
    per_tok, _ = policy_loss(lp, zeros(2, 3), torch.tensor([[0.5] * 3, [-2.0] * 3]), mask)
    assert per_seq.item() == pytest.approx(per_tok.item())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(correction=Correction("tis")), "proximal"),
        (dict(correction=Correction("mask")), "proximal"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(agg="mean"), "agg"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        policy_loss(zeros(1, 2), zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), **kwargs)


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="must match"):
        policy_loss(zeros(1, 2), zeros(1, 3), torch.tensor([1.0]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(zeros(2, 2), zeros(2, 2), torch.tensor([1.0]), torch.ones(2, 2))


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError):
        aggregate(zeros(1, 1), torch.ones(1, 1), "sum")


# ----------------------------------------------------------------------------------- KL


def test_kl_estimators_hand_computed():
    lp = torch.tensor([math.log(0.5)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    d = math.log(2.0)  # log p - log q
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(d)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.5 - (-d) - 1)  # q/p - log(q/p) - 1


def test_k3_is_clamped_like_verl():
    lp = torch.zeros(3, dtype=torch.float64)
    ref = torch.tensor([1000.0, -1000.0, -5.0], dtype=torch.float64)
    got = kl_penalty(lp, ref, "k3")
    # exp(1000) would overflow: the log-ratio is clamped to 20, the result to 10.
    assert got.tolist() == [10.0, 10.0, pytest.approx(math.exp(-5) + 5 - 1)]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(-10, 0), min_size=1, max_size=20),
    st.lists(st.floats(-10, 0), min_size=1, max_size=20),
)
def test_k2_and_k3_are_non_negative_and_zero_on_equal_policies(a, b):
    n = min(len(a), len(b))
    lp, ref = torch.tensor(a[:n], dtype=torch.float64), torch.tensor(b[:n], dtype=torch.float64)
    for kind in ("k2", "k3"):
        assert (kl_penalty(lp, ref, kind) >= 0).all()
        assert kl_penalty(lp, lp, kind).abs().max().item() == 0.0


def test_unknown_kl_kind():
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_off_policy_telemetry_by_hand():
    """The learner-behaviour gap, and the shares truncated (tis) and of sequences dropped."""
    logp = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -0.5, 0.0]])
    behaviour = torch.tensor([[0.0, -3.0, -1.5], [-0.5, -0.6, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    _, stats = policy_loss(logp, behaviour, adv, mask)
    gaps = [0.0, 2.0, -0.5, 0.0, 0.1]  # learner minus behaviour on the five generated tokens
    assert stats["logprob_gap_mean"] == pytest.approx(sum(gaps) / 5)
    assert stats["logprob_gap_abs_mean"] == pytest.approx(sum(map(abs, gaps)) / 5)
    assert stats["logprob_gap_tail_fraction"] == pytest.approx(1 / 5)  # only the 2-nat gap
    proximal = behaviour.clone()
    proximal[0, 1] += 2.0  # w = e^2 > cap on one token
    _, tis = policy_loss(
        logp,
        behaviour,
        adv,
        mask,
        proximal_logprobs=proximal,
        correction=Correction("tis", {"cap": 2.0}),
    )
    assert tis["truncated_fraction"] == pytest.approx(1 / 5)
    proximal[1] += 3.0  # the second sequence's geometric-mean weight e^3: dropped whole
    _, seq = policy_loss(
        logp,
        behaviour,
        adv,
        mask,
        proximal_logprobs=proximal,
        correction=Correction("seq_mask", {"floor": 0.5, "cap": 2.0}),
    )
    assert seq["sequence_drop_fraction"] == pytest.approx(1 / 2)


def test_unknown_corrections_and_parameters_are_refused_in_one_line():
    with pytest.raises(ValueError, match="unknown importance correction 'bogus'"):
        Correction("bogus")
    with pytest.raises(ValueError, match="correction tis takes cap, not floor"):
        Correction("tis", {"floor": 0.5})


def test_k3_is_k3_by_default_never_negative_and_its_gradient_finite_at_any_ratio():
    lp = torch.tensor([0.0, 0.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.0, 0.5, -1.0], dtype=torch.float64)
    assert kl_penalty(lp, ref).tolist() == kl_penalty(lp, ref, "k3").tolist()
    # exp(x) - x - 1 rounds below 0 at x = 3e-8 in float32: the result is clamped to 0
    tiny = kl_penalty(torch.zeros(1), torch.tensor([3e-8]), "k3")
    assert float(tiny) == 0.0
    assert float(torch.exp(torch.tensor([3e-8])) - torch.tensor([3e-8]) - 1.0) < 0
    # the log-ratio is clamped before exp: at log q - log p = 1000 the gradient is 0, not NaN
    far = torch.tensor([-1000.0, 0.3], dtype=torch.float64, requires_grad=True)
    kl_penalty(far, torch.zeros(2, dtype=torch.float64), "k3").sum().backward()
    assert far.grad[0] == 0 and far.grad[1] != 0 and torch.isfinite(far.grad).all()


def test_the_shape_refusals_name_the_shapes():
    one = torch.tensor([1.0])
    with pytest.raises(ValueError, match=r"^logprobs must be \[B, T\], got shape \(3,\)$"):
        policy_loss(torch.zeros(3), torch.zeros(3), one, torch.ones(3))
    with pytest.raises(
        ValueError, match=r"^proximal_logprobs \(1, 3\) must match logprobs \(1, 2\)$"
    ):
        policy_loss(zeros(1, 2), zeros(1, 2), one, torch.ones(1, 2), proximal_logprobs=zeros(1, 3))
    with pytest.raises(ValueError, match=r"^advantages \[B\] has B=1, logprobs has B=2$"):
        policy_loss(zeros(2, 3), zeros(2, 3), one, torch.ones(2, 3))
    with pytest.raises(
        ValueError,
        match=r"^advantages must be \[B\] or \[B, T\], got \(2, 2\) for logprobs \(2, 3\)$",
    ):
        policy_loss(zeros(2, 3), zeros(2, 3), zeros(2, 2), torch.ones(2, 3))
    args = (zeros(1, 2), zeros(1, 2), one, torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"^unknown ratio level 'tok': use token or sequence$"):
        policy_loss(*args, ratio_level="tok")
    with pytest.raises(
        ValueError, match=r"^unknown surrogate 'trpo': use ppo_clip, cispo, clip_cov, kl_cov$"
    ):
        policy_loss(*args, surrogate="trpo")


def test_any_dual_clip_above_1_is_taken_and_the_loss_keeps_the_log_probs_dtype():
    lp = torch.log(torch.tensor([[1.8, 1.0]]))  # float32
    loss, stats = policy_loss(
        lp,
        torch.zeros(1, 2),
        torch.tensor([-1.0], dtype=torch.float64),
        torch.ones(1, 2),
        dual_clip=1.5,
    )
    assert loss.dtype == torch.float32  # float64 advantages do not promote it
    assert float(loss) == pytest.approx((1.5 + 1.0) / 2)  # r = 1.8 capped at 1.5
    assert stats["dual_clip_fraction"] == 0.5


def test_a_bool_loss_mask_trains_as_its_0_1_floats_do():
    lp = logs([[1.3, 0.7, 1.0], [0.6, 1.6, 1.1]])
    behaviour = zeros(2, 3)
    proximal = behaviour + torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    kwargs = dict(proximal_logprobs=proximal, correction=Correction("mask", {"cap": 2.0}))
    adv = torch.tensor([0.5, -2.0])
    floats, stats = policy_loss(lp, behaviour, adv, mask, **kwargs)
    bools, bool_stats = policy_loss(lp, behaviour, adv, mask.bool(), **kwargs)
    assert float(bools) == pytest.approx(float(floats)) and bool_stats == stats
    assert stats["mask_drop_fraction"] == pytest.approx(1 / 5)


def test_without_proximal_log_probs_nothing_is_dropped():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    behaviour = torch.tensor([[-1.0, -5.0, -1.0]])
    for name in ("mask", "icepop", "seq_mask", "tis"):
        assert kept_by_importance(mask, behaviour, None, Correction(name)) is mask
    proximal = behaviour + torch.tensor([[0.0, 3.0, 0.0]])  # w = e^3 over the cap on token 1
    kept = kept_by_importance(mask, behaviour, proximal, Correction("mask", {"cap": 2.0}))
    assert kept.tolist() == [[1.0, 0.0, 0.0]]


def test_the_ratio_telemetry_reads_the_trained_tokens_only():
    """ratio_max and the means over the trained tokens (a masked token's larger ratio is not
    read); one trained token is its own mean; no trained token reads 0."""
    lp = logs([[1.5, 3.0], [0.5, 1.0]])
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    _, stats = policy_loss(lp, zeros(2, 2), torch.tensor([1.0, 1.0]), mask, dual_clip=None)
    assert stats["ratio_max"] == pytest.approx(1.5)
    assert stats["ratio_mean"] == pytest.approx(1.5)
    assert stats["tokens"] == 1.0
    _, empty = policy_loss(lp, zeros(2, 2), torch.tensor([1.0, 1.0]), mask * 0, dual_clip=None)
    assert empty["ratio_max"] == 0.0 and empty["ratio_mean"] == 0.0


def test_gspos_ratio_of_a_sequence_of_one_kept_token_is_that_tokens():
    lp = logs([[1.1, 1.5, 0.9], [1.05, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    loss, stats = policy_loss(
        lp,
        zeros(2, 3),
        torch.tensor([1.0, 1.0]),
        mask,
        ratio_level="sequence",
        agg="seq-mean-token-mean",
    )
    second = math.exp((math.log(1.05) + 0 + 0) / 3)
    assert float(loss) == pytest.approx((-1.1 - second) / 2)  # both inside the clip range
    assert stats["ratio_max"] == pytest.approx(1.1)


def test_the_dropped_share_counts_the_sequences_with_tokens_and_the_tail_gaps_over_1():
    """Four rows: two kept, one of a single token dropped whole (w = e^3), one with no
    generated token at all (not counted); alone, the dropped row is the whole share. A gap of
    exactly 1 nat is not in the tail; ppo_clip chooses no token (cov_selected_fraction 0)."""
    lp = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    proximal = behaviour + torch.tensor([[0.0, 0.0], [0.0, 0.0], [3.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    seq_mask = Correction("seq_mask", {"floor": 0.5, "cap": 2.0})

    def stats(rows):
        return policy_loss(
            lp[rows],
            behaviour[rows],
            torch.ones(len(rows)),
            mask[rows],
            proximal_logprobs=proximal[rows],
            correction=seq_mask,
            dual_clip=None,
        )[1]

    every = stats([0, 1, 2, 3])
    assert every["sequence_drop_fraction"] == pytest.approx(1 / 3)  # of the three with tokens
    assert stats([2])["sequence_drop_fraction"] == 1.0
    assert every["logprob_gap_tail_fraction"] == 0.0  # the one gap of 1.0 is not over 1
    assert every["cov_selected_fraction"] == 0.0
