import math

import torch

from learner.advantages import stratified_advantages_with_stats
from learner.telemetry import in_stratum_variance, stratum_summary


def test_summary_hand_computed():
    # Group 0: stratum 0 rewards (1, 0), stratum 1 rewards (1, 1); group 1: stratum 0 reward (0).
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1])
    strata = torch.tensor([0, 0, 1, 1, 0])
    result = stratified_advantages_with_stats(rewards, groups, strata, alpha=1.0, eps=0.0)
    assert result.advantages.tolist() == [1.0, -1.0, 0.0, 0.0, 0.0]
    variances = in_stratum_variance(result, result.advantages)
    assert sorted(variances.tolist()) == [0.0, 0.0, 1.0]
    summary = stratum_summary(
        result, rewards, strata, {"calls": torch.tensor([2.0, 2, 5, 5, math.nan])}
    )
    assert summary[0]["count"] == 3 and summary[0]["mean_reward"] == 1 / 3
    assert (
        summary[0]["in_stratum_adv_var"] == 1.0
    )  # the singleton and equal-reward cells are left out
    assert math.isnan(summary[1]["in_stratum_adv_var"])  # its only cell has no spread
    assert summary[0]["calls"] == 2.0 and summary[1]["calls"] == 5.0  # NaN ignored
