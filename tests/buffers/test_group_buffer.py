import asyncio
import contextlib
import random
import re

import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers.group_buffer import CLOSED_MEMORY, GroupBuffer
from buffers.records import InvalidTrajectory
from buffers.spill import ParquetSpill
from buffers.testing import synthetic_trajectory as traj


def run(coro):
    return asyncio.run(coro)


def assert_accounting(buffer: GroupBuffer) -> None:
    s = buffer.stats()
    assert s.put == s.released + s.filtered + s.dropped_stale + s.abandoned + s.pending, s
    for stratum, c in s.per_stratum.items():
        parts = ("released", "filtered", "dropped_stale", "abandoned", "pending")
        assert c["put"] == sum(c[k] for k in parts), stratum


def test_interleaved_arrivals_release_each_group_when_complete():
    async def scenario():
        buffer = GroupBuffer(group_size=4, max_staleness=0, max_groups_in_flight=100)
        arrivals = [(f"p{p}", i) for p in range(25) for i in range(4)]
        random.Random(3).shuffle(arrivals)
        completion = []
        seen: dict[str, int] = {}
        for prompt, i in arrivals:
            await buffer.put(traj(prompt, i, tool_names=["search"] * (i % 3)))
            seen[prompt] = seen.get(prompt, 0) + 1
            if seen[prompt] == 4:
                completion.append(prompt)
            assert buffer.stats().ready_groups == len(completion)  # nothing consumed yet
        released = [await buffer.next_group(current_version=0) for _ in range(25)]
        assert [g.prompt_id for g in released] == completion  # first complete, first out
        for group in released:
            assert [t.sample_index for t in group.members] == [0, 1, 2, 3]
            assert {t.prompt_id for t in group.members} == {group.prompt_id}
        assert_accounting(buffer)
        assert buffer.stats().released == 100 and buffer.stats().pending == 0

    run(scenario())


def test_next_group_waits_for_the_last_member():
    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=0)
        await buffer.put(traj("a", 0))
        waiter = asyncio.create_task(buffer.next_group(0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await buffer.put(traj("a", 1))
        group = await asyncio.wait_for(waiter, 1.0)
        assert group.prompt_id == "a"

    run(scenario())


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_staleness_drop_at_exactly_eta_plus_one(eta, tmp_path):
    async def scenario():
        spill = ParquetSpill(tmp_path, rows_per_file=1000)
        buffer = GroupBuffer(group_size=2, max_staleness=eta, spill=spill)
        for prompt, version in [("old", 10), ("edge", 11), ("new", 12)]:
            for i in range(2):
                await buffer.put(traj(prompt, i, version=version))
        # current 11 + eta: "old" (version 10) is eta + 1 behind -> dropped; "edge" is exactly eta.
        current = 11 + eta
        group = await buffer.next_group(current)
        assert group.prompt_id == "edge"
        assert (await buffer.next_group(current)).prompt_id == "new"
        stats = await buffer.close()
        assert (stats.dropped_stale, stats.released) == (2, 4)
        table = pq.read_table(tmp_path)
        rows = {(r["prompt_id"], r["status"], r["consumed_version"]) for r in table.to_pylist()}
        assert rows == {
            ("old", "dropped_stale", current),
            ("edge", "released", current),
            ("new", "released", current),
        }

    run(scenario())


def test_mixed_version_group_is_as_old_as_its_oldest_token():
    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=1)
        first = traj("a", 0, version=5)
        first.token_versions[0] = 3  # the first tokens were sampled before a weight update
        await buffer.put(first)
        await buffer.put(traj("a", 1, version=5))
        await buffer.put(traj("b", 0, version=5))
        await buffer.put(traj("b", 1, version=5))
        assert (await buffer.next_group(5)).prompt_id == "b"  # a is 2 behind: dropped
        assert buffer.stats().dropped_stale == 2

    run(scenario())


def test_backpressure_blocks_new_groups_and_resumes():
    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=0, max_groups_in_flight=2)
        await buffer.put(traj("a", 0))
        await buffer.put(traj("b", 0))
        blocked = asyncio.create_task(buffer.put(traj("c", 0)))
        await asyncio.sleep(0.01)
        assert not blocked.done()  # a third group would exceed the limit
        await asyncio.wait_for(buffer.put(traj("a", 1)), 1.0)  # open groups always take members
        await asyncio.sleep(0.01)
        assert not blocked.done()  # "a" is complete but still held: still 2 in flight
        assert (await buffer.next_group(0)).prompt_id == "a"
        await asyncio.wait_for(blocked, 1.0)
        assert buffer.stats().open_groups == 2
        assert_accounting(buffer)

    run(scenario())


