"""Dynamic sampling with refill (DAPO) in the buffer: a complete group whose rewards are all
equal leaves as `filtered` at consumption, the step takes the next group instead, its place
comes back at once, and admission over-admits by the share filtered so far."""

import asyncio
import contextlib

import pyarrow.parquet as pq
import pytest

from buffers.group_buffer import GroupBuffer, rewards_differ
from buffers.records import Group, InvalidTrajectory
from buffers.spill import ParquetSpill
from buffers.testing import synthetic_trajectory as traj
from tests.buffers.test_group_buffer import assert_accounting


async def fill(buffer, prompt, rewards, tool_calls=0):
    for i, reward in enumerate(rewards):
        t = traj(prompt, i, tool_names=["search"] * tool_calls)
        t.reward = reward
        await buffer.put(t)


def test_rewards_differ_is_dapos_keep_rule():
    def group(*rewards):
        members = []
        for i, r in enumerate(rewards):
            members.append(traj("p", i))
            members[-1].reward = r
        return Group("p", tuple(members))

    assert rewards_differ(group(0.0, 1.0, 0.0)) and rewards_differ(group(0.5, 0.25))
    assert not rewards_differ(group(0.0, 0.0, 0.0)) and not rewards_differ(group(1.0, 1.0))
    assert not rewards_differ(group(1.0))  # a group of one carries no signal


def test_a_step_refills_past_filtered_groups_and_the_books_count_them(tmp_path):
    async def scenario():
        spill = ParquetSpill(tmp_path / "spill", rows_per_file=1000)
        buffer = GroupBuffer(
            group_size=2, max_staleness=1, groups_per_step=2, spill=spill, usable=rewards_differ
        )
        for p, rewards, calls in [
            ("flat0", [0.0, 0.0], 0),
            ("a", [0.0, 1.0], 1),
            ("flat1", [1.0, 1.0], 2),
            ("flat2", [0.0, 0.0], 1),
            ("b", [1.0, 0.0], 0),
            ("c", [1.0, 0.0], 0),
        ]:
            if p.startswith("flat") or p == "a":  # four places: (η + 1) * groups_per_step
                await buffer.admit(p)
            await fill(buffer, p, rewards, calls)
        step = await buffer.next_groups(current_version=0, count=2)
        assert [g.prompt_id for g in step] == ["a", "b"]  # flat ones skipped, the step refilled
        s = buffer.stats()
        assert (s.filtered, s.filtered_groups, s.released, s.pending) == (6, 3, 4, 2)
        assert {k: c["filtered"] for k, c in s.per_stratum.items()} == {0: 2, 1: 2, 2: 2}
        assert s.places_used == 1  # a's, until trained and served; the filtered ones' are back
        assert_accounting(buffer)
        await buffer.close()
        statuses = pq.read_table(tmp_path / "spill").column("status").to_pylist()
        assert statuses.count("filtered") == 6 and statuses.count("released") == 4

    asyncio.run(scenario())


def test_admission_over_admits_by_the_share_filtered_and_caps_it():
    async def scenario():
        buffer = GroupBuffer(
            group_size=2,
            max_staleness=0,
            groups_per_step=2,
            max_groups_in_flight=100,
            usable=rewards_differ,
            max_overadmit=4.0,
        )
        assert buffer.place_limit() == 2  # nothing seen yet: (η + 1) * groups_per_step
        for p, rewards in [("f0", [0.0, 0.0]), ("u0", [0.0, 1.0]), ("u1", [1.0, 0.0])]:
            await fill(buffer, p, rewards)
        await buffer.next_groups(current_version=0, count=2)
        assert buffer.place_limit() == 3  # one of three filtered: 2 / (1 - 1/3)
        buffer = GroupBuffer(
            group_size=1, max_staleness=0, groups_per_step=1, usable=lambda g: False
        )
        for i in range(5):  # every group filtered: the over-admission stops at max_overadmit
            await fill(buffer, f"f{i}", [0.0])
        step = asyncio.create_task(buffer.next_groups(current_version=0, count=1))
        await asyncio.sleep(0.02)
        assert not step.done() and buffer.stats().filtered_groups == 5
        assert buffer.place_limit() == 4  # 1 / (1 - 3/4)
        step.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await step

    asyncio.run(scenario())


