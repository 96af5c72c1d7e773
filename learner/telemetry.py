"""Per-stratum summaries of a batch: the quantities of the paper's Figures 2-3, as plain floats."""

from __future__ import annotations

import torch

from learner.advantages import StratifiedAdvantages, segment_stats


def in_stratum_variance(result: StratifiedAdvantages, values: torch.Tensor) -> torch.Tensor:
    """Population variance of `values` inside each (group, stratum) cell, one entry per cell.

    With `values = result.advantages` this is the paper's in-stratum advantage variance (pure SAN
    gives 1 in every cell with spread, Theorem 4); cells of one trajectory give 0.
    """
    _, _, std = segment_stats(values, result.cell_index, len(result.cells.count))
    return std * std


def theorem1_terms(result: StratifiedAdvantages) -> dict[str, float]:
    """Theorem 1's decomposition, averaged over the batch's trajectories (groups are equal-sized,
    so this is also the mean over groups): Var[A_G] = Var[A_S] + cross-stratum term, with A_G the
    group-centred and A_S the (group, stratum)-centred rewards, and the cross-stratum term
    (1/K) sum_k n_k (mean_k - mean_group)^2 the variance the global baseline adds."""
    global_c = result.global_centered.to(torch.float64)
    strat_c = result.stratified_centered.to(torch.float64)
    return {
        "theorem1_global_var": (global_c * global_c).mean().item(),
        "theorem1_in_stratum": (strat_c * strat_c).mean().item(),
        "theorem1_cross_stratum": ((global_c - strat_c) ** 2).mean().item(),
        "theorem1_cross_stratum_chance": cross_stratum_chance(result),
    }


def cross_stratum_chance(result: StratifiedAdvantages) -> float:
    """The cross-stratum term expected if each group's stratum labels were shuffled among its
    trajectories (same cell sizes): what strata that say nothing about the reward give.

    Drawing n_k of a group's n rewards at random, E[n_k (mean_k - mean)^2] = S^2 (1 - n_k / n)
    with S^2 = SS / (n - 1), so the K cells of a group add up to SS (K - 1) / (n - 1), SS being
    the group's sum of squares about its mean. Averaged over trajectories like the other terms.
    """
    groups, cells = result.groups, result.cells
    order = torch.argsort(groups.group_id)
    row = order[torch.searchsorted(groups.group_id[order], cells.group_id)]
    k = torch.bincount(row, minlength=len(groups.count)).to(torch.float64)
    n = groups.count.to(torch.float64)
    ss = n * groups.std.to(torch.float64) ** 2
    expected = torch.where(n > 1, ss * (k - 1) / (n - 1).clamp(min=1), torch.zeros_like(ss))
    return (expected.sum() / n.sum()).item() if n.sum() > 0 else 0.0


def stratum_summary(
    result: StratifiedAdvantages,
    rewards: torch.Tensor,
    strata: torch.Tensor,
    extra: dict[str, torch.Tensor] | None = None,
    advantages: torch.Tensor | None = None,
) -> dict[int, dict[str, float]]:
    """For each stratum: trajectory count, mean reward, mean advantage, the mean in-stratum advantage
    variance over its cells whose rewards vary (NaN if none: a cell of equal rewards carries no
    signal and would only pull the mean towards 0), and the mean of every `extra` column (NaNs
    ignored). `advantages`: those trained (another estimator's); None: `result`'s blend."""
    rewards = rewards.to(torch.float64)
    advantages = result.advantages if advantages is None else advantages
    cell_var = in_stratum_variance(result, advantages.to(torch.float64))
    summary: dict[int, dict[str, float]] = {}
    for value in torch.unique(strata).tolist():
        rows = strata == value
        cells = (result.cells.stratum == value) & (result.cells.count >= 2) & (result.cells.std > 0)
        entry = {
            "count": float(rows.sum().item()),
            "mean_reward": rewards[rows].mean().item(),
            "mean_advantage": advantages[rows].to(torch.float64).mean().item(),
            "in_stratum_adv_var": cell_var[cells].mean().item() if cells.any() else float("nan"),
        }
        for name, column in (extra or {}).items():
            picked = column[rows].to(torch.float64)
            picked = picked[~torch.isnan(picked)]
            entry[name] = picked.mean().item() if picked.numel() else float("nan")
        summary[int(value)] = entry
    return summary