def test_a_step_larger_than_the_room_still_fills():
    """Groups chosen for a step no longer hold room: a step of 4 with room for 2 completes."""

    async def scenario():
        buffer = GroupBuffer(
            group_size=1, max_staleness=0, max_groups_in_flight=2, groups_per_step=4
        )

        async def produce():
            for i in range(4):
                await buffer.admit(f"p{i}")
                await buffer.put(traj(f"p{i}", 0))

        producer = asyncio.create_task(produce())
        groups = await asyncio.wait_for(buffer.next_groups(0, 4), 2.0)
        await producer
        assert [g.prompt_id for g in groups] == ["p0", "p1", "p2", "p3"]
        assert_accounting(buffer)

    run(scenario())


def test_backpressure_on_resident_bytes():
    async def scenario():
        one = traj("a", 0, tokens=100).nbytes
        buffer = GroupBuffer(group_size=2, max_staleness=0, max_resident_bytes=one + 1)
        await buffer.put(traj("a", 0, tokens=100))
        await buffer.put(traj("b", 0, tokens=100))  # under the limit when it arrived
        blocked = asyncio.create_task(buffer.put(traj("c", 0, tokens=100)))
        await asyncio.sleep(0.01)
        assert not blocked.done()
        await buffer.put(traj("a", 1, tokens=100))
        await buffer.put(traj("b", 1, tokens=100))
        await buffer.next_group(0)
        await asyncio.sleep(0.01)
        assert not blocked.done()  # "b" still holds more than the limit
        await buffer.next_group(0)
        await asyncio.wait_for(blocked, 1.0)

    run(scenario())


def test_abandon_counts_spills_and_never_trains(tmp_path):
    async def scenario():
        spill = ParquetSpill(tmp_path)
        buffer = GroupBuffer(group_size=3, max_staleness=0, max_groups_in_flight=1, spill=spill)
        await buffer.put(traj("dead", 0))
        await buffer.put(traj("dead", 1))
        blocked = asyncio.create_task(buffer.put(traj("next", 0)))
        await asyncio.sleep(0.01)
        assert buffer.abandon("dead") == 2
        await asyncio.wait_for(blocked, 1.0)  # abandoning freed the slot
        assert buffer.abandon("dead") == 0
        await buffer.put(traj("dead", 2))  # a straggler: kept as abandoned, never trained
        for i in (1, 2):
            await buffer.put(traj("next", i))
        assert (await buffer.next_group(0)).prompt_id == "next"
        stats = await buffer.close()
        assert (stats.abandoned, stats.released, stats.pending) == (3, 3, 0)
        assert stats.abandoned_groups == 1  # abandoned twice, one group
        statuses = pq.read_table(tmp_path).column("status").to_pylist()
        assert sorted(statuses) == ["abandoned"] * 3 + ["released"] * 3

    run(scenario())


def test_abandoning_before_any_member_arrived_catches_the_stragglers():
    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=0)
        assert buffer.abandon("early") == 0  # its first member's actor died before putting anything
        assert buffer.abandon("early") == 0  # and its second
        await buffer.put(traj("early", 1))
        stats = buffer.stats()
        assert (stats.abandoned, stats.pending, stats.open_groups) == (1, 0, 0)
        assert stats.abandoned_groups == 1
        assert_accounting(buffer)

    run(scenario())


