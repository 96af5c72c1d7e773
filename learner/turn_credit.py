"""Turn-level credit for finding the answer (`learner.turn_credit`): TSPO's idea (arXiv
2601.22776), read so that the turns that found the gold answer are credited and never punished.

The first-occurrence reading (`actors.latent_reward`) adds β to a wrong answer's reward when its
observations held a gold answer. In a group that also has right answers that β is below the
group's mean, so the turns that found the answer get a negative advantage
(tests/learner/test_algorithm.py). This reading leaves the reward as it is and splits each
trajectory at the observation that first held a gold answer (`first_answer_token`, recorded for
every trajectory whatever its outcome):

- the outcome advantage A is the estimator's, on the outcome reward;
- the finding advantage F is "found it" (0 or 1) normalised within the group, as GRPO would
  normalise a reward: (f − mean) / (std + ε), 0 where every member found it or none did;
- a trajectory that found it: its tokens before that observation get max(A, 0) + β·F (F ≥ 0
  there: they did their part, whatever came after), its tokens from that observation on get A
  (the turns that had the answer in view are judged by the outcome);
- a trajectory that did not: every token gets A + β·F (F ≤ 0: its searches missed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from buffers.records import Trajectory
from learner.estimators import estimate


def found_answer(trajectories: Sequence[Trajectory]) -> torch.Tensor:
    """bool per trajectory: an observation held a gold answer."""
    return torch.tensor([t.first_answer_token >= 0 for t in trajectories], dtype=torch.bool)


def finding_advantage(found: torch.Tensor, group_ids: torch.Tensor, eps: float) -> torch.Tensor:
    """(f − group mean) / (group std + eps), population std, per trajectory (float64): GRPO's
    normalisation (the registered `grpo` estimator) of "found it"."""
    f = found.to(torch.float64)
    return estimate("grpo", f, group_ids, torch.zeros_like(group_ids), eps=eps).advantages


def turn_credit(
    trajectories: Sequence[Trajectory],
    group_ids: torch.Tensor,
    advantages: torch.Tensor,
    beta: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(late, early) per trajectory: the advantage of its tokens from the finding observation on
    (all its tokens if it found nothing), and of its tokens before that observation."""
    found = found_answer(trajectories)
    bonus = beta * finding_advantage(found, group_ids, eps)
    late = torch.where(found, advantages, advantages + bonus)
    early = torch.where(found, advantages.clamp(min=0) + bonus, late)
    return late, early


def token_advantages(
    trajectories: Sequence[Trajectory], late: torch.Tensor, early: torch.Tensor, width: int
) -> torch.Tensor:
    """[B, width]: `early` on each trajectory's tokens before its finding observation, `late`
    from it on (a trajectory that found nothing: `late` everywhere)."""
    out = late.to(torch.float32).unsqueeze(-1).repeat(1, width)
    for row, t in enumerate(trajectories):
        if t.first_answer_token > 0:
            out[row, : min(t.first_answer_token, width)] = float(early[row])
    return out
