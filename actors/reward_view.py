"""What a reward sees: the finished trajectory (`RewardView`) and the question it answered
(`RewardTask`).

A reward is a callable, sync or async:

    score(view: RewardView, task: RewardTask) -> float | dict[str, float]

A float is the reward. A dict is the reward split into named components: they sum to the reward,
and each is logged under its name (metrics.jsonl `reward/<name>`, Prometheus
`strata_reward_component{component}`). `actors/scoring.py` weighs, times and guards them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RewardView:
    """One finished trajectory as text: what the policy wrote and what its tools answered."""

    answer: str | None
    """The stripped content of the response's last complete <answer>...</answer>; None: none."""
    response: str
    """Everything generated, turn after turn (the tool observations between turns left out)."""
    tool_calls: tuple[tuple[str, dict], ...] = ()
    """(tool name, arguments as the tool got them), in order; a call the loop refused (unknown
    tool, malformed) is not among them."""
    observations: tuple[str, ...] = ()
    """Each call's result text as the tool returned it (before it was cut to
    actors.max_observation_tokens), one per tool call."""
    turns: int = 0
    """Generation turns (a tool call and its observation end a turn; the answer ends the last)."""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["tool_calls"] = [[name, arguments] for name, arguments in self.tool_calls]
        out["observations"] = list(self.observations)
        return out


@dataclass(frozen=True)
class RewardTask:
    """The question a trajectory answered, with every field its data row had."""

    question: str
    answers: tuple[str, ...]
    """The acceptable answers, canonical first (the dataset's ground truth)."""
    id: str = ""
    data_source: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Every other field of the row (e.g. Search-R1's `reward_model`, GAIA's `file_name`)."""

    @classmethod
    def of(cls, task: Any) -> RewardTask:
        """The view of a dataset question (pipeline.assets.datasets.Question or alike)."""
        extra = dict(getattr(task, "extra", None) or {})
        level = getattr(task, "level", None)
        if level is not None:
            extra.setdefault("level", level)
        return cls(
            question=task.question,
            answers=tuple(task.ground_truth),
            id=str(getattr(task, "id", "")),
            data_source=getattr(task, "data_source", ""),
            extra=extra,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "question": self.question,
            "answers": list(self.answers),
            "id": self.id,
            "data_source": self.data_source,
            "extra": dict(self.extra),
        }


def dumps(view: RewardView, task: RewardTask) -> bytes:
    """`{"view": ..., "task": ...}` as JSON (what a remote reward is sent). A row's values that
    JSON lacks (numpy arrays and numbers from Parquet, bytes, dates) go as lists, numbers and
    strings."""
    return json.dumps({"view": view.to_json(), "task": task.to_json()}, default=_jsonable).encode()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)
