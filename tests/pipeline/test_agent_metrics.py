"""A custom or openai agent's lost trajectories (by kind) and history rewrites reach
metrics.jsonl and Prometheus the way reward_errors does: counted in the agents' AgentStats, read
off the local runtime's actor (`LocalRoles.actor_stats`, the pools' sums), written into every
step's line by the streaming loop (fake learner) and advanced into strata_agent_* counters."""

import asyncio
import itertools
import json
from types import SimpleNamespace

from prometheus_client import generate_latest

from actors.agent import AgentStats
from actors.pool import ActorPool
from buffers.group_buffer import GroupBuffer
from pipeline.config.schema import BufferConfig, LearnerConfig, StrataConfig
from pipeline.runtime.fakes import SimulatedAgent, SimulatedEngine, SimulatedTask
from pipeline.runtime.local import LocalRoles
from pipeline.runtime.metrics import RunMetrics
from pipeline.runtime.stream import RunSummary, stream
from tests.pipeline.test_tool_metrics import Roles, _Buffer


def test_agent_failures_by_kind_and_rewrites_reach_the_metrics(tmp_path):
    pools = [AgentStats(), AgentStats()]  # two pools' agents: their counts add up
    pools[0].failures.update({"timeout": 2, "raised": 1})
    pools[1].failures.update({"timeout": 1})
    pools[0].rewrites, pools[1].rewrites = 3, 1

    async def scenario():
        engine = SimulatedEngine()
        acting = SimpleNamespace(
            engine=SimpleNamespace(version=0, generated_tokens=0), mcp_servers=[]
        )
        agents = [SimpleNamespace(stats=stats) for stats in pools]
        local = LocalRoles(None, None, acting, agents, None, None)
        roles = Roles(engine, step_s=0.01, local=local)
        config = StrataConfig(
            buffer=BufferConfig(group_size=2, max_staleness=1),
            learner=LearnerConfig(groups_per_step=1, max_steps=2),
        )
        buffer = GroupBuffer(group_size=2, max_staleness=1, groups_per_step=1)
        tasks = (SimulatedTask(str(i)) for i in itertools.count())
        pool = ActorPool(SimulatedAgent(engine), buffer, tasks, group_size=2, concurrency=4)
        await asyncio.wait_for(stream(config, roles, buffer, [pool], tmp_path, RunSummary()), 60)
        return await local.actor_stats()

    actors = asyncio.run(scenario())
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for step in steps:
        assert {k: v for k, v in step.items() if k.startswith("agent_")} == {
            "agent_failures": 4,
            "agent_failures/raised": 1,
            "agent_failures/timeout": 3,
            "agent_rewrites": 4,
        }
    metrics = RunMetrics()
    metrics.sample(_Buffer(), actors)
    text = generate_latest(metrics.registry).decode()
    assert 'strata_agent_failures_total{kind="timeout"} 3.0' in text
    assert 'strata_agent_failures_total{kind="raised"} 1.0' in text
    assert "strata_agent_rewrites_total 4.0" in text
    pools[0].failures["exit"] += 1
    metrics.sample(_Buffer(), asyncio.run(_read(pools)))
    text = generate_latest(metrics.registry).decode()  # new counts only: nothing counted twice
    assert 'strata_agent_failures_total{kind="exit"} 1.0' in text
    assert 'strata_agent_failures_total{kind="timeout"} 3.0' in text


async def _read(pools):
    acting = SimpleNamespace(engine=SimpleNamespace(version=0, generated_tokens=0), mcp_servers=[])
    agents = [SimpleNamespace(stats=stats) for stats in pools]
    return await LocalRoles(None, None, acting, agents, None, None).actor_stats()
