'''Plain Python functions as tools: the schema from the signature, each call checked against it.

    def lookup(word: str, language: Literal["en", "fr"] = "en") -> str:
        """Look a word up in the dictionary.

        Args:
            word: The word to look up.
            language: Which dictionary.
        """

`function_tool(lookup)` is a tool (the contract: actors/tools.py) named `lookup`. Its schema, in
OpenAI's function format as chat templates take it, comes from the signature: one property per
parameter, typed from its annotation (str, int, float, bool, lists, tuples, dicts, `X | None`,
`Literal[...]` and Enums as `enum`, pydantic models and dataclasses as objects); the required
ones are those without a default; the description is the docstring's text before its sections,
each parameter's the docstring's line for it (Google's `Args:` block or Sphinx's
`:param name:`). Every parameter needs an annotation; `*args`, `**kwargs` and positional-only
parameters are refused, one line, when the tool is made.

A call's arguments, a JSON object, are validated against that schema strictly, as JSON (`"3"` is
not an integer, an unknown key is refused): a call that does not fit runs nothing and its
observation says what is wrong and what the tool takes, counted as the tool's error
(`ToolStats.bad_calls`). Validated arguments are converted to the annotations (an Enum member, a
model instance, a tuple) and the function called. What it returns is the observation: a str as
it is, a `ToolResult` as it is (how a function reports a failure), None as "", anything else as
JSON. A function that raises is a failed observation too (`actors.tools.call_tool`).

A sync function runs in a worker thread (`asyncio.to_thread`), so a slow one cannot stall the
event loop every trajectory of the pool runs on; an async one is awaited on that loop. Either sees
the calling trajectory through `actors.tools.trajectory()`. Trajectories call a tool concurrently:
a sync one must be thread-safe, and the loop's default executor runs min(32, CPUs + 4) such calls
at once (the others wait their turn); nothing bounds a call's time but the function itself.

`args` (a config's `{fn: ..., args: {...}}`) are fixed keyword arguments: an API key, a data
path. They leave the schema, so the model never sees or sets them. For a class they are its
constructor's arguments.

Per-trajectory state (a browser tab, a scratch directory) is a class with `create` and `release`:

    class Scratch:
        """Files of the trajectory's own."""

        def __init__(self, root: str = "/tmp") -> None: ...   # once per process: `args`
        def create(self) -> Path: ...                         # the state
        def release(self, state: Path) -> None: ...
        def __call__(self, state: Path, name: str, text: str | None = None) -> str:
            """Read a file, or write it when text is given. Args: ..."""

The instance is shared by every trajectory of the process. `create()` runs at a trajectory's
first call of the tool and its result is handed to every call of that trajectory as the first
argument of `__call__` (the schema is the parameters after it); `release(state)` runs when the
trajectory ends, whether it answered, ran out of turns or raised (the agent loop releases in a
`finally`). A `create` that raises fails that call (an observation) and is tried again at the
next; a `release` that raises is counted (`ToolStats.release_errors`). Each of the three may be
sync (a worker thread) or async. Called outside an agent loop, a stateful tool creates and
releases a state around each call. The tool's name: `name` given, else the class's `name`
attribute, else the class name; its description: `__call__`'s docstring, else the class's.
'''

from __future__ import annotations

import asyncio
import inspect
import json
import re
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from actors.tools import (
    CURRENT_TRAJECTORY,
    ToolResult,
    bad_call,
    check_arguments,
    function_schema,
)

TOOL_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
"""A tool's name: what a chat template's function name allows, and a tag the tags format can
write (`<name> ... </name>`)."""


class ToolDefinitionError(ValueError):
    """A function or class that cannot be a tool; the message is one line."""


