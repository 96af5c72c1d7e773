"""Advantage estimators: rewards, prompt groups and strata in, one advantage per trajectory out.

    stratified  Algorithm 1 of Stratified GRPO (learner.advantages): alpha * SAN + (1 - alpha) * GN
    grpo        (r - mean_g) / (std_g + eps)                     group-normalised (GRPO)
    dr_grpo     r - mean_g                                       mean-centred, no std (Dr. GRPO)
    rloo        r - mean of the group's other members            leave-one-out baseline
    mc_grpo     (r - median_g) / (MAD_g + eps)                   median-centred (MC-GRPO)
    reinforce_pp           (r - mean_step) / (std_step + eps)    REINFORCE++: no group baseline
    reinforce_pp_baseline  (r - mean_g) / (std_step(r - mean_g) + eps)   REINFORCE++-baseline

Each is a pure function over 1-D tensors, vectorised with segment reductions (no loop over
groups), returning an `Estimate`: the advantages and which trajectories the loss keeps. Only
mc_grpo drops any: in a group of odd size the median is one member's own reward, and that pivot
rollout (advantage 0 by construction) is left out of the loss, as the paper does.

mc_grpo when the MAD is 0 (more than half the group shares the median reward): the paper leaves
this open. Here the denominator falls back to the group's population std (+ eps), so the rare
members away from the majority still get a bounded signal; a group whose rewards are all equal
gets 0. A group of one gets 0 under every estimator but reinforce_pp.

REINFORCE++ (arXiv 2501.03262) normalises over the whole step ("global batch normalisation")
rather than per group: reinforce_pp has no group baseline at all (a group of one, or a group whose
rewards are all equal, still gets a signal against the step's mean), reinforce_pp_baseline
subtracts the group mean first and then divides by the step's spread of what is left. The step is
every group the learner trains at once (learner/algorithm.py computes advantages before the ranks
split the step, so the normalisation is the whole step's with any number of ranks). Readings
where the paper (and OpenRLHF, its implementation) leave room: each trajectory counts once (the
implementation whitens over tokens, weighting a trajectory by its length; with an outcome reward
and no per-token KL the two differ only in those weights), std is the population std, and the
baseline variant does not subtract the step's mean of r - mean_g again (it is 0 by construction,
so a flat group or a singleton stays exactly 0). REINFORCE++'s other half, the KL as a
per-token penalty in the reward, is the learner's `learner.kl_in_reward` (learner/trainer.py):
it needs the reference policy's log-probs, which the estimators do not see.

Each registers itself with `register_estimator(name, fn, *params)` right after its def (a call,
not a decorator: mutmut 3 does not mutate decorated functions): a function
`(rewards, group_ids, strata, **params) -> Estimate` whose keyword parameters are the fields of
its config section (`learner.advantage: {type: NAME, ...}`, pipeline/config/algorithm.py; a test
checks the two agree). Add one: the function here, its section there, its loop in
learner/estimator_loops.py for the tests to compare against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from learner.advantages import (
    _check_inputs,
    _dense_ids,
    _working,
    affine_rows,
    segment_stats,
    stratified_advantages,
)


@dataclass(frozen=True)
class Estimate:
    advantages: torch.Tensor
    """One per trajectory, the rewards' dtype."""
    keep: torch.Tensor
    """bool per trajectory: False leaves it out of the loss (its tokens count nowhere)."""


@dataclass(frozen=True)
class Estimator:
    fn: Callable[..., Estimate]
    params: tuple[str, ...]
    """Its keyword parameters: the fields of its config section besides `type`."""


ESTIMATORS: dict[str, Estimator] = {}
"""`learner.advantage.type` -> the estimator; filled by `register_estimator`."""


def register_estimator(name: str, fn: Callable[..., Estimate], *params: str) -> None:
    """Register `fn` as estimator `name`, taking keyword `params`: called right after its def
    (not a decorator, which mutmut would not mutate behind)."""
    if name in ESTIMATORS:
        raise ValueError(f"estimator {name!r} is registered twice")
    ESTIMATORS[name] = Estimator(fn, params)


