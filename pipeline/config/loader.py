"""Read a YAML config, apply `--set` overrides, validate, and explain failures in one line.

Every failure is a `ConfigError` whose message names where the problem is (the file, or the
`--set` that introduced it), the dotted key, the offending value and the constraint it breaks.
"""

from __future__ import annotations

import difflib
import os
import re
import tempfile
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from pipeline.config.base import shown
from pipeline.config.overrides import OverrideError, apply_override, parse_override
from pipeline.config.schema import StrataConfig


class ConfigError(ValueError):
    """A config problem a user can fix; the message is one line: characters that would break it
    (a newline in a key or a --set) are shown escaped."""

    def __init__(self, message: str) -> None:
        super().__init__("".join(c if c.isprintable() else repr(c)[1:-1] for c in message))


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-6` as a float (YAML 1.1 wants `1.0e-6`)."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        # PyYAML's scalar constructors let out what int(), datetime() or a dict lookup raise on
        # a value that does not fit its tag (`!!int abc`, `!!bool x`, `!!timestamp x`, a number
        # of 4300+ digits): make it a YAML error at the value's line.
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, AttributeError, LookupError):
            tag = node.tag.rpartition(":")[2]
            value = shown(node.value) if isinstance(node.value, str) else "this value"
            problem = f"cannot read {value} as !!{tag}"
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from None


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The YAML mapping in `path` ({} for an empty file)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"config file not found: {p} (pass the path of a YAML config, e.g. configs/local.yaml)"
        )
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a UTF-8 text file") from None
    except RecursionError:
        raise ConfigError(f"{p}: invalid YAML: nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{p}: the top level must be a mapping of sections, got {type(data).__name__}"
        )
    return data


def model_classes(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold (unwrapping Annotated, unions and Optional)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return model_classes(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in model_classes(arg)]
    return []


def _section_model(raw: dict[str, Any], parts: Sequence[str]) -> type[BaseModel] | None:
    """The model class that validates the section at `parts` (a union picks by the raw `type`)."""
    model: type[BaseModel] = StrataConfig
    node: Any = raw
    for part in parts:
        field = model.model_fields.get(part)
        node = node.get(part) if isinstance(node, dict) else None
        candidates = model_classes(field.annotation) if field else []
        if not candidates:
            return None
        chosen = candidates[0]
        if len(candidates) > 1 and isinstance(node, dict) and "type" in node:
            for candidate in candidates:
                tag = candidate.model_fields.get("type")
                if tag is not None and tag.default == node["type"]:
                    chosen = candidate
        model = chosen
    return model


def _union_members(raw: dict[str, Any], parent: str) -> list[type[BaseModel]]:
    """The backends of the union at `parent` (none when it is not a union)."""
    if not parent:
        return []
    *above, name = parent.split(".")
    holder = _section_model(raw, above)
    field = holder.model_fields.get(name) if holder is not None else None
    members = model_classes(field.annotation) if field is not None else []
    return members if len(members) > 1 else []


def _other_members_with(raw: dict[str, Any], parent: str, leaf: str) -> list[str]:
    """The `type`s of the other backends of the union at `parent` that have key `leaf`."""
    members = _union_members(raw, parent)
    return [m.model_fields["type"].default for m in members if leaf in m.model_fields]


def _close_in_other_members(raw: dict[str, Any], parent: str, leaf: str) -> tuple[str, str] | None:
    """(key, type) of the closest key to `leaf` among the other backends of the union at `parent`."""
    owner = {
        k: m.model_fields["type"].default
        for m in _union_members(raw, parent)
        for k in m.model_fields
        if k != "type"
    }
    close = difflib.get_close_matches(leaf, list(owner), n=1)
    return (close[0], owner[close[0]]) if close else None


def _union_tags(model: type[BaseModel] = StrataConfig) -> set[str]:
    """Every `type` tag of every backend union in the schema (pydantic puts them into error locations)."""
    tags: set[str] = set()
    for field in model.model_fields.values():
        members = model_classes(field.annotation)
        for member in members:
            tag = member.model_fields.get("type")
            if len(members) > 1 and tag is not None and isinstance(tag.default, str):
                tags.add(tag.default)
            tags |= _union_tags(member)
    return tags


_TAGS = _union_tags()


def _dotted(raw: dict[str, Any], loc: Sequence[Any]) -> tuple[str, Any]:
    """Dotted key and the raw value there (None if absent) for a pydantic error location."""
    parts: list[str] = []
    node: Any = raw
    for part in loc:
        if (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        ):
            node = node[part]
        elif isinstance(node, dict) and part in _TAGS:
            continue  # a union's tag, not a key the user wrote
        else:
            node = None
        parts.append(f"[{part}]" if isinstance(part, int) else str(part))
    return ".".join(parts).replace(".[", "["), node


def _describe(error: dict[str, Any], raw: dict[str, Any], origin: str) -> str:
    dotted, value = _dotted(raw, error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    message = message[:1].lower() + message[1:]
    if error["type"] == "extra_forbidden":
        parent, _, leaf = dotted.rpartition(".")
        model = _section_model(raw, parent.split(".") if parent else [])
        hint = ""
        owners = _other_members_with(raw, parent, leaf)
        if model is not None and owners:
            kind = model.model_fields["type"].default
            return (
                f"{origin}: {dotted} does not act for {parent}.type {kind} (it is a key of "
                f"{', '.join(owners)}): remove it, or give the whole section, e.g. "
                f"--set '{parent}={{type: {kind}}}'"
            )
        if model is not None:
            valid = list(model.model_fields)
            close = difflib.get_close_matches(leaf, valid, n=1)
            where = f" in {parent}" if parent else ""
            prefix = f"{parent}." if parent else ""
            hint = (
                f" (did you mean '{prefix}{close[0]}'?)"
                if close
                else f" (valid keys{where}: {', '.join(valid)})"
            )
            elsewhere = _close_in_other_members(raw, parent, leaf) if not close else None
            if elsewhere:
                key, kind = elsewhere
                hint = f" (did you mean '{prefix}{key}'? it is a key of {parent}.type {kind})"
        return f"{origin}: unknown key '{dotted}'{hint}"
    if error["type"] == "union_tag_invalid":
        expected = error.get("ctx", {}).get("expected_tags", "")
        return (
            f"{origin}: {dotted}.type = {error.get('ctx', {}).get('tag')!r}: use one of {expected}"
        )
    if error["type"] == "union_tag_not_found":
        return f"{origin}: {dotted} = {shown(value)}: must be a section (key: value lines)"
    if error["type"] == "missing":
        return f"{origin}: {dotted} is required but missing"
    if not dotted:
        return f"{origin}: {message}"
    if isinstance(value, dict) or value is None:
        return f"{origin}: {dotted}: {message}"
    return f"{origin}: {dotted} = {shown(value)}: {message}"


def _names(key: str, dotted: str) -> bool:
    """Whether the override `key` set the value at `dotted` (or inside the section it names)."""
    if dotted == key or dotted.startswith(key + "."):
        return True
    if dotted and key.startswith(dotted + "."):
        return True  # a section-level check on a section the override changed
    section, _, leaf = key.rpartition(".")
    return leaf == "type" and dotted.startswith(section + ".")  # the override chose the backend


def validate(
    raw: dict[str, Any], source: str, overrides: dict[str, str] | None = None
) -> StrataConfig:
    """Validate a raw mapping; the first problem becomes a one-line `ConfigError`."""
    overrides = overrides or {}
    try:
        return StrataConfig.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        dotted = _dotted(raw, first["loc"])[0]
        origin = source
        for key, text in overrides.items():
            if _names(key, dotted):
                origin = f"{source} (--set {text})"
        line = _describe(first, raw, origin)
        if len(errors) > 1:
            line += f" [and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''}]"
        raise ConfigError(line) from None


def load_config(
    path: str | os.PathLike[str], overrides: Sequence[str] = (), notes: list[str] | None = None
) -> StrataConfig:
    """The validated config in `path` with `--set` overrides applied in order. A `--set` that
    changes a backend section's `type` starts that section from the new type's defaults: the
    file's keys there that the new type does not have are dropped (keys given by --set stay),
    and `notes` gets one line saying which. So does a `--set` of an engine's `urls`: the file's
    settings of servers the launcher would start are dropped (see `_switch_to_urls`)."""
    raw = read_yaml(path)
    applied: dict[str, str] = {}
    for text in overrides:
        try:
            key, value = parse_override(text)
            note = _switch_type(raw, key, value, applied, text, str(path))
            note = note or _switch_to_urls(raw, key, value, applied, text, str(path))
            apply_override(raw, key, value)
        except OverrideError as exc:
            raise ConfigError(str(exc)) from None
        if note is not None and notes is not None:
            notes.append(note)
        applied[key] = text
    return validate(raw, str(path), applied)


def _node_at(raw: dict[str, Any], parts: Sequence[str]) -> dict[str, Any] | None:
    """The raw section at `parts`, or None when there is none."""
    node: Any = raw
    for part in parts:
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _drop_file_keys(
    node: dict[str, Any], section: str, keys: list[str], applied: dict[str, str]
) -> str | None:
    """Delete `keys` of the raw `section` except those an earlier --set gave; the dropped ones
    as "section.key, ..." (None if none)."""
    dropped = [k for k in keys if f"{section}.{k}" not in applied]
    for name in dropped:
        del node[name]
    return ", ".join(f"{section}.{k}" for k in dropped) if dropped else None


def _switch_to_urls(
    raw: dict[str, Any], key: str, value: Any, applied: dict[str, str], text: str, source: str
) -> str | None:
    """Before `--set SECTION.urls=[...]` on a server engine: the servers are running elsewhere, so
    the file's settings of servers the launcher would start (`STARTED_ONLY`) are dropped (those
    an earlier --set gave stay, and validation refuses them), and said."""
    section, _, leaf = key.rpartition(".")
    if leaf != "urls" or not section or not value:
        return None
    started = getattr(_section_model(raw, section.split(".")), "STARTED_ONLY", ())
    node = _node_at(raw, section.split("."))
    if not started or node is None:
        return None
    keys = _drop_file_keys(node, section, [k for k in started if k in node], applied)
    if keys is None:
        return None
    return (
        f"--set {text}: the servers run elsewhere, so the launcher starts none; dropped {keys} "
        f"(settings of started servers) from {source}"
    )


def _switch_type(
    raw: dict[str, Any], key: str, value: Any, applied: dict[str, str], text: str, source: str
) -> str | None:
    """Before `--set SECTION.type=VALUE` is applied: if it changes the section's backend, drop
    the file's keys of that section the new backend does not have (those an earlier --set gave
    stay), and say so."""
    section, _, leaf = key.rpartition(".")
    if leaf != "type" or not section:
        return None
    parts = section.split(".")
    parent = _section_model(raw, parts[:-1])
    field = parent.model_fields.get(parts[-1]) if parent is not None else None
    if field is None or len(model_classes(field.annotation)) < 2:
        return None  # a plain `type` field (data.type): the section's keys hold for every value
    node = _node_at(raw, parts)
    if node is None:
        return None
    model = _section_model(raw, parts)
    tag = model.model_fields.get("type") if model is not None else None
    current = node.get("type", tag.default if tag is not None else None)
    if current == value:
        return None
    chosen = [m for m in model_classes(field.annotation) if m.model_fields["type"].default == value]
    accepted = (
        set(chosen[0].model_fields) if chosen else set()
    )  # an unknown type: validation says so
    keys = _drop_file_keys(node, section, [k for k in node if k not in accepted], applied)
    if keys is None:
        return None
    return (
        f"--set {text}: {section} starts from the {value} defaults; dropped {keys} "
        f"(of the {current} backend, not of {value}) from {source}"
    )


def dump_config(config: StrataConfig, notes: Sequence[str] = ()) -> str:
    """The fully resolved config (defaults included) as YAML that `load_config` reads back;
    `notes` go first, as comments."""
    text = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, default_flow_style=False)
    return "".join(f"# note: {note}\n" for note in notes) + text


def write_resolved_config(
    config: StrataConfig, run_dir: str | os.PathLike[str], notes: Sequence[str] = ()
) -> Path:
    """Write `run_dir/config.yaml` atomically (temporary file, then rename)."""
    target = Path(run_dir) / "config.yaml"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".config.", suffix=".yaml", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(dump_config(config, notes))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
