"""Admission places and the consumption order of `GroupBuffer` (the run's one admission controller)."""

import asyncio
import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers.group_buffer import CLOSED_MEMORY, GroupBuffer
from buffers.records import InvalidTrajectory
from buffers.testing import synthetic_trajectory as traj


def run(coro):
    return asyncio.run(coro)


async def fill(buffer, prompt, version=0, tool_calls=0, size=None):
    for i in range(size or buffer.group_size):
        await buffer.put(traj(prompt, i, version=version, tool_names=["search"] * tool_calls))


async def blocked(buffer, prompt) -> bool:
    """True if admitting `prompt` has to wait now (the attempt is withdrawn)."""
    attempt = asyncio.create_task(buffer.admit(prompt))
    await asyncio.sleep(0.02)
    if attempt.done():
        return False
    attempt.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await attempt
    return True


def test_every_way_out_of_the_buffer_frees_its_place_exactly_once():
    """η = 0 with one group per step: one place. Each way a group leaves gives it back; a second
    abandon of a gone group gives nothing back (places are never negative or doubled)."""

    async def steps():
        now = [0.0]
        buffer = GroupBuffer(
            group_size=2, max_staleness=0, group_timeout_s=10, clock=lambda: now[0]
        )
        # dropped as stale: its tokens are version 0, the learner is at 1
        await buffer.admit("stale")
        await fill(buffer, "stale", version=0)
        assert await blocked(buffer, "x")
        waiter = asyncio.create_task(buffer.next_groups(1, 1))
        await asyncio.sleep(0.02)
        assert buffer.stats().dropped_stale == 2 and buffer.stats().places_used == 0
        # abandoned (its actor died), twice: the second gives nothing back
        await buffer.admit("dead")
        assert await blocked(buffer, "x")
        buffer.abandon("dead")
        buffer.abandon("dead")
        assert buffer.stats().places_used == 0
        # timed out before any member arrived
        await buffer.admit("silent")
        now[0] = 11.0
        assert buffer.expire_overdue() == 1 and buffer.stats().places_used == 0
        # released: the place waits until the engines serve the version trained on it
        buffer.serve(1)
        await buffer.admit("good")
        await fill(buffer, "good", version=1)
        (group,) = await asyncio.wait_for(waiter, 1)
        assert group.prompt_id == "good" and buffer.stats().places_used == 1
        buffer.trained([group], 2)
        assert await blocked(buffer, "x")  # trained, not served yet: one version early
        buffer.serve(2)
        assert buffer.stats().places_used == 0
        # a step that trained nothing gives its places back at once
        await buffer.admit("flat")
        await fill(buffer, "flat", version=2)
        flat = await buffer.next_groups(2, 1)
        buffer.trained(flat, None)
        assert buffer.stats().places_used == 0
        return buffer.stats()

    stats = run(steps())
    assert stats.admitted_groups == 5 and stats.abandoned_groups == 2
    assert stats.put == stats.released + stats.dropped_stale + stats.abandoned + stats.pending


def test_abandoning_a_complete_group_changes_nothing():
    """Found by the property test below: a complete group waiting for the learner is not open;
    abandoning it must neither free its place nor mark it abandoned while it is still ready."""

    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=1, groups_per_step=2)
        await buffer.admit("p")
        await fill(buffer, "p")
        assert buffer.abandon("p") == 0
        stats = buffer.stats()
        assert (stats.places_used, stats.ready_groups, stats.abandoned_groups) == (1, 1, 0)
        return [g.prompt_id for g in await buffer.next_groups(0, 1)]

    assert run(scenario()) == ["p"]


def test_a_member_for_a_complete_group_is_rejected_not_a_second_group():
    """Found by the property test below: a duplicate that arrived after the group was complete,
    but before the learner took it, opened a second group under the same prompt id."""

    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=1)
        await fill(buffer, "p")
        with pytest.raises(InvalidTrajectory, match="already complete"):
            await buffer.put(traj("p", 0))
        stats = buffer.stats()
        assert (stats.open_groups, stats.ready_groups, stats.rejected, stats.put) == (0, 1, 1, 2)

    run(scenario())


def test_places_are_eta_plus_one_steps_of_groups():
    async def scenario():
        buffer = GroupBuffer(group_size=1, max_staleness=2, groups_per_step=3)
        for i in range(9):
            await buffer.admit(f"p{i}")
        return await blocked(buffer, "p9"), buffer.stats()

    waits, stats = run(scenario())
    assert waits and stats.places == stats.places_used == 9


