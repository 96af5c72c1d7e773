"""Stratified Advantage Normalisation blended with group normalisation (Algorithm 1, arXiv 2510.06214).

Per prompt group g and stratum k (population statistics, 1/n):

    A_GN(i)  = (R_i - mean_g) / (std_g + eps)
    A_SAN(i) = (R_i - mean_{g,k}) / (std_{g,k} + eps)        # 0 for a stratum of one trajectory
    A(i)     = alpha * A_SAN(i) + (1 - alpha) * A_GN(i)

Everything is vectorised with segment reductions (`index_add_` over dense segment ids), so a batch
of a million trajectories costs a few scatters (and a sort when ids are sparse), never a Python
loop over groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SegmentStats:
    """Population statistics of the rewards in each segment (a group, or a (group, stratum) cell)."""

    group_id: torch.Tensor  # int64 [S]: the caller's group id of each segment
    stratum: torch.Tensor  # int64 [S]: the caller's stratum value (-1 for whole-group segments)
    count: torch.Tensor  # int64 [S]
    mean: torch.Tensor  # [S], the rewards' dtype
    std: torch.Tensor  # [S], population std (1/n)


@dataclass(frozen=True)
class StratifiedAdvantages:
    """The blended advantages plus what telemetry and tests need to look inside them."""

    advantages: torch.Tensor  # alpha * san + (1 - alpha) * gn
    san: torch.Tensor  # per-(group, stratum) normalised
    gn: torch.Tensor  # per-group normalised (standard GRPO)
    stratified_centered: torch.Tensor  # R_i - mean_{g,k}: the paper's unnormalised A_S
    global_centered: torch.Tensor  # R_i - mean_g: the paper's unnormalised A_G
    groups: SegmentStats
    cells: SegmentStats
    cell_index: torch.Tensor  # int64 [N]: row of `cells` that each trajectory belongs to


def segment_stats(
    values: torch.Tensor, segment: torch.Tensor, num_segments: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Count, mean and population std of `values` per dense segment id (two-pass for accuracy).

    A segment whose values are all equal gets its mean set to that value exactly, so its centred
    rewards are exactly 0: otherwise sum/n rounding leaves ~1e-8 residues in float32 that a small
    std + eps would blow up into spurious advantages of ~0.01.
    """
    count = torch.bincount(segment, minlength=num_segments)
    zeros = torch.zeros(num_segments, dtype=values.dtype, device=values.device)
    total = zeros.clone().index_add_(0, segment, values)
    mean = total / count.to(values.dtype)
    lo = zeros.clone().scatter_reduce_(0, segment, values, "amin", include_self=False)
    hi = zeros.clone().scatter_reduce_(0, segment, values, "amax", include_self=False)
    mean = torch.where(lo == hi, lo, mean)
    centered = values - mean[segment]
    sq = zeros.clone().index_add_(0, segment, centered * centered)
    std = torch.sqrt(sq / count.to(values.dtype))
    return count, mean, std