def _groups(rewards: torch.Tensor, group_ids: torch.Tensor, strata: torch.Tensor, eps: float):
    _check_inputs(rewards, group_ids, strata)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    g, values = _dense_ids(group_ids.to(device=rewards.device, dtype=torch.int64))
    count, mean, std = segment_stats(rewards, g, len(values))
    return g, count, mean, std


def _scaled(rewards: torch.Tensor, g: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor):
    """(rewards - mean_g) * scale_g per trajectory, from per-group means and scales: the blend's
    per-row map with offset 0 (one C loop where it applies)."""
    return affine_rows(rewards, g, torch.stack([scale, torch.zeros_like(scale), mean], dim=1))


def _all(rewards: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(rewards, dtype=torch.bool)


def stratified(rewards, group_ids, strata, *, alpha: float = 0.6, eps: float = 1e-6) -> Estimate:
    return Estimate(stratified_advantages(rewards, group_ids, strata, alpha, eps), _all(rewards))


register_estimator("stratified", stratified, "alpha", "eps")


def grpo(rewards, group_ids, strata, *, eps: float = 1e-6) -> Estimate:
    """(r - mean_g) * 1 / (std_g + eps); 0 where std_g + eps is 0 or the group has one member."""
    g, count, mean, std = _groups(rewards, group_ids, strata, eps)
    denom = std + eps
    scale = torch.where((denom > 0) & (count > 1), 1 / denom, torch.zeros_like(denom))
    return Estimate(_scaled(rewards, g, mean, scale), _all(rewards))


register_estimator("grpo", grpo, "eps")


def dr_grpo(rewards, group_ids, strata) -> Estimate:
    g, count, mean, _ = _groups(rewards, group_ids, strata, 0.0)
    scale = (count > 1).to(rewards.dtype)
    return Estimate(_scaled(rewards, g, mean, scale), _all(rewards))


register_estimator("dr_grpo", dr_grpo)


def rloo(rewards, group_ids, strata) -> Estimate:
    """r_i - (sum_g - r_i) / (n - 1) = n / (n - 1) * (r_i - mean_g)."""
    g, count, mean, _ = _groups(rewards, group_ids, strata, 0.0)
    n = count.to(rewards.dtype)
    scale = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.zeros_like(n))
    return Estimate(_scaled(rewards, g, mean, scale), _all(rewards))


register_estimator("rloo", rloo)