def function_tool(obj: Any, name: str | None = None, args: dict | None = None):
    """The tool `obj` makes: a function (sync or async), a class with `__call__` (made with
    `args`; with `create`/`release`, a per-trajectory state), an instance of one, or an object
    that is already a tool (it has a `schema`), given back as it is (a class of those: made with
    `args`). ToolDefinitionError (one line) when it cannot be one."""
    args = dict(args or {})
    label = getattr(obj, "__qualname__", None) or type(obj).__name__
    if inspect.isclass(obj):
        try:
            instance = obj(**args)
        except Exception as exc:
            raise ToolDefinitionError(
                f"{label}({_kwargs(args)}) failed: {type(exc).__name__}: {exc}"
            ) from None
        name = name or getattr(obj, "name", None) or obj.__name__
        if hasattr(instance, "schema"):
            return _named(instance, name, label)
        return _from_callable(instance, name, {}, label)
    if hasattr(obj, "schema") and callable(obj):
        if args:
            raise ToolDefinitionError(f"{label} is made already: it takes no args")
        return _named(obj, name or obj.name, label)
    if not callable(obj):
        raise ToolDefinitionError(f"{label} is not callable: a tool is a function or a class")
    if args and not (inspect.isfunction(obj) or inspect.ismethod(obj)):
        raise ToolDefinitionError(f"{label} is made already: it takes no args")
    name = name or getattr(obj, "name", None) or getattr(obj, "__name__", None)
    return _from_callable(obj, name or type(obj).__name__, args, label)


def _named(tool, name: str, label: str):
    if tool.name != name:
        raise ToolDefinitionError(
            f"{label} is a tool named {tool.name!r}; it cannot be renamed {name!r}"
        )
    return tool


def _kwargs(args: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items())


def _from_callable(obj: Any, name: str, args: dict, label: str) -> FunctionTool:
    stateful = callable(getattr(obj, "create", None)) and callable(getattr(obj, "release", None))
    fn = obj if inspect.isfunction(obj) or inspect.ismethod(obj) else obj.__call__
    skip = 1 if stateful else 0  # the state, handed to every call
    doc = inspect.getdoc(fn) or ("" if fn is obj else inspect.getdoc(type(obj))) or ""
    return FunctionTool(fn, name, args, label, doc, skip, obj if stateful else None)


