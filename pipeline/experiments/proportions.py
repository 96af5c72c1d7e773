"""Two proportions compared (the trap's escape fractions, pipeline/experiments/trap.py): Wilson's
interval of one, Newcombe's hybrid score interval of a difference and Fisher's exact test; and
the Clopper-Pearson (exact) interval of one, for a handful of runs (the window experiment's).

Newcombe's interval (method 10 of Newcombe 1998, "Interval estimation for the difference between
independent proportions") combines the two Wilson intervals: for d = p1 - p2,

    [d - sqrt((p1 - l1)^2 + (u2 - p2)^2),  d + sqrt((u1 - p1)^2 + (p2 - l2)^2)]

It stays inside [-1, 1] and behaves at 0 and n successes, where the Wald interval does not.
"""

from __future__ import annotations

import math

Z95 = 1.959964


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% by default)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def newcombe(x1: int, n1: int, x2: int, n2: int, z: float = Z95) -> tuple[float, float]:
    """Newcombe's hybrid score interval (95% by default) of x1 / n1 - x2 / n2."""
    if n1 < 1 or n2 < 1:
        raise ValueError(f"each proportion needs at least one trial, got n {n1} and {n2}")
    p1, p2 = x1 / n1, x2 / n2
    (l1, u1), (l2, u2) = wilson(x1, n1, z), wilson(x2, n2, z)
    d = p1 - p2
    return d - math.hypot(p1 - l1, u2 - p2), d + math.hypot(u1 - p1, p2 - l2)


def fisher_p(x1: int, n1: int, x2: int, n2: int) -> float:
    """Fisher's exact test, two-sided, of x1 successes in n1 against x2 in n2."""
    # imported here, as plots import matplotlib: scipy.stats takes about 0.5 s of CPU to import,
    # and every run's report.md imports this module (its diagnosis's trap model) without a test
    from scipy import stats as sps

    return float(sps.fisher_exact([[x1, n1 - x1], [x2, n2 - x2]]).pvalue)


def clopper_pearson(successes: int, n: int) -> tuple[float, float]:
    """Clopper-Pearson (exact) 95% interval of a binomial proportion."""
    from scipy import stats as sps  # see fisher_p

    ci = sps.binomtest(successes, n).proportion_ci(method="exact")
    return float(ci.low), float(ci.high)
