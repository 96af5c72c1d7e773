"""Comparisons that are tests (pipeline/experiments/stats.py)."""

import numpy as np
import pytest
from scipy import stats as sps

from pipeline.experiments.stats import compare, hierarchical_bootstrap, permutation_p, welch


def test_welch_is_scipys_and_its_interval_holds_the_difference():
    rng = np.random.default_rng(0)
    a, b = rng.normal(0.4, 0.05, 5), rng.normal(0.3, 0.1, 7)
    p, (low, high) = welch(a, b)
    assert p == pytest.approx(sps.ttest_ind(a, b, equal_var=False).pvalue, rel=1e-9)
    assert low < a.mean() - b.mean() < high


def test_the_permutation_test_is_exact_for_few_runs():
    # 3 vs 3 runs: 20 relabellings; the most extreme split and its mirror give p = 0.1, so
    # ranges that do not overlap are never significant at 5% with three seeds a side
    assert permutation_p(np.array([0.4, 0.5, 0.6]), np.array([0.1, 0.2, 0.3])) == pytest.approx(0.1)
    assert permutation_p(np.array([0.2, 0.2]), np.array([0.2, 0.2])) == 1.0


def test_the_hierarchical_bootstrap_covers_both_noises():
    rng = np.random.default_rng(1)
    hardness = rng.random(200)  # the same questions for every run
    runs_a = [(rng.random(200) < np.clip(hardness + 0.1, 0, 1)).astype(float) for _ in range(6)]
    runs_b = [(rng.random(200) < hardness).astype(float) for _ in range(6)]
    low, high = hierarchical_bootstrap(runs_a, runs_b, replicates=2000)
    diff = np.mean(runs_a) - np.mean(runs_b)
    assert low < diff < high and low > 0  # a real difference of about 0.1
    low, high = hierarchical_bootstrap(runs_b, runs_b, replicates=2000)
    assert low < 0 < high


def test_a_verdict_needs_every_test():
    many = compare([0.50, 0.52, 0.51, 0.49, 0.50, 0.52], [0.30, 0.31, 0.29, 0.30, 0.32, 0.28])
    assert many.significant and many.verdict() == "above"
    assert "a is above b" in many.text("a", "b")
    few = compare([0.4, 0.5, 0.6], [0.1, 0.2, 0.3])
    assert few.welch_p < 0.05 and few.permutation_p == pytest.approx(0.1)
    assert not few.significant and few.verdict() == "no significant difference"
    assert compare([0.5], [0.4, 0.3]) is None