def _dense_ids(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids in [0, m) for arbitrary int64 values, and the value of each id.

    Values spanning a small range map by subtraction (no sort; some ids may then be unused);
    anything else goes through `torch.unique`, which sorts.
    """
    if values.numel() == 0:
        return values.clone(), values.new_empty(0)
    lo, hi = int(values.min()), int(values.max())  # Python ints: no int64 overflow in hi - lo
    if hi - lo < 2 * values.numel() + 64:
        return values - lo, torch.arange(lo, hi + 1, dtype=torch.int64, device=values.device)
    unique, inverse = torch.unique(values, return_inverse=True)
    return inverse, unique


def _normalise(
    centered: torch.Tensor, std: torch.Tensor, count: torch.Tensor, eps: float
) -> torch.Tensor:
    """centered / (std + eps); 0 for singleton segments and for a zero denominator (eps = 0)."""
    denom = std + eps
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    out = centered / safe
    return torch.where((count > 1) & (denom > 0), out, torch.zeros_like(out))


def _check_inputs(rewards: torch.Tensor, group_ids: torch.Tensor, strata: torch.Tensor) -> None:
    if rewards.dim() != 1 or group_ids.dim() != 1 or strata.dim() != 1:
        raise ValueError(
            "rewards, group_ids and strata must be 1-D tensors, got shapes "
            f"{tuple(rewards.shape)}, {tuple(group_ids.shape)}, {tuple(strata.shape)}"
        )
    if not (len(rewards) == len(group_ids) == len(strata)):
        raise ValueError(
            f"rewards, group_ids and strata must have equal length, got "
            f"{len(rewards)}, {len(group_ids)}, {len(strata)}"
        )
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a float tensor, got {rewards.dtype}")
    if group_ids.is_floating_point() or strata.is_floating_point():
        raise ValueError("group_ids and strata must be integer tensors")


def stratified_advantages_with_stats(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    strata: torch.Tensor,
    alpha: float = 0.6,
    eps: float = 1e-6,
) -> StratifiedAdvantages:
    """Algorithm 1 of the paper, with the intermediate estimators and per-segment statistics.

    `group_ids` and `strata` may hold any integer values in any order; only equality matters.
    """
    _check_inputs(rewards, group_ids, strata)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    device = rewards.device
    group_ids = group_ids.to(device=device, dtype=torch.int64)
    strata = strata.to(device=device, dtype=torch.int64)

    # Dense ids: group g in [0, G), stratum s in [0, S), cell c = (g, s) over G*S slots when that
    # is small, else over the (g, s) pairs that occur. Unused slots have count 0 and are never read.
    g, group_values = _dense_ids(group_ids)
    s, stratum_values = _dense_ids(strata)
    num_strata = len(stratum_values)
    cell = g * num_strata + s
    if len(group_values) * num_strata <= 8 * len(rewards) + 1024:
        cell_keys = torch.arange(len(group_values) * num_strata, device=device)
        c = cell
    else:
        cell_keys, c = torch.unique(cell, return_inverse=True)

    g_count, g_mean, g_std = segment_stats(rewards, g, len(group_values))
    c_count, c_mean, c_std = segment_stats(rewards, c, len(cell_keys))

    global_centered = rewards - g_mean[g]
    stratified_centered = rewards - c_mean[c]
    gn = _normalise(global_centered, g_std[g], g_count[g], eps)
    san = _normalise(stratified_centered, c_std[c], c_count[c], eps)
    advantages = alpha * san + (1.0 - alpha) * gn

    used_groups = g_count > 0
    groups = SegmentStats(
        group_id=group_values[used_groups],
        stratum=torch.full_like(group_values[used_groups], -1),
        count=g_count[used_groups],
        mean=g_mean[used_groups],
        std=g_std[used_groups],
    )
    used_cells = c_count > 0
    keys = cell_keys[used_cells]
    cells = SegmentStats(
        group_id=group_values[keys // num_strata],
        stratum=stratum_values[keys % num_strata],
        count=c_count[used_cells],
        mean=c_mean[used_cells],
        std=c_std[used_cells],
    )
    return StratifiedAdvantages(
        advantages=advantages,
        san=san,
        gn=gn,
        stratified_centered=stratified_centered,
        global_centered=global_centered,
        groups=groups,
        cells=cells,
        cell_index=(torch.cumsum(used_cells, 0) - 1)[c],
    )


def stratified_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    strata: torch.Tensor,
    alpha: float = 0.6,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Blended advantage A = alpha * A_SAN + (1 - alpha) * A_GN, same dtype as `rewards`.

    alpha = 0 is standard GRPO; alpha = 1 is pure SAN. A stratum of one trajectory has A_SAN = 0.
    """
    return stratified_advantages_with_stats(rewards, group_ids, strata, alpha, eps).advantages
