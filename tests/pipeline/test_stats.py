"""Comparisons that are tests (pipeline/experiments/stats.py), each against scipy."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from pipeline.experiments.stats import (
    can_reach,
    compare,
    detectable,
    hierarchical_bootstrap,
    permutation_p,
    smallest_permutation_p,
    welch,
)


@pytest.mark.parametrize("seed, n_a, n_b", [(0, 5, 7), (1, 3, 3), (2, 2, 9), (3, 12, 4)])
def test_welch_p_and_interval_are_scipys(seed, n_a, n_b):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(0.4, 0.05, n_a), rng.normal(0.3, 0.1, n_b)
    p, (low, high), df = welch(a, b)
    want = sps.ttest_ind(a, b, equal_var=False)
    interval = want.confidence_interval(0.95)
    assert p == pytest.approx(want.pvalue, rel=1e-9) and df == pytest.approx(want.df, rel=1e-9)
    assert (low, high) == pytest.approx((interval.low, interval.high), rel=1e-9)


def mean_gap(x, y, axis=-1):
    return np.mean(x, axis=axis) - np.mean(y, axis=axis)


def scipys(a, b, alternative, resamples):
    """scipy's permutation p of the difference of means; two-sided as |difference| (scipy's own
    two-sided doubles the smaller tail, which differs when the null is not symmetric)."""
    stat, alt = mean_gap, alternative
    if alternative == "two-sided":
        stat, alt = (lambda x, y, axis=-1: np.abs(mean_gap(x, y, axis))), "greater"
    return sps.permutation_test(
        (a, b),
        stat,
        permutation_type="independent",
        alternative=alt,
        n_resamples=resamples,
        vectorized=True,
        random_state=0,
    ).pvalue


@pytest.mark.parametrize("alternative", ["two-sided", "greater", "less"])
@pytest.mark.parametrize("seed, n_a, n_b", [(0, 3, 3), (1, 4, 6), (2, 5, 2), (3, 6, 6)])
def test_the_exact_permutation_p_is_scipys(alternative, seed, n_a, n_b):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(0.45, 0.1, n_a).round(2), rng.normal(0.4, 0.1, n_b).round(2)  # some ties
    got = permutation_p(a, b, alternative=alternative)
    assert got == pytest.approx(scipys(a, b, alternative, np.inf), rel=1e-12)


@pytest.mark.parametrize("alternative", ["two-sided", "greater"])
def test_the_monte_carlo_permutation_p_counts_the_observed_labelling(alternative):
    """10 vs 10 runs: 184,756 relabellings, over the exact limit. Fully separated runs: no random
    relabelling is as extreme, and p is 1 / (draws + 1) as scipy's, never 0."""
    a, b = np.linspace(0.6, 0.7, 10), np.linspace(0.1, 0.2, 10)
    got = permutation_p(a, b, draws=2000, alternative=alternative)
    assert got == pytest.approx(1 / 2001) and got == pytest.approx(scipys(a, b, alternative, 2000))
    # overlapping runs: the Monte Carlo p within its own noise of the exact one
    rng = np.random.default_rng(5)
    a, b = rng.normal(0.5, 0.1, 10), rng.normal(0.45, 0.1, 10)
    exact = permutation_p(a, b, alternative=alternative, exact_limit=10**6)
    drawn = permutation_p(a, b, draws=4000, alternative=alternative)
    assert drawn != exact and abs(drawn - exact) < 4 * math.sqrt(exact * (1 - exact) / 4000)
    assert abs(drawn - scipys(a, b, alternative, 4000)) < 6 * math.sqrt(exact * (1 - exact) / 4000)


def test_the_permutation_test_is_exact_for_few_runs():
    # 3 vs 3 runs: 20 relabellings; the most extreme split and its mirror give p = 0.1, so
    # ranges that do not overlap are never significant at 5% with three seeds a side
    a, b = np.array([0.4, 0.5, 0.6]), np.array([0.1, 0.2, 0.3])
    assert permutation_p(a, b) == pytest.approx(0.1)
    assert permutation_p(a, b, alternative="greater") == pytest.approx(0.05)
    assert permutation_p(a, b, alternative="less") == 1.0
    assert permutation_p(np.array([0.2, 0.2]), np.array([0.2, 0.2])) == 1.0