def test_due_groups_go_first_and_the_learner_keeps_room_for_them():
    """η = 1, two groups per step. "slow" was admitted at version 0, so at version 1 it is due:
    the step must hold it, even though two later groups completed first."""

    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=1, groups_per_step=2)
        await buffer.admit("slow")
        await buffer.put(traj("slow", 0, version=0, tool_names=["search"] * 3))
        buffer.serve(1)
        for name in ("fast1", "fast2", "fast3"):
            await buffer.admit(name)
        for name in ("fast1", "fast2", "fast3"):
            await fill(buffer, name, version=1)
        step = asyncio.create_task(buffer.next_groups(1, 2))
        await asyncio.sleep(0.05)
        assert not step.done()  # one fast group taken, the other place kept for "slow"
        await buffer.put(traj("slow", 1, version=0, tool_names=["search"] * 3))
        groups = await asyncio.wait_for(step, 1)
        return [g.prompt_id for g in groups], buffer.stats()

    chosen, stats = run(scenario())
    assert chosen == ["fast1", "slow"] and stats.dropped_stale == 0


def test_first_complete_first_out_without_due_groups():
    async def scenario():
        buffer = GroupBuffer(group_size=1, max_staleness=3, groups_per_step=2)
        for name in ("a", "b", "c"):
            await buffer.admit(name)
        for name in ("c", "a", "b"):
            await fill(buffer, name)
        return [g.prompt_id for g in await buffer.next_groups(0, 3)]

    assert run(scenario()) == ["c", "a", "b"]


operations = st.lists(
    st.tuples(
        st.sampled_from(["admit", "put", "take", "abandon", "publish", "empty"]), st.integers(0, 7)
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(operations)
def test_places_used_is_admitted_minus_freed_under_random_interleavings(ops):
    """Whatever happens, places used = groups admitted whose place is not back yet, never more
    than the places; once every group has left and its version is served, none is used."""

    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=1, groups_per_step=2)
        admitted, version, consumed = [], 0, []
        for op, a in ops:
            if op == "admit" and buffer.stats().places_used < buffer.places:
                prompt = f"p{len(admitted)}"
                await buffer.admit(prompt)
                admitted.append(prompt)
            elif op == "put" and admitted:
                prompt = admitted[a % len(admitted)]
                try:  # a member already there, or its group already complete: refused
                    await buffer.put(traj(prompt, a % 2, version=version))
                except InvalidTrajectory as refused:
                    assert "duplicate" in str(refused) or "already complete" in str(refused)
            elif op == "take" and buffer.stats().ready_groups:
                with contextlib.suppress(TimeoutError):
                    consumed += await asyncio.wait_for(buffer.next_groups(version, 1), 0.01)
            elif op == "abandon" and admitted:
                buffer.abandon(admitted[a % len(admitted)])
            elif op in ("publish", "empty") and consumed:
                if op == "publish":
                    version += 1
                    buffer.trained(consumed, version)
                    buffer.serve(version if a % 2 else version - 1)  # sometimes served late
                else:
                    buffer.trained(consumed, None)
                consumed = []
            stats = buffer.stats()
            assert 0 <= stats.places_used <= stats.places
        for prompt in admitted:
            buffer.abandon(prompt)  # whatever is still open leaves
        buffer.trained(consumed, None)
        buffer.serve(version)
        stats = buffer.stats()
        assert stats.places_used == stats.ready_groups  # only complete, never-taken groups
        assert stats.put == stats.released + stats.dropped_stale + stats.abandoned + stats.pending

    run(scenario())


def test_abandoning_a_due_group_releases_the_learner_waiting_for_it():
    """The learner keeps room in its step for a due group still generating; when that group is
    abandoned (its actor died) the learner takes the ready group instead, without another arrival."""

    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=1, groups_per_step=2)
        await buffer.admit("due")  # admitted at version 0: due at version 1
        buffer.serve(1)
        await buffer.admit("fresh")
        await fill(buffer, "fresh", version=1)
        step = asyncio.create_task(buffer.next_groups(1, 1))
        await asyncio.sleep(0.05)
        assert not step.done()  # the one place in the step is kept for "due"
        buffer.abandon("due")
        return [g.prompt_id for g in await asyncio.wait_for(step, 1)]

    assert run(scenario()) == ["fresh"]


