"""Comparisons between two variants of an experiment that are tests, not overlapping ranges.

For a measure per run (e.g. held-out accuracy at the last evaluation) of variant A against B:

- Welch's t-test over runs (unequal variances), with its 95% interval of the difference and
  its degrees of freedom (`scipy.stats.ttest_ind`);
- a permutation test over runs (`scipy.stats.permutation_test`): exact (every relabelling) when
  there are at most 50,000, else 20,000 random ones, counted with the observed labelling among
  them ((hits + 1) / (draws + 1): a Monte Carlo p is never 0); `smallest_permutation_p`
  says the least p a design of n_a vs n_b runs can give at all (3 vs 3: 0.05 one-sided, 0.1
  two-sided, so "p < 0.05" is out of its reach whatever the runs);
- a hierarchical bootstrap 95% interval of the difference where the per-question scores are at
  hand: runs are resampled within each variant, then questions (one resample of the question set
  per replicate, shared by every run: the variants answer the same questions), so both sources
  of noise (which run, which questions) are in the interval;
- the difference this many runs could detect with 80% power at the 5% level (two-sided): (t of
  0.975 + t of 0.8) times the standard error of the difference, with t on the runs' own
  Welch-Satterthwaite degrees of freedom (a normal z would promise 3 vs 3 runs detect 2.8 standard
  errors; with their at most 4 degrees of freedom it takes at least 3.7).

A verdict says "above" or "below" only when Welch's test and the permutation test both give
p < 0.05 and the bootstrap interval (where there is one) excludes 0; anything else is "no
significant difference", which with few runs is what most comparisons are.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import stats as sps

LEVEL = 0.05
EXACT_LIMIT = 50_000
"""At most this many relabellings: the permutation test enumerates them all."""
DRAWS = 20_000
"""Random relabellings of the Monte Carlo permutation test (more than EXACT_LIMIT in all)."""

Alternative = Literal["two-sided", "greater", "less"]


@dataclass(frozen=True)
class Comparison:
    diff: float
    """mean(A) - mean(B) over runs."""
    n_a: int
    n_b: int
    welch_p: float
    welch_ci: tuple[float, float]
    permutation_p: float
    bootstrap_ci: tuple[float, float] | None
    """Hierarchical bootstrap (runs, then questions); None without per-question scores."""
    detectable: float
    """The difference these runs detect with 80% power (two-sided Welch test at 5%, t on the
    runs' Welch-Satterthwaite degrees of freedom)."""

    @property
    def significant(self) -> bool:
        inside = self.bootstrap_ci is None or not (
            self.bootstrap_ci[0] <= 0 <= self.bootstrap_ci[1]
        )
        return self.welch_p < LEVEL and self.permutation_p < LEVEL and inside

    def verdict(self) -> str:
        if not self.significant:
            return "no significant difference"
        return "above" if self.diff > 0 else "below"

    def text(self, a: str, b: str) -> str:
        """One sentence: the difference, its intervals, the tests, the verdict and the power."""
        interval = (
            f"95% interval [{self.bootstrap_ci[0]:+.3f}, {self.bootstrap_ci[1]:+.3f}] "
            "(hierarchical bootstrap over runs and questions)"
            if self.bootstrap_ci is not None
            else f"95% interval [{self.welch_ci[0]:+.3f}, {self.welch_ci[1]:+.3f}] (Welch)"
        )
        said = f"{a} is {self.verdict()} {b}" if self.significant else self.verdict()
        return (
            f"{a} − {b}: {self.diff:+.3f}, {interval}, Welch p = {self.welch_p:.2g}, "
            f"permutation p = {self.permutation_p:.2g} ({self.n_a} vs {self.n_b} runs): {said}; "
            f"these runs detect a difference of {self.detectable:.3f} with 80% power"
        )


def _zeroed(x: float) -> float:
    """A difference of float rounding only is 0 (it would read -0.000)."""
    return 0.0 if abs(x) < 1e-12 else x


def _standard_error(a: np.ndarray, b: np.ndarray) -> float:
    """Of mean(a) - mean(b), variances unequal."""
    return math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))