@pytest.mark.parametrize("n_a, n_b", [(2, 2), (3, 3), (4, 4), (3, 5), (2, 6), (5, 5), (4, 7)])
@pytest.mark.parametrize("alternative", ["two-sided", "greater"])
def test_the_smallest_permutation_p_is_the_most_separated_runs_p(n_a, n_b, alternative):
    """The floor a design can reach is what the test gives runs that are as separated as can be
    (A's every run above B's, far apart)."""
    a, b = 10.0 + np.arange(n_a) * 0.01, np.arange(n_b) * 0.01
    floor = smallest_permutation_p(n_a, n_b, alternative)
    assert floor == pytest.approx(permutation_p(a, b, alternative=alternative))
    assert can_reach(n_a, n_b, 0.05, alternative) == (floor < 0.05)


def test_which_designs_can_reach_five_percent():
    assert smallest_permutation_p(3, 3, "greater") == pytest.approx(1 / 20)
    assert smallest_permutation_p(3, 3) == pytest.approx(2 / 20)
    assert not can_reach(3, 3, 0.05, "greater") and not can_reach(3, 3)
    assert can_reach(4, 4, 0.05, "greater") and can_reach(4, 4)  # 1/70, 2/70
    assert not can_reach(2, 4, 0.05, "greater") and can_reach(2, 5, 0.05, "greater")  # 1/15, 1/21
    assert smallest_permutation_p(10, 10, draws=2000) == pytest.approx(1 / 2001)  # Monte Carlo
    with pytest.raises(ValueError, match="a run a side"):
        smallest_permutation_p(0, 3)


def welch_power(delta, se, df, level=0.05):
    """The power of the two-sided Welch test at a true difference `delta`: the noncentral t."""
    crit = sps.t.ppf(1 - level / 2, df)
    return sps.nct.sf(crit, df, delta / se) + sps.nct.cdf(-crit, df, delta / se)


@pytest.mark.parametrize("seed, n_a, n_b", [(0, 3, 3), (1, 4, 6), (2, 8, 8), (3, 3, 10)])
def test_the_detectable_difference_has_80_percent_power_on_the_runs_degrees_of_freedom(
    seed, n_a, n_b
):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(0.5, 0.05, n_a), rng.normal(0.4, 0.08, n_b)
    got = detectable(a, b)
    df = sps.ttest_ind(a, b, equal_var=False).df
    se = math.sqrt(a.var(ddof=1) / n_a + b.var(ddof=1) / n_b)
    assert got == pytest.approx((sps.t.ppf(0.975, df) + sps.t.ppf(0.8, df)) * se, rel=1e-9)
    assert 0.78 < welch_power(got, se, df) < 0.84  # the t approximation of the exact power
    z = (sps.norm.ppf(0.975) + sps.norm.ppf(0.8)) * se  # what a normal approximation promises
    if df < 10:
        assert welch_power(z, se, df) < 0.75
    assert compare(list(a), list(b)).detectable == got
    assert detectable(np.array([0.3, 0.3]), np.array([0.2, 0.2])) == 0.0


def question_runs(rng, runs, questions, rate, run_sd, question_sd):
    """Per-question 0/1 scores: each question its own hardness (shared by every run), each run
    its own offset (how that seed's training went)."""
    hardness = np.clip(rate + rng.normal(0, question_sd, questions), 0.02, 0.98)
    return [
        (rng.random(questions) < np.clip(hardness + rng.normal(0, run_sd), 0, 1)).astype(float)
        for _ in range(runs)
    ], hardness


