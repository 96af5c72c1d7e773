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

igpo (IGPO, arXiv 2510.14967): a turn that searched is credited with the information it
gained, how much the observation it brought raised the policy's own probability of the gold
answer: IG_k = P_{k+1} - P_k, where P_k is the probability of `<answer> gold </answer>` right
after the context before turn k (teacher-forced, the geometric mean of its tokens' probabilities,
so the answer's length does not count). The gains are normalised over the group's searching
turns, (IG - mean) / (std + eps), and a turn's A_step is the discounted sum of its own and its
later turns' normalised gains (gamma per turn); the answering turn has none (its credit is the
outcome, in A_episode). The probabilities come from the learner's model before the step
(`scorer`), which is why igpo is refused where only every rank together can run the model
(ZeRO-3 over several ranks).

Each method registers itself with `register_step_credit(name, fn, *params, scored=...)` right
after its def (a call, not a decorator: mutmut 3 does not mutate decorated functions): a
function `(trajectories, group_ids, **params) -> list of [len(token_ids)] float32 tensors`
(A_step per token), given `scorer` too when `scored`; `omega` is every section's own.
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
    scored: bool = False
    """Whether it needs `scorer`: (trajectory, cut) pairs -> the mean log-prob of the gold
    answer after the prompt and the trajectory's first `cut` tokens, under the current policy."""


STEP_CREDITS: dict[str, Registered] = {}
"""`learner.step_credit.type` -> its method (besides `none`); filled by `register_step_credit`."""


def register_step_credit(
    name: str, fn: Callable[..., list[torch.Tensor]], *params: str, scored: bool = False
) -> None:
    """Register `fn` as step credit `name`, taking keyword `params`: called right after its def
    (not a decorator, which mutmut would not mutate behind)."""
    if name in STEP_CREDITS:
        raise ValueError(f"step credit {name!r} is registered twice")
    STEP_CREDITS[name] = Registered(fn, params, scored)


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


register_step_credit("gigpo", gigpo, "gamma", "eps")


Scorer = Callable[[list[tuple[Trajectory, int]]], list[float]]


def igpo(
    trajectories: Sequence[Trajectory],
    group_ids: torch.Tensor,
    *,
    gamma: float,
    eps: float,
    scorer: Scorer,
) -> list[torch.Tensor]:
    """A_step per token: the discounted sum of a turn's and its later turns' information gains,
    normalised over the group's searching turns."""
    spans = [turns(t) for t in trajectories]
    probes = [(t, start) for t, s in zip(trajectories, spans, strict=True) for start, _, _ in s]
    scores = iter(scorer(probes)) if probes else iter(())
    gains: dict[int, list[tuple[int, int, float]]] = defaultdict(list)  # group -> (i, k, IG)
    for i, s in enumerate(spans):
        chance = [math.exp(next(scores)) for _ in s]  # P_k: before turn k
        for k in range(len(s) - 1):  # every turn followed by an observation
            gains[int(group_ids[i])].append((i, k, chance[k + 1] - chance[k]))
    normalised: dict[tuple[int, int], float] = {}
    for members in gains.values():
        values = [g for _, _, g in members]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        for i, k, g in members:
            usable = len(values) > 1 and std + eps > 0
            normalised[i, k] = (g - mean) / (std + eps) if usable else 0.0
    out = [torch.zeros(len(t.token_ids), dtype=torch.float32) for t in trajectories]
    for i, s in enumerate(spans):
        to_go = 0.0
        for k in range(len(s) - 2, -1, -1):  # the answering turn (last) keeps 0
            to_go = normalised[i, k] + gamma * to_go
            start, end, _ = s[k]
            out[i][start:end] = to_go
    return out


register_step_credit("igpo", igpo, "gamma", "eps", scored=True)


def step_advantages(
    name: str,
    trajectories: Sequence[Trajectory],
    group_ids: torch.Tensor,
    episode: torch.Tensor,
    omega: float,
    scorer: Scorer | None = None,
    **params: float,
) -> list[torch.Tensor]:
    """Per trajectory, per token: A_episode + omega * A_step (float32)."""
    chosen = STEP_CREDITS[name]
    if chosen.scored:
        if scorer is None:
            raise ValueError(
                f"step credit {name} scores the gold answer with the policy: no scorer"
            )
        params = {**params, "scorer": scorer}
    steps = chosen.fn(trajectories, group_ids, **params)
    return [float(a) + omega * s for a, s in zip(episode.tolist(), steps, strict=True)]


def section_params(section) -> dict:
    """The method's keyword parameters, read from its config section by attribute."""
    return {p: getattr(section, p) for p in STEP_CREDITS[section.type].params}
