"""Stratified Advantage Normalisation blended with group normalisation (Algorithm 1, arXiv 2510.06214).

Per prompt group g and stratum k (population statistics, 1/n):

    A_GN(i)  = (R_i - mean_g) / (std_g + eps)
    A_SAN(i) = (R_i - mean_{g,k}) / (std_{g,k} + eps)        # 0 for a stratum of one trajectory
    A(i)     = alpha * A_SAN(i) + (1 - alpha) * A_GN(i)

How a batch of N trajectories is computed, with no Python loop and no sort for the usual ids:
- Ids become dense by subtraction when they span a small range (one min/max pass): a step's
  prompt ids, tool-call counts. Anything else (hash-like ids) goes through `torch.unique`, a sort.
- Cells are the (group, stratum) slots `s * G + g`. One pass over N sums every cell's count,
  rewards and squared rewards; a group's follow by summing its cells (its S slots), not by
  another pass over N.
- Each cell then has a mean, a slope and an offset, and A = (R - mean_{g,k}) * slope + offset,
  with R - mean_g = (R - mean_{g,k}) + (mean_{g,k} - mean_g): one read of the cell's
  (slope, offset, mean) row, a subtraction, a multiplication and an addition per trajectory.
- The two passes over N are C loops (learner/advantages.c, via learner/native.py) for CPU
  tensors when a C compiler is at hand, else torch ops (three `bincount`s; a row gather and
  elementwise ops) that give the same bits, more slowly.
Sums run in float64 (float64 rewards are split into a float32 head and the rest, summed apart), so
an all-equal segment's mean is its reward exactly and its advantages are exactly 0: sum / n
rounding would otherwise leave residues that a small std + eps blows up. The one-pass variance
(sum of squares minus n * mean^2) loses about log10(mean^2 / variance) of float64's 16 digits,
which matters only for rewards with a huge common offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from learner import native


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


def _sums(values: torch.Tensor, segment: torch.Tensor, num_segments: int):
    """Per dense segment id: count (int64), and float64 sum, head-only sum and sum of squares.

    Float32 (and narrower) values sum exactly in float64; float64 values are split into a float32
    head and a tail that sum apart, so that `head / n + (sum - head) / n` of an all-equal segment
    is its value exactly. Returns (count, sum_head, sum_tail, sum_squares); sum_tail is None for
    non-float64 values.
    """

    fused = native.cell_sums(values, segment, num_segments)  # one C loop: the same sums, faster
    if fused is not None:
        return fused

    def total(weights: torch.Tensor) -> torch.Tensor:  # float64 even for no values
        return torch.bincount(segment, weights=weights, minlength=num_segments).to(torch.float64)

    count = torch.bincount(segment, minlength=num_segments)
    x = values.to(torch.float64)
    squares = total(x * x)
    if values.dtype != torch.float64:
        return count, total(x), None, squares
    head = values.to(torch.float32).to(torch.float64)
    return count, total(head), total(x - head), squares  # x - head is exact


def _moments(
    count: torch.Tensor,
    head: torch.Tensor,
    tail: torch.Tensor | None,
    squares: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean (float64) and population std (in `dtype`; 0 for empty segments) from `_sums`' output,
    which it consumes: the divisions run in place, so a batch's [segments]-sized temporaries are
    few. The variance is taken in float64 (it is a difference of sums); its root only needs the
    rewards' precision."""
    n = count.to(torch.float64).clamp_(min=1)
    mean = head.div_(n) if tail is None else head.div_(n).add_(tail.div_(n))
    std = _sqrt_(squares.div_(n).addcmul_(mean, mean, value=-1).to(dtype).clamp_(min=0))
    return mean, std


def _sqrt_(x: torch.Tensor) -> torch.Tensor:
    """Square root in place; float32/float64 on CPU through numpy. torch 2.13's CPU sqrt slows
    down on arrays that mix zeros with other values, and a batch's per-cell variances do (every
    all-equal cell's is 0): 625k float32 values, half of them 0, took 1.26 ms against 0.11 ms for
    as many non-zero ones and 0.17-0.22 ms through numpy, measured side by side on 2 cores.
    numpy's is also correctly rounded; torch's differed in the last bit on 10% of 1M random floats
    (against the float64 root rounded to float32)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return x.sqrt_()
    np.sqrt(x.numpy(), out=x.numpy())
    return x


def _scale(std: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / (std + eps), and 0 where that is 1 / 0 (std 0 with eps 0). A segment of one gets
    1 / eps: its only member's deviation is exactly 0, so its advantage is 0 all the same."""
    scale = (std + eps).reciprocal_()
    return scale.nan_to_num_(posinf=0.0) if eps == 0 else scale