class FunctionTool:
    """A function (or a stateful class's `__call__`) as a tool; see the module doc."""

    open_tag, close_tag = "<result>", "</result>"

    def __init__(
        self,
        fn: Callable,
        name: str,
        args: dict,
        label: str,
        doc: str,
        skip: int = 0,
        stateful: Any = None,
    ) -> None:
        if not TOOL_NAME.match(name or ""):
            raise ToolDefinitionError(
                f"{label}: tool name {name!r} must be a letter then up to 63 letters, digits, "
                "_ or -"
            )
        self.name = name
        self._fn = fn
        self._args = args
        self._stateful = stateful
        description, about = parse_docstring(doc)
        self._model = _arguments_model(fn, name, args, label, skip)
        parameters = clean_schema(self._model.model_json_schema())
        for key, prop in parameters.get("properties", {}).items():
            if key in about and "description" not in prop:
                prop["description"] = about[key]
        self.schema = function_schema(name, description or name, parameters)

    async def __call__(self, arguments: dict) -> ToolResult:
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
        if self._stateful is None:
            return as_result(await self._run(self._fn, **values))
        context = CURRENT_TRAJECTORY.get()
        if context is None:  # outside an agent loop: a state around this call alone
            state = await self._run(self._stateful.create)
            try:
                return as_result(await self._run(self._fn, state, **values))
            finally:
                await self._run(self._stateful.release, state)
        key = id(self)
        if key not in context.states:
            state = await self._run(self._stateful.create)
            context.states[key] = state
            release = self._stateful.release
            context.releases.append((self.name, lambda: self._run(release, state)))
        return as_result(await self._run(self._fn, context.states[key], **values))

    async def _run(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        result = await asyncio.to_thread(fn, *args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    async def close(self) -> None:
        """The tool object's own `close`, if it has one (a shared browser, a connection)."""
        owner = self._stateful or getattr(self._fn, "__self__", None)
        close = getattr(owner, "close", None)
        if callable(close):
            result = close()
            if inspect.isawaitable(result):
                await result


def as_result(value: Any) -> ToolResult:
    """A function's return value as the observation (see the module doc)."""
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


def _arguments_model(fn: Callable, name: str, args: dict, label: str, skip: int) -> type[BaseModel]:
    """A pydantic model of `fn`'s parameters (strict, no unknown keys), less the first `skip`
    and those `args` fixes."""
    try:
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:  # a forward reference that does not resolve, a builtin
        raise ToolDefinitionError(
            f"{label}: its signature cannot be read: {type(exc).__name__}: {exc}"
        ) from None
    parameters = list(signature.parameters.values())[skip:]
    unknown = sorted(set(args) - {p.name for p in parameters})
    if unknown:
        raise ToolDefinitionError(f"{label} has no parameter {', '.join(unknown)} (args)")
    fields: dict[str, Any] = {}
    for p in parameters:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ToolDefinitionError(
                f"{label}: *{p.name} cannot be described by a schema; name each parameter"
            )
        if p.kind is p.POSITIONAL_ONLY:
            raise ToolDefinitionError(
                f"{label}: parameter {p.name} is positional-only; a tool is called by keyword"
            )
        if p.name in args:
            continue
        if p.name not in hints:
            raise ToolDefinitionError(
                f"{label}: parameter {p.name} has no type annotation (the schema is made of them)"
            )
        default = ... if p.default is p.empty else p.default
        fields[p.name] = (hints[p.name], default)
    try:
        model = create_model(f"{name}_arguments", __config__=ConfigDict(extra="forbid"), **fields)
        model.model_json_schema()
    except Exception as exc:  # an annotation pydantic cannot describe
        raise ToolDefinitionError(
            f"{label}: its parameters cannot be described as JSON: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0]}"
        ) from None
    return model


def clean_schema(schema: dict) -> dict:
    """pydantic's JSON schema as a tool's parameters: no titles, references inlined where they
    do not recurse (what chat models read best)."""
    defs = schema.pop("$defs", {})

    def walk(node: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [walk(n, seen) for n in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/") and ref[8:] in defs and ref[8:] not in seen:
            inlined = {**defs[ref[8:]], **{k: v for k, v in node.items() if k != "$ref"}}
            return walk(inlined, (*seen, ref[8:]))
        out = {}
        for key, value in node.items():
            if key == "title" and isinstance(value, str):
                continue
            if key in ("properties", "$defs") and isinstance(value, dict):
                out[key] = {k: walk(v, seen) for k, v in value.items()}
            else:
                out[key] = walk(value, seen)
        return out

    cleaned = walk(schema, ())
    recursive = {
        k: walk(v, (k,)) for k, v in defs.items() if f'"#/$defs/{k}"' in json.dumps(cleaned)
    }
    if recursive:
        cleaned["$defs"] = recursive
    return cleaned


_SECTION = re.compile(
    r"^(Args|Arguments|Parameters|Params|Keyword Args|Returns?|Yields?|Raises|Examples?|Notes?"
    r"|Attributes|See Also|Warnings?)\s*:?\s*$"
)
_GOOGLE_PARAM = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SPHINX_PARAM = re.compile(r"^:param\s+(?:[^:]*\s)?\*{0,2}(\w+)\s*:\s*(.*)$")
_SPHINX_FIELD = re.compile(r"^:\w+")


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(the description, {parameter: its line}) of a docstring: the text before the first
    section, and the parameters of a Google `Args:` block or Sphinx `:param name:` lines
    (continuation lines joined)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    description: list[str] = []
    about: dict[str, str] = {}
    section = None  # None: the description; "args": a Google Args block; "other"
    indent = None
    current = None
    for line in lines:
        stripped = line.strip()
        header = _SECTION.match(stripped) if not line[:1].isspace() else None
        if header:
            section = (
                "args" if header[1] in ("Args", "Arguments", "Parameters", "Params") else "other"
            )
            indent, current = None, None
            continue
        sphinx = _SPHINX_PARAM.match(stripped)
        if sphinx and not line[:1].isspace():
            section, current = "sphinx", sphinx[1]
            about[current] = sphinx[2].strip()
            continue
        if _SPHINX_FIELD.match(stripped) and not line[:1].isspace():
            section, current = "other", None
            continue
        if section is None:
            description.append(stripped)
        elif section == "args" and stripped and not set(stripped) <= {"-"}:
            width = len(line) - len(line.lstrip())
            match = _GOOGLE_PARAM.match(stripped)
            if match and (indent is None or width <= indent):
                indent, current = width, match[1]
                about[current] = match[2].strip()
            elif current is not None:
                about[current] = f"{about[current]} {stripped}".strip()
        elif section == "sphinx" and stripped and current is not None:
            about[current] = f"{about[current]} {stripped}".strip()
    text = " ".join(" ".join(description).split())
    return text, {k: " ".join(v.split()) for k, v in about.items() if v}
