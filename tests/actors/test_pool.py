import asyncio
from dataclasses import dataclass

import pytest

from actors.agent import AgentLoop, AgentSettings
from actors.embedded import EmbeddedEngine
from actors.engine import EngineError
from actors.pool import ActorPool, PoolFailure
from buffers.group_buffer import GroupBuffer


@dataclass(frozen=True)
class Task:
    id: str
    question: str = "Where was Varno Telik born?"
    ground_truth: tuple[str, ...] = ("Quorvex",)
    data_source: str = "minigaia_l1"


class Flaky:
    """The real engine, failing chosen calls the way a dead server does, or slowing a prompt down."""

    def __init__(self, engine, fail_calls=(), slow_prompt_len=None, delay=0.0):
        self.engine, self.fail_calls, self.calls = engine, set(fail_calls), 0
        self.slow_prompt_len, self.delay = slow_prompt_len, delay

    @property
    def version(self):
        return self.engine.version

    async def generate(self, prompt_ids, params):
        self.calls += 1
        if self.calls in self.fail_calls:
            raise EngineError("server 127.0.0.1:30000 died")
        if self.delay:
            await asyncio.sleep(self.delay)
        return await self.engine.generate(prompt_ids, params)


@pytest.fixture
def engine(tiny_policy_dir):
    return EmbeddedEngine.from_pretrained(tiny_policy_dir, max_batch_size=8)


def make_pool(engine, buffer, tasks, **kw):
    loop = AgentLoop(
        engine, engine.tokenizer, {}, AgentSettings(max_turns=1, max_new_tokens_per_turn=4)
    )
    options = dict(group_size=3, concurrency=4)
    options.update(kw)
    return ActorPool(loop, buffer, tasks, **options)


def test_groups_of_every_prompt_reach_the_buffer(engine):
    async def scenario():
        buffer = GroupBuffer(group_size=3, max_staleness=1000)
        pool = make_pool(engine, buffer, [Task(f"t{i}") for i in range(5)])
        stats = await pool.run()
        groups = [await buffer.next_group(0) for _ in range(5)]
        return stats, groups, buffer.stats()

    stats, groups, buffer_stats = asyncio.run(scenario())
    assert (stats.groups_started, stats.trajectories, stats.aborted) == (5, 15, 0)
    assert sorted(g.prompt_id.split("@")[0] for g in groups) == [f"t{i}" for i in range(5)]
    assert all(sorted(t.sample_index for t in g.members) == [0, 1, 2] for g in groups)
    assert buffer_stats.released == 15 and buffer_stats.pending == 0


async def until(condition, seconds=60.0):
    """Wait (not a fixed sleep: slow machines) until `condition()` holds."""
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


def test_pools_share_the_buffers_admission_places(engine):
    """Two pools, one controller: (η + 1) * groups_per_step = 4 groups in flight in all; the
    places of consumed groups come back once the engines serve the version trained on them."""

    async def scenario():
        buffer = GroupBuffer(group_size=3, max_staleness=1, groups_per_step=2)
        tasks = iter([Task(f"t{i}") for i in range(40)])
        pools = [make_pool(engine, buffer, tasks, name=f"pool-{i}") for i in range(2)]
        runners = [asyncio.create_task(pool.run()) for pool in pools]
        await until(lambda: buffer.stats().places_used == 4 and buffer.stats().ready_groups == 4)
        await asyncio.sleep(0.2)
        first = sum(p.stats.groups_started for p in pools)
        groups = await buffer.next_groups(0, 2)
        buffer.trained(groups, 1)
        await asyncio.sleep(0.2)
        consumed_not_served = sum(p.stats.groups_started for p in pools)
        buffer.serve(1)
        await until(lambda: sum(p.stats.groups_started for p in pools) == 6)
        for runner in runners:
            runner.cancel()
        await asyncio.gather(*runners, return_exceptions=True)
        return first, consumed_not_served, buffer.stats()

    first, consumed_not_served, stats = asyncio.run(scenario())
    assert first == 4 and consumed_not_served == 4  # a consumed group's place waits for serve
    assert stats.places_used == 4 and stats.served_version == 1


def test_a_generation_the_server_aborted_is_never_trained(engine):
    """finish_reason "abort" (the server cut the answer off, e.g. paused for an update) aborts
    the member and abandons its group instead of scoring a cut-off answer."""

    class Aborting(Flaky):
        async def generate(self, prompt_ids, params):
            out = await self.engine.generate(prompt_ids, params)
            self.calls += 1
            if self.calls == 2:
                out.finish_reason = "abort"
            return out

    async def scenario():
        buffer = GroupBuffer(group_size=3, max_staleness=1000)
        pool = make_pool(engine, buffer, [Task("a"), Task("b")], concurrency=1)
        pool.agent.engine = Aborting(engine)
        stats = await pool.run()
        return stats, await buffer.next_group(0), buffer.stats()

    stats, released, buffer_stats = asyncio.run(scenario())
    assert (stats.aborted, stats.trajectories, stats.groups_abandoned) == (1, 5, 1)
    assert released.prompt_id.startswith("b@")
    assert buffer_stats.abandoned == 2 and buffer_stats.released == 3
    assert all(t.finish_reason != "abort" for t in released.members)