def segment_stats(
    values: torch.Tensor, segment: torch.Tensor, num_segments: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Count, mean and population std of `values` per dense segment id, in the values' dtype
    (an all-equal segment's mean is its value exactly; empty segments get zeros)."""
    count, head, tail, squares = _sums(values, segment, num_segments)
    mean, std = _moments(count, head, tail, squares, values.dtype)
    return count, mean.to(values.dtype), std


def _dense_ids(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids in [0, m) for arbitrary int64 values, and the value of each id.

    Values spanning a small range map by subtraction (no sort; some ids may then be unused);
    anything else goes through `torch.unique`, which sorts.
    """
    if values.numel() == 0:
        return values.clone(), values.new_empty(0)
    lo, hi = (int(v) for v in torch.aminmax(values))  # Python ints: no int64 overflow in hi - lo
    if hi - lo < 2 * values.numel() + 64:
        dense = values if lo == 0 else values - lo
        return dense, torch.arange(lo, hi + 1, dtype=torch.int64, device=values.device)
    unique, inverse = torch.unique(values, return_inverse=True)
    return inverse, unique


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


@dataclass(frozen=True)
class _Blend:
    """One batch's ids and per-cell tables (float64; [C] over cells, [G] over groups)."""

    c: torch.Tensor  # [N] dense cell id of each trajectory (int32 when C fits)
    group_values: torch.Tensor  # [G] the caller's id of each dense group
    stratum_values: torch.Tensor  # [S] the caller's stratum of each dense stratum
    occurring: torch.Tensor | None  # [C] g * S + s of each cell; None: cells are all S * G slots
    owner: torch.Tensor | None  # [C] each occurring cell's dense group (None with slots)
    cell_count: torch.Tensor  # [C] int64
    cell_mean: torch.Tensor  # float64
    cell_std: torch.Tensor  # the rewards' dtype, as are the scales
    cell_scale: torch.Tensor  # 1 / (std_{g,k} + eps)
    group_count: torch.Tensor  # [G] int64
    group_mean: torch.Tensor  # float64
    group_std: torch.Tensor
    group_scale: torch.Tensor  # 1 / (std_g + eps)

    @property
    def slotted(self) -> bool:
        return self.occurring is None

    def cell_groups_and_strata(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each cell's dense group and dense stratum (made on demand: the advantages alone never
        need them)."""
        if self.occurring is not None:
            return self.owner, self.occurring % len(self.stratum_values)
        slot = torch.arange(len(self.cell_count), device=self.c.device)
        return slot % len(self.group_values), slot // len(self.group_values)

    def to_cells(self, v: torch.Tensor) -> torch.Tensor:
        """[G] -> [C]: each cell's group's value."""
        if self.owner is None:
            return v.repeat(len(self.stratum_values))
        return v.index_select(0, self.owner)

    @property
    def between(self) -> torch.Tensor:
        """[C] mean_{g,k} - mean_g, float64."""
        return self.cell_mean - self.to_cells(self.group_mean)


def _blend(rewards, group_ids, strata, alpha: float, eps: float) -> _Blend:
    _check_inputs(rewards, group_ids, strata)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    device = rewards.device
    g, group_values = _dense_ids(group_ids.to(device=device, dtype=torch.int64))
    s, stratum_values = _dense_ids(strata.to(device=device, dtype=torch.int64))
    num_groups, num_strata = len(group_values), len(stratum_values)
    slots = num_groups * num_strata
    # Cells over all S * G slots when that is small (no sort; empty slots have count 0 and are
    # never read), else over the (g, s) pairs that occur. Slot s * G + g: a stratum's cells side
    # by side, so per-cell arithmetic with a group's number broadcasts along long rows (with
    # g * S + s the rows would be S long, and each op's loop overhead paid per row). int32 ids
    # when they fit: the sums and the gather read half the bytes.
    if 0 < slots <= 2 * len(rewards) + 1024:
        ids = torch.int32 if slots < 2**31 else torch.int64
        c, occurring, owner = torch.add(g.to(ids), s.to(ids), alpha=num_groups), None, None
    else:
        occurring, c = torch.unique(torch.add(s, g, alpha=num_strata), return_inverse=True)
        owner = occurring // num_strata  # each occurring cell's group
    num_cells = slots if occurring is None else len(occurring)

    def to_groups(v: torch.Tensor) -> torch.Tensor:  # sum over each group's cells
        if owner is None:
            return v.view(num_strata, num_groups).sum(0)
        return torch.zeros(num_groups, dtype=v.dtype, device=device).index_add_(0, owner, v)

    cell_count, cell_head, cell_tail, cell_squares = _sums(rewards, c, num_cells)
    group_count, group_head, group_squares = (
        to_groups(v) for v in (cell_count, cell_head, cell_squares)
    )
    group_tail = None if cell_tail is None else to_groups(cell_tail)
    cell_mean, cell_std = _moments(cell_count, cell_head, cell_tail, cell_squares, rewards.dtype)
    group_mean, group_std = _moments(
        group_count, group_head, group_tail, group_squares, rewards.dtype
    )
    return _Blend(
        c=c,
        group_values=group_values,
        stratum_values=stratum_values,
        occurring=occurring,
        owner=owner,
        cell_count=cell_count,
        cell_mean=cell_mean,
        cell_std=cell_std,
        cell_scale=_scale(cell_std, eps),
        group_count=group_count,
        group_mean=group_mean,
        group_std=group_std,
        group_scale=_scale(group_std, eps),
    )


def _blended(b: _Blend, alpha: float, rewards: torch.Tensor) -> torch.Tensor:
    """alpha * SAN + (1 - alpha) * GN, per trajectory, in the rewards' dtype: with d = R - mean_{g,k},
    A = d * (alpha * cell_scale + (1 - alpha) * group_scale) + (1 - alpha) * between * group_scale.
    For an all-equal cell d is exactly 0 (its mean is exact, also in the rewards' dtype).
    A cell's slope, offset and mean sit side by side in one row, so each trajectory reads its
    cell's three numbers with one gather (one cache line) instead of three. With slot cells the
    rows are built on the [S, G] grid, each group's numbers broadcast over the S strata."""
    table = torch.empty(len(b.cell_count), 3, dtype=rewards.dtype, device=rewards.device)
    weighted = b.group_scale * (1.0 - alpha)  # (1 - alpha) * group_scale
    if b.slotted:  # [S, G] grids: a group's numbers broadcast over the S rows, no copies
        grid, shape = table.view(len(b.stratum_values), -1, 3), (len(b.stratum_values), -1)
        cell_mean = b.cell_mean.view(shape)
        between = cell_mean - b.group_mean
    else:
        grid, cell_mean, weighted, between = table, b.cell_mean, b.to_cells(weighted), b.between
    torch.add(weighted, b.cell_scale.view(cell_mean.shape), alpha=alpha, out=grid[..., 0])
    torch.mul(between, weighted, out=grid[..., 1])  # rounded once, from float64
    grid[..., 2] = cell_mean
    return affine_rows(rewards, b.c, table)


def affine_rows(values: torch.Tensor, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """(values - mean) * slope + offset per trajectory, with (slope, offset, mean) the row
    `table[ids]` of its segment: the C loop (learner/native.py) where it applies, else a row
    gather, then a multiply and an add (not addcmul, which is a fused multiply-add on some CPUs
    and not on others): the same bits either way, on every machine."""
    fused = native.affine(values, ids, table)
    if fused is not None:
        return fused
    row = table.index_select(0, ids)
    return (values - row[:, 2]).mul_(row[:, 0]).add_(row[:, 1])


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
    dtype, rewards = rewards.dtype, _working(rewards)
    b = _blend(rewards, group_ids, strata, alpha, eps)
    deviation = rewards - b.cell_mean.to(rewards.dtype)[b.c]
    global_centered = deviation + b.between.to(rewards.dtype)[b.c]
    used_groups = b.group_count > 0
    groups = SegmentStats(
        group_id=b.group_values[used_groups],
        stratum=torch.full_like(b.group_values[used_groups], -1),
        count=b.group_count[used_groups],
        mean=b.group_mean[used_groups].to(dtype),
        std=b.group_std[used_groups].to(dtype),
    )
    used_cells = b.cell_count > 0
    cell_group, cell_stratum = b.cell_groups_and_strata()
    cells = SegmentStats(
        group_id=b.group_values[cell_group[used_cells]],
        stratum=b.stratum_values[cell_stratum[used_cells]],
        count=b.cell_count[used_cells],
        mean=b.cell_mean[used_cells].to(dtype),
        std=b.cell_std[used_cells].to(dtype),
    )
    return StratifiedAdvantages(
        advantages=_blended(b, alpha, rewards).to(dtype),
        san=(deviation * b.cell_scale[b.c]).to(dtype),
        gn=(global_centered * b.to_cells(b.group_scale)[b.c]).to(dtype),
        stratified_centered=deviation.to(dtype),
        global_centered=global_centered.to(dtype),
        groups=groups,
        cells=cells,
        cell_index=(torch.cumsum(used_cells, 0) - 1)[b.c],
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
    work = _working(rewards)
    return _blended(_blend(work, group_ids, strata, alpha, eps), alpha, work).to(rewards.dtype)


def _working(rewards: torch.Tensor) -> torch.Tensor:
    """16-bit rewards are computed in float32 (and the results returned in their dtype): in
    float16 a zero-spread cell's 1 / (0 + eps) overflows to inf, and 0 * inf is NaN."""
    if rewards.dtype in (torch.float16, torch.bfloat16):
        return rewards.float()
    return rewards
