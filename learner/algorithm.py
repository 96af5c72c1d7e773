"""One learner step's algorithm, apart from the trainer: the step's groups in; the trajectories
to train, their advantages under the chosen estimator, which of them the loss keeps, and the
step's reward and per-stratum telemetry out. A pure function (no model, no ranks): the DeepSpeed
learner (learner/trainer.py) trains what it returns and nothing else.

Groups arrive checked: the buffer refuses a trajectory whose arrays disagree, whose reward is not
finite or whose stratum is out of range (buffers/records.py), and hands out complete groups
only. The filters here are the config's own: `drop_zero_variance_groups` leaves whole groups
out, `overlong_filter` leaves trajectories cut by the response budget out of the loss (their
rewards still count in their group's statistics, as DAPO's overlong filtering masks the loss).

Telemetry reads the strata's statistics (each group's and each (group, stratum) cell's mean and
spread: Theorem 1's terms) whatever the estimator, and, per stratum, the in-stratum variance and
the mean of the advantages actually trained (for the blend, the mean is its residual
cross-stratum offset, (1 - alpha) times GN's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from buffers.group_buffer import rewards_differ
from buffers.records import Group, Trajectory
from learner.advantages import stratified_advantages_with_stats
from learner.estimators import Estimate, estimate, section_params
from learner.step_credit import STEP_CREDITS, step_advantages
from learner.step_credit import section_params as step_params
from learner.telemetry import stratum_summary, theorem1_terms
from learner.turn_credit import found_answer, turn_credit


@dataclass(frozen=True)
class StepPlan:
    """What one optimiser step trains: `trajectories` group by group, in order."""

    groups: list[Group]
    trajectories: list[Trajectory]
    advantages: torch.Tensor
    """One per trajectory (float64)."""
    keep: torch.Tensor
    """bool per trajectory: False leaves it out of the loss."""
    metrics: dict[str, float] = field(default_factory=dict)
    """groups, skipped_groups, and (when any group is left) the reward and stratum telemetry."""
    early: torch.Tensor | None = None
    """Turn-level credit (`turn_credit` > 0): per trajectory, the advantage of its tokens before
    the observation that first held a gold answer (the rest take `advantages`); None: off."""
    per_token: list[torch.Tensor] | None = None
    """Step-level credit (`learner.step_credit`): per trajectory, one advantage per token
    (A_episode + omega * A_step); None: off."""


CRITIC = "gae"
"""The advantage type whose advantages a critic gives, per token, in the trainer
(learner/gae.py): the plan's own are 0 for it."""


def episode_level(config: Any) -> tuple[str | None, dict[str, Any], Any]:
    """(episode estimator, its parameters, the step credit's section or None) of the `learner`
    section: gigpo and igpo as `learner.advantage.type` are GRPO's episode advantage plus their
    step credit, as their papers compose them; gae has none (None: the trainer's critic gives
    the advantages)."""
    section = config.advantage
    if section.type in STEP_CREDITS:
        return "grpo", {"eps": section.eps}, section
    if section.type == CRITIC:
        return None, {}, None
    credit = getattr(config, "step_credit", None)
    credit = credit if credit is not None and credit.type != "none" else None
    return section.type, section_params(section.type, section), credit


def component_means(trajectories: list[Trajectory]) -> dict[str, float]:
    """`reward/<name>`: the mean of each named part of the reward (a weighted actors.reward's
    terms, a reward's dict keys) over the trajectories that carry it."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for t in trajectories:
        for name, value in t.reward_components.items():
            sums[name] = sums.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1
    return {f"reward/{name}": sums[name] / counts[name] for name in sums}


def plan_step(groups: list[Group], config: Any, scorer: Any = None) -> StepPlan:
    """The step's plan under `config`, the `learner` config section (read by attribute);
    `scorer` scores gold answers with the policy for step credits that need it (igpo)."""
    usable = [g for g in groups if rewards_differ(g) or not config.drop_zero_variance_groups]
    metrics = {"groups": float(len(usable)), "skipped_groups": float(len(groups) - len(usable))}
    trajectories = [t for g in usable for t in g.members]
    if not usable:
        empty = torch.zeros(0, dtype=torch.float64)
        return StepPlan(usable, trajectories, empty, empty.bool(), metrics)
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float64)
    group_ids = torch.tensor([i for i, g in enumerate(usable) for _ in g.members])
    strata = torch.tensor([t.stratum for t in trajectories])  # assigned at collection
    name, params, credit = episode_level(config)
    if name is None:  # gae: 0 here, the critic's per token in the trainer
        chosen = Estimate(torch.zeros_like(rewards), torch.ones_like(rewards, dtype=torch.bool))
    else:
        chosen = estimate(name, rewards, group_ids, strata, **params)
    stats = stratified_advantages_with_stats(rewards, group_ids, strata)  # the strata's statistics
    metrics["reward_mean"] = float(rewards.mean())
    metrics.update(component_means(trajectories))
    metrics["adv_var_global_unnormalised"] = float(stats.global_centered.var(unbiased=False))
    metrics.update(theorem1_terms(stats))
    for stratum, row in stratum_summary(
        stats, rewards, strata, advantages=chosen.advantages
    ).items():
        metrics[f"stratum/{stratum}/count"] = row["count"]
        metrics[f"stratum/{stratum}/reward"] = row["mean_reward"]
        if name is not None:  # the critic's advantages are the trainer's (value telemetry there)
            metrics[f"stratum/{stratum}/in_stratum_adv_var"] = row["in_stratum_adv_var"]
            metrics[f"stratum/{stratum}/mean_advantage"] = row["mean_advantage"]
    advantages, early = chosen.advantages, None
    beta = getattr(config, "turn_credit", 0.0)
    if beta > 0:
        eps = getattr(config.advantage, "eps", 1e-6)
        advantages, early = turn_credit(trajectories, group_ids, advantages, beta, eps)
        metrics["found_answer_share"] = float(found_answer(trajectories).double().mean())
    per_token = None
    if credit is not None:
        per_token = step_advantages(
            credit.type,
            trajectories,
            group_ids,
            advantages,
            credit.omega,
            scorer,
            **step_params(credit),
        )
        moved = [  # |omega * A_step| on the generated tokens: what the step credit adds
            (p - float(a)).abs()[torch.as_tensor(t.loss_mask) == 1]
            for p, a, t in zip(per_token, advantages.tolist(), trajectories, strict=True)
        ]
        metrics["step_advantage_abs_mean"] = float(torch.cat(moved).mean())
    keep = chosen.keep
    overlong = torch.tensor([t.finish_reason == "length" for t in trajectories])
    metrics["overlong_share"] = float(overlong.double().mean())
    if getattr(config, "overlong_filter", False):  # DAPO: in the group's statistics, not the loss
        keep = keep & ~overlong
    return StepPlan(usable, trajectories, advantages, keep, metrics, early, per_token)
