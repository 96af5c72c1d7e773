"""Tools the agent calls: search (the retrieval client) and python (the sandbox).

A tool never raises into the agent loop: a failure (server down, timeout, hostile code) is an
observation the model reads, and it is counted.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

from actors.sandbox import run_python
from retrieval.client import RetrievalClient, RetrievalError
from retrieval.corpus import format_passages

MAX_QUERY_CHARS = 512  # a 100,000-character "query" is model noise, not a search


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    text: str  # what goes between the observation tags


class Tool(Protocol):
    name: str
    open_tag: str  # observation tags, e.g. <information> ... </information>
    close_tag: str

    async def __call__(self, argument: str) -> ToolResult: ...


@dataclass
class TrajectoryContext:
    """What the tools know of the trajectory calling them: its question's attached files (copied
    into the python sandbox's working directory) and its calls so far, per tool (budgets)."""

    files: tuple[str, ...] = ()
    calls: Counter = field(default_factory=Counter)


CURRENT_TRAJECTORY: ContextVar[TrajectoryContext | None] = ContextVar(
    "strata_trajectory", default=None
)
"""Set by the agent loop for the trajectory it runs: a tool is shared by every trajectory, and
asyncio gives each task its own value."""


def trajectory() -> TrajectoryContext:
    """The calling trajectory's context (an empty one outside an agent loop)."""
    return CURRENT_TRAJECTORY.get() or TrajectoryContext()


@dataclass
class ToolStats:
    calls: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)

    def record(self, name: str, ok: bool, seconds: float) -> None:
        self.calls[name] += 1
        self.seconds[name] += seconds
        if not ok:
            self.errors[name] += 1


class SearchTool:
    name = "search"
    open_tag, close_tag = "<information>", "</information>"

    def __init__(self, client: RetrievalClient, topk: int = 3) -> None:
        self.client = client
        self.topk = topk

    async def __call__(self, argument: str) -> ToolResult:
        query = " ".join(argument.split())[:MAX_QUERY_CHARS]
        if not query:
            return ToolResult(False, "Empty search query.")
        try:
            hits = await self.client.search(query, self.topk)
        except RetrievalError as exc:
            return ToolResult(False, f"Search failed: {exc}")
        return ToolResult(True, format_passages([passage for passage, _ in hits]))


class PythonTool:
    name = "python"
    open_tag, close_tag = "<output>", "</output>"

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        max_output_chars: int = 2048,
        isolation: str = "bwrap",
    ) -> None:
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_output_chars = max_output_chars
        self.isolation = isolation  # "bwrap": refuse where bubblewrap cannot run; "none": rlimits

    async def __call__(self, argument: str) -> ToolResult:

        result = await run_python(
            argument,
            self.timeout_s,
            memory_mb=self.memory_mb,
            max_output_chars=self.max_output_chars,
            isolation=self.isolation,
            files=trajectory().files,
        )
        return ToolResult(result.ok, result.output)


async def call_tool(tool: Tool, argument: str, stats: ToolStats) -> ToolResult:
    """Run a tool, timing (on the loop's clock: a simulated run's own) and counting it; an
    unexpected exception becomes a failed observation."""
    clock = asyncio.get_running_loop().time
    start = clock()
    try:
        result = await tool(argument)
    except Exception as exc:  # a broken tool must not end the trajectory
        result = ToolResult(False, f"{tool.name} failed: {type(exc).__name__}: {exc}")
    stats.record(tool.name, result.ok, clock() - start)
    return result
