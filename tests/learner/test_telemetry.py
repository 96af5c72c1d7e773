import itertools
import math

import torch

from learner.advantages import stratified_advantages_with_stats
from learner.telemetry import in_stratum_variance, stratum_summary, theorem1_terms


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


def test_theorem1_terms_hand_computed_and_they_add_up():
    # One group of 4: stratum 0 rewards (0, 0), stratum 1 rewards (1, 0); group mean 1/4.
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    groups, strata = torch.zeros(4, dtype=torch.long), torch.tensor([0, 0, 1, 1])
    terms = theorem1_terms(stratified_advantages_with_stats(rewards, groups, strata, 0.6, 1e-6))
    # cross: (1/4) * (2 * (0 - 1/4)^2 + 2 * (1/2 - 1/4)^2) = 1/16; in-stratum: (1/4) * 2 * (1/2)^2
    assert math.isclose(terms["theorem1_cross_stratum"], 1 / 16)
    assert math.isclose(terms["theorem1_in_stratum"], 1 / 8)
    assert math.isclose(terms["theorem1_global_var"], 3 / 16)  # var of (0, 0, 1, 0)
    generator = torch.Generator().manual_seed(0)
    rewards = torch.rand(64, generator=generator, dtype=torch.float64)
    groups = torch.arange(64) // 8
    strata = torch.randint(0, 3, (64,), generator=generator)
    terms = theorem1_terms(stratified_advantages_with_stats(rewards, groups, strata, 0.6, 1e-6))
    assert math.isclose(
        terms["theorem1_global_var"], terms["theorem1_in_stratum"] + terms["theorem1_cross_stratum"]
    )


def test_cross_stratum_chance_is_the_mean_over_shuffled_labels():
    # The closed form against the average over every relabelling of small groups' strata.
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.5, 3.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    groups = torch.tensor([7, 7, 7, 7, 7, 2, 2, 2, 2])  # not dense, not sorted by id
    strata = torch.tensor([0, 0, 1, 2, 2, 5, 5, 5, 4])
    result = stratified_advantages_with_stats(rewards, groups, strata, 0.6, 1e-6)
    chance = theorem1_terms(result)["theorem1_cross_stratum_chance"]
    totals = []
    for left in itertools.permutations(range(5)):
        for right in itertools.permutations(range(4)):
            shuffled = torch.cat([strata[:5][list(left)], strata[5:][list(right)]])
            again = stratified_advantages_with_stats(rewards, groups, shuffled, 0.6, 1e-6)
            totals.append(theorem1_terms(again)["theorem1_cross_stratum"])
    assert math.isclose(chance, sum(totals) / len(totals), rel_tol=1e-12)
    assert chance > 0
    # Strata that are the rewards take all the variance, above chance; one stratum gives 0.
    exact = theorem1_terms(
        stratified_advantages_with_stats(rewards, groups, (rewards * 2).long(), 0.6, 1e-6)
    )
    assert math.isclose(exact["theorem1_cross_stratum"], exact["theorem1_global_var"])
    assert exact["theorem1_cross_stratum"] > exact["theorem1_cross_stratum_chance"] > 0
    zeros = torch.zeros(9, dtype=torch.long)
    one = stratified_advantages_with_stats(rewards, groups, zeros, 0.6, 1e-6)
    assert theorem1_terms(one)["theorem1_cross_stratum_chance"] == 0.0
