"""The tool contract, the base every tool written in Python is (`FunctionTool`), the built-in
tools search (the retrieval client) and python (the sandbox), and how the agent loop calls a tool.

A tool is an object with

    name: str                  what the model calls it (and `Trajectory.tool_names` records)
    schema: dict               OpenAI's function format: {"type": "function", "function":
                               {"name", "description", "parameters": a JSON schema object}}
    open_tag, close_tag: str   the tags its result comes back between in the tags format
    async __call__(arguments: dict) -> ToolResult

`arguments` is the call's JSON object as the model wrote it; the tool checks it against its own
schema, and a call that does not fit is a failed observation saying why (`ToolResult.bad_call`),
counted as that tool's error. Every tool written in Python is a `FunctionTool`: the built-ins
(search and python here, web_search and browse in their modules) as subclasses, a plug-in's
function or class through `actors.function_tools.function_tool`; its schema comes from its
signature and docstring (actors/tool_schema.py) and its calls are validated against it. An MCP
server's tools (`actors.mcp_tools`) take their server's schema and are checked against it as JSON
Schema (`check_arguments`).

A tool never raises into the agent loop: a failure (server down, timeout, hostile code, bad
arguments) is an observation the model reads, and it is counted (`ToolStats`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

import jsonschema
from pydantic import BaseModel, ValidationError

from actors.formats import parameters_text, string_parameter
from actors.sandbox import run_python
from actors.tool_schema import describe
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


@dataclass
class TrajectoryContext:
    """What the tools know of the trajectory calling them, and what the agent loop records of
    its calls: the question's attached files (copied into the python sandbox's working
    directory), every call and observation in order (what the reward sees), and the
    per-trajectory state of tools that keep some (`FunctionTool`: a web tool's calls so far, a
    plug-in's scratch directory), released when the trajectory ends."""

    files: tuple[str, ...] = ()
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

    def add(self, other: ToolStats) -> None:
        """Count `other`'s figures here too (the pools of one process, added up)."""
        for counter in ("calls", "errors", "seconds", "bad_calls", "release_errors"):
            getattr(self, counter).update(getattr(other, counter))


def keeps_state(obj: Any) -> bool:
    """Whether `obj` (a tool's class or object) keeps per-trajectory state: it has `create` and
    `release` (see FunctionTool)."""
    return callable(getattr(obj, "create", None)) and callable(getattr(obj, "release", None))


class FunctionTool:
    """A Python function as a tool: what a plug-in's function or class becomes
    (`actors.function_tools.function_tool`: `FunctionTool(fn, name)`) and what each built-in is
    (a subclass naming its method: `class SearchTool(FunctionTool, method="search")`).

    Its schema comes from the function's signature and docstring (actors/tool_schema.py). A
    call's arguments, a JSON object (or the bare text, for a tool of one string parameter, as
    the tags format writes it), are validated against it strictly, as JSON (`"3"` is not an
    integer, an unknown key is refused): a call that does not fit runs nothing and its
    observation says what is wrong and what the tool takes (`ToolResult.bad_call`). Validated
    arguments are converted to the annotations (an Enum member, a model instance, a tuple) and
    the function called; what it returns is the observation (`as_result`). A sync function runs
    in a worker thread (`asyncio.to_thread`), so a slow one cannot stall the event loop every
    trajectory of the pool runs on; an async one is awaited on that loop.

    Per-trajectory state (a browser tab, a scratch directory, a web tool's calls so far) is kept
    by an object with `create()` and `release(state)` (a plug-in's class, or the subclass
    itself): `create` runs at a trajectory's first call of the tool, and what it returns is the
    first argument of every call of that trajectory (the schema is the parameters after it);
    `release(state)` runs when the trajectory ends, whether it answered, ran out of turns or
    raised (the agent loop releases in a `finally`: `TrajectoryContext.release`). A `create`
    that raises fails that call (an observation) and is tried again at the next; a `release`
    that raises is counted (`ToolStats.release_errors`). Each may be sync or async. Called
    outside an agent loop, a stateful tool creates and releases a state around each call.

    A subclass's tool is named after its method and its schema is made once, with the class:
    the class's `name`, `schema` and tags are read before any tool is made (the warm start's
    prompts)."""

    open_tag, close_tag = "<result>", "</result>"
    name: str
    schema: dict
    method: ClassVar[str | None] = None
    """A subclass's method that is the tool; None: the function the tool was made with."""
    _model: type[BaseModel]
    _args: Mapping[str, Any] = MappingProxyType({})

    def __init_subclass__(cls, method: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if method is None:
            return
        fn = getattr(cls, method)
        skip = 2 if keeps_state(cls) else 1  # self, and the state
        doc = inspect.getdoc(fn) or ""
        cls._model, description, parameters = describe(fn, method, {}, cls.__qualname__, doc, skip)
        cls.method, cls.name = method, method
        cls.schema = function_schema(method, description, parameters)

    def __init__(
        self,
        fn: Callable,
        name: str,
        args: Mapping[str, Any] | None = None,
        label: str | None = None,
        doc: str | None = None,
        owner: Any = None,
    ) -> None:
        """The tool `name` of `fn`, its `args` fixed (they leave the schema: an API key, a data
        path); `owner`: the object whose `create`/`release` keep its state, passed to `fn` first.
        `doc` describes it (`fn`'s docstring by default); `label` names it in a refusal
        (ToolDefinitionError, actors/tool_schema.py)."""
        self._fn, self._owner, self._args = fn, owner, dict(args or {})
        doc = (inspect.getdoc(fn) or "") if doc is None else doc
        skip = 0 if owner is None else 1
        self._model, description, parameters = describe(
            fn, name, self._args, label or name, doc, skip
        )
        self.name = name
        self.schema = function_schema(name, description, parameters)

    async def __call__(self, arguments: dict | str) -> ToolResult:
        if isinstance(arguments, str) and (parameter := string_parameter(self)) is not None:
            arguments = {parameter: arguments}
        if not isinstance(arguments, dict):
            return check_arguments(self, arguments) or ToolResult(False, "", bad_call=True)
        try:
            parsed = self._model.model_validate_json(json.dumps(arguments), strict=True)
        except ValidationError as exc:
            problems = [
                ".".join(str(p) for p in e["loc"]) + ": " + e["msg"] if e["loc"] else e["msg"]
                for e in exc.errors()
            ]
            return bad_call(self, problems)
        values = {key: getattr(parsed, key) for key in type(parsed).model_fields}
        values.update(self._args)
        fn, owner = self._target()
        if owner is None:
            return as_result(await run_either(fn, **values))
        context = CURRENT_TRAJECTORY.get()
        if context is None:  # outside an agent loop: a state around this call alone
            state = await run_either(owner.create)
            try:
                return as_result(await run_either(fn, state, **values))
            finally:
                await run_either(owner.release, state)
        key = id(self)
        if key not in context.states:
            state = await run_either(owner.create)
            context.states[key] = state
            release = owner.release
            context.releases.append((self.name, lambda: run_either(release, state)))
        return as_result(await run_either(fn, context.states[key], **values))

    def _target(self) -> tuple[Callable, Any]:
        """(the function a call runs, the object keeping its per-trajectory state or None)."""
        if self.method is None:
            return self._fn, self._owner
        return getattr(self, self.method), (self if keeps_state(self) else None)

    async def close(self) -> None:
        """The function's object's own `close`, if it has one (a plug-in's shared browser, a
        connection). A built-in with something to close overrides this."""
        if self.method is not None:
            return
        owner = self._owner or getattr(self._fn, "__self__", None)
        close = getattr(owner, "close", None)
        if callable(close):
            result = close()
            if inspect.isawaitable(result):
                await result


async def run_either(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`: awaited on this loop when it is async, else in a worker thread."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await asyncio.to_thread(fn, *args, **kwargs)
    return await result if inspect.isawaitable(result) else result


def as_result(value: Any) -> ToolResult:
    """A function's return value as the observation: a str as it is, a ToolResult as it is (how
    a function reports a failure), None as "", a pydantic model or anything else as JSON."""
    if isinstance(value, ToolResult):
        return value
    if value is None:
        return ToolResult(True, "")
    if isinstance(value, str):
        return ToolResult(True, value)
    if isinstance(value, BaseModel):
        return ToolResult(True, value.model_dump_json())
    try:
        return ToolResult(True, json.dumps(value, ensure_ascii=False, default=str))
    except ValueError:  # circular
        return ToolResult(True, str(value))


class SearchTool(FunctionTool, method="search"):
    """`search`: the retrieval server's top passages for the query."""

    open_tag, close_tag = "<information>", "</information>"

    def __init__(self, client: RetrievalClient, topk: int = 3) -> None:
        self.client = client
        self.topk = topk

    async def search(self, query: str) -> ToolResult:
        """Search the knowledge base; returns the top passages for the query.

        Args:
            query: What to search for.
        """
        query = " ".join(query.split())[:MAX_QUERY_CHARS]
        if not query:
            return ToolResult(False, "Empty search query.")
        try:
            hits = await self.client.search(query, self.topk)
        except RetrievalError as exc:
            return ToolResult(False, f"Search failed: {exc}")
        return ToolResult(True, format_passages([passage for passage, _ in hits]))

    async def close(self) -> None:
        await self.client.close()


SEARCH_SCHEMA = SearchTool.schema


class PythonTool(FunctionTool, method="python"):
    """`python`: what the code prints, run in the sandbox (actors/sandbox.py) with the
    question's attached files in its working directory."""

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

    async def python(self, code: str) -> ToolResult:
        """Run Python code in a sandbox; returns what it prints.

        Args:
            code: The program to run.
        """
        result = await run_python(
            code.strip(),
            self.timeout_s,
            memory_mb=self.memory_mb,
            max_output_chars=self.max_output_chars,
            isolation=self.isolation,
            files=trajectory().files,
        )
        return ToolResult(result.ok, result.output)


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
