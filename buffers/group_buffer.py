"""`GroupBuffer`: trajectories in any order in, complete prompt groups out, never a stale one.

Producers (agent loops) `put` trajectories; a prompt's group is complete when `group_size` distinct
samples have arrived. The learner takes `next_groups(current_version, count)` for each step: no
group more than `max_staleness` (η) versions behind `current_version` (older ones are dropped,
counted and spilled).

Admission (the one controller every actor pool shares). A pool calls `admit(prompt_id)` before it
generates a group; the group takes one of `(η + 1) * groups_per_step` places and is stamped with
the version the engines serve (`serve`). A place comes back exactly once: when the group leaves
the buffer dropped, abandoned or timed out; or, for a group the learner consumed, once the engines
serve the version trained on it (`trained` + `serve`; at once for a step that trained nothing).
Freeing a consumed group's place only when its update is served keeps every admitted group within
η versions: a place freed at release would let the pools admit one version early.

Consumption order (stratum fairness). Complete groups leave first-complete-first-out, except that
a group admitted at version s is *due* once `s + η <= current_version`: the next step would make it
too stale. Due groups go first, and the learner keeps room in the step for due groups still being
generated and waits for them. Slow groups are the many-search ones, so first-complete-first-out
alone would drop exactly the strata with the most tool calls. A due group whose members never
finish holds the learner until they fail (engine and tool calls all have timeouts) or
`group_timeout_s` abandons it.

Backpressure: `admit` also waits while `max_groups_in_flight` groups are open or waiting, or
`max_resident_bytes` are held (groups already chosen for the step being assembled do not count). A trajectory of a group that was not admitted waits on the same
room before it opens one; members of open groups never wait: they are what lets a group complete.

Dynamic sampling with refill (DAPO; `usable`, e.g. `rewards_differ`). A complete group the step
cannot use leaves the buffer at consumption as `filtered` (counted per stratum, spilled as such,
its place back at once) and the step takes the next group instead, so a step trains
`groups_per_step` usable groups. To keep as many usable groups generating as without the filter,
admission over-admits by the share of groups filtered so far, f: (η + 1) * groups_per_step /
(1 - f) places, f capped at 1 - 1 / `max_overadmit` (`max_groups_in_flight` bounds it too). Due
groups still go first; a due group the filter rejects is gone like any other filtered group.

Accounting (trajectories, also per stratum), true after every call:
    put == released + filtered + dropped_stale + abandoned + pending
Rejected arrivals (invalid, duplicate) are counted apart and are not part of `put`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from buffers.records import Group, InvalidTrajectory, Trajectory
from buffers.spill import ParquetSpill

CLOSED_MEMORY = 65_536  # prompt ids remembered after their group left, to catch late arrivals


@dataclass
class _OpenGroup:
    first_at: float
    members: dict[int, Trajectory] = field(default_factory=dict)


def rewards_differ(group: Group) -> bool:
    """Whether a group's rewards are not all equal: one whose are carries no group-normalised
    signal (DAPO's dynamic sampling keeps 0 < correct < G; this is that for any reward)."""
    rewards = group.rewards
    return bool((rewards != rewards[0]).any())


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
    admitted_groups: int = 0
    """Groups that took an admission place (`admit`)."""
    places_used: int = 0
    """Admission places taken now (admitted groups not yet freed); at most `places`."""
    places: int = 0
    """Admission places: (η + 1) * groups_per_step."""
    served_version: int = 0
    """The version the engines serve, as last told by `serve`."""
    filtered: int = 0
    """Trajectories of complete groups the step could not use (`usable`), left at consumption."""
    filtered_groups: int = 0
    """Groups filtered so far (dynamic sampling)."""


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
        groups_per_step: int = 1,
        due_first: bool = True,
        usable: Callable[[Group], bool] | None = None,
        max_overadmit: float = 4.0,
    ) -> None:
        """`due_first` False: plain first-complete-first-out, the order before due groups were
        taken first (benchmarks/fairness.py compares the two). `usable`: dynamic sampling's test
        of a complete group (None: every group is used); `max_overadmit` caps the over-admission
        it brings (see the module doc)."""
        if (
            group_size < 1
            or max_staleness < 0
            or max_groups_in_flight < 1
            or max_resident_bytes < 1
            or groups_per_step < 1
            or max_overadmit < 1
        ):
            raise ValueError(
                "group_size, max_groups_in_flight, max_resident_bytes, groups_per_step, "
                "max_overadmit >= 1; max_staleness >= 0"
            )
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.max_groups_in_flight = max_groups_in_flight
        self.max_resident_bytes = max_resident_bytes
        self.group_timeout_s = group_timeout_s
        self.spill = spill
        self._clock = clock
        self.places = (max_staleness + 1) * groups_per_step
        self.due_first = due_first
        self.usable = usable
        self.max_overadmit = max_overadmit
        self._released_groups = 0
        self._filtered_groups = 0
        self.served_version = 0
        self._admitted = 0
        self._places: dict[str, int] = {}  # prompt -> version served at admission, place taken
        self._trained: list[tuple[int, str]] = []  # (version made, prompt): freed when served
        self._open: dict[str, _OpenGroup] = {}
        self._ready: deque[Group] = deque()
        self._ready_ids: set[str] = set()  # prompts of `_ready` and `_taking`: not consumed yet
        self._taking: list[Group] = []  # chosen for the step `next_groups` is assembling
        self._closed: OrderedDict[str, str] = OrderedDict()
        self._abandoned_groups = 0
        self._is_closed = False
        self._counts: Counter[tuple[str, int]] = Counter()  # (event, stratum) -> trajectories
        self._pending: Counter[int] = Counter()  # stratum -> trajectories held
        self._resident = 0
        # One event loop owns the buffer and no method awaits between reading and changing state,
        # so it needs no lock: waiters park on futures that the state changes resolve.
        self._space_waiters: deque[asyncio.Future[None]] = deque()  # producers, for capacity
        self._place_waiters: deque[asyncio.Future[None]] = deque()  # pools, for a place
        self._group_waiters: deque[asyncio.Future[None]] = deque()  # the learner, for a group

    # ------------------------------------------------------------------------------ admission

    async def admit(self, prompt_id: str) -> None:
        """Wait for an admission place and room, then open `prompt_id`'s group (no member yet),
        stamped with the served version. Its place comes back exactly once (see the module doc)."""
        if prompt_id in self._open or prompt_id in self._closed or prompt_id in self._places:
            raise ValueError(f"prompt {prompt_id!r} was admitted already: prompt ids are unique")
        while len(self._places) >= self.place_limit() or not self._has_room():
            await _park(
                self._place_waiters
                if len(self._places) >= self.place_limit()
                else self._space_waiters
            )
        self._admitted += 1
        self._places[prompt_id] = self.served_version
        self._open[prompt_id] = _OpenGroup(first_at=self._clock())

    def place_limit(self) -> int:
        """Admission places now: (η + 1) * groups_per_step, over-admitted by the share of groups
        dynamic sampling has filtered so far (see the module doc)."""
        seen = self._filtered_groups + self._released_groups
        if self.usable is None or not seen:
            return self.places
        share = min(self._filtered_groups / seen, 1 - 1 / self.max_overadmit)
        return math.ceil(self.places / (1 - share))

    def serve(self, version: int) -> None:
        """The engines serve `version` now: new admissions are stamped with it, and the places of
        groups trained into it (or an older version) come back."""
        self.served_version = max(self.served_version, version)
        settled = [p for v, p in self._trained if v <= self.served_version]
        self._trained = [(v, p) for v, p in self._trained if v > self.served_version]
        for prompt in settled:
            self._free_place(prompt)

    def trained(self, groups: list[Group], version: int | None) -> None:
        """The learner's step on `groups` (consumed from here) made `version`; None: it trained
        nothing and publishes nothing, so their places come back now."""
        for group in groups:
            if version is None or version <= self.served_version:
                self._free_place(group.prompt_id)
            else:
                self._trained.append((version, group.prompt_id))

    def _free_place(self, prompt_id: str) -> None:
        if self._places.pop(prompt_id, None) is not None:  # once: a freed place is gone
            _wake(self._place_waiters)

    def _due(self, prompt_id: str, current_version: int) -> bool:
        """Admitted at a version the next step would leave more than η behind."""
        admitted_at = self._places.get(prompt_id)
        return (
            self.due_first
            and admitted_at is not None
            and admitted_at + self.max_staleness <= current_version
        )

    def _due_before(self, current_version: int) -> bool:
        """Whether any admitted group is due at `current_version` (see `_due`)."""
        return (
            self.due_first
            and bool(self._places)
            and min(self._places.values()) + self.max_staleness <= current_version
        )

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
            if prompt in self._ready_ids:  # complete: one more member is one too many
                self._counts["rejected", trajectory.stratum] += 1
                raise InvalidTrajectory(
                    f"trajectory {trajectory.key!r}: its group is already complete"
                )
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
        # Groups chosen for the step being assembled do not count: they leave as soon as the step
        # is whole, and counting them would deadlock a step larger than the room.
        taking = sum(t.nbytes for g in self._taking for t in g.members)
        in_flight = len(self._open) + len(self._ready)
        return (
            in_flight < self.max_groups_in_flight
            and self._resident - taking < self.max_resident_bytes
        )

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
            self._ready_ids.add(trajectory.prompt_id)
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
        """One group, as `next_groups(current_version, 1)` (waits for one)."""
        return (await self.next_groups(current_version, 1))[0]

    async def next_groups(self, current_version: int, count: int) -> list[Group]:
        """`count` complete groups for the learner at `current_version`, none more than η behind;
        due groups first, waiting for those still being generated (see the module doc).

        The groups are released (spilled as such) once all `count` are there; their admission
        places stay taken until the caller reports the step with `trained`. Cancelled while it
        waits for the rest, the groups it had chosen go back to the front of the queue."""
        chosen = self._taking
        try:
            return await self._take(current_version, count, chosen)
        except BaseException:
            self._ready.extendleft(reversed(chosen))  # not trained: complete and waiting again
            raise
        finally:
            self._taking = []

    async def _take(self, current_version: int, count: int, chosen: list[Group]) -> list[Group]:
        while True:
            self.expire_overdue()
            if not self._ready:  # nothing to take: wait for a completion
                await _park(self._group_waiters, timeout=self._until_next_deadline())
                continue
            # The oldest admission decides whether any group is due (one pass in C); usually
            # none is, and the groups go first complete, first out without a look at each.
            any_due = self._due_before(current_version)
            due_open = sum(self._due(p, current_version) for p in self._open) if any_due else 0
            order = (
                sorted(self._ready, key=lambda g: not self._due(g.prompt_id, current_version))
                if any_due
                else list(self._ready)
            )
            for group in order:  # sorted() is stable: first complete, first out within each
                if len(chosen) == count:
                    break
                if (
                    due_open
                    and len(chosen) + due_open >= count
                    and not self._due(group.prompt_id, current_version)
                ):
                    break  # the rest of the step is kept for due groups still generating
                self._ready.remove(group)
                fresh = current_version - group.policy_version <= self.max_staleness
                if fresh and self.usable is not None and not self.usable(group):
                    self._ready_ids.discard(group.prompt_id)  # dynamic sampling: refill
                    self._leave(group.members, "filtered", consumed_version=current_version)
                    self._filtered_groups += 1
                    self._remember(group.prompt_id, "filtered")  # its place comes back now
                    _wake(self._place_waiters)  # and the over-admission may have grown
                    _wake(self._space_waiters)
                    continue
                if fresh:
                    chosen.append(group)  # released once the step is whole
                    _wake(self._space_waiters)  # it no longer counts against the room
                    continue
                self._ready_ids.discard(group.prompt_id)
                self._leave(group.members, "dropped_stale", consumed_version=current_version)
                self._remember(group.prompt_id, "dropped_stale")
                _wake(self._space_waiters)
            if len(chosen) == count:
                self._released_groups += len(chosen)
                for group in chosen:
                    self._ready_ids.discard(group.prompt_id)
                    self._leave(group.members, "released", consumed_version=current_version)
                    self._remember(group.prompt_id, "released")
                _wake(self._space_waiters)
                return list(chosen)
            await _park(self._group_waiters, timeout=self._until_next_deadline())

    def _until_next_deadline(self) -> float | None:
        if self.group_timeout_s is None or not self._open:
            return None
        oldest = min(g.first_at for g in self._open.values())
        return max(0.0, oldest + self.group_timeout_s - self._clock())

    # ------------------------------------------------------------------------------ lifecycle

    def abandon(self, prompt_id: str) -> int:
        """Give up on an open group (its actor died): its members are counted, spilled, never trained.

        Returns how many members it had (0 if the prompt has no open group; a complete group
        waiting for the learner is not open and stays as it is)."""
        group = self._open.pop(prompt_id, None)
        if group is None:
            if prompt_id not in self._closed and prompt_id not in self._ready_ids:
                # No member has arrived yet: its siblings still may, and must count as abandoned.
                self._remember(prompt_id, "abandoned")
            return 0
        self._leave(tuple(group.members.values()), "abandoned", consumed_version=-1)
        self._remember(prompt_id, "abandoned")
        _wake(self._space_waiters)
        _wake(self._group_waiters)  # the learner may be keeping room for it in the step
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
        if status != "released":  # a consumed group's place waits for `trained` and `serve`
            self._free_place(prompt_id)
        self._closed[prompt_id] = status
        if len(self._closed) > CLOSED_MEMORY:
            self._closed.popitem(last=False)

    def held(self) -> list[Trajectory]:
        """The trajectories held now (open groups, complete ones, those being taken): what a
        checkpoint records as in flight. None once closed (`close` spilled them as pending)."""
        if self._is_closed:
            return []
        groups = [tuple(g.members.values()) for g in self._open.values()]
        groups += [g.members for g in (*self._taking, *self._ready)]
        return [t for members in groups for t in members]

    async def close(self) -> BufferStats:
        """Spill whatever is still held as `pending`, flush the spill, return the final stats."""
        self._is_closed = True
        if self.spill is not None:
            for group in self._open.values():
                self.spill.append(tuple(group.members.values()), "pending")
            for ready in [*self._taking, *self._ready]:
                self.spill.append(ready.members, "pending")
            await asyncio.to_thread(self.spill.close)
        return self.stats()

    # ---------------------------------------------------------------------------------- stats

    def stats(self) -> BufferStats:
        events = ("put", "released", "filtered", "dropped_stale", "abandoned", "rejected")
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
            ready_groups=len(self._ready) + len(self._taking),
            resident_bytes=self._resident,
            per_stratum=per_stratum,
            admitted_groups=self._admitted,
            places_used=len(self._places),
            places=self.place_limit(),
            served_version=self.served_version,
            filtered_groups=self._filtered_groups,
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