def test_the_hierarchical_bootstrap_holds_the_runs_noise():
    """Many questions, runs that differ by their seed: the interval is as wide as the runs'
    spread says (Welch's over run means), not the questions' (a bootstrap over questions alone
    would be about a tenth as wide)."""
    rng = np.random.default_rng(2)
    hardness = np.clip(0.5 + rng.normal(0, 0.2, 3000), 0.02, 0.98)

    def runs(shift):
        return [
            (rng.random(3000) < np.clip(hardness + shift + rng.normal(0, 0.08), 0, 1)).astype(float)
            for _ in range(5)
        ]

    runs_a, runs_b = runs(0.0), runs(0.0)
    low, high = hierarchical_bootstrap(runs_a, runs_b, replicates=1500)
    _, (w_low, w_high), _ = welch(np.mean(runs_a, axis=1), np.mean(runs_b, axis=1))
    assert high - low > 0.5 * (w_high - w_low) and low < 0 < high
    stacked_a, stacked_b = np.stack(runs_a), np.stack(runs_b)
    q_only = [  # the interval over questions alone, every run kept: the one this test refuses
        stacked_a[:, q].mean() - stacked_b[:, q].mean()
        for q in (rng.integers(0, 3000, 3000) for _ in range(300))
    ]
    assert high - low > 4 * (np.quantile(q_only, 0.975) - np.quantile(q_only, 0.025))


def test_the_hierarchical_bootstrap_holds_the_questions_noise():
    """Every run of a variant the same scores (no seed noise) on few questions: the interval
    still has the questions' width, and a real difference of about 0.1 is inside and above 0."""
    rng = np.random.default_rng(1)
    hardness = rng.random(200)
    one_a = (rng.random(200) < np.clip(hardness + 0.1, 0, 1)).astype(float)
    one_b = (rng.random(200) < hardness).astype(float)
    low, high = hierarchical_bootstrap([one_a] * 4, [one_b] * 4, replicates=2000)
    diff = one_a.mean() - one_b.mean()
    assert low < diff < high and low > 0
    assert high - low > 0.04  # a bootstrap over runs alone: width 0
    low, high = hierarchical_bootstrap([one_b] * 4, [one_b] * 4, replicates=500)
    assert low == high == 0.0  # the same scores on both sides: no difference at any resample


def test_a_verdict_needs_every_test():
    many = compare([0.50, 0.52, 0.51, 0.49, 0.50, 0.52], [0.30, 0.31, 0.29, 0.30, 0.32, 0.28])
    assert many.significant and many.verdict() == "above"
    assert "a is above b" in many.text("a", "b")
    few = compare([0.4, 0.5, 0.6], [0.1, 0.2, 0.3])
    assert few.welch_p < 0.05 and few.permutation_p == pytest.approx(0.1)
    assert not few.significant and few.verdict() == "no significant difference"
    assert compare([0.5], [0.4, 0.3]) is None


def test_runs_without_spread_give_welch_its_limits():
    assert welch(np.array([0.2, 0.2]), np.array([0.2, 0.2])) == (1.0, (0.0, 0.0), 0.0)
    p, (low, high), df = welch(np.array([0.3, 0.3]), np.array([0.2, 0.2]))
    assert p == 0.0 and low == high == pytest.approx(0.1) and df == 0.0


def test_the_floor_at_the_edges_of_the_exact_limit_and_of_the_sizes():
    assert smallest_permutation_p(1, 3) == pytest.approx(1 / 4)  # one run a side is a design
    assert smallest_permutation_p(3, 1, "greater") == pytest.approx(1 / 4)
    assert smallest_permutation_p(3, 3, exact_limit=20, draws=1) == pytest.approx(0.1)  # exact
    assert smallest_permutation_p(3, 3, exact_limit=19, draws=1) == pytest.approx(0.5)  # drawn
    assert smallest_permutation_p(10, 10, exact_limit=10**6, draws=100) == pytest.approx(
        2 / math.comb(20, 10)
    )
    assert not can_reach(4, 4, 0.02) and can_reach(4, 4, 0.02, "greater")  # 2/70, 1/70
    a, b = np.array([0.4, 0.5, 0.6]), np.array([0.1, 0.2, 0.3])
    assert permutation_p(a, b, exact_limit=20) == pytest.approx(0.1)  # 20 relabellings: exact
    assert permutation_p(a, b, exact_limit=19, draws=10) != pytest.approx(0.1)  # 10 drawn
    assert permutation_p(a, b, exact_limit=19, draws=50) == pytest.approx(0.1)  # 50 > 20: exact
    with pytest.raises(ValueError, match="two-sided, greater or less, got 'both'"):
        permutation_p(a, b, alternative="both")