def test_a_step_trained_into_the_version_already_served_frees_its_places_at_once():
    """`trained` with the version the engines already serve (a step that published nothing
    newer): nothing later will `serve` a newer version for it, so its place comes back now."""

    async def scenario():
        buffer = GroupBuffer(group_size=1, max_staleness=0)
        buffer.serve(2)
        await buffer.admit("a")
        await fill(buffer, "a", version=2)
        step = await buffer.next_groups(2, 1)
        assert buffer.stats().places_used == 1
        buffer.trained(step, 2)
        assert buffer.stats().places_used == 0 and not await blocked(buffer, "b")

    run(scenario())


def test_a_complete_due_group_is_taken_while_another_due_group_still_generates():
    """η = 0, one group a step, both admitted at version 0 (due at 0): the learner keeps the
    step's room for due groups only against groups that are not due, so the complete due
    group is taken at once, not held back for the one still generating."""

    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=0, groups_per_step=2)
        for name in ("open", "done"):
            await buffer.admit(name)
        await buffer.put(traj("open", 0))
        await fill(buffer, "done")
        return await asyncio.wait_for(buffer.next_groups(0, 1), 1)

    assert [g.prompt_id for g in run(scenario())] == ["done"]


@pytest.mark.parametrize("how", ["abandoned", "served"])
def test_a_pool_waiting_for_a_place_is_let_in_when_one_comes_back(how):
    """One place, taken: a second admission waits, and goes in as soon as the place comes back
    (the group abandoned, or its trained version served), with no other event."""

    async def scenario():
        buffer = GroupBuffer(group_size=1, max_staleness=0)
        await buffer.admit("a")
        if how == "served":
            await fill(buffer, "a")
            buffer.trained(await buffer.next_groups(0, 1), 1)
        waiting = asyncio.create_task(buffer.admit("b"))
        await asyncio.sleep(0.02)
        assert not waiting.done()
        if how == "abandoned":
            buffer.abandon("a")
        else:
            buffer.serve(1)
        await asyncio.wait_for(waiting, 1)
        return buffer.stats()

    stats = run(scenario())
    assert (stats.admitted_groups, stats.places_used) == (2, 1)


@pytest.mark.parametrize("before", ["admitted", "opened by a member", "abandoned", "released"])
def test_a_prompt_is_admitted_at_most_once(before):
    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=0, groups_per_step=2)
        if before == "admitted":
            await buffer.admit("p")
        elif before == "opened by a member":
            await buffer.put(traj("p", 0))
        elif before == "abandoned":
            await buffer.admit("p")
            buffer.abandon("p")
        else:
            await fill(buffer, "p")
            await buffer.next_groups(0, 1)
        with pytest.raises(
            ValueError, match=r"^prompt 'p' was admitted already: prompt ids are unique$"
        ):
            await buffer.admit("p")

    run(scenario())


def test_stats_report_the_version_served():
    buffer = GroupBuffer(group_size=1, max_staleness=0)
    buffer.serve(3)
    buffer.serve(2)  # never back
    assert buffer.stats().served_version == 3


def test_a_due_group_that_never_finishes_holds_the_step_until_its_timeout():
    """The step's one place is kept for a due group; when no member ever comes, the group times
    out and the learner takes the ready group, with no other call on the buffer."""

    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=1, group_timeout_s=0.1)
        await buffer.admit("due")  # admitted at version 0: due at version 1
        await buffer.put(traj("due", 0))
        buffer.serve(1)
        await buffer.admit("fresh")
        await fill(buffer, "fresh", version=1)
        step = asyncio.create_task(buffer.next_groups(1, 1))
        await asyncio.sleep(0.02)
        assert not step.done()
        chosen = await asyncio.wait_for(step, 2)
        return [g.prompt_id for g in chosen], buffer.stats()

    chosen, stats = run(scenario())
    assert chosen == ["fresh"] and (stats.abandoned, stats.abandoned_groups) == (1, 1)


def test_a_place_settled_by_serve_is_not_freed_again_by_a_later_serve():
    """A consumed group's place comes back once, when its version is served. Once the buffer has
    forgotten the prompt (after CLOSED_MEMORY later closures) its id may be admitted again,
    and serving the same version again must not free that new place."""

    async def scenario():
        buffer = GroupBuffer(group_size=1, max_staleness=1)
        await buffer.admit("p")
        await fill(buffer, "p")
        buffer.trained(await buffer.next_groups(0, 1), 1)
        buffer.serve(1)
        assert buffer.stats().places_used == 0
        for i in range(CLOSED_MEMORY):
            buffer.abandon(f"other{i}")
        await buffer.admit("p")
        buffer.serve(1)
        return buffer.stats().places_used

    assert run(scenario()) == 1
