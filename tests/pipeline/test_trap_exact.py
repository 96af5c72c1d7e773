"""The trap's exact expected update against sampling, and Theorem 3 on it."""

import math

import numpy as np
import pytest
import torch

from learner.estimators import estimate
from pipeline.experiments.trap import expected_reward as trap_expected_reward
from pipeline.experiments.trap_exact import (
    Expected,
    _cosine,
    bias_table,
    compositions,
    expected_path,
    expected_update,
    silent_shares,
    start_table,
)


def sampled(chain, hop, p_guess, size, groups, estimator="stratified", seed=0, **params):
    """The same expectations by sampling `groups` groups, trajectory by trajectory."""
    rng = np.random.default_rng(seed)
    n = size * groups
    is_chain = rng.random(n) < chain
    a1, a2 = rng.random(n) < hop, rng.random(n) < hop  # True: the right choice
    reward = np.where(is_chain, a1 & a2, rng.random(n) < p_guess).astype(np.float64)
    ids = torch.from_numpy(np.repeat(np.arange(groups), size))
    adv = estimate(
        estimator,
        torch.from_numpy(reward),
        ids,
        torch.from_numpy(is_chain.astype(np.int64)),
        **params,
    ).advantages.numpy()
    stratum = adv * (is_chain - chain)
    hop_term = adv * is_chain * (a1 - hop)
    return (stratum.mean(), stratum.std() / np.sqrt(n)), (
        hop_term.mean(),
        hop_term.std() / np.sqrt(n),
    )


def test_compositions_count_and_sum():
    assert len(list(compositions(8))) == 165
    assert all(sum(c) == 8 for c in compositions(8))


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_the_exact_update_is_what_sampling_averages_to(alpha):
    exact = expected_update(0.4, 0.35, 0.3, 4, alpha=alpha, eps=1e-6)
    (s, s_se), (h, h_se) = sampled(0.4, 0.35, 0.3, 4, 60_000, alpha=alpha, eps=1e-6)
    assert abs(exact.stratum - s) < 4 * s_se + 1e-12
    assert abs(exact.hop - h) < 4 * h_se + 1e-12


def test_theorem3_sans_alone_has_no_between_strata_component():
    for chain, hop in ((0.5, 1 / 3), (0.2, 0.7), (0.9, 0.1)):
        assert expected_update(chain, hop, 0.3, 8, alpha=1.0, eps=1e-6).stratum == pytest.approx(
            0.0, abs=1e-12
        )
        grpo = expected_update(chain, hop, 0.3, 8, alpha=0.0, eps=1e-6).stratum
        blend = expected_update(chain, hop, 0.3, 8, alpha=0.6, eps=1e-6).stratum
        assert blend == pytest.approx(0.4 * grpo, rel=1e-9)  # SAN adds nothing between strata


def test_the_mean_field_path_starts_at_the_trap_and_follows_theorem_3():
    """Along the path of expected updates: the first row is the trap's start (expected_update's
    numbers there); alpha = 1 never moves P(chain) off 0.5 (Theorem 3, at every step) while it
    learns the hops; GRPO moves onto guessing, the blend at alpha 0.8 onto the chain."""
    start = expected_update(0.5, 1 / 5, 0.3, 4, alpha=0.0, eps=1e-6)
    grpo = expected_path(0.0, 5, 0.3, 4, steps=120)
    first = grpo[0]
    assert (first["chain"], first["hop"]) == (0.5, pytest.approx(0.2))
    assert first["stratum_ratio"] == pytest.approx(start.stratum / start.true_stratum)
    # GRPO's expected update points along the true gradient all the way (docs/results/trap.md)
    assert min(r["cosine"] for r in grpo) > 0.99 and max(r["cosine"] for r in grpo) <= 1 + 1e-12
    san = expected_path(1.0, 5, 0.3, 4, steps=120)
    assert all(r["chain"] == pytest.approx(0.5, abs=1e-12) for r in san)
    assert san[-1]["hop"] > 0.9
    blend = expected_path(0.8, 5, 0.3, 4, steps=120)
    assert grpo[-1]["chain"] < 0.02  # collapsed onto guessing
    low = min(r["chain"] for r in blend)  # the blend first drifts toward guessing, then turns
    assert low < 0.25 and blend[-1]["chain"] > 0.3 > low + 0.1