def test_the_random_draws_are_seeded_and_the_defaults_are_the_documented_ones():
    rng = np.random.default_rng(8)
    a, b = rng.normal(0.5, 0.1, 10), rng.normal(0.45, 0.1, 10)
    assert permutation_p(a, b, draws=500) == permutation_p(a, b, draws=500, seed=0)
    runs_a = [rng.random(30) for _ in range(3)]
    runs_b = [rng.random(30) for _ in range(3)]
    assert hierarchical_bootstrap(runs_a, runs_b) == hierarchical_bootstrap(
        runs_a, runs_b, replicates=4000, seed=0
    )


def test_the_bootstrap_draws_every_question_and_every_run():
    """The first question, or the first run, is the only one that differs: a resampling that
    never drew index 0 would give the interval [0, 0]."""
    zeros = np.zeros(4)
    first_question = np.array([1.0, 0, 0, 0])
    assert hierarchical_bootstrap([first_question] * 2, [zeros] * 2, replicates=400)[1] > 0
    assert hierarchical_bootstrap([np.ones(4), zeros], [zeros, zeros], replicates=400)[1] > 0
    assert hierarchical_bootstrap([zeros, zeros], [np.ones(4), zeros], replicates=400)[0] < 0


def test_the_sentence_says_which_interval_and_which_way():
    rng = np.random.default_rng(3)
    scores_a = [(rng.random(40) < 0.3).astype(float) for _ in range(2)]
    scores_b = [(rng.random(40) < 0.6).astype(float) for _ in range(2)]
    a, b = [float(s.mean()) for s in scores_a], [float(s.mean()) for s in scores_b]
    both = compare(a, b, scores_a, scores_b)  # two runs a side is enough
    assert both.n_a == both.n_b == 2 and both.diff == pytest.approx(np.mean(a) - np.mean(b))
    assert both.bootstrap_ci == hierarchical_bootstrap(scores_a, scores_b)
    low, high = both.bootstrap_ci
    assert (
        f"95% interval [{low:+.3f}, {high:+.3f}] (hierarchical bootstrap over runs and questions)"
        in both.text("x", "y")
    )
    assert ": no significant difference;" in both.text("x", "y")
    for one_side in ((scores_a, None), (None, scores_b), (scores_a, [s[:30] for s in scores_b])):
        welch_only = compare(a, b, *one_side)  # per-question scores on one side, or unequal
        assert welch_only.bootstrap_ci is None
        low, high = welch_only.welch_ci
        assert f"95% interval [{low:+.3f}, {high:+.3f}] (Welch)" in welch_only.text("x", "y")
    below = compare([0.30, 0.31, 0.29, 0.30, 0.32, 0.28], [0.50, 0.52, 0.51, 0.49, 0.50, 0.52])
    assert below.verdict() == "below" and "a is below b" in below.text("a", "b")
    assert below.diff == pytest.approx(1.80 / 6 - 3.04 / 6, abs=1e-12)


def test_a_difference_of_rounding_only_reads_as_zero():
    tied = compare([0.3, 0.2, 0.1], [0.1, 0.2, 0.3])  # mean difference -5.6e-17 in floats
    assert tied.diff == 0.0 and "a − b: +0.000," in tied.text("a", "b")


def test_ties_that_differ_by_rounding_count_at_any_scale():
    """Runs in the hundreds of thousands: relabellings whose difference equals the observed one
    but for float rounding still count (the tolerance scales with the difference)."""
    a = np.array([640000.3, 270000.1, 40000.2])
    b = np.array([810000.1, 910000.3, 610000.2])
    assert permutation_p(a, b) == pytest.approx(0.2)  # 4 of 20, not 3


def test_a_tie_is_equality_up_to_rounding_not_a_near_miss():
    """The permutation test counts a relabelling's difference as reaching the observed one when
    it is equal up to float rounding (scipy's tolerance: 100 machine epsilons of the observed
    difference). Differences 1e-12 apart are distinct: here two relabellings fall short of the
    observed 1.5 + 0.5e-12 by 1e-12."""
    a, b = np.array([1.0, 3.0]), np.array([0.0, 1.0 - 1e-12])
    assert permutation_p(a, b) == pytest.approx(2 / 6)  # {1, 3} and its mirror only
    assert permutation_p(a, np.array([0.0, 1.0 - 2e-16])) == pytest.approx(4 / 6)  # ties
