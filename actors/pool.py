"""Actor pool: `concurrency` agent loops sampling `group_size` trajectories per prompt into the buffer.

Admission is not the pool's: before it starts a group the pool asks the sink (the group buffer,
shared by every pool) for a place, which bounds staleness before any token is generated (see
`buffers.group_buffer`). A group, once started, always runs all its members to the end: the slow
ones (many tool calls) are the strata the paper cares about most, so they are never cut short to
make room. A member that fails (engine error, a generation the server aborted, a rejected record)
is counted and its group abandoned in the buffer, which frees its place; the pool goes on, unless
`max_failed_groups` groups in a row fail (`PoolFailure`: a broken engine, not bad luck).
Failures are reported at most every 30 s.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from actors.agent import AgentLoop, TaskLike
from actors.engine import EngineError
from buffers.records import InvalidTrajectory, Trajectory


class TrajectorySink(Protocol):
    """What the pool needs of the buffer."""

    async def admit(self, prompt_id: str) -> None: ...

    async def put(self, trajectory: Trajectory) -> None: ...

    def abandon(self, prompt_id: str) -> int: ...


@dataclass
class PoolStats:
    groups_started: int = 0
    trajectories: int = 0
    aborted: int = 0
    rejected: int = 0
    groups_abandoned: int = 0  # groups with an aborted or rejected member: never trained on


class PoolFailure(EngineError):
    """Every one of many groups in a row failed: generation is broken, not unlucky."""


class ActorPool:
    def __init__(
        self,
        agent: AgentLoop,
        sink: TrajectorySink,
        tasks: Iterable[TaskLike],
        *,
        group_size: int,
        concurrency: int,
        name: str = "pool-0",
        max_failed_groups: int = 64,
        failure_window_s: float = 120.0,
        first_serial: int = 0,
    ) -> None:
        """`first_serial` numbers the first group's prompt id (`TASK@POOL:SERIAL`): a resumed run
        passes the checkpoint's data cursor, so its prompt ids never repeat the earlier ones'.
        `max_failed_groups` groups abandoned in a row, with no trajectory delivered for
        `failure_window_s` either, stop the pool with PoolFailure (the run fails, saying why);
        a server restarting for a minute is not a failure."""
        self.agent = agent
        self.sink = sink
        self._tasks: Iterator[TaskLike] = iter(tasks)
        self.group_size = group_size
        self.name = name
        self._slots = asyncio.Semaphore(concurrency)
        self._running: set[asyncio.Task] = set()
        self._serial = itertools.count(first_serial)
        self.stats = PoolStats()
        self.max_failed_groups, self.failure_window_s = max_failed_groups, failure_window_s
        self._delivered_at = time.monotonic()
        self.failure: PoolFailure | None = None
        self._abandoned: set[str] = set()
        self._failed_in_a_row = 0
        self._last_report = -1e9

    async def run(self, max_groups: int | None = None) -> PoolStats:
        """Start groups until the tasks (or `max_groups`) run out, then wait for all members."""
        try:
            for started in itertools.count():
                if max_groups is not None and started >= max_groups:
                    break
                task = next(self._tasks, None)
                if task is None:
                    break
                prompt_id = f"{task.id}@{self.name}:{next(self._serial)}"  # unique: tasks repeat
                await self.sink.admit(prompt_id)
                if self.failure is not None:
                    self.sink.abandon(prompt_id)
                    raise self.failure
                await self._start_group(task, prompt_id)
            if self._running:
                await asyncio.gather(*self._running)
            if self.failure is not None:
                raise self.failure
        finally:  # stopped (cancelled, failed): no member may outlive the pool
            members = list(self._running)
            for member in members:
                member.cancel()
            await asyncio.gather(*members, return_exceptions=True)
        return self.stats

    async def _start_group(self, task: TaskLike, prompt_id: str) -> None:
        self.stats.groups_started += 1
        for index in range(self.group_size):
            await self._slots.acquire()  # in order: a group's members start before the next group's
            member = asyncio.create_task(self._member(task, prompt_id, index))
            self._running.add(member)
            member.add_done_callback(self._running.discard)

    async def _member(self, task: TaskLike, prompt_id: str, index: int) -> None:
        try:
            trajectory = await self.agent.run(task, prompt_id, index)
            await self.sink.put(trajectory)
            self.stats.trajectories += 1
            self._failed_in_a_row = 0
            self._delivered_at = time.monotonic()
        except EngineError as exc:  # GenerationAborted too: a cut-off answer is never trained
            self.stats.aborted += 1
            self._abandon(prompt_id, exc)
        except InvalidTrajectory as exc:
            self.stats.rejected += 1
            self._abandon(prompt_id, exc)
        finally:
            self._slots.release()

    def _abandon(self, prompt_id: str, error: Exception) -> None:
        self.sink.abandon(prompt_id)
        now = time.monotonic()
        if now - self._last_report >= 30:  # the first failure, then at most one line per 30 s
            self._last_report = now
            print(
                f"strata: {self.name}: {self.stats.aborted} aborted and {self.stats.rejected} "
                f"rejected trajectories so far; the last: {error}",
                flush=True,
            )
        if prompt_id in self._abandoned:
            return
        self._abandoned.add(prompt_id)
        self.stats.groups_abandoned += 1
        self._failed_in_a_row += 1
        silent = now - self._delivered_at
        if (
            self._failed_in_a_row >= self.max_failed_groups
            and silent >= self.failure_window_s
            and self.failure is None
        ):
            self.failure = PoolFailure(
                f"{self.name}: the last {self._failed_in_a_row} groups all failed and no trajectory "
                f"was delivered for {silent:.0f} s; the last error: {error}"
            )