def _rows(g: torch.Tensor, count: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The groups as matrices, one per group size n: (group ids [G_n], members [G_n, n]), each
    row a group's trajectory indices in arrival order. One stable sort by group id (none when the
    batch already has each group's members side by side, as the learner's batches do), then a
    gather per distinct size: a batch has few sizes (every group complete, or short by a drop)."""
    grouped = len(g) < 2 or bool((g[1:] >= g[:-1]).all())
    order = torch.arange(len(g), device=g.device) if grouped else torch.argsort(g, stable=True)
    start = torch.cumsum(count, 0) - count
    by_size = torch.argsort(count, stable=True)
    sizes, repeats = torch.unique_consecutive(count[by_size], return_counts=True)
    rows, first = [], 0
    for n, k in zip(sizes.tolist(), repeats.tolist(), strict=True):
        groups, first = by_size[first : first + k], first + k
        if n > 0:
            offsets = torch.arange(n, device=g.device)
            rows.append((groups, order[start[groups].view(-1, 1) + offsets]))
    return rows


def _medians(values: torch.Tensor, rows: list[tuple[torch.Tensor, torch.Tensor]], num_groups: int):
    """Per group: the median of `values` (the mean of the two middle ones for an even size) and,
    per trajectory, whether it is the odd group's middle member in (value, position) order: each
    size's rows sorted along the row, stably, so equal values keep their arrival order."""
    median = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    pivot = torch.zeros_like(values, dtype=torch.bool)
    for groups, members in rows:
        n = members.shape[1]
        ordered, position = torch.sort(values[members], dim=1, stable=True)
        median[groups] = (ordered[:, (n - 1) // 2] + ordered[:, n // 2]) / 2
        if n % 2 == 1:
            pivot[members.gather(1, position[:, n // 2, None]).view(-1)] = True
    return median, pivot


def mc_grpo(rewards, group_ids, strata, *, eps: float = 1e-6) -> Estimate:
    g, count, _, std = _groups(rewards, group_ids, strata, eps)
    rows = _rows(g, count)
    median, pivot = _medians(rewards, rows, len(count))
    centered = rewards - median[g]
    mad, _ = _medians(centered.abs(), rows, len(count))
    # per group, then one gather: MAD 0 falls back to the std (module doc); no spread, no signal
    usable = ((mad > 0) | (std > 0)) & (count > 1)
    denom = torch.where(usable, torch.where(mad > 0, mad, std) + eps, torch.ones_like(mad))
    advantages = torch.where(usable[g], centered / denom[g], torch.zeros_like(centered))
    return Estimate(advantages, ~pivot)


register_estimator("mc_grpo", mc_grpo, "eps")


def _step_scaled(centred: torch.Tensor, eps: float) -> torch.Tensor:
    """centred / (std over the step + eps), std the population std of `centred` about 0;
    0 where the denominator is 0."""
    denom = centred.pow(2).mean().sqrt() + eps if len(centred) else centred.new_zeros(())
    return centred / denom if denom > 0 else torch.zeros_like(centred)


def reinforce_pp(rewards, group_ids, strata, *, eps: float = 1e-6) -> Estimate:
    """(r - mean_step) / (std_step + eps): REINFORCE++ with an outcome reward, no group baseline."""
    _check_inputs(rewards, group_ids, strata)
    # the step as one segment: its mean summed in float64 is a flat step's value exactly (a
    # float32 mean of seven 0.7s is not, and the difference, divided by its own tiny std, is not 0)
    _, mean, _ = segment_stats(rewards, torch.zeros_like(rewards, dtype=torch.int64), 1)
    centred = rewards - mean
    return Estimate(_step_scaled(centred, eps), _all(rewards))


register_estimator("reinforce_pp", reinforce_pp, "eps")


def reinforce_pp_baseline(rewards, group_ids, strata, *, eps: float = 1e-6) -> Estimate:
    """(r - mean_g) / (std_step(r - mean_g) + eps): the group mean as baseline, the step's spread
    as scale (REINFORCE++-baseline); 0 for a group of one."""
    g, count, mean, _ = _groups(rewards, group_ids, strata, eps)
    centred = _scaled(rewards, g, mean, (count > 1).to(rewards.dtype))
    return Estimate(_step_scaled(centred, eps), _all(rewards))


register_estimator("reinforce_pp_baseline", reinforce_pp_baseline, "eps")


def estimate(
    name: str, rewards: torch.Tensor, group_ids: torch.Tensor, strata: torch.Tensor, **params: Any
) -> Estimate:
    """The advantages of estimator `name` (a key of `ESTIMATORS`) with its keyword `params`,
    in the rewards' dtype (16-bit rewards computed in float32). Rewards must be finite: the buffer
    refuses a trajectory whose reward is not."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}: use {', '.join(ESTIMATORS)}")
    chosen = ESTIMATORS[name]
    unknown = sorted(set(params) - set(chosen.params))
    if unknown:
        takes = ", ".join(chosen.params) or "no parameters"
        raise ValueError(f"estimator {name} takes {takes}, not {', '.join(unknown)}")
    # 16-bit rewards in float32: in float16 a flat group's 1 / (0 + eps) is inf, and 0 * inf NaN
    out = chosen.fn(_working(rewards), group_ids, strata, **params)
    return Estimate(out.advantages.to(rewards.dtype), out.keep)


def section_params(name: str, section: Any) -> dict[str, Any]:
    """The keyword parameters of estimator `name` read from its config section (by attribute:
    the learner never imports the pipeline's config classes)."""
    return {p: getattr(section, p) for p in ESTIMATORS[name].params}
