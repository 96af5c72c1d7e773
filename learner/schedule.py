"""Learning-rate schedules shared by the RL learner and the supervised warm start.

Both warm up linearly over their first steps, then decay along `decay(kind, progress)`, where
progress runs from 0 to 1: over the optimiser steps after warm-up for the RL learner
(`learner.schedule`), and over the share of the time budget spent for the warm start.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

Decay = Literal["constant", "linear", "cosine"]


def warmup(step: int, warmup_steps: int) -> float:
    """Linear warm-up from 1/warmup_steps to 1 over the first `warmup_steps` steps."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


def decay(kind: Decay, progress: float, floor: float = 0.0) -> float:
    """The share of the peak rate at `progress` (clamped to [0, 1]); it never goes below `floor`."""
    progress = min(1.0, max(0.0, progress))
    if kind == "constant":
        return 1.0
    shape = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * shape


def step_schedule(warmup_steps: int, max_steps: int, kind: Decay) -> Callable[[int], float]:
    """The RL learner's factor per optimiser step (torch's LambdaLR): warm-up, then `kind` over
    the remaining steps to `max_steps`."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return warmup(step, warmup_steps)
        return decay(kind, (step - warmup_steps) / max(1, max_steps - warmup_steps))

    return factor
