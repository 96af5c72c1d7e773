'''Plain Python functions (and classes) as tools: what a plug-in's `actors.tools` entry names.

    def lookup(word: str, language: Literal["en", "fr"] = "en") -> str:
        """Look a word up in the dictionary.

        Args:
            word: The word to look up.
            language: Which dictionary.
        """

`function_tool(lookup)` is a tool named `lookup`: a `FunctionTool` (actors/tools.py), the base
the built-in tools are written on too. Its schema, in OpenAI's function format as chat templates
take it, comes from the signature and the docstring (actors/tool_schema.py says how); a call's
arguments are validated against it strictly, and a call that does not fit runs nothing: its
observation says what is wrong and what the tool takes, counted as the tool's error
(`ToolStats.bad_calls`). What the function returns is the observation: a str as it is, a
`ToolResult` as it is (how a function reports a failure), None as "", anything else as JSON. A
function that raises is a failed observation too (`actors.tools.call_tool`).

A sync function runs in a worker thread, an async one on the event loop; either sees the calling
trajectory through `actors.tools.trajectory()`. Trajectories call a tool concurrently: a sync one
must be thread-safe, and the loop's default executor runs min(32, CPUs + 4) such calls at once
(the others wait their turn); nothing bounds a call's time but the function itself.

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
trajectory ends, however it ends (`FunctionTool` says the rest). The tool's name: `name` given,
else the class's `name` attribute, else the class name; its description: `__call__`'s
docstring, else the class's.
'''

from __future__ import annotations

import inspect
from typing import Any

from actors.tool_schema import ToolDefinitionError
from actors.tools import FunctionTool, keeps_state


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
    fn = obj if inspect.isfunction(obj) or inspect.ismethod(obj) else obj.__call__
    doc = inspect.getdoc(fn) or ("" if fn is obj else inspect.getdoc(type(obj))) or ""
    return FunctionTool(fn, name, args, label, doc, obj if keeps_state(obj) else None)
