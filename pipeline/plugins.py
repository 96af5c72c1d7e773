"""Plug-ins: a config names a tool, a reward, a dataset loader, a stratifier, an advantage
estimator or an agent by a registered name or by an import string, and `resolve` finds it.

    search                      a built-in name (the kind's own registry, where it already lives)
    my_tool                     a name an installed package adds through the entry-point group
                                `strata.tools` (`strata.rewards`, `strata.datasets`, ...)
    my_pkg.tools:lookup         an import string: module, then the attribute (dots go deeper)
    plugins/tools.py:lookup     the same from a file, relative to the current directory

Built-ins come first: an entry point of the same name is shadowed (and `available` says so). A
name that is none of these, an import that fails, an entry point that does not load: each is a
`PluginError` of one line saying what, where and what to do. Nothing here knows what a tool or a
reward is: the caller checks the object it gets (pipeline/ wires, actors/ never imports this).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.formats import BUILTIN_TOOLS
from actors.rewards import REWARDS
from buffers.strata import STRATIFIERS

KINDS = ("tools", "rewards", "datasets", "stratifiers", "estimators", "agents")
"""The kinds of plug-in; kind K's entry points are the group `strata.K`."""
SINGULAR = {
    "tools": "tool",
    "rewards": "reward",
    "datasets": "dataset loader",
    "stratifiers": "stratifier",
    "estimators": "advantage estimator",
    "agents": "agent",
}


class PluginError(ValueError):
    """A plug-in that cannot be had; the message is one line."""


REGISTERED: dict[str, dict[str, Any]] = {"tools": {}, "datasets": {}}
"""The built-ins of the kinds whose registries live in pipeline/ (which imports this module):
each registers its own (`register_builtins`), so nothing here imports them. A name is known
before its object is (None until the owner is imported): a config names it without torch."""


def register_builtins(kind: str, registry: dict[str, Any]) -> None:
    """`registry`'s names are built-ins of `kind` (tools: pipeline/runtime/parts.py; datasets:
    pipeline/assets/datasets.py and the config's data types); None declares a name only."""
    for name, made in registry.items():
        if made is not None or name not in REGISTERED[kind]:
            REGISTERED[kind][name] = made


def _tools() -> dict[str, Any]:
    return {name: REGISTERED["tools"].get(name) for name in BUILTIN_TOOLS}


def _rewards() -> dict[str, Any]:
    return REWARDS


def _datasets() -> dict[str, Any]:
    return REGISTERED["datasets"]


def _stratifiers() -> dict[str, Any]:
    return STRATIFIERS


def _estimators() -> dict[str, Any]:
    from learner.estimators import ESTIMATORS  # torch: only when asked

    return ESTIMATORS


def _agents() -> dict[str, Any]:
    return {}  # Strata's own loop is actors.agent.type builtin, not a plug-in to name


BUILTINS: dict[str, Callable[[], dict[str, Any]]] = {
    "tools": _tools,
    "rewards": _rewards,
    "datasets": _datasets,
    "stratifiers": _stratifiers,
    "estimators": _estimators,
    "agents": _agents,
}
"""kind -> the registry of its built-in names (the estimators' imported when first asked)."""
PLUGGED: dict[str, set[str]] = {kind: set() for kind in KINDS}
"""Names a plug-in was registered under in a built-in registry (a config's plug-in section
does that, pipeline/config/algorithm.py): not built-ins, whatever the registry holds."""


def builtins(kind: str) -> dict[str, Any]:
    """The built-in names of `kind` and their objects (plug-ins registered beside them left out)."""
    _check_kind(kind)
    return {k: v for k, v in BUILTINS[kind]().items() if k not in PLUGGED[kind]}


def is_import_string(spec: str) -> bool:
    """Whether `spec` is `module:attr` or `file.py:attr` rather than a name."""
    return ":" in spec


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"no plug-in kind {kind!r}; the kinds are {', '.join(KINDS)}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def entry_points(kind: str) -> list[importlib.metadata.EntryPoint]:
    """The installed packages' entry points of group `strata.<kind>`, sorted by name."""
    _check_kind(kind)
    found = importlib.metadata.entry_points(group=f"strata.{kind}")
    return sorted(found, key=lambda ep: (ep.name, _package(ep)))


