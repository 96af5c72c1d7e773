"""Comparisons between two variants of an experiment that are tests, not overlapping ranges.

For a measure per run (e.g. held-out accuracy at the last evaluation) of variant A against B:

- Welch's t-test over runs (unequal variances), with its 95% interval of the difference;
- a permutation test over runs: exact (every relabelling) when there are at most 50,000, else
  20,000 random ones;
- a hierarchical bootstrap 95% interval of the difference where the per-question scores are at
  hand: runs are resampled within each variant, then questions (one resample of the question set
  per replicate, shared by every run: the variants answer the same questions), so both sources
  of noise (which run, which questions) are in the interval;
- the difference this many runs could detect with 80% power at the 5% level (two-sided, normal
  approximation, the runs' own spread).

A verdict says "above" or "below" only when Welch's test and the permutation test both give
p < 0.05 and the bootstrap interval (where there is one) excludes 0; anything else is "no
significant difference", which with few runs is what most comparisons are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import numpy as np
from scipy import stats as sps

LEVEL = 0.05


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
    """The difference these runs detect with 80% power (two-sided, 5%)."""

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


def welch(a: np.ndarray, b: np.ndarray) -> tuple[float, tuple[float, float]]:
    """Welch's two-sided p and 95% interval of mean(a) - mean(b)."""
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    diff = float(a.mean() - b.mean())
    if se == 0:
        return (1.0 if diff == 0 else 0.0), (diff, diff)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    p = float(2 * sps.t.sf(abs(diff) / se, df))
    half = float(sps.t.ppf(0.975, df)) * se
    return p, (diff - half, diff + half)


def permutation_p(a: np.ndarray, b: np.ndarray, draws: int = 20_000, seed: int = 0) -> float:
    """Two-sided p of the difference of means under relabelling the runs."""
    pooled = np.concatenate([a, b])
    observed = abs(a.mean() - b.mean())
    n, k = len(pooled), len(a)
    if math.comb(n, k) <= 50_000:
        splits = (list(c) for c in combinations(range(n), k))
    else:
        rng = np.random.default_rng(seed)
        splits = (rng.choice(n, k, replace=False) for _ in range(draws))
    total = hits = 0
    for chosen in splits:
        mask = np.zeros(n, dtype=bool)
        mask[chosen] = True
        hits += abs(pooled[mask].mean() - pooled[~mask].mean()) >= observed - 1e-12
        total += 1
    return hits / total


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
    p, ci = welch(xa, xb)
    boot = None
    if per_question_a and per_question_b:
        lengths = {len(x) for x in (*per_question_a, *per_question_b)}
        if len(lengths) == 1:
            boot = hierarchical_bootstrap(per_question_a, per_question_b)
    spread = math.sqrt(xa.var(ddof=1) / len(xa) + xb.var(ddof=1) / len(xb))
    detectable = (sps.norm.ppf(0.975) + sps.norm.ppf(0.8)) * spread
    return Comparison(
        _zeroed(float(xa.mean() - xb.mean())),
        len(xa),
        len(xb),
        p,
        ci,
        permutation_p(xa, xb),
        boot,
        detectable,
    )
