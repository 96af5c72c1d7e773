"""A tool's parameters from a Python signature and docstring: a strict pydantic model of them
(what a call's arguments are validated with) and its JSON schema (what chat templates take, the
`parameters` of OpenAI's function format).

One property per parameter, typed from its annotation (str, int, float, bool, lists, tuples,
dicts, `X | None`, `Literal[...]` and Enums as `enum`, pydantic models and dataclasses as
objects); the required ones are those without a default; no other key is allowed
(`additionalProperties: false`). The description is the docstring's text before its sections,
each parameter's the docstring's line for it (Google's `Args:` block or Sphinx's
`:param name:`). Every parameter needs an annotation; `*args`, `**kwargs` and positional-only
parameters are refused, one line (ToolDefinitionError), when the tool is made.

It imports nothing of Strata's: the tool contract (actors/tools.py) builds every Python tool's
schema here, and MCP's tools (actors/mcp_tools.py) read their servers' docstrings and schemas
with it.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model

TOOL_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
"""A tool's name: what a chat template's function name allows, and a tag the tags format can
write (`<name> ... </name>`)."""


class ToolDefinitionError(ValueError):
    """A function or class that cannot be a tool; the message is one line."""


def describe(
    fn: Callable, name: str, args: dict, label: str, doc: str, skip: int = 0
) -> tuple[type[BaseModel], str, dict]:
    """(the arguments' model, the description, the parameters' JSON schema) of `fn` as the tool
    `name`: its parameters less the first `skip` and those `args` fixes, described by `doc`.
    ToolDefinitionError (one line, starting with `label`) when it cannot be a tool."""
    if not TOOL_NAME.match(name or ""):
        raise ToolDefinitionError(
            f"{label}: tool name {name!r} must be a letter then up to 63 letters, digits, _ or -"
        )
    description, about = parse_docstring(doc)
    model = arguments_model(fn, name, args, label, skip)
    parameters = clean_schema(model.model_json_schema())
    for key, prop in parameters.get("properties", {}).items():
        if key in about and "description" not in prop:
            prop["description"] = about[key]
    return model, description or name, parameters


def arguments_model(fn: Callable, name: str, args: dict, label: str, skip: int) -> type[BaseModel]:
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
