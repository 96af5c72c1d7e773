"""Two proportions compared (the trap's escape fractions, pipeline/experiments/trap.py): Wilson's
interval of one, Newcombe's hybrid score interval of a difference and Fisher's exact test; and
the Clopper-Pearson (exact) interval of one, for a handful of runs. scipy computes the intervals
of one proportion (`binomtest(...).proportion_ci`) and Fisher's test; it has no interval of a
difference, so Newcombe's is built here from the two Wilson intervals.

Newcombe's interval (method 10 of Newcombe 1998, "Interval estimation for the difference between
independent proportions") combines the two Wilson intervals: for d = p1 - p2,

    [d - sqrt((p1 - l1)^2 + (u2 - p2)^2),  d + sqrt((u1 - p1)^2 + (p2 - l2)^2)]

It stays inside [-1, 1] and behaves at 0 and n successes, where the Wald interval does not.
"""

from __future__ import annotations

import math

# scipy.stats is imported where it is used, as plots import matplotlib: it takes about 0.5 s of
# CPU to import, and every run's report.md imports this module (its diagnosis's trap model)


def _binomial_ci(successes: int, n: int, method: str) -> tuple[float, float]:
    from scipy import stats as sps

    ci = sps.binomtest(successes, n).proportion_ci(confidence_level=0.95, method=method)
    return float(ci.low), float(ci.high)


def wilson(successes: int, n: int) -> tuple[float, float]:
    """Wilson score 95% interval of a binomial proportion; [0, 1] without a trial."""
    return (0.0, 1.0) if n == 0 else _binomial_ci(successes, n, "wilson")


def newcombe(x1: int, n1: int, x2: int, n2: int) -> tuple[float, float]:
    """Newcombe's hybrid score 95% interval of x1 / n1 - x2 / n2."""
    if n1 < 1 or n2 < 1:
        raise ValueError(f"each proportion needs at least one trial, got n {n1} and {n2}")
    p1, p2 = x1 / n1, x2 / n2
    (l1, u1), (l2, u2) = wilson(x1, n1), wilson(x2, n2)
    d = p1 - p2
    return d - math.hypot(p1 - l1, u2 - p2), d + math.hypot(u1 - p1, p2 - l2)


def fisher_p(x1: int, n1: int, x2: int, n2: int) -> float:
    """Fisher's exact test, two-sided, of x1 successes in n1 against x2 in n2."""
    from scipy import stats as sps

    return float(sps.fisher_exact([[x1, n1 - x1], [x2, n2 - x2]]).pvalue)


def clopper_pearson(successes: int, n: int) -> tuple[float, float]:
    """Clopper-Pearson (exact) 95% interval of a binomial proportion."""
    return _binomial_ci(successes, n, "exact")
