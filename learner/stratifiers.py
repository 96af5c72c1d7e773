"""Stratifiers: how a trajectory maps to a stratum.

A stratifier sees, for each trajectory, the names of the tools it called in order (e.g.
`["search", "search", "python"]`) and returns one int64 stratum per trajectory. Stratum values
are stable across batches, so per-stratum telemetry lines up from step to step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

ToolCalls = Sequence[Sequence[str]]


class Stratifier(Protocol):
    def __call__(self, tool_calls: ToolCalls) -> torch.Tensor:
        """One int64 stratum per trajectory."""
        ...


class ToolCallCount:
    """The paper's stratifier: the number of tool calls (stratum k = k calls)."""

    def __call__(self, tool_calls: ToolCalls) -> torch.Tensor:
        return torch.tensor([len(calls) for calls in tool_calls], dtype=torch.int64)


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

    def __call__(self, tool_calls: ToolCalls) -> torch.Tensor:
        width = len(self.tools) + 1  # last digit counts tools outside `tools`
        counts = torch.zeros((len(tool_calls), width), dtype=torch.int64)
        for row, calls in enumerate(tool_calls):
            for name in calls:
                counts[row, self._digit.get(name, width - 1)] += 1
        counts.clamp_(max=self.base - 1)
        place = self.base ** torch.arange(width, dtype=torch.int64)
        return counts @ place


class RandomStrata:
    """Uniformly random strata in [0, k): the paper's control (Table 7), structure-blind."""

    def __init__(self, k: int, seed: int = 0) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        self._generator = torch.Generator().manual_seed(seed)

    def __call__(self, tool_calls: ToolCalls) -> torch.Tensor:
        return torch.randint(0, self.k, (len(tool_calls),), generator=self._generator)


def make_stratifier(
    name: str,
    *,
    tools: Sequence[str] = ("search", "python"),
    max_calls: int = 8,
    k: int = 2,
    seed: int = 0,
) -> Stratifier:
    """The stratifier a config names: `tool_calls`, `tool_signature` or `random`."""
    if name == "tool_calls":
        return ToolCallCount()
    if name == "tool_signature":
        return ToolSignature(tools, max_calls)
    if name == "random":
        return RandomStrata(k, seed)
    raise ValueError(f"unknown stratifier {name!r}: use tool_calls, tool_signature or random")