def _ttest(a: np.ndarray, b: np.ndarray):
    """scipy's Welch test; a side whose runs are all equal is a valid sample (its variance 0),
    not the precision loss scipy warns of."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Precision loss occurred", RuntimeWarning)
        return sps.ttest_ind(a, b, equal_var=False)


def welch(a: np.ndarray, b: np.ndarray) -> tuple[float, tuple[float, float], float]:
    """Welch's two-sided p, 95% interval of mean(a) - mean(b) and Welch-Satterthwaite degrees of
    freedom (scipy's `ttest_ind(equal_var=False)`). Runs without spread have no t: p is 1 for
    equal means and 0 otherwise, the interval the difference itself, the degrees of freedom 0."""
    if _standard_error(a, b) == 0:
        diff = float(a.mean() - b.mean())
        return (1.0 if diff == 0 else 0.0), (diff, diff), 0.0
    found = _ttest(a, b)
    ci = found.confidence_interval(1 - LEVEL)
    return float(found.pvalue), (float(ci.low), float(ci.high)), float(found.df)


def detectable(a: np.ndarray, b: np.ndarray, power: float = 0.8, level: float = LEVEL) -> float:
    """The difference of means these runs detect with `power` in a two-sided Welch test at
    `level`: (t_{1 - level/2} + t_{power}) * se on the Welch-Satterthwaite degrees of freedom;
    0 when the runs have no spread."""
    se = _standard_error(a, b)
    if se == 0:
        return 0.0
    df = _ttest(a, b).df
    return float((sps.t.ppf(1 - level / 2, df) + sps.t.ppf(power, df)) * se)


def _exact(n_a: int, n_b: int, exact_limit: int, draws: int) -> bool:
    """Whether the permutation test enumerates every relabelling: when there are at most
    `exact_limit`, or no more than the `draws` it would otherwise make (scipy's own rule)."""
    return math.comb(n_a + n_b, n_a) <= max(exact_limit, draws)


def smallest_permutation_p(
    n_a: int,
    n_b: int,
    alternative: Alternative = "two-sided",
    exact_limit: int = EXACT_LIMIT,
    draws: int = DRAWS,
) -> float:
    """The least p `permutation_p` can give n_a vs n_b runs whatever their values (no ties):
    one relabelling in C(n_a + n_b, n_a) is as extreme as the observed one, two two-sided when
    n_a == n_b (the swapped labelling is its mirror); drawn at random rather than enumerated,
    the Monte Carlo floor 1 / (draws + 1) as well."""
    if n_a < 1 or n_b < 1:
        raise ValueError(f"a permutation test needs a run a side, got {n_a} vs {n_b}")
    extreme = 2 if alternative == "two-sided" and n_a == n_b else 1
    floor = extreme / math.comb(n_a + n_b, n_a)
    return floor if _exact(n_a, n_b, exact_limit, draws) else max(floor, 1 / (draws + 1))


def can_reach(
    n_a: int, n_b: int, level: float = LEVEL, alternative: Alternative = "two-sided"
) -> bool:
    """Whether a permutation test of n_a vs n_b runs can give p < `level` at all (3 vs 3 cannot
    reach 0.05 even one-sided: its least p is 1/20)."""
    return smallest_permutation_p(n_a, n_b, alternative) < level


def _mean_gap(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(x, axis=axis) - np.mean(y, axis=axis)


def _abs_mean_gap(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.abs(_mean_gap(x, y, axis))


def permutation_p(
    a: np.ndarray,
    b: np.ndarray,
    draws: int = DRAWS,
    seed: int = 0,
    alternative: Alternative = "two-sided",
    exact_limit: int = EXACT_LIMIT,
) -> float:
    """p of the difference of means mean(a) - mean(b) under relabelling the runs
    (`scipy.stats.permutation_test`): two-sided as |difference| at least the observed one (scipy's
    own two-sided doubles the smaller tail, which differs from it when the sides are unequal),
    "greater" / "less" one-sided. Exact over every relabelling when there are at most
    `exact_limit`, else `draws` random ones counted with the observed one ((hits + 1) /
    (draws + 1), never 0)."""
    if alternative not in ("two-sided", "greater", "less"):
        raise ValueError(f"alternative must be two-sided, greater or less, got {alternative!r}")
    statistic, side = _mean_gap, alternative
    if alternative == "two-sided":
        statistic, side = _abs_mean_gap, "greater"
    exact = _exact(len(a), len(b), exact_limit, draws)
    found = sps.permutation_test(
        (np.asarray(a, dtype=float), np.asarray(b, dtype=float)),
        statistic,
        permutation_type="independent",
        alternative=side,
        n_resamples=np.inf if exact else draws,
        vectorized=True,
        random_state=seed,
    )
    return float(found.pvalue)


def hierarchical_bootstrap(
    a: list[np.ndarray], b: list[np.ndarray], replicates: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile interval of mean(A) - mean(B): each run is an array of per-question
    scores over the same questions in the same order."""
    rng = np.random.default_rng(seed)
    runs_a, runs_b = np.stack(a), np.stack(b)
    questions = runs_a.shape[1]
    diffs = np.empty(replicates)
    for i in range(replicates):
        q = rng.integers(0, questions, questions)
        ra = runs_a[rng.integers(0, len(a), len(a))][:, q]
        rb = runs_b[rng.integers(0, len(b), len(b))][:, q]
        diffs[i] = ra.mean() - rb.mean()
    low, high = np.quantile(diffs, [0.025, 0.975])
    return float(low), float(high)


def compare(
    a: list[float],
    b: list[float],
    per_question_a: list[np.ndarray] | None = None,
    per_question_b: list[np.ndarray] | None = None,
) -> Comparison | None:
    """A against B; None with fewer than 2 runs on a side."""
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(xa) < 2 or len(xb) < 2:
        return None
    p, ci, _ = welch(xa, xb)
    boot = None
    if per_question_a and per_question_b:
        lengths = {len(x) for x in (*per_question_a, *per_question_b)}
        if len(lengths) == 1:
            boot = hierarchical_bootstrap(per_question_a, per_question_b)
    return Comparison(
        _zeroed(float(xa.mean() - xb.mean())),
        len(xa),
        len(xb),
        p,
        ci,
        permutation_p(xa, xb),
        boot,
        detectable(xa, xb),
    )