def test_group_timeout_abandons_while_the_learner_waits():
    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=0, group_timeout_s=0.05)
        await buffer.put(traj("stuck", 0))
        waiter = asyncio.create_task(buffer.next_group(0))
        await asyncio.sleep(0.3)
        assert buffer.stats().abandoned == 1 and buffer.stats().open_groups == 0
        assert not waiter.done()
        await buffer.put(traj("live", 0))
        await buffer.put(traj("live", 1))
        assert (await asyncio.wait_for(waiter, 1.0)).prompt_id == "live"

    run(scenario())


def test_timeout_with_a_fake_clock():
    now = [0.0]
    buffer = GroupBuffer(group_size=2, max_staleness=0, group_timeout_s=10, clock=lambda: now[0])

    async def scenario():
        await buffer.put(traj("a", 0))
        now[0] = 5.0
        await buffer.put(traj("b", 0))
        now[0] = 10.0
        assert buffer.expire_overdue() == 1  # only "a" is 10 s old
        now[0] = 15.0
        assert buffer.expire_overdue() == 1

    run(scenario())
    assert buffer.stats().abandoned == 2


def test_the_learner_sleeps_until_the_oldest_open_group_times_out():
    """Waiting for a group, the learner wakes at the oldest open group's deadline, not in a busy
    loop: over 0.2 s with a frozen clock and a 10 s timeout it reads the clock a few times."""
    reads = [0]

    def clock():
        reads[0] += 1
        return 0.0

    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=0, group_timeout_s=10, clock=clock)
        await buffer.put(traj("open", 0))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(buffer.next_group(0), 0.2)

    run(scenario())
    assert reads[0] < 10, reads[0]


def test_bad_arrivals_are_rejected_and_lose_nothing():
    async def scenario():
        buffer = GroupBuffer(group_size=3, max_staleness=0)
        await buffer.put(traj("a", 0, reward=0.5))
        bad_length = traj("a", 1)
        bad_length.loss_mask = bad_length.loss_mask[:-2]
        bad_version = traj("a", 1)
        bad_version.token_versions[0] = -7
        for bad, message in [
            (bad_length, "differ in length"),
            (bad_version, "negative policy version"),
            (traj("a", 0), "duplicate"),
            (traj("a", 3), "sample_index must be < group_size 3"),
        ]:
            with pytest.raises(InvalidTrajectory, match=message):
                await buffer.put(bad)
        assert buffer.stats().rejected == 4 and buffer.stats().pending == 1
        await buffer.put(traj("a", 1, reward=1.5))
        await buffer.put(traj("a", 2, reward=2.5))
        group = await buffer.next_group(0)
        assert group.rewards.tolist() == [0.5, 1.5, 2.5]  # the first arrival survived intact
        with pytest.raises(InvalidTrajectory, match="already complete"):
            await buffer.put(traj("a", 1))
        assert buffer.stats().rejected == 5
        assert_accounting(buffer)

    run(scenario())


def test_close_spills_what_is_still_held(tmp_path):
    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=0, spill=ParquetSpill(tmp_path))
        await buffer.put(traj("open", 0))
        await buffer.put(traj("ready", 0))
        await buffer.put(traj("ready", 1))
        held = sorted(t.key for t in buffer.held())  # what a checkpoint records as in flight
        assert held == sorted(t.key for t in (traj("open", 0), traj("ready", 0), traj("ready", 1)))
        last_file, writes = buffer.spill.mark()
        assert (last_file, writes) == (0, [])  # nothing has left the buffer: no file yet
        stats = await buffer.close()
        assert stats.pending == 3 and buffer.held() == []  # spilled as pending by close
        assert pq.read_table(tmp_path).column("status").to_pylist() == ["pending"] * 3
        assert buffer.spill.mark()[0] == 1

    run(scenario())


operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("put"),
            st.integers(0, 5),
            st.integers(0, 3),
            st.integers(0, 2),
            st.integers(0, 4),
        ),
        st.tuples(st.just("bad"), st.integers(0, 5), st.integers(0, 3), st.just(0), st.just(0)),
        st.tuples(st.just("take"), st.integers(0, 6), st.just(0), st.just(0), st.just(0)),
        st.tuples(st.just("abandon"), st.integers(0, 5), st.just(0), st.just(0), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(operations)
def test_accounting_identity_under_random_interleavings(ops):
    async def scenario():
        buffer = GroupBuffer(group_size=3, max_staleness=1, max_groups_in_flight=1000)
        for op, a, b, c, d in ops:
            if op == "put":
                with contextlib.suppress(InvalidTrajectory):
                    await buffer.put(
                        traj(f"p{a}", b % 3 if d else b, version=c, tool_names=["search"] * c)
                    )
            elif op == "bad":
                t = traj(f"p{a}", b % 3)
                t.behavior_logprobs[0] = float("nan")
                with pytest.raises(InvalidTrajectory):
                    await buffer.put(t)
            elif op == "take" and buffer.stats().ready_groups:
                # Times out when every ready group was stale and got dropped.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(buffer.next_group(a), 0.01)
            elif op == "abandon":
                buffer.abandon(f"p{a}")
            assert_accounting(buffer)

    run(scenario())


def test_a_step_interrupted_while_it_waits_for_its_groups_releases_none(tmp_path):
    """next_groups(count=2) holding one group when it is cancelled (the run stopped mid-wait):
    that group was never trained, so it is not released: it waits again, first in line, and a
    run that closes now spills it as pending."""

    async def scenario():
        spill = ParquetSpill(tmp_path)
        buffer = GroupBuffer(group_size=2, max_staleness=1, spill=spill, groups_per_step=2)
        for prompt in ("a", "b"):
            await buffer.put(traj(prompt, 0))
        await buffer.put(traj("a", 1))  # a complete, b still generating
        waiting = asyncio.create_task(buffer.next_groups(0, 2))
        await asyncio.sleep(0.05)
        held = buffer.stats()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        after = buffer.stats()
        await buffer.put(traj("b", 1))
        step = await asyncio.wait_for(buffer.next_groups(0, 2), 5)  # hangs if a was lost
        again = asyncio.create_task(buffer.next_groups(0, 2))
        await buffer.put(traj("c", 0))
        await buffer.put(traj("c", 1))
        await asyncio.sleep(0.05)  # c is held for a step that never completes
        final = await buffer.close()
        again.cancel()
        return held, after, [g.prompt_id for g in step], final

    held, after, step, final = run(scenario())
    assert held.released == 0 and held.ready_groups == 1  # chosen, not released yet
    assert after.released == 0 and after.ready_groups == 1 and after.pending == 3
    assert step == ["a", "b"]
    assert (final.released, final.pending) == (4, 2)
    statuses = sorted(pq.read_table(tmp_path).column("status").to_pylist())
    assert statuses == ["pending"] * 2 + ["released"] * 4


@pytest.mark.parametrize(
    "bad",
    [
        {"group_size": 0},
        {"max_staleness": -1},
        {"max_groups_in_flight": 0},
        {"max_resident_bytes": 0},
        {"groups_per_step": 0},
        {"max_overadmit": 0.99},
    ],
)
def test_each_limit_below_its_floor_is_refused_alone_with_the_floors_named(bad):
    limits = {"group_size": 2, "max_staleness": 1} | bad
    message = (
        "group_size, max_groups_in_flight, max_resident_bytes, groups_per_step, "
        "max_overadmit >= 1; max_staleness >= 0"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        GroupBuffer(**limits)


def test_every_limit_at_its_floor_is_accepted():
    buffer = GroupBuffer(
        group_size=1,
        max_staleness=0,
        max_groups_in_flight=1,
        max_resident_bytes=1,
        groups_per_step=1,
        max_overadmit=1,
    )
    assert (buffer.max_resident_bytes, buffer.max_overadmit, buffer.places) == (1, 1, 1)


def test_by_default_64_groups_are_in_flight_and_a_65th_waits():
    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=0)
        for i in range(64):
            await asyncio.wait_for(buffer.put(traj(f"p{i}", 0)), 1)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(buffer.put(traj("p64", 0)), 0.05)
        return buffer.stats().open_groups

    assert run(scenario()) == 64


def test_complete_groups_waiting_for_the_learner_count_against_the_room():
    async def scenario():
        buffer = GroupBuffer(group_size=1, max_staleness=0, max_groups_in_flight=2)
        await buffer.put(traj("a", 0))
        await buffer.put(traj("b", 0))  # both complete, neither taken
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(buffer.put(traj("c", 0)), 0.05)
        return buffer.stats()

    stats = run(scenario())
    assert (stats.ready_groups, stats.open_groups, stats.put) == (2, 0, 2)


def test_a_buffer_holding_exactly_its_byte_limit_opens_no_new_group():
    async def scenario():
        one = traj("a", 0, tokens=100).nbytes
        buffer = GroupBuffer(group_size=2, max_staleness=0, max_resident_bytes=one)
        await buffer.put(traj("a", 0, tokens=100))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(buffer.put(traj("b", 0, tokens=100)), 0.05)
        await buffer.put(traj("a", 1, tokens=100))  # a member of an open group never waits
        return buffer.stats(), 2 * one

    stats, two = run(scenario())
    assert (stats.ready_groups, stats.resident_bytes) == (1, two)


def test_a_step_larger_than_the_byte_room_still_fills():
    """Groups chosen for a step no longer hold bytes: with room for one group's bytes, the
    second group of a step is admitted while the first waits in the step."""

    async def scenario():
        one = traj("p0", 0).nbytes
        buffer = GroupBuffer(
            group_size=1, max_staleness=0, max_resident_bytes=one, groups_per_step=2
        )

        async def produce():
            for i in range(2):
                await buffer.admit(f"p{i}")
                await buffer.put(traj(f"p{i}", 0))
                await asyncio.sleep(0.01)  # the learner takes it into the step

        producer = asyncio.create_task(produce())
        groups = await asyncio.wait_for(buffer.next_groups(0, 2), 2.0)
        await producer
        return [g.prompt_id for g in groups]

    assert run(scenario()) == ["p0", "p1"]


def test_dropping_a_stale_group_lets_a_waiting_producer_in():
    """The learner drops the one group in flight as stale and keeps waiting for a fresh one: the
    producer it blocked opens its group without any other event."""

    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=0, max_groups_in_flight=1)
        await buffer.put(traj("old", 0, version=0))
        await buffer.put(traj("old", 1, version=0))
        blocked = asyncio.create_task(buffer.put(traj("new", 0, version=3)))
        await asyncio.sleep(0.01)
        assert not blocked.done()
        step = asyncio.create_task(buffer.next_groups(3, 1))
        await asyncio.wait_for(blocked, 1)
        await buffer.put(traj("new", 1, version=3))
        return [g.prompt_id for g in await asyncio.wait_for(step, 1)], buffer.stats()

    step, stats = run(scenario())
    assert step == ["new"] and stats.dropped_stale == 2


