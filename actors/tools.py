"""The tool contract, the built-in tools search (the retrieval client) and python (the sandbox),
and how the agent loop calls a tool.

A tool is an object with

    name: str                  what the model calls it (and `Trajectory.tool_names` records)
    schema: dict               OpenAI's function format: {"type": "function", "function":
                               {"name", "description", "parameters": a JSON schema object}}
    open_tag, close_tag: str   the tags its result comes back between in the tags format
    async __call__(arguments: dict) -> ToolResult

`arguments` is the call's JSON object as the model wrote it; the tool checks it against its own
schema, and a call that does not fit is a failed observation saying why (`ToolResult.bad_call`),
counted as that tool's error. A plain function becomes a tool through
`actors.function_tools.function_tool`, an MCP server's tools through `actors.mcp_tools`. A tool
written for one string argument (web_search and browse until their own rewrite) gets the contract
from `StringTool`.

A tool never raises into the agent loop: a failure (server down, timeout, hostile code, bad
arguments) is an observation the model reads, and it is counted (`ToolStats`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

import jsonschema

from actors.formats import parameters_text, string_parameter
from actors.sandbox import run_python
from retrieval.client import RetrievalClient, RetrievalError
from retrieval.corpus import format_passages

MAX_QUERY_CHARS = 512  # a 100,000-character "query" is model noise, not a search


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    text: str  # what goes between the observation tags
    bad_call: bool = False
    """The arguments did not fit the tool's schema: nothing ran (counted in ToolStats.bad_calls)."""


class Tool(Protocol):
    name: str
    schema: dict  # OpenAI's function format, as chat templates take it (`tools=`)
    open_tag: str  # observation tags, e.g. <information> ... </information>
    close_tag: str

    async def __call__(self, arguments: dict) -> ToolResult: ...


def function_schema(name: str, description: str, parameters: dict) -> dict:
    """A tool's schema in OpenAI's function format."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def string_schema(name: str, description: str, parameter: str, about: str) -> dict:
    """The schema of a tool of one required string parameter."""
    properties = {parameter: {"type": "string", "description": about}}
    parameters = {"type": "object", "properties": properties, "required": [parameter]}
    return function_schema(name, description, parameters)


def check_arguments(tool, arguments: Any) -> ToolResult | None:
    """None when `arguments` fits the tool's schema, else the failed observation that says what
    is wrong and what the tool takes (one line, at most three problems)."""
    parameters = tool.schema["function"]["parameters"]
    if not isinstance(arguments, dict):
        problems = [f"the arguments must be a JSON object, not {type(arguments).__name__}"]
    else:
        validator = jsonschema.Draft202012Validator(parameters)
        errors = sorted(validator.iter_errors(arguments), key=lambda e: list(e.path))
        problems = [
            ".".join(str(p) for p in e.path) + ": " + e.message if e.path else e.message
            for e in errors
        ]
    if not problems:
        return None
    return bad_call(tool, problems)


def bad_call(tool, problems: list[str]) -> ToolResult:
    """The observation of a call whose arguments do not fit `tool`'s schema."""
    text = "; ".join(" ".join(p.split()) for p in problems[:3])
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return ToolResult(
        False,
        f"Invalid call of {tool.name}: {text}{more}. Its parameters: "
        f"{parameters_text(tool.schema)}.",
        bad_call=True,
    )


def string_argument(tool, arguments: Any) -> str | ToolResult:
    """The one string argument of a call of `tool` (see `string_parameter`), or the failed
    observation of a call that does not fit its schema."""
    refused = check_arguments(tool, arguments)
    return refused if refused is not None else arguments[string_parameter(tool)]


