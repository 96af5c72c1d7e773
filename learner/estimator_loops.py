"""Loop references of the advantage estimators: one group at a time, one formula each, as the
papers write them, and GAE one row at a time. Slow on purpose; the vectorised estimators
(learner/estimators.py, learner/gae.py) are checked against these in tests/learner/ and timed
beside them in benchmarks/advantages.py.
The stratified blend's own loop reference is Algorithm 1 in tests/learner/test_advantages.py."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def loop_estimate(
    name: str, rewards: Sequence[float], groups: Sequence[int], eps: float = 1e-6
) -> tuple[list[float], list[bool]]:
    """(advantages, keep) of estimator `name` (grpo, dr_grpo, rloo, mc_grpo, reinforce_pp,
    reinforce_pp_baseline)."""
    adv, keep = [0.0] * len(rewards), [True] * len(rewards)
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    if name == "reinforce_pp":  # the step's mean and population std, no groups
        mean = statistics.fmean(rewards)
        return _over_the_step([r - mean for r in rewards], eps), keep
    if name == "reinforce_pp_baseline":  # the group's mean, then the step's spread
        centred = [0.0] * len(rewards)
        for idx in members.values():
            mean = sum(rewards[i] for i in idx) / len(idx)
            for i in idx:
                centred[i] = rewards[i] - mean if len(idx) > 1 else 0.0
        return _over_the_step(centred, eps), keep
    for idx in members.values():
        r = [rewards[i] for i in idx]
        n, mean = len(r), sum(r) / len(r)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / n)
        if name == "mc_grpo":
            median = statistics.median(r)
            mad = statistics.median([abs(x - median) for x in r])
            denom = (mad if mad > 0 else std) + eps if (mad > 0 or std > 0) else 0.0
            if n % 2 == 1:  # the pivot: the middle of (reward, position)
                keep[idx[sorted(range(n), key=lambda k: (r[k], k))[n // 2]]] = False
        for k, i in enumerate(idx):
            if n == 1:
                adv[i] = 0.0
            elif name == "grpo":
                adv[i] = (r[k] - mean) / (std + eps) if std + eps > 0 else 0.0
            elif name == "dr_grpo":
                adv[i] = r[k] - mean
            elif name == "rloo":
                adv[i] = r[k] - (sum(r) - r[k]) / (n - 1)
            elif name == "mc_grpo":
                adv[i] = (r[k] - median) / denom if denom > 0 else 0.0
            else:
                raise ValueError(f"no loop reference for {name!r}")
    return adv, keep


def _over_the_step(centred: list[float], eps: float) -> list[float]:
    """Each value over the step's population std about 0, plus eps (0 where that is 0)."""
    denom = math.sqrt(sum(x * x for x in centred) / len(centred)) + eps
    return [x / denom if denom > 0 else 0.0 for x in centred]


def loop_gae(
    rewards: Sequence[float],
    values: Sequence[float],
    mask: Sequence[float],
    gamma: float,
    lam: float,
) -> tuple[list[float], list[float]]:
    """(advantages, returns) of one row by Schulman et al. (2016), eq. 16, over its generated
    tokens in order (`mask` 1): observation tokens are not time steps, V after the last step is
    0; 0 off the generated tokens. The reference of learner/gae.py's vectorised `gae`."""
    steps = [t for t, m in enumerate(mask) if m]
    advantages, returns = [0.0] * len(mask), [0.0] * len(mask)
    carried = 0.0
    for k in range(len(steps) - 1, -1, -1):
        t = steps[k]
        following = values[steps[k + 1]] if k + 1 < len(steps) else 0.0
        delta = rewards[t] + gamma * following - values[t]
        carried = delta + gamma * lam * carried
        advantages[t], returns[t] = carried, carried + values[t]
    return advantages, returns
