"""`--set dotted.key=value` overrides: typed value parsing and application to a raw config dict."""

from __future__ import annotations

import re
from typing import Any

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class OverrideError(ValueError):
    """An override that cannot be parsed or applied; the message is one line for the user."""


def _split_top_level(body: str) -> list[str]:
    """Split on commas that are not inside brackets or quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(body):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return parts


def parse_value(text: str) -> Any:
    """Typed value of an override: int, float, bool, null, `[a, b]` lists, `{key: value, ...}`
    sections (a whole section at once), quoted or bare strings."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.startswith("[") and text.endswith("]"):
        body = text[1:-1].strip()
        return [parse_value(part) for part in _split_top_level(body)] if body else []
    if text.startswith("{") and text.endswith("}"):
        section: dict[str, Any] = {}
        body = text[1:-1].strip()
        for part in _split_top_level(body) if body else []:
            key, sep, value = part.partition(": ")  # as in YAML: a colon and a space
            if not sep or not _KEY.fullmatch(key.strip()) or "." in key:
                raise OverrideError(f"expected {{key: value, ...}}, got {part.strip()!r}")
            section[key.strip()] = parse_value(value)
        return section
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "~"):  # as in YAML; "none" stays a word (learner.importance.type=none)
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_override(text: str) -> tuple[str, Any]:
    """`learner.advantage.alpha=0.8` -> ("learner.advantage.alpha", 0.8)."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not _KEY.fullmatch(key):
        raise OverrideError(
            f"--set {text!r}: expected dotted.key=value, e.g. --set learner.advantage.alpha=0.8"
        )
    try:
        return key, parse_value(value)
    except OverrideError as exc:
        raise OverrideError(f"--set {text!r}: {exc}") from None
    except RecursionError:
        raise OverrideError(f"--set {text!r}: brackets nested too deeply") from None


def apply_override(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set `raw[a][b][c] = value` for key `a.b.c`, creating sections that are absent."""
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            prefix = ".".join(parts[: depth + 1])
            raise OverrideError(f"--set {key}=...: {prefix!r} is a value, not a section")
        node = child
    node[parts[-1]] = value