def test_an_engine_failure_aborts_one_member_and_abandons_its_group(engine):
    async def scenario():
        buffer = GroupBuffer(group_size=3, max_staleness=1000)
        pool = make_pool(engine, buffer, [Task("a"), Task("b")], concurrency=1)
        pool.agent.engine = Flaky(engine, fail_calls={2})
        stats = await pool.run()
        released = await buffer.next_group(0)
        return stats, released, buffer.stats()

    stats, released, buffer_stats = asyncio.run(scenario())
    assert (stats.aborted, stats.trajectories) == (1, 5)
    assert released.prompt_id.startswith("b@")  # group "a" lost a member and was abandoned
    assert buffer_stats.abandoned == 2 and buffer_stats.released == 3 and buffer_stats.pending == 0


def test_slow_members_are_never_cut_short(engine):
    async def scenario():
        buffer = GroupBuffer(group_size=3, max_staleness=1000)
        pool = make_pool(engine, buffer, [Task("slow"), Task("fast")], concurrency=2)
        pool.agent.engine = Flaky(engine, delay=0.2)
        stats = await pool.run()
        return stats, [await buffer.next_group(0) for _ in range(2)]

    stats, groups = asyncio.run(scenario())
    assert stats.trajectories == 6 and all(g.size == 3 for g in groups)


def test_abandoned_groups_give_their_admission_place_back(engine):
    """With the learner stuck at version 0 (no group completes while a server is down), failed
    groups must not use up admission: else the pool waits for a version that never comes."""

    async def scenario():
        buffer = GroupBuffer(group_size=3, max_staleness=1, groups_per_step=2)
        tasks = [Task(f"t{i}") for i in range(12)]
        pool = make_pool(engine, buffer, tasks, concurrency=3)
        pool.agent.engine = Flaky(engine, fail_calls=set(range(1, 16)))  # the first 5 groups
        stats = await asyncio.wait_for(pool.run(max_groups=8), 120)
        return stats, buffer.stats()

    stats, buffer_stats = asyncio.run(scenario())
    # the admission limit is (1 + 0 + 1) * 2 = 4 groups: 8 started because 5 were abandoned
    assert stats.groups_started == 8 and stats.groups_abandoned == 5
    assert stats.aborted == 15 and buffer_stats.pending == 9  # three whole groups wait


def test_a_pool_whose_every_group_fails_stops_with_the_reason(engine, capsys):
    async def scenario():
        buffer = GroupBuffer(group_size=3, max_staleness=1000)
        tasks = [Task(f"t{i}") for i in range(100)]
        pool = make_pool(engine, buffer, tasks, max_failed_groups=6, failure_window_s=0.0)
        pool.agent.engine = Flaky(engine, fail_calls=set(range(1, 10_000)))
        with pytest.raises(PoolFailure, match=r"last 6 groups all failed.*127.0.0.1:30000 died"):
            await asyncio.wait_for(pool.run(), 120)
        return pool.stats

    stats = asyncio.run(scenario())
    assert 6 <= stats.groups_started < 100
    printed = capsys.readouterr().out
    assert printed.count("aborted and 0 rejected trajectories so far") == 1  # not one per failure


def test_failures_within_the_window_do_not_stop_the_pool(engine):
    """A server restarting fails every request for a while: not a broken engine yet."""

    async def scenario():
        buffer = GroupBuffer(group_size=3, max_staleness=1000)
        tasks = [Task(f"t{i}") for i in range(12)]
        pool = make_pool(engine, buffer, tasks, max_failed_groups=2, failure_window_s=3600.0)
        pool.agent.engine = Flaky(engine, fail_calls=set(range(1, 25)))  # 8 groups in a row
        return await asyncio.wait_for(pool.run(), 120)

    stats = asyncio.run(scenario())
    assert stats.groups_abandoned == 8 and stats.trajectories == 12 and stats.groups_started == 12


def test_a_stopped_pool_leaves_no_member_running():
    """A member that takes a moment to stop (a tool call finishing) delivers before the pool's
    run ends, never after: the run then closes the buffer and writes its books, and a late put
    would be a trajectory the books count but the spill never holds."""
    from pipeline.runtime.fakes import SimulatedAgent, SimulatedEngine, SimulatedTask

    class SlowToStop(SimulatedAgent):
        async def run(self, task, prompt_id, sample_index):
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                await asyncio.sleep(0.1)  # finishing what it was doing
            return await super().run(task, prompt_id, sample_index)

    async def scenario():
        buffer = GroupBuffer(group_size=2, max_staleness=1)
        tasks = iter([SimulatedTask(f"t{i}") for i in range(10)])
        pool = ActorPool(SlowToStop(SimulatedEngine()), buffer, tasks, group_size=2, concurrency=2)
        runner = asyncio.create_task(pool.run())
        await until(lambda: pool.stats.groups_started >= 1)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        at_stop = buffer.stats().put
        await asyncio.sleep(0.3)
        return at_stop, buffer.stats().put

    at_stop, later = asyncio.run(scenario())
    assert at_stop >= 2 and later == at_stop  # delivered while the pool stopped, none after
