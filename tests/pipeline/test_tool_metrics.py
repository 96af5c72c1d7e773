"""Tool faults reach metrics.jsonl and Prometheus: a call that does not fit its tool's schema, a
per-trajectory state whose release raised and an MCP server started again after it died, each
counted where it happens (actors/tools.py, a real MCP server of tests/actors/mcp_standin.py),
read off the local runtime's actor (`LocalRoles.actor_stats`), written into every step's line
of metrics.jsonl by the streaming loop (fake learner) and advanced into the strata_* counters,
per tool and per server."""

import asyncio
import itertools
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import generate_latest

from actors.agent import AgentStats
from actors.function_tools import function_tool
from actors.mcp_tools import McpServerSpec, open_mcp_tools
from actors.pool import ActorPool
from actors.tools import CURRENT_TRAJECTORY, TrajectoryContext, call_tool
from buffers.group_buffer import GroupBuffer
from pipeline.config.schema import BufferConfig, LearnerConfig, StrataConfig
from pipeline.runtime.fakes import SimulatedAgent, SimulatedEngine, SimulatedRoles, SimulatedTask
from pipeline.runtime.local import LocalRoles
from pipeline.runtime.metrics import RunMetrics
from pipeline.runtime.stream import ActorStats, RunSummary, stream

STANDIN = str(Path(__file__).parents[1] / "actors" / "mcp_standin.py")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


class Leaky:
    """A scratch state that cannot be given back."""

    def create(self) -> list:
        return []

    def release(self, state: list) -> None:
        raise OSError("the scratch directory is gone")

    def __call__(self, state: list) -> str:
        return "kept"


async def faults(log_dir: Path) -> tuple[AgentStats, list]:
    """One bad call of add, one release of leaky that raises, one restart of the server calc
    (killed, then called again): counted as the agent loop counts them."""
    stats = AgentStats()
    spec = McpServerSpec("calc", command=[sys.executable, STANDIN], tools=["add", "pid"])
    servers, mcp = await open_mcp_tools([spec], log_dir)
    await call_tool(function_tool(add), {"a": "2", "b": 40}, stats.tools)
    context = TrajectoryContext()
    token = CURRENT_TRAJECTORY.set(context)
    try:
        await call_tool(function_tool(Leaky, name="leaky"), {}, stats.tools)
    finally:
        CURRENT_TRAJECTORY.reset(token)
        await context.release(stats.tools)  # as the agent loop does when a trajectory ends
    os.kill(int((await mcp["calc_pid"]({})).text), signal.SIGKILL)
    for _ in range(3):  # the call in flight when it is found dead fails; the next restarts it
        if (await call_tool(mcp["calc_add"], {"a": 1, "b": 1}, stats.tools)).ok:
            break
    return stats, servers


@dataclass
class Roles(SimulatedRoles):
    """The fake learner side, reading its actors' figures off a local runtime's roles."""

    local: LocalRoles | None = None

    async def actor_stats(self) -> dict[str, ActorStats]:
        return await self.local.actor_stats()


def test_bad_calls_release_errors_and_mcp_restarts_reach_the_metrics(tmp_path):
    async def scenario():
        stats, servers = await faults(tmp_path / "logs")
        engine = SimulatedEngine()
        acting = SimpleNamespace(
            engine=SimpleNamespace(version=0, generated_tokens=0), mcp_servers=servers
        )
        local = LocalRoles(None, None, acting, [SimpleNamespace(stats=stats)], None, None)
        roles = Roles(engine, step_s=0.01, local=local)
        config = StrataConfig(
            buffer=BufferConfig(group_size=2, max_staleness=1),
            learner=LearnerConfig(groups_per_step=1, max_steps=2),
        )
        buffer = GroupBuffer(group_size=2, max_staleness=1, groups_per_step=1)
        tasks = (SimulatedTask(str(i)) for i in itertools.count())
        pool = ActorPool(SimulatedAgent(engine), buffer, tasks, group_size=2, concurrency=4)
        try:
            await asyncio.wait_for(
                stream(config, roles, buffer, [pool], tmp_path, RunSummary()), 60
            )
            return await local.actor_stats()
        finally:
            for server in servers:
                await server.close()

    actors = asyncio.run(scenario())
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for step in steps:
        assert {k: v for k, v in step.items() if k.startswith(("tool_", "mcp_"))} == {
            "tool_bad_calls": 1,
            "tool_bad_calls/add": 1,
            "tool_release_errors": 1,
            "tool_release_errors/leaky": 1,
            "mcp_restarts": 1,
            "mcp_restarts/calc": 1,
        }
    metrics = RunMetrics()
    metrics.declare_tools(["add", "leaky", "calc_add", "calc_pid"], ["calc"])
    metrics.sample(_Buffer(), actors)
    text = generate_latest(metrics.registry).decode()
    assert 'strata_tool_bad_calls_total{tool="add"} 1.0' in text
    assert 'strata_tool_bad_calls_total{tool="calc_add"} 0.0' in text  # declared, none yet
    assert 'strata_tool_release_errors_total{tool="leaky"} 1.0' in text
    assert 'strata_mcp_restarts_total{server="calc"} 1.0' in text
    metrics.sample(_Buffer(), actors)  # totals read again: nothing new is counted twice
    assert (
        'strata_mcp_restarts_total{server="calc"} 1.0' in generate_latest(metrics.registry).decode()
    )


class _Buffer:
    """The buffer's counters as `sample` reads them, all 0."""

    released = filtered = dropped_stale = abandoned = rejected = abandoned_groups = 0
    open_groups = ready_groups = 0