def test_san_is_silent_on_a_rare_chain_as_often_as_the_shares_say():
    """A chain alone in its stratum, or in a cell of one reward, gets A_SAN = 0: sampled groups
    of 8 at P(chain) 0.1 (the pipeline's start) against `silent_shares`' closed forms."""
    shares = silent_shares(0.1, 0.2, 8)
    assert shares["alone"] == pytest.approx(0.9**7)  # 0.478: half the chains are alone
    assert silent_shares(0.5, 0.2, 8)["alone"] == pytest.approx(0.5**7)  # 0.008
    q = 0.2 * 0.2
    silent = q * shares["paid_silent"] + (1 - q) * shares["failed_silent"]
    rng = np.random.default_rng(3)
    groups, size = 40_000, 8
    is_chain = rng.random(groups * size) < 0.1
    paid = (rng.random(groups * size) < q) & is_chain
    san = estimate(
        "stratified",
        torch.from_numpy(paid.astype(np.float64)),
        torch.from_numpy(np.repeat(np.arange(groups), size)),
        torch.from_numpy(is_chain.astype(np.int64)),
        alpha=1.0,
        eps=1e-6,
    ).advantages.numpy()
    zero = (san[is_chain] == 0).mean()
    assert abs(zero - silent) < 4 * np.sqrt(silent * (1 - silent) / is_chain.sum())


def test_the_start_table_compares_each_alpha_with_grpo_at_each_start():
    rows = start_table([0.0, 0.8], [5], [0.1, 0.5], 0.3, 8)
    by = {(r["start_chain"], r["alpha"]): r for r in rows}
    assert by[0.1, 0.0]["hop_over_grpo"] == pytest.approx(1.0)
    assert by[0.5, 0.8]["stratum_over_grpo"] == pytest.approx(0.2, rel=1e-9)
    # a rare chain keeps less of its hop update under the blend (issue 59: 0.44 against 0.86)
    assert by[0.1, 0.8]["hop_over_grpo"] < 0.5 < 0.8 < by[0.5, 0.8]["hop_over_grpo"]


def test_the_path_starts_at_the_start_share_and_hops_learn_at_their_speed():
    slow = expected_path(1.0, 5, 0.3, 8, steps=12, start_chain=0.2)
    fast = expected_path(1.0, 5, 0.3, 8, steps=12, start_chain=0.2, hop_speed=3.0)
    assert all(r["chain"] == pytest.approx(0.2, abs=1e-12) for r in slow + fast)  # Theorem 3
    assert slow[1]["hop"] - 0.2 == pytest.approx((fast[1]["hop"] - 0.2) / 3, rel=0.05)
    assert fast[-1]["hop"] > slow[-1]["hop"] + 0.03


@pytest.mark.parametrize(
    ("estimator", "params", "step"),
    [("grpo", {"eps": 1e-6}, None), ("rloo", {}, 1.0), ("dr_grpo", {}, 7 / 8)],
)
def test_a_group_only_estimator_is_exact_gradient_ascent(estimator, params, step):
    """docs/results/trap.md's identity: with a binary reward and independent group members, an
    advantage that is a function of the group's rewards alone has expected update
    (g(1) - g(0)) grad J, g(r) its mean given reward r: the stratum and hop components are the
    same multiple of the true gradient's, at any policy (RLOO's multiple is 1, Dr. GRPO's
    (G - 1) / G, GRPO's depends on the policy)."""
    for chain, hop in ((0.5, 0.2), (0.1, 0.25), (0.8, 0.6)):
        found = expected_update(chain, hop, 0.3, 8, estimator, **params)
        ratio = found.stratum / found.true_stratum
        assert found.hop / found.true_hop == pytest.approx(ratio, rel=1e-9)
        if step is not None:
            assert ratio == pytest.approx(step, rel=1e-9)
    blend = expected_update(0.5, 0.2, 0.3, 8, alpha=0.8, eps=1e-6)  # SAN is not group-only
    assert blend.hop / blend.true_hop > 4 * blend.stratum / blend.true_stratum


