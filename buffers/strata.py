"""Stratifiers: how a trajectory maps to a stratum, assigned once, when the trajectory is made.

A stratifier sees, for each trajectory, the names of the tools it called in order (e.g.
`["search", "search", "python"]`) and returns one int64 stratum per trajectory. The agent loop
records it in `Trajectory.stratum`, so the buffer's books, the Parquet spill, replay and the
learner's advantages all use the same strata. Values are stable across batches, so per-stratum
telemetry lines up from step to step. Add one: a class with `__call__`, registered with
`@register_stratifier(name, *params)` (its own parameters, the fields of its config section
`learner.stratifier: {type: NAME, ...}` in pipeline/config/algorithm.py); every stratifier is
built with the run's tool names and turn limit besides.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

ToolCalls = Sequence[Sequence[str]]


class Stratifier(Protocol):
    def __call__(self, tool_calls: ToolCalls, keys: Sequence[str] | None = None) -> np.ndarray:
        """One int64 stratum per trajectory; `keys` name the trajectories (prompt#sample) for
        stratifiers that need a stable identity."""
        ...


@dataclass(frozen=True)
class Registered:
    make: Callable[..., Stratifier]
    """(tools, max_calls, **params) -> the stratifier."""
    params: tuple[str, ...]
    """Its own parameters: the fields of its config section besides `type`."""


STRATIFIERS: dict[str, Registered] = {}
"""`learner.stratifier.type` -> the stratifier; filled by `register_stratifier`."""


def register_stratifier(
    name: str, *params: str
) -> Callable[[Callable[..., Stratifier]], Callable[..., Stratifier]]:
    """Register the decorated factory `(tools, max_calls, **params)` as stratifier `name`."""

    def register(make: Callable[..., Stratifier]) -> Callable[..., Stratifier]:
        if name in STRATIFIERS:
            raise ValueError(f"stratifier {name!r} is registered twice")
        STRATIFIERS[name] = Registered(make, params)
        return make

    return register


class ToolCallCount:
    """The paper's stratifier: the number of tool calls (stratum k = k calls)."""

    def __call__(self, tool_calls: ToolCalls, keys: Sequence[str] | None = None) -> np.ndarray:
        return np.array([len(calls) for calls in tool_calls], dtype=np.int64)


class ToolSignature:
    """Counts per tool type: two searches and one python call differ from three searches.

    The stratum is the mixed-radix number of the per-tool counts, in the order of `tools`
    (base `max_calls + 1`); counts above `max_calls` share the top digit. Tools not in `tools`
    are counted under one extra "other" digit, so no call is silently ignored.
    """

    def __init__(self, tools: Sequence[str], max_calls: int) -> None:
        if not tools:
            raise ValueError("ToolSignature needs at least one tool name")
        if max_calls < 1:
            raise ValueError(f"max_calls must be >= 1, got {max_calls}")
        self.tools = list(tools)
        self.base = max_calls + 1
        self._digit = {name: i for i, name in enumerate(self.tools)}

    def __call__(self, tool_calls: ToolCalls, keys: Sequence[str] | None = None) -> np.ndarray:
        width = len(self.tools) + 1  # last digit counts tools outside `tools`
        counts = np.zeros((len(tool_calls), width), dtype=np.int64)
        for row, calls in enumerate(tool_calls):
            for name in calls:
                counts[row, self._digit.get(name, width - 1)] += 1
        np.minimum(counts, self.base - 1, out=counts)
        return counts @ (self.base ** np.arange(width, dtype=np.int64))


class RandomStrata:
    """Random strata in [0, k): the paper's control (Table 7), structure-blind. With `keys` a
    trajectory's stratum is a hash of the seed and its key, so it is the same wherever and
    whenever it is computed; without, a seeded draw per call."""

    def __init__(self, k: int, seed: int = 0) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k, self.seed = k, seed
        self._rng = np.random.default_rng(seed)

    def __call__(self, tool_calls: ToolCalls, keys: Sequence[str] | None = None) -> np.ndarray:
        if keys is None:
            return self._rng.integers(0, self.k, len(tool_calls), dtype=np.int64)
        digests = (
            hashlib.blake2b(f"{self.seed}:{key}".encode(), digest_size=8).digest() for key in keys
        )
        return np.array([int.from_bytes(d, "little") % self.k for d in digests], dtype=np.int64)


@register_stratifier("tool_calls")
def _tool_calls(tools: Sequence[str], max_calls: int) -> Stratifier:
    return ToolCallCount()


@register_stratifier("tool_signature")
def _tool_signature(tools: Sequence[str], max_calls: int) -> Stratifier:
    return ToolSignature(tools, max_calls)


@register_stratifier("random", "k", "seed")
def _random(tools: Sequence[str], max_calls: int, *, k: int = 2, seed: int = 0) -> Stratifier:
    return RandomStrata(k, seed)


def make_stratifier(
    name: str, *, tools: Sequence[str] = ("search", "python"), max_calls: int = 8, **params: Any
) -> Stratifier:
    """The stratifier a config names (a key of `STRATIFIERS`) with its own `params`."""
    if name not in STRATIFIERS:
        raise ValueError(f"unknown stratifier {name!r}: use {', '.join(STRATIFIERS)}")
    chosen = STRATIFIERS[name]
    unknown = sorted(set(params) - set(chosen.params))
    if unknown:
        takes = ", ".join(chosen.params) or "no parameters"
        raise ValueError(f"stratifier {name} takes {takes}, not {', '.join(unknown)}")
    return chosen.make(tools, max_calls, **params)


def section_params(section: Any) -> dict[str, Any]:
    """The stratifier's own parameters read from its config section (by attribute)."""
    return {p: getattr(section, p) for p in STRATIFIERS[section.type].params}