def test_a_late_member_of_a_stale_group_is_refused_naming_why():
    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=0)
        await fill_group(buffer, "old", version=0)
        await fill_group(buffer, "new", version=1)
        assert (await buffer.next_group(1)).prompt_id == "new"
        with pytest.raises(InvalidTrajectory, match=r"already complete \(dropped_stale\)$"):
            await buffer.put(traj("old", 0, version=0))
        return buffer.stats()

    stats = run(scenario())
    assert (stats.dropped_stale, stats.rejected, stats.abandoned_groups) == (2, 1, 0)


def test_every_arrival_for_a_complete_group_is_counted_as_rejected():
    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=0)
        await fill_group(buffer, "p")
        for i in (0, 1, 0):
            with pytest.raises(InvalidTrajectory, match="already complete"):
                await buffer.put(traj("p", i))
        return buffer.stats()

    stats = run(scenario())
    assert (stats.rejected, stats.per_stratum[1]["rejected"], stats.put) == (3, 3, 2)


def test_an_abandoned_groups_spilled_rows_carry_no_consuming_version(tmp_path):
    """Abandoned members were never consumed: the spill records consumed_version -1."""

    async def scenario():
        buffer = GroupBuffer(group_size=3, max_staleness=0, spill=ParquetSpill(tmp_path))
        await buffer.put(traj("dead", 0))
        await buffer.put(traj("dead", 1))
        assert buffer.abandon("dead") == 2
        await buffer.close()

    run(scenario())
    rows = pq.read_table(tmp_path).to_pylist()
    assert [(r["status"], r["consumed_version"]) for r in rows] == [("abandoned", -1)] * 2