def test_over_admission_is_refused_below_one():
    with pytest.raises(ValueError, match="max_overadmit >= 1"):
        GroupBuffer(group_size=2, max_staleness=0, max_overadmit=0.5)


def test_a_filtered_group_leaves_no_trace_but_its_closed_status(tmp_path):
    """Filtered at consumption: spilled with the version that consumed it, out of the buffer's
    ready prompts, and a late member for it is refused, naming why."""

    async def scenario():
        spill = ParquetSpill(tmp_path / "spill", rows_per_file=1000)
        buffer = GroupBuffer(group_size=2, max_staleness=3, spill=spill, usable=rewards_differ)
        await fill(buffer, "flat", [1.0, 1.0])
        await fill(buffer, "kept", [0.0, 1.0])
        assert [g.prompt_id for g in await buffer.next_groups(3, 1)] == ["kept"]
        assert buffer._ready_ids == set()  # only groups not consumed yet
        with pytest.raises(InvalidTrajectory, match=r"already complete \(filtered\)"):
            await buffer.put(traj("flat", 0))
        await buffer.close()
        table = pq.read_table(tmp_path / "spill").to_pydict()
        return {(s, v) for s, v in zip(table["status"], table["consumed_version"], strict=True)}

    assert asyncio.run(scenario()) == {("filtered", 3), ("released", 3)}


def test_the_over_admission_follows_the_share_filtered_over_every_step():
    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=1, usable=rewards_differ)
        limits = [buffer.place_limit()]  # (η + 1) * groups_per_step = 2
        await fill(buffer, "flat", [1.0, 1.0])
        await fill(buffer, "u0", [0.0, 1.0])
        await buffer.next_groups(0, 1)
        limits.append(buffer.place_limit())  # one of two filtered: 2 / (1 - 1/2)
        await fill(buffer, "u1", [1.0, 0.0])
        await buffer.next_groups(0, 1)
        limits.append(buffer.place_limit())  # one of three: 2 / (1 - 1/3)
        return limits

    assert asyncio.run(scenario()) == [2, 4, 3]


def test_a_filtered_group_lets_a_pool_waiting_for_a_place_in():
    """Both places taken (η = 1, none due yet). A group that took no place is filtered: the
    over-admission grows and the pool waiting for a place goes in, while the learner still
    waits for a usable group."""

    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=1, usable=rewards_differ)
        await buffer.admit("a0")
        await buffer.admit("a1")
        waiting = asyncio.create_task(buffer.admit("b"))
        await fill(buffer, "flat", [0.0, 0.0])
        await asyncio.sleep(0.02)
        assert not waiting.done()
        step = asyncio.create_task(buffer.next_groups(0, 1))
        await asyncio.wait_for(waiting, 1)
        assert not step.done() and buffer.place_limit() == 8  # 2 / (1 - 3/4), the cap
        step.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await step
        return buffer.stats()

    stats = asyncio.run(scenario())
    assert (stats.admitted_groups, stats.places_used, stats.filtered_groups) == (3, 3, 1)


def test_a_filtered_group_lets_a_waiting_producer_in():
    """Room for one group, held by a complete one the step cannot use: filtering it lets the
    blocked producer open its group while the learner waits."""

    async def scenario():
        buffer = GroupBuffer(
            group_size=2, max_staleness=0, max_groups_in_flight=1, usable=rewards_differ
        )
        await fill(buffer, "flat", [1.0, 1.0])
        blocked = asyncio.create_task(fill(buffer, "next", [0.0, 1.0]))
        await asyncio.sleep(0.02)
        assert not blocked.done()
        step = asyncio.create_task(buffer.next_groups(0, 1))
        await asyncio.wait_for(blocked, 1)
        return [g.prompt_id for g in await asyncio.wait_for(step, 1)]

    assert asyncio.run(scenario()) == ["next"]