def test_the_blend_damps_the_move_between_strata_by_one_minus_alpha_in_every_sample():
    """SAN sums to 0 in every (group, stratum) cell, so on any draw the blend's stratum update
    is exactly (1 - alpha) times GRPO's on the same draw, not only in expectation."""
    rng = np.random.default_rng(5)
    n, size = 64 * 8, 8
    chain = rng.random(n) < 0.3
    reward = np.where(chain, rng.random(n) < 0.1, rng.random(n) < 0.3).astype(np.float64)
    ids = torch.from_numpy(np.repeat(np.arange(n // size), size))
    strata = torch.from_numpy(chain.astype(np.int64))

    def stratum_update(alpha):
        adv = estimate("stratified", torch.from_numpy(reward), ids, strata, alpha=alpha, eps=1e-6)
        return float((adv.advantages.numpy() * (chain - 0.3)).sum())

    assert stratum_update(0.8) == pytest.approx(0.2 * stratum_update(0.0), rel=1e-9)
    assert stratum_update(1.0) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("choices", [2, 3, 6])
def test_the_cosine_is_over_every_logit_of_the_stratum_and_both_hops(choices):
    """Against the vectors written out: the stratum pair (+s, -s) and two hop vectors (u, then
    -u / (M - 1) on each of the M - 1 wrong choices), for the update and the true gradient."""

    def whole(stratum, hop):
        hops = [hop, *[-hop / (choices - 1)] * (choices - 1)]
        return np.array([stratum, -stratum, *hops, *hops])

    found = Expected(stratum=0.3, hop=-0.7, true_stratum=0.2, true_hop=0.5)
    mine, true = whole(found.stratum, found.hop), whole(found.true_stratum, found.true_hop)
    cosine = mine @ true / np.sqrt((mine @ mine) * (true @ true))
    assert _cosine(found, choices) == pytest.approx(cosine, rel=1e-12)
    assert np.isnan(_cosine(Expected(0.0, 0.0, 0.2, 0.5), choices))
    assert np.isnan(_cosine(Expected(0.3, 0.1, 0.0, 0.0), choices))


def test_the_bias_and_start_tables_are_the_exact_update_at_hop_one_over_m():
    rows = bias_table([0.0, 0.8], [3, 5], 0.3, 8)  # P(chain) 0.5 unless told
    assert [(r["chain_choices"], r["alpha"]) for r in rows] == [
        (3, 0.0),
        (3, 0.8),
        (5, 0.0),
        (5, 0.8),
    ]
    for r in rows:
        found = expected_update(0.5, 1 / r["chain_choices"], 0.3, 8, alpha=r["alpha"], eps=1e-6)
        assert {k: r[k] for k in found.__dict__} == found.__dict__
    (row,) = bias_table([0.3], [4], 0.2, 6, chain=0.2)
    found = expected_update(0.2, 1 / 4, 0.2, 6, alpha=0.3, eps=1e-6)
    assert row == {"chain_choices": 4, "alpha": 0.3, **found.__dict__}
    (row,) = start_table([0.8], [4], [0.2], 0.3, 6)
    found = expected_update(0.2, 1 / 4, 0.3, 6, "stratified", alpha=0.8, eps=1e-6)
    grpo = expected_update(0.2, 1 / 4, 0.3, 6, "grpo", eps=1e-6)
    assert row == {
        "start_chain": 0.2,
        "chain_choices": 4,
        "group_size": 6,
        "alpha": 0.8,
        **found.__dict__,
        "stratum_over_grpo": found.stratum / grpo.stratum,
        "hop_over_grpo": found.hop / grpo.hop,
        **silent_shares(0.2, 1 / 4, 6),
    }


def test_the_silent_shares_are_their_closed_forms():
    q = 0.4 * 0.4
    assert silent_shares(0.3, 0.4, 5) == pytest.approx(
        {
            "alone": 0.7**4,
            "paid_silent": (1 - 0.3 * (1 - q)) ** 4,
            "failed_silent": (1 - 0.3 * q) ** 4,
        },
        rel=1e-12,
    )


def test_the_path_steps_at_learning_rate_1_unless_told():
    path = expected_path(0.6, 4, 0.3, 6, steps=3)
    assert path == expected_path(0.6, 4, 0.3, 6, steps=3, lr=1.0)
    assert path[-1]["chain"] != expected_path(0.6, 4, 0.3, 6, steps=3, lr=2.0)[-1]["chain"]


def test_the_paths_expected_reward_is_the_sampling_trap_s_at_its_logits():
    """Each row's E[reward] against pipeline.experiments.trap.expected_reward, fed the logits the
    row's P(chain) and P(right hop) come from (the chain logit minus the guess's; the right hop's
    logit above each wrong one's)."""
    for row in expected_path(0.6, 4, 0.3, 6, steps=4, start_chain=0.2):
        theta = np.array([[0.0, np.log(row["chain"] / (1 - row["chain"]))]])  # guess, chain
        gap = np.log(row["hop"] * 3 / (1 - row["hop"]))  # right over each of M - 1 = 3 wrong
        hops = np.array([[gap, 0.0, 0.0, 0.0]])
        assert row["expected_reward"] == pytest.approx(
            float(trap_expected_reward(theta, hops, hops, 0.3)[0]), rel=1e-12
        )


def test_where_the_true_stratum_gradient_is_0_the_paths_ratio_is_nan_not_an_error():
    """M 2, p_guess 1/4: at the start a chain pays (1/2)^2, what a guess pays, so the true
    gradient of the chain logit is 0 and the update's ratio to it is undefined."""
    (row,) = expected_path(0.6, 2, 0.25, 4, steps=1)
    assert np.isnan(row["stratum_ratio"])


def test_an_estimator_whose_advantages_need_not_sum_to_0_is_exact_too():
    """mc_grpo centres a group on its median: its advantages need not sum to 0, so the stratum
    update's -c sum(A) part counts, and the exact update still averages what sampling does."""
    exact = expected_update(0.4, 0.35, 0.3, 4, "mc_grpo", eps=1e-6)
    (s, s_se), (h, h_se) = sampled(0.4, 0.35, 0.3, 4, 60_000, "mc_grpo", eps=1e-6)
    assert abs(exact.stratum - s) < 4 * s_se + 1e-12
    assert abs(exact.hop - h) < 4 * h_se + 1e-12


@pytest.mark.parametrize(
    ("chain", "hop", "p_guess"),
    [(0.4, 0.3, 0.0), (0.4, 0.3, 1.0), (0.4, 1.0, 0.3), (0.7, 1.0, 0.0)],
)
def test_where_an_outcome_cannot_happen_rloo_still_follows_the_true_gradient(chain, hop, p_guess):
    """A guess that never (or always) pays, or hops that are always right (a chain that cannot
    fail): RLOO's expected update is still exactly the true gradient (its multiple is 1)."""
    found = expected_update(chain, hop, p_guess, 6, "rloo")
    assert found.stratum == pytest.approx(found.true_stratum, rel=1e-9)
    assert found.hop == pytest.approx(found.true_hop, rel=1e-9, abs=1e-15)


def test_each_step_of_the_path_adds_lr_times_the_expected_update():
    """The chain logit moves by lr s and the guess logit by -lr s (their gap by 2 lr s); the right
    hop's logit by lr k u and each wrong one's by -lr k u / (M - 1), k the hop speed."""
    rows = expected_path(0.6, 4, 0.3, 6, steps=3, lr=0.5, start_chain=0.3, hop_speed=2.0)
    assert [(r["step"], r["alpha"]) for r in rows] == [(0, 0.6), (1, 0.6), (2, 0.6)]
    first = rows[0]
    assert (first["chain"], first["hop"]) == (pytest.approx(0.3), 0.25)
    found = expected_update(first["chain"], first["hop"], 0.3, 6, alpha=0.6, eps=1e-6)
    gap = math.log(first["chain"] / (1 - first["chain"])) + 2 * 0.5 * found.stratum
    hop_gap = 0.5 * 2.0 * found.hop * (1 + 1 / 3)
    assert rows[1]["chain"] == pytest.approx(1 / (1 + math.exp(-gap)), rel=1e-12)
    assert rows[1]["hop"] == pytest.approx(1 / (1 + 3 * math.exp(-hop_gap)), rel=1e-12)