def test_without_a_timeout_nothing_expires():
    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=0)
        await buffer.put(traj("a", 0))
        return buffer.expire_overdue(), buffer.stats().open_groups

    assert run(scenario()) == (0, 1)


def test_resident_bytes_are_the_payload_held():
    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=0)
        held = [traj("a", 0, tokens=50), traj("b", 0, tokens=70), traj("b", 1, tokens=90)]
        for t in held:
            await buffer.put(t)
        return buffer.stats().resident_bytes, sum(t.nbytes for t in held)

    resident, expected = run(scenario())
    assert resident == expected > 0


def close_others(buffer: GroupBuffer, count: int, tag: str = "other") -> None:
    """Close `count` other prompts (abandoned before any member arrived)."""
    for i in range(count):
        buffer.abandon(f"{tag}{i}")


def test_the_buffer_remembers_the_last_closed_memory_prompts_and_forgets_the_oldest():
    """Late arrivals are caught for the last CLOSED_MEMORY closed prompts: the oldest of them is
    still remembered, one closure later it is forgotten (a new group), the newest never is."""

    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=0)
        buffer.abandon("first")
        close_others(buffer, CLOSED_MEMORY - 1)
        await buffer.put(traj("first", 0))  # still remembered: a straggler, kept as abandoned
        remembered = buffer.stats()
        buffer.abandon("last")
        await buffer.put(traj("last", 0))
        await buffer.put(traj("first", 1))  # forgotten now: it opens a group
        return remembered, buffer.stats(), [t.prompt_id for t in buffer.held()]

    remembered, after, held = run(scenario())
    assert (remembered.abandoned, remembered.open_groups) == (1, 0)
    assert (after.abandoned, after.open_groups, after.pending) == (2, 1, 1)
    assert held == ["first"]


@pytest.mark.parametrize("way_out", ["dropped_stale", "released"])
def test_a_consumed_prompt_once_forgotten_opens_a_new_group(way_out):
    """A prompt that left the buffer is remembered as closed, then forgotten after
    CLOSED_MEMORY later closures: nothing else of it stays behind to refuse its id."""

    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=0)
        await fill_group(buffer, "p", version=0)
        await fill_group(buffer, "q", version=1)
        taken = await buffer.next_group(1 if way_out == "dropped_stale" else 0)
        assert getattr(buffer.stats(), way_out) == 2
        close_others(buffer, CLOSED_MEMORY)
        await buffer.put(traj("p", 0, version=1))
        return taken.prompt_id, buffer.stats()

    taken, stats = run(scenario())
    assert taken == ("q" if way_out == "dropped_stale" else "p")
    assert (stats.open_groups, stats.rejected) == (1, 0)


async def fill_group(buffer, prompt, version=0):
    for i in range(buffer.group_size):
        await buffer.put(traj(prompt, i, version=version))
