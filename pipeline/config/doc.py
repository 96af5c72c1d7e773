"""`python -m pipeline.config_doc > docs/config.md`: the config reference, made from the schema.

Every key of `pipeline.config.schema` with its default, its constraints and its docstring, section by
section; a backend union lists each variant under its `type`. A test checks that docs/config.md is
what this prints, so the reference cannot drift from the code.
"""

from __future__ import annotations

import sys
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from pipeline.config.loader import model_classes
from pipeline.config.schema import StrataConfig


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        made = field.default_factory()
        return "(section)" if isinstance(made, BaseModel) else f"`{made!r}`"
    if field.is_required():
        return "required"
    return f"`{field.default!r}`"


def _constraints(field: FieldInfo) -> str:
    parts = []
    for item in field.metadata:
        for name, symbol in (
            ("gt", ">"),
            ("ge", ">="),
            ("lt", "<"),
            ("le", "<="),
            ("min_length", "length >="),
        ):
            value = getattr(item, name, None)
            if value is not None:
                parts.append(f"{symbol} {value}")
    annotation = str(field.annotation).replace("typing.", "")
    if "Literal" in annotation:
        parts.append("one of " + annotation[annotation.index("[") + 1 : annotation.rindex("]")])
    return ", ".join(parts)


def _rows(model: type[BaseModel], prefix: str, out: list[str], sections: list) -> None:
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        members = model_classes(field.annotation)
        doc = " ".join((field.description or "").split())
        row = f"| `{key}` | {_default(field)} | {_constraints(field)} | {doc} |"
        if members:
            if _takes_more_than_sections(field.annotation):  # a name or a list of them too
                out.append(row)
            sections.append((key, members, doc))
            continue
        out.append(row)


def _takes_more_than_sections(annotation: Any) -> bool:
    """Whether a field whose annotation holds sections also takes other values (a string, a
    list): then it has a row of its own beside their sections."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _takes_more_than_sections(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return any(_takes_more_than_sections(arg) for arg in typing.get_args(annotation))
    return not (isinstance(annotation, type) and issubclass(annotation, BaseModel))


def _label(member: type[BaseModel]) -> str:
    """How a section of a union is told from the others: its `type`, else its first required
    key (`{url: ...}`)."""
    tag = member.model_fields.get("type")
    if tag is not None:
        return f"type: {'a plug-in' if tag.is_required() else tag.default}"
    required = [name for name, f in member.model_fields.items() if f.is_required()]
    return f"{{{required[0]}: ...}}" if required else member.__name__


def render() -> str:
    lines = [
        "# Config reference",
        "",
        "Made by `python -m pipeline.config_doc > docs/config.md` from `pipeline/config/schema.py`; a test",
        "keeps the two the same. Set any key in a YAML file or with `--set dotted.key=value`.",
        "",
    ]
    queue: list[tuple[str, list[type[BaseModel]], str]] = []
    _rows(StrataConfig, "", [], queue)
    while queue:
        key, members, doc = queue.pop(0)
        for member in members:
            variant = f" (`{_label(member)}`)" if len(members) > 1 else ""
            lines += [f"## `{key}`{variant}", ""]
            about = " ".join((member.__doc__ or "").split()) if len(members) > 1 else doc
            if about:
                lines += [about, ""]
            rows: list[str] = []
            nested: list[Any] = []
            _rows(member, f"{key}.", rows, nested)
            if rows:
                lines += [
                    "| key | default | constraint | what it does |",
                    "|---|---|---|---|",
                    *rows,
                    "",
                ]
            queue[:0] = nested
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