def _package(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "an unnamed package"
    return f"{dist.metadata['Name'] or dist.name}=={dist.version}"


def available(kind: str) -> list[tuple[str, str]]:
    """(name, origin) of every name `kind` knows: "built-in", then "entry point PKG==VER"
    (`value`), "shadowed by the built-in" when a built-in has the same name."""
    _check_kind(kind)
    builtin = list(builtins(kind))
    out = [(name, "built-in") for name in builtin]
    for ep in entry_points(kind):
        origin = f"entry point {_package(ep)} ({ep.value})"
        if ep.name in builtin:
            origin += ", shadowed by the built-in"
        out.append((ep.name, origin))
    return out


def resolve(kind: str, spec: str, where: str = "") -> Any:
    """The object `spec` names for `kind`: a built-in name, an entry point's name, or an import
    string (`package.module:attr`, `path/to/file.py:attr`). PluginError (one line, starting with
    `where`) when there is none or it does not import."""
    _check_kind(kind)
    prefix = f"{where}: " if where else ""
    if not isinstance(spec, str) or not spec.strip():
        raise PluginError(f"{prefix}a {SINGULAR[kind]} must be named by a non-empty string")
    if is_import_string(spec):
        return import_string(spec, where)
    builtin = builtins(kind)
    if spec in builtin:
        if builtin[spec] is None:  # declared by the config, its registry not imported here
            raise PluginError(f"{prefix}{SINGULAR[kind]} {spec!r} is built in: its owner builds it")
        return builtin[spec]
    matches = [ep for ep in entry_points(kind) if ep.name == spec]
    if len(matches) > 1:
        owners = ", ".join(_package(ep) for ep in matches)
        raise PluginError(
            f"{prefix}{SINGULAR[kind]} {spec!r} is registered by {len(matches)} plug-ins "
            f"({owners}): give an import string instead, e.g. {matches[0].value}"
        )
    if matches:
        ep = matches[0]
        try:
            return ep.load()
        except Exception as exc:  # the plug-in's own import: anything may fail there
            raise PluginError(
                f"{prefix}{SINGULAR[kind]} {spec!r} (entry point {ep.value} of {_package(ep)}) "
                f"cannot be loaded: {_first_line(exc)}"
            ) from None
    found = ", ".join(f"{ep.name} ({_package(ep)})" for ep in entry_points(kind)) or "none"
    raise PluginError(
        f"{prefix}unknown {SINGULAR[kind]} {spec!r}; known: {', '.join(builtin) or 'none'}; "
        f"plug-ins found (entry points strata.{kind}): {found}; or give an import string "
        "package.module:attr or path/to/file.py:attr"
    )


def import_string(spec: str, where: str = "") -> Any:
    """The attribute `spec` (`module:attr` or `file.py:attr`, attr dotted for nested ones)
    names; PluginError saying what failed."""
    prefix = f"{where}: " if where else ""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise PluginError(
            f"{prefix}import string {spec!r} must be package.module:attr or path/to/file.py:attr"
        )
    try:
        if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
            module = _file_module(Path(module_name))
        else:
            module = importlib.import_module(module_name)
        value: Any = module
        for part in attr.split("."):
            value = getattr(value, part)
    except Exception as exc:  # the plug-in's own import: anything may fail there
        raise PluginError(f"{prefix}cannot import {spec!r}: {_first_line(exc)}") from None
    return value


def _file_module(path: Path) -> Any:
    """The module of the Python file at `path`, imported once under a private name (the file's
    resolved path hashed), so two resolutions give the same objects."""
    if not path.is_file():
        raise FileNotFoundError(f"no such file {path} (relative to {Path.cwd()})")
    resolved = path.resolve()
    name = f"_strata_plugin_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickle look it up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def plugin_origin(kind: str, spec: str) -> str | None:
    """Where `spec` comes from when it is a plug-in (an import string, or an entry point's name
    no built-in shadows), else None; built-in registries are imported only to tell shadowing, so
    a config of built-ins is described without importing torch."""
    _check_kind(kind)
    if is_import_string(spec):
        return "import string"
    matches = [ep for ep in entry_points(kind) if ep.name == spec]
    if not matches or spec in builtins(kind):
        return None
    return ", ".join(f"entry point {_package(ep)} ({ep.value})" for ep in matches)


def configured(config: Any) -> list[tuple[str, str, str]]:
    """(key, kind, spec) of every thing `config` (a StrataConfig) chooses by name: the data
    loader, the stratifier, the estimator, the agent, each tool and each reward function."""
    dumped = config.model_dump(mode="json")
    out = [
        ("data.type", "datasets", dumped["data"]["type"]),
        ("learner.stratifier.type", "stratifiers", dumped["learner"]["stratifier"]["type"]),
        ("learner.advantage.type", "estimators", dumped["learner"]["advantage"]["type"]),
    ]
    actors = dumped["actors"]
    if actors["agent"].get("path"):  # custom and openai agents; `type` chooses no plug-in
        out.append(("actors.agent.path", "agents", actors["agent"]["path"]))
    for key, kind in (("tools", "tools"), ("reward", "rewards")):
        out += [(f"actors.{key}{at}", kind, spec) for at, spec in _named(actors.get(key))]
    return out


def _named(value: Any, at: str = "") -> list[tuple[str, str]]:
    """(where, spec) of the names in a config value: a string, a list of them, or sections
    naming one by `fn` or `type` (a remote reward's `url` names none)."""
    if isinstance(value, str):
        return [(at, value)]
    if isinstance(value, list):
        return [found for i, v in enumerate(value) for found in _named(v, f"{at}[{i}]")]
    if isinstance(value, dict):
        for key in ("fn", "type"):
            if isinstance(value.get(key), str):
                return [(f"{at}.{key}", value[key])]
    return []


def origin(kind: str, spec: str) -> str:
    """Where `spec` resolves from for `kind`, in words (for --dry-run and --list-plugins):
    "built-in", "entry point PKG==VER (value)", "import string", or "unknown"."""
    _check_kind(kind)
    if is_import_string(spec):
        return "import string"
    if spec in builtins(kind):
        return "built-in"
    for ep in entry_points(kind):
        if ep.name == spec:
            return f"entry point {_package(ep)} ({ep.value})"
    return "unknown"
