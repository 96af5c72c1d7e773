"""`GroupBuffer`: trajectories in any order in, complete prompt groups out, never a stale one.

Producers (agent loops) `put` trajectories; a prompt's group is complete when `group_size` distinct
samples have arrived, and complete groups wait in first-complete-first-out order. The learner's
`next_group(current_version)` takes the oldest complete group whose oldest generated token is at
most `max_staleness` (η) versions behind; older groups are dropped, counted and spilled.

Backpressure: a trajectory that would open a new group waits while `max_groups_in_flight` groups
are open or waiting, or `max_resident_bytes` are held. Members of already open groups never wait:
they are what lets a group complete and leave, so holding them back could deadlock.

Accounting (trajectories, also per stratum), true after every call:
    put == released + dropped_stale + abandoned + pending
Rejected arrivals (invalid, duplicate) are counted apart and are not part of `put`.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from buffers.records import Group, InvalidTrajectory, Trajectory
from buffers.spill import ParquetSpill

_CLOSED_MEMORY = 65_536  # prompt ids remembered after their group left, to catch late arrivals


@dataclass
class _OpenGroup:
    first_at: float
    members: dict[int, Trajectory] = field(default_factory=dict)


@dataclass(frozen=True)
class BufferStats:
    put: int
    released: int
    dropped_stale: int
    abandoned: int
    rejected: int
    pending: int
    abandoned_groups: int
    """Groups given up on (an actor died, a timeout), also those none of whose members arrived."""
    open_groups: int
    ready_groups: int
    resident_bytes: int
    per_stratum: dict[int, dict[str, int]]


class GroupBuffer:
    def __init__(
        self,
        group_size: int,
        max_staleness: int,
        max_groups_in_flight: int = 64,
        max_resident_bytes: int = 1 << 30,
        group_timeout_s: float | None = None,
        spill: ParquetSpill | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (
            group_size < 1
            or max_staleness < 0
            or max_groups_in_flight < 1
            or max_resident_bytes < 1
        ):
            raise ValueError(
                "group_size, max_groups_in_flight, max_resident_bytes >= 1; max_staleness >= 0"
            )
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.max_groups_in_flight = max_groups_in_flight
        self.max_resident_bytes = max_resident_bytes
        self.group_timeout_s = group_timeout_s
        self.spill = spill
        self._clock = clock
        self._open: dict[str, _OpenGroup] = {}
        self._ready: deque[Group] = deque()
        self._closed: OrderedDict[str, str] = OrderedDict()
        self._abandoned_groups = 0
        self._counts: Counter[tuple[str, int]] = Counter()  # (event, stratum) -> trajectories
        self._pending: Counter[int] = Counter()  # stratum -> trajectories held
        self._resident = 0
        # One event loop owns the buffer and no method awaits between reading and changing state,
        # so it needs no lock: waiters park on futures that the state changes resolve.
        self._space_waiters: deque[asyncio.Future[None]] = deque()  # producers, for capacity
        self._group_waiters: deque[asyncio.Future[None]] = deque()  # the learner, for a group

    # ------------------------------------------------------------------------------ producers

    async def put(self, trajectory: Trajectory) -> None:
        """Add one trajectory; waits while a new group would exceed capacity.

        Raises `InvalidTrajectory` (counted as rejected, nothing buffered is touched) for broken
        records, a sample_index outside [0, group_size), or a duplicate (prompt_id, sample_index).
        """
        try:
            trajectory.validate()
            if trajectory.sample_index >= self.group_size:
                raise InvalidTrajectory(
                    f"trajectory {trajectory.key!r}: sample_index must be < group_size {self.group_size}"
                )
        except InvalidTrajectory:
            self._counts["rejected", trajectory.stratum] += 1
            raise
        while True:
            prompt = trajectory.prompt_id
            if prompt in self._closed:
                self._arrive_after_close(trajectory)
                return
            group = self._open.get(prompt)
            if group is not None:
                self._join(group, trajectory)
                return
            if self._has_room():
                group = self._open[prompt] = _OpenGroup(first_at=self._clock())
                self._join(group, trajectory)
                return
            await _park(self._space_waiters)

    def _has_room(self) -> bool:
        in_flight = len(self._open) + len(self._ready)
        return in_flight < self.max_groups_in_flight and self._resident < self.max_resident_bytes

    def _join(self, group: _OpenGroup, trajectory: Trajectory) -> None:
        if trajectory.sample_index in group.members:
            self._counts["rejected", trajectory.stratum] += 1
            raise InvalidTrajectory(
                f"trajectory {trajectory.key!r}: duplicate (prompt_id, sample_index)"
            )
        group.members[trajectory.sample_index] = trajectory
        self._counts["put", trajectory.stratum] += 1
        self._pending[trajectory.stratum] += 1
        self._resident += trajectory.nbytes
        if len(group.members) == self.group_size:
            del self._open[trajectory.prompt_id]
            members = tuple(group.members[i] for i in sorted(group.members))
            self._ready.append(Group(trajectory.prompt_id, members))
            _wake(self._group_waiters)

    def _arrive_after_close(self, trajectory: Trajectory) -> None:
        status = self._closed[trajectory.prompt_id]
        if status != "abandoned":
            self._counts["rejected", trajectory.stratum] += 1
            raise InvalidTrajectory(
                f"trajectory {trajectory.key!r}: its group is already complete ({status})"
            )
        # A straggler of an abandoned group (its actor was slow, not dead): keep it, never train it.
        self._counts["put", trajectory.stratum] += 1
        self._counts["abandoned", trajectory.stratum] += 1
        if self.spill is not None:
            self.spill.append([trajectory], "abandoned")

    # -------------------------------------------------------------------------------- learner

    async def next_group(self, current_version: int) -> Group:
        """The oldest complete group at most η versions behind `current_version` (waits for one)."""
        while True:
            self.expire_overdue()
            while self._ready:
                group = self._ready.popleft()
                staleness = current_version - group.policy_version
                status = "released" if staleness <= self.max_staleness else "dropped_stale"
                self._leave(group.members, status, consumed_version=current_version)
                self._remember(group.prompt_id, status)
                _wake(self._space_waiters)
                if status == "released":
                    return group
            await _park(self._group_waiters, timeout=self._until_next_deadline())

    def _until_next_deadline(self) -> float | None:
        if self.group_timeout_s is None or not self._open:
            return None
        oldest = min(g.first_at for g in self._open.values())
        return max(0.0, oldest + self.group_timeout_s - self._clock())

    # ------------------------------------------------------------------------------ lifecycle

    def abandon(self, prompt_id: str) -> int:
        """Give up on an open group (its actor died): its members are counted, spilled, never trained.

        Returns how many members it had (0 if the prompt has no open group)."""
        group = self._open.pop(prompt_id, None)
        if group is None:
            if prompt_id not in self._closed:
                # No member has arrived yet: its siblings still may, and must count as abandoned.
                self._remember(prompt_id, "abandoned")
            return 0
        self._leave(tuple(group.members.values()), "abandoned", consumed_version=-1)
        self._remember(prompt_id, "abandoned")
        _wake(self._space_waiters)
        return len(group.members)

    def expire_overdue(self) -> int:
        """Abandon open groups older than `group_timeout_s`; returns how many.

        `next_group` calls this whenever it looks for work and wakes up for the earliest deadline."""
        if self.group_timeout_s is None:
            return 0
        now = self._clock()
        overdue = [p for p, g in self._open.items() if now - g.first_at >= self.group_timeout_s]
        for prompt in overdue:
            self.abandon(prompt)
        return len(overdue)

    def _leave(self, members: tuple[Trajectory, ...], status: str, consumed_version: int) -> None:
        for t in members:
            self._counts[status, t.stratum] += 1
            self._pending[t.stratum] -= 1
            self._resident -= t.nbytes
        if self.spill is not None:
            self.spill.append(members, status, consumed_version)

    def _remember(self, prompt_id: str, status: str) -> None:
        self._abandoned_groups += status == "abandoned"  # a prompt is closed once
        self._closed[prompt_id] = status
        if len(self._closed) > _CLOSED_MEMORY:
            self._closed.popitem(last=False)

    async def close(self) -> BufferStats:
        """Spill whatever is still held as `pending`, flush the spill, return the final stats."""
        if self.spill is not None:
            for group in self._open.values():
                self.spill.append(tuple(group.members.values()), "pending")
            for ready in self._ready:
                self.spill.append(ready.members, "pending")
            await asyncio.to_thread(self.spill.close)
        return self.stats()

    # ---------------------------------------------------------------------------------- stats

    def stats(self) -> BufferStats:
        events = ("put", "released", "dropped_stale", "abandoned", "rejected")
        strata = {s for _, s in self._counts} | set(self._pending)
        per_stratum = {
            s: {**{e: self._counts[e, s] for e in events}, "pending": self._pending[s]}
            for s in sorted(strata)
        }
        total = {e: sum(v[e] for v in per_stratum.values()) for e in (*events, "pending")}
        return BufferStats(
            **total,
            abandoned_groups=self._abandoned_groups,
            open_groups=len(self._open),
            ready_groups=len(self._ready),
            resident_bytes=self._resident,
            per_stratum=per_stratum,
        )


async def _park(waiters: deque[asyncio.Future[None]], timeout: float | None = None) -> None:
    """Wait until `_wake(waiters)` (or `timeout` seconds); callers re-check state afterwards."""
    future = asyncio.get_running_loop().create_future()
    waiters.append(future)
    try:
        await asyncio.wait_for(future, timeout)
    except TimeoutError:
        pass
    finally:
        if not future.done():
            future.cancel()  # a cancelled waiter is skipped by _wake


def _wake(waiters: deque[asyncio.Future[None]]) -> None:
    while waiters:
        future = waiters.popleft()
        if not future.done():
            future.set_result(None)
