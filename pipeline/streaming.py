"""The streaming loop both runtimes share: the learner takes each complete group as it comes.

A runtime builds the roles (`Roles`: the learner and what publishes its weights, wherever they
live), the group buffer and the actor pools, and hands them to `stream`, which runs until
`learner.max_steps`: groups in, one learner step (the pools keep generating meanwhile), weights
out, pools told the new version, metrics and checkpoints written. The run directory gets
`metrics.jsonl` (one line per step) and `checkpoints/`; on a resumed run both continue.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from actors.pool import ActorPool
from actors.tools import ToolStats
from buffers.group_buffer import GroupBuffer
from buffers.records import Group
from pipeline.config import StrataConfig

CURSOR_KEY = "tasks_started"
"""Checkpoint field: tasks the pools had started, so a resumed run goes on with the next ones."""


class RuntimeUnavailable(RuntimeError):
    """A runtime that cannot start here (no cluster, too few resources); one line, what to do."""


@dataclass
class RunSummary:
    steps: int = 0
    """The learner's step count at the end (on a resumed run, including the steps before)."""
    trajectories: int = 0
    seconds: float = 0.0
    learner_busy_s: float = 0.0
    learner_idle_s: float = 0.0
    metrics: list[dict] = field(default_factory=list)
    checkpoint: Path | None = None
    resumed_from: int = 0
    """Step of the checkpoint this run resumed from (0: a fresh run)."""
    actor_restarts: int = 0

    @property
    def busy_fraction(self) -> float:
        return self.learner_busy_s / max(self.seconds, 1e-9)


@dataclass
class ActorStats:
    """What the metrics read off one generation actor (an engine and the loops that use it)."""

    version: int
    generated_tokens: int
    tools: ToolStats


class Roles(Protocol):
    """The learner side as the loop sees it, in-process or remote."""

    @property
    def version(self) -> int: ...

    async def step(self, groups: list[Group]) -> dict: ...

    async def publish(self) -> float:
        """Make every actor serve the learner's current version; returns the seconds it took."""
        ...

    async def checkpoint(self, directory: Path, extra: dict) -> Path: ...

    async def actor_stats(self) -> dict[str, ActorStats]: ...


def task_stream(questions: Sequence, seed: int, shuffle: bool, skip: int = 0) -> Iterator:
    """Questions forever, reshuffled each epoch with a seeded generator; the first `skip` are
    passed over (a resumed run continues where the checkpoint's pools had got to)."""

    def forever():
        rng = random.Random(seed)
        for _ in itertools.count():
            order = list(questions)
            if shuffle:
                rng.shuffle(order)
            yield from order

    return itertools.islice(forever(), skip, None)


async def _next_group(buffer: GroupBuffer, version: int, pools: list[asyncio.Task]):
    """The buffer's next group; a pool that has failed raises its error instead (no group
    would ever come)."""

    def raise_failure(tasks) -> None:
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()

    raise_failure(pools)
    getting = asyncio.ensure_future(buffer.next_group(version))
    watched = [task for task in pools if not task.done()]
    try:
        while True:
            done, _ = await asyncio.wait([getting, *watched], return_when=asyncio.FIRST_COMPLETED)
            if getting in done:
                return getting.result()
            raise_failure(done)
            watched = [task for task in watched if not task.done()]  # finished: out of tasks
    finally:
        if not getting.done():
            getting.cancel()


def previous_metrics(run_dir: Path, up_to_step: int) -> list[dict]:
    """The metrics.jsonl lines of the steps a resumed run keeps (those after its checkpoint are
    redone, so they are dropped from the file too)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if row.get("step", up_to_step + 1) <= up_to_step:
            kept.append(row)
    tmp = path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
    tmp.replace(path)
    return kept


async def stream(
    config: StrataConfig,
    roles: Roles,
    buffer: GroupBuffer,
    pools: list[ActorPool],
    run_dir: Path,
    summary: RunSummary,
    progress: Callable[[dict], None] | None = None,
    run_metrics: Any = None,
    tasks_started: Callable[[], int] = lambda: 0,
    evaluator: Any = None,
) -> RunSummary:
    """Train until `learner.max_steps`; `summary` is filled in place, so the caller still has it
    when the run is interrupted. Checkpoints go to run_dir/checkpoints, also on the way out.
    `evaluator` (a pipeline.evaluate.PeriodicEval) evaluates the weights of the steps it is due at."""
    pool_tasks = [asyncio.create_task(pool.run()) for pool in pools]
    metrics_file = (run_dir / "metrics.jsonl").open("a")
    checkpoints = run_dir / "checkpoints"
    start = time.perf_counter()
    trained = 0  # trajectories trained in this process (throughput counts only these)
    tokens_at_start = sum(s.generated_tokens for s in (await roles.actor_stats()).values())
    summary.steps = roles.version
    finished = False
    try:
        while roles.version < config.learner.max_steps:
            waited = time.perf_counter()
            groups = [
                await _next_group(buffer, roles.version, pool_tasks)
                for _ in range(config.learner.groups_per_step)
            ]
            busy = time.perf_counter()
            summary.learner_idle_s += busy - waited
            metrics = await roles.step(groups)  # the pools keep generating meanwhile
            summary.learner_busy_s += time.perf_counter() - busy
            metrics["weight_sync_seconds"] = await roles.publish()
            metrics.update(getattr(roles, "last_publish", {}))
            for pool in pools:
                pool.notify_version()
            summary.steps = roles.version
            trained += sum(g.size for g in groups)
            summary.trajectories += sum(g.size for g in groups)
            elapsed = time.perf_counter() - start
            stats = buffer.stats()
            actors = await roles.actor_stats()
            tokens = sum(s.generated_tokens for s in actors.values()) - tokens_at_start
            metrics.update(step=summary.steps, elapsed_s=elapsed, trajectories_per_s=trained / elapsed,
                           generated_tokens_per_s=max(tokens, 0) / elapsed,
                           buffer_ready=stats.ready_groups, buffer_open=stats.open_groups,
                           dropped_stale=stats.dropped_stale, abandoned=stats.abandoned,
                           abandoned_groups=stats.abandoned_groups,
                           aborted=sum(p.stats.aborted for p in pools))  # fmt: skip
            if run_metrics is not None:
                members = [t for g in groups for t in g.members]
                run_metrics.observe_step(metrics, members, busy - waited)
                run_metrics.sample(stats, actors)
            metrics_file.write(json.dumps(metrics) + "\n")
            metrics_file.flush()
            summary.metrics.append(metrics)
            if progress is not None:
                progress(metrics)
            every = config.learner.checkpoint_every
            if every and summary.steps % every == 0:
                await roles.checkpoint(checkpoints, {"step": summary.steps, CURSOR_KEY: tasks_started()})  # fmt: skip
            if evaluator is not None and evaluator.due(summary.steps):
                evaluator.start(summary.steps, roles.version)  # runs beside the next steps
        finished = True
    finally:
        summary.seconds = time.perf_counter() - start
        metrics_file.close()
        for task in pool_tasks:
            task.cancel()
        await asyncio.gather(*pool_tasks, return_exceptions=True)
        if evaluator is not None:  # a finished run waits for its last evaluation
            await evaluator.close(wait=finished)
        await buffer.close()
        if summary.steps > summary.resumed_from:
            summary.checkpoint = await roles.checkpoint(
                checkpoints, {"step": summary.steps, CURSOR_KEY: tasks_started()}
            )
    return summary
