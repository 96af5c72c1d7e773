"""Step-level credit (`learner.step_credit`): an advantage per turn, added to the episode's.

    A(i, k) = A_episode(i) + omega * A_step(i, k)

A_episode is `learner.advantage`'s (the stratified blend by default), the same on every token of
trajectory i; A_step is the chosen method's, the same on every token of i's turn k (its k-th run
of generated tokens; observation tokens carry no loss anyway). So the stratified blend stays the
episode-level signal and the step-level term only redistributes credit among the turns.

gigpo (GiGPO, arXiv 2505.10978): step groups gather the turns, across one prompt group's
trajectories, taken from the same state. Reading chosen for a search agent: a turn's state is
the observations it has seen so far, token for token (two trajectories that searched the same
queries got the same results and stand in the same state; every member's first turn shares the
prompt). A turn's return is the discounted outcome, gamma^(turns after it) * reward (the reward
comes at the end; the paper's step rewards are 0 here), and A_step is that return normalised in
its step group, (R - mean) / (std + eps) with the population std; 0 in a step group of one or of
equal returns, as GRPO gives a flat group.

Each method registers itself with `@register_step_credit(name, *params)`: a function
`(trajectories, group_ids, **params) -> list of [len(token_ids)] float32 tensors` (A_step per
token); `omega` is every section's own.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from buffers.records import Trajectory


@dataclass(frozen=True)
class Registered:
    fn: Callable[..., list[torch.Tensor]]
    params: tuple[str, ...]


STEP_CREDITS: dict[str, Registered] = {}
"""`learner.step_credit.type` -> its method (besides `none`); filled by `register_step_credit`."""


def register_step_credit(name: str, *params: str) -> Callable[[Callable], Callable]:
    def register(fn: Callable[..., list[torch.Tensor]]) -> Callable[..., list[torch.Tensor]]:
        if name in STEP_CREDITS:
            raise ValueError(f"step credit {name!r} is registered twice")
        STEP_CREDITS[name] = Registered(fn, params)
        return fn

    return register


def turns(trajectory: Trajectory) -> list[tuple[int, int, tuple]]:
    """(start, end, state) of each turn: its run of generated tokens [start, end) and the
    observation tokens seen before it (one tuple per observation)."""
    mask = np.asarray(trajectory.loss_mask)
    ids = np.asarray(trajectory.token_ids)
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask, [0]))))
    out, seen, last = [], [], 0
    for start, end in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
        if start > last:
            seen.append(tuple(ids[last:start].tolist()))  # the observation before this turn
        out.append((start, end, tuple(seen)))
        last = end
    return out


@register_step_credit("gigpo", "gamma", "eps")
def gigpo(
    trajectories: Sequence[Trajectory], group_ids: torch.Tensor, *, gamma: float, eps: float
) -> list[torch.Tensor]:
    """A_step per token: each turn's discounted return normalised within its step group."""
    cells: dict[tuple, list[tuple[int, int, int, float]]] = defaultdict(list)
    for i, t in enumerate(trajectories):
        spans = turns(t)
        for k, (start, end, state) in enumerate(spans):
            ret = gamma ** (len(spans) - 1 - k) * float(t.reward)
            cells[int(group_ids[i]), state].append((i, start, end, ret))
    out = [torch.zeros(len(t.token_ids), dtype=torch.float32) for t in trajectories]
    for members in cells.values():
        if len(members) < 2:
            continue
        returns = [m[3] for m in members]
        mean = sum(returns) / len(returns)
        std = math.sqrt(sum((r - mean) ** 2 for r in returns) / len(returns))
        if std + eps <= 0:
            continue
        for i, start, end, ret in members:
            out[i][start:end] = (ret - mean) / (std + eps)
    return out


def step_advantages(
    name: str,
    trajectories: Sequence[Trajectory],
    group_ids: torch.Tensor,
    episode: torch.Tensor,
    omega: float,
    **params: float,
) -> list[torch.Tensor]:
    """Per trajectory, per token: A_episode + omega * A_step (float32)."""
    steps = STEP_CREDITS[name].fn(trajectories, group_ids, **params)
    return [float(a) + omega * s for a, s in zip(episode.tolist(), steps, strict=True)]


def section_params(section) -> dict:
    """The method's keyword parameters, read from its config section by attribute."""
    return {p: getattr(section, p) for p in STEP_CREDITS[section.type].params}
