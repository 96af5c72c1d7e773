"""Fakes of the two expensive boundaries of the streaming loop, for tests and benchmarks that
exercise the real buffer, pools, admission and loop: an agent whose trajectories take longer the
more tools they call (`SimulatedAgent`), and a learner that sleeps instead of training
(`SimulatedRoles`). Nothing else here is fake."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from pathlib import Path

from buffers.records import Group, Trajectory
from buffers.testing import synthetic_trajectory
from pipeline.runtime.roles import Roles
from pipeline.runtime.stream import ActorStats


@dataclass
class SimulatedEngine:
    version: int = 0
    """The version the (simulated) engines serve: what new tokens are labelled with."""


@dataclass(frozen=True)
class SimulatedTask:
    id: str
    question: str = "q"
    ground_truth: tuple[str, ...] = ("a",)
    data_source: str = "simulated"


class SimulatedAgent:
    """A trajectory with k tool calls takes about base_s + k * per_call_s; its tokens carry the
    version served when it started, its reward is a coin flip. k is mostly the prompt's own
    (a multi-hop question needs more searches: its whole group is slow), one more or one fewer
    for a third of the samples. The many-search trajectories are the slow ones, as in the paper."""

    def __init__(
        self,
        engine: SimulatedEngine,
        *,
        max_calls: int = 3,
        base_s: float = 0.01,
        per_call_s: float = 0.02,
        seed: int = 0,
        actor_id: str = "sim",
    ) -> None:
        self.engine, self.max_calls = engine, max_calls
        self.base_s, self.per_call_s, self.seed, self.actor_id = base_s, per_call_s, seed, actor_id

    async def run(self, task, prompt_id: str, sample_index: int) -> Trajectory:
        level = random.Random(f"{self.seed}:{task.id}").randint(0, self.max_calls)
        rng = random.Random(f"{self.seed}:{prompt_id}:{sample_index}")
        calls = min(
            self.max_calls, max(0, level + (rng.choice((-1, 1)) if rng.random() < 1 / 3 else 0))
        )
        version = self.engine.version
        await asyncio.sleep(self.base_s + calls * self.per_call_s * (0.5 + rng.random()))
        return synthetic_trajectory(
            prompt_id,
            sample_index,
            version=version,
            reward=float(rng.random() < 0.5),
            tool_names=["search"] * calls,
        )


@dataclass
class SimulatedRoles(Roles):
    """A fake learner side (`pipeline.runtime.roles.Roles`): a step sleeps `step_s` and makes the
    next version; `empty` decides which steps have no usable group (they train nothing)."""

    engine: SimulatedEngine
    step_s: float = 0.05
    empty: set[int] = field(default_factory=set)
    """Indices (0-based, counting every step call) of steps that find no usable group."""
    version: int = 0
    calls: int = 0
    published: list[int] = field(default_factory=list)

    async def step(self, groups: list[Group]) -> dict:
        await asyncio.sleep(self.step_s)
        self.calls += 1
        if self.calls - 1 in self.empty:
            return {"groups": 0.0, "skipped_groups": float(len(groups))}
        self.version += 1
        return {"groups": float(len(groups)), "version": float(self.version)}

    async def publish(self) -> dict:
        if self.published and self.published[-1] >= self.version:
            raise ValueError(f"version {self.version} published twice")
        self.published.append(self.version)
        self.engine.version = self.version
        return {"published": True, "weight_sync_seconds": 0.0, "served_version": self.version}

    async def checkpoint(self, directory: Path, extra: dict) -> Path:
        return directory

    async def actor_stats(self) -> dict[str, ActorStats]:
        return {}