@dataclass
class TrajectoryContext:
    """What the tools know of the trajectory calling them, and what the agent loop records of
    its calls: the question's attached files (copied into the python sandbox's working
    directory), its calls so far per tool (budgets), every call and observation in order (what
    the reward sees), and the per-trajectory state of tools that keep some
    (`actors.function_tools`), released when the trajectory ends."""

    files: tuple[str, ...] = ()
    calls: Counter = field(default_factory=Counter)
    tool_calls: list[tuple[str, dict]] = field(default_factory=list)
    """(tool name, its arguments as parsed) of every call the loop made, bad ones included."""
    observations: list[str] = field(default_factory=list)
    """The text each call returned, as returned (before it is cut to tokens)."""
    states: dict[Any, Any] = field(default_factory=dict)
    """A stateful tool's state, by the tool's key (what its `create` returned)."""
    releases: list[tuple[str, Callable[[], Awaitable[None]]]] = field(default_factory=list)
    """(tool name, how to release its state), in creation order."""

    async def release(self, stats: ToolStats | None = None) -> None:
        """Release every tool state this trajectory created, the last created first; a release
        that raises is counted (ToolStats.release_errors) and the others still run."""
        while self.releases:
            name, release = self.releases.pop()
            try:
                await release()
            except Exception:  # a broken release must not end the run
                if stats is not None:
                    stats.release_errors[name] += 1
        self.states.clear()


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
    bad_calls: Counter = field(default_factory=Counter)
    """Calls whose arguments did not fit the schema (also counted in `errors`)."""
    release_errors: Counter = field(default_factory=Counter)
    """Per-trajectory states whose release raised."""

    def record(self, name: str, ok: bool, seconds: float, bad_call: bool = False) -> None:
        self.calls[name] += 1
        self.seconds[name] += seconds
        if not ok:
            self.errors[name] += 1
        if bad_call:
            self.bad_calls[name] += 1


SEARCH_SCHEMA = string_schema(
    "search",
    "Search the knowledge base; returns the top passages for the query.",
    "query",
    "What to search for.",
)
PYTHON_SCHEMA = string_schema(
    "python", "Run Python code in a sandbox; returns what it prints.", "code", "The program to run."
)


class SearchTool:
    name = "search"
    schema = SEARCH_SCHEMA
    open_tag, close_tag = "<information>", "</information>"

    def __init__(self, client: RetrievalClient, topk: int = 3) -> None:
        self.client = client
        self.topk = topk

    async def __call__(self, arguments: dict) -> ToolResult:
        argument = string_argument(self, arguments)
        if isinstance(argument, ToolResult):
            return argument
        query = " ".join(argument.split())[:MAX_QUERY_CHARS]
        if not query:
            return ToolResult(False, "Empty search query.")
        try:
            hits = await self.client.search(query, self.topk)
        except RetrievalError as exc:
            return ToolResult(False, f"Search failed: {exc}")
        return ToolResult(True, format_passages([passage for passage, _ in hits]))

    async def close(self) -> None:
        await self.client.close()


class PythonTool:
    name = "python"
    schema = PYTHON_SCHEMA
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

    async def __call__(self, arguments: dict) -> ToolResult:
        code = string_argument(self, arguments)
        if isinstance(code, ToolResult):
            return code
        result = await run_python(
            code.strip(),
            self.timeout_s,
            memory_mb=self.memory_mb,
            max_output_chars=self.max_output_chars,
            isolation=self.isolation,
            files=trajectory().files,
        )
        return ToolResult(result.ok, result.output)


class StringTool:
    """The contract for a tool written for one string argument, `await tool(text)`: one string
    parameter, its schema, checked calls. Its name, tags and `call_tag` (the tags format's
    action, when it is not the name) are the wrapped tool's; `close` reaches it."""

    def __init__(self, tool, description: str, parameter: str, about: str) -> None:
        self.tool = tool
        self.name = tool.name
        self.open_tag, self.close_tag = tool.open_tag, tool.close_tag
        self.call_tag = getattr(tool, "call_tag", tool.name)
        self.schema = string_schema(self.name, description, parameter, about)

    async def __call__(self, arguments: dict) -> ToolResult:
        argument = string_argument(self, arguments)
        if isinstance(argument, ToolResult):
            return argument
        return await self.tool(argument)

    async def close(self) -> None:
        close = getattr(self.tool, "close", None)
        if close is not None:
            await close()


async def call_tool(tool: Tool, arguments: dict | str, stats: ToolStats) -> ToolResult:
    """Run a tool, timing (on the loop's clock: a simulated run's own) and counting it; an
    unexpected exception becomes a failed observation. A bare string stands for a one-string
    tool's argument (`string_parameter`)."""
    if isinstance(arguments, str):
        arguments = {string_parameter(tool) or "input": arguments}
    clock = asyncio.get_running_loop().time
    start = clock()
    try:
        result = await tool(arguments)
    except Exception as exc:  # a broken tool must not end the trajectory
        result = ToolResult(False, f"{tool.name} failed: {type(exc).__name__}: {exc}")
    stats.record(tool.name, result.ok, clock() - start, result.bad_call)
    return result
