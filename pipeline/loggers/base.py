"""What a logger is: something a run hands its step metrics, its evaluations, its config and its
report's plots to, under one naming scheme.

The names (every logger that has names uses these):
- `train/<key>`: each scalar of a `metrics.jsonl` line, at that line's `step` (`published`, a
  bool, as 0/1; None is left out).
- `eval/<row>/<tools|no_tools>/<field>`: each number of an evaluation's rows (accuracy, pass_at_k,
  tool_calls, response_tokens, format_errors), at the evaluation's step; the rows themselves as
  the table `eval/table` where the logger has tables.
- `report/<name>`: the report's plots (`reward.png` ...) as images, at the run's last step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

EVAL_FIELDS = ("accuracy", "pass_at_k", "tool_calls", "response_tokens", "format_errors")
EVAL_COLUMNS = ("step", "name", "tools", "questions", "samples", *EVAL_FIELDS)
"""The columns of the `eval/table` table, one row per evaluation row."""


class LoggerError(Exception):
    """A chosen logger cannot open here (its package is missing, W&B refused the run)."""


@dataclass
class StepRecord:
    """One learner step as the loggers see it: its metrics.jsonl line, the trajectories trained,
    how long the learner waited for them, and what the run read off the buffer and the actors."""

    metrics: dict
    trajectories: list
    idle_s: float
    buffer_stats: Any
    actors: dict


class Logger:
    """A place a run's figures go. Each method may be left as it is (the logger has no such thing);
    `name` is its entry in `metrics.loggers`."""

    name: ClassVar[str]
    needs: ClassVar[str] = ""
    """The package it needs (imported when the run opens it), for the one line that says so."""

    def begin(self, step: int) -> None:
        """The stream starts at `step` (0, or a resumed checkpoint's: later records redo steps
        after it)."""

    def log_step(self, record: StepRecord) -> None: ...

    def log_eval(self, step: int, rows: list) -> None:
        """An evaluation's rows (pipeline.evaluation.heldout.Row) at `step`."""

    def log_report(self, step: int, images: list[Path]) -> None: ...

    def close(self) -> None: ...

    def discard(self) -> None:
        """Remove what opening wrote to the run directory (a run refused before it started
        leaves nothing behind)."""


def train_scalars(metrics: dict) -> dict[str, float]:
    """A metrics.jsonl line as `train/<key>` numbers (bools as 0/1; None and text left out)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, int | float):
            out[f"train/{key}"] = float(value)
    return out


def eval_scalars(rows: list) -> dict[str, float]:
    """An evaluation's rows as `eval/<row>/<tools|no_tools>/<field>` numbers (None left out)."""
    out = {}
    for row in rows:
        where = f"eval/{row.name}/{'tools' if row.tools else 'no_tools'}"
        for field in EVAL_FIELDS:
            value = getattr(row, field)
            if value is not None:
                out[f"{where}/{field}"] = float(value)
    return out


def eval_table(step: int, rows: list) -> list[list]:
    """An evaluation's rows as the table `eval/table` (columns EVAL_COLUMNS)."""
    return [[step, *(getattr(row, c) for c in EVAL_COLUMNS[1:])] for row in rows]
