"""An experiment's run directories read back for `pipeline.experiment_report`, and the numbers
it shows: held-out accuracy by level, spreads over seeds, smoothed per-step series, strata shares.
Reading is lenient: a run without metrics or evaluations is kept (and reported as such)."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from pipeline.evaluation.report_learning import TOOLS_ACTOR, per_question

LEVELS = ("L1", "L2", "L3", "L2+L3", "all")
_LEVEL = re.compile(r"(?:^|[_\s-])l(?:evel)?\s*(\d+)$", re.IGNORECASE)  # minigaia_l2, level 2
_RUN = re.compile(r"(?P<variant>.+)-seed(?P<seed>\d+)")


@dataclass
class RunData:
    name: str
    variant: str
    seed: int
    run_dir: Path
    metrics: list[dict]  # metrics.jsonl, one object per learner step
    evals: list[dict]  # eval.jsonl, by step
    accounting: dict | None
    config: dict  # the run's resolved config.yaml, raw
    status: str | None  # from experiment.json (None: not recorded)


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill mid-write
    return rows


def load_runs(out_dir: Path) -> tuple[list[RunData], dict]:
    """The runs of the experiment in `out_dir` (experiment.json's, else every VARIANT-seedK
    directory), and experiment.json ({} if absent)."""
    record_file = out_dir / "experiment.json"
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    listed = [
        (r["name"], r["variant"], int(r["seed"]), r.get("status")) for r in record.get("runs", [])
    ]
    if not listed:
        for d in sorted(p for p in out_dir.iterdir() if p.is_dir()):
            match = _RUN.fullmatch(d.name)
            if match and (d / "config.yaml").is_file():
                listed.append((d.name, match["variant"], int(match["seed"]), None))
    runs = []
    for name, variant, seed, status in listed:
        run_dir = out_dir / name
        config_file = run_dir / "config.yaml"
        accounting = run_dir / "accounting.json"
        runs.append(
            RunData(
                name,
                variant,
                seed,
                run_dir,
                _jsonl(run_dir / "metrics.jsonl"),
                sorted(_jsonl(run_dir / "eval.jsonl"), key=lambda e: e["step"]),
                json.loads(accounting.read_text()) if accounting.is_file() else None,
                (yaml.safe_load(config_file.read_text()) or {}) if config_file.is_file() else {},
                status,
            )
        )
    return runs, record


def by_variant(runs: list[RunData]) -> dict[str, list[RunData]]:
    grouped: dict[str, list[RunData]] = defaultdict(list)
    for run in runs:
        grouped[run.variant].append(run)
    return dict(grouped)


def setting(config: dict, dotted: str, default: Any = None) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return default if node is None else node


def is_grpo(config: dict) -> bool:
    """Plain GRPO: the grpo estimator, or stratified with α = 0; outcome reward only, no
    turn-level credit."""
    kind = setting(config, "learner.advantage.type", "stratified")
    # configs of an older schema hold the blend's alpha at learner.alpha
    alpha = setting(config, "learner.advantage.alpha", setting(config, "learner.alpha", 0.6))
    plain = not setting(config, "actors.latent_reward", 0.0)
    plain = plain and not setting(config, "learner.turn_credit", 0.0)
    return plain and (kind == "grpo" or (kind == "stratified" and alpha == 0))


# ------------------------------------------------------------------------------ evaluation


def level_of(row_name: str) -> int | None:
    match = _LEVEL.search(row_name)
    return int(match.group(1)) if match else None


def level_accuracy(record: dict, tools: bool = True) -> dict[str, float]:
    """Accuracy per column of LEVELS in one eval.jsonl record. A level pools every row (data
    source) of that level, and L2+L3 both levels, weighted by their questions; `all` is the
    record's own `all` row. Columns without rows are left out."""
    rows = [r for r in record.get("rows", []) if bool(r.get("tools")) == tools]
    out: dict[str, float] = {}
    for column, levels in COLUMN_LEVELS.items():
        members = [r for r in rows if r["name"] != "all" and level_of(r["name"]) in levels]
        weight = sum(r["questions"] for r in members)
        if weight:
            out[column] = sum(r["accuracy"] * r["questions"] for r in members) / weight
    for r in rows:
        if r["name"] == "all":
            out["all"] = float(r["accuracy"])
    return out


COLUMN_LEVELS = {"L1": (1,), "L2": (2,), "L3": (3,), "L2+L3": (2, 3)}
"""The level columns and the levels each pools (`all`: every question)."""


def question_scores(run: RunData, column: str, which: int = -1) -> np.ndarray | None:
    """The per-question accuracy (mean reward over its samples, with tools) of the run's first
    (0) or last (-1) evaluation in `column`, ordered by question; None where the evaluation's
    trajectories were not kept."""
    if not run.evals:
        return None
    path = run.run_dir / "eval" / f"step-{run.evals[which]['step']:06d}.trajectories.parquet"
    if not path.is_file():
        return None
    scores = per_question(path, TOOLS_ACTOR)
    chosen = [
        p
        for p in sorted(scores)
        if column == "all" or level_of(scores[p][0]) in COLUMN_LEVELS.get(column, ())
    ]
    return np.array([scores[p][1] for p in chosen]) if chosen else None


def eval_row(record: dict, name: str = "all", tools: bool = True) -> dict | None:
    return next(
        (r for r in record.get("rows", []) if r["name"] == name and bool(r["tools"]) == tools), None
    )


# ------------------------------------------------------------------------------- spreads


@dataclass(frozen=True)
class Spread:
    """Values over seeds: mean, sample standard deviation (ddof 1; NaN for one seed), min, max."""

    mean: float
    std: float
    low: float
    high: float
    n: int

    def text(self, digits: int = 3) -> str:
        if self.n == 1:
            return f"{self.mean:.{digits}f} (1 seed)"
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f} ({self.low:.{digits}f}–{self.high:.{digits}f})"

    def overlaps(self, other: Spread) -> bool:
        return self.low <= other.high and other.low <= self.high


def spread(values: list[float]) -> Spread | None:
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return None
    std = float(np.std(finite, ddof=1)) if len(finite) > 1 else float("nan")
    return Spread(float(np.mean(finite)), std, min(finite), max(finite), len(finite))


# -------------------------------------------------------------------------------- series


def series(metrics: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of `key`, NaN and missing steps dropped."""
    points = [
        (m["step"], m[key])
        for m in metrics
        if isinstance(m.get(key), int | float) and math.isfinite(m[key])
    ]
    if not points:
        return np.array([]), np.array([])
    steps, values = zip(*points, strict=True)
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` points (fewer at the start)."""
    if window <= 1 or len(values) == 0:
        return values
    sums = np.cumsum(np.insert(values, 0, 0.0))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(0, ends - window)
    return (sums[ends] - sums[starts]) / (ends - starts)


def band(per_run: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, ...]:
    """(steps, mean, min, max) over runs at every step any run has (each step over the runs
    that have it)."""
    steps = np.unique(np.concatenate([s for s, _ in per_run])) if per_run else np.array([])
    columns: list[list[float]] = [[] for _ in steps]
    index = {s: i for i, s in enumerate(steps)}
    for run_steps, values in per_run:
        for s, v in zip(run_steps, values, strict=True):
            columns[index[s]].append(v)
    stats = np.array([(np.mean(c), np.min(c), np.max(c)) for c in columns]).reshape(-1, 3)
    return steps, stats[:, 0], stats[:, 1], stats[:, 2]


def last_window(metrics: list[dict], key: str, window: int) -> float | None:
    """Mean of `key` over the run's last `window` steps that have it."""
    _, values = series(metrics, key)
    return float(np.mean(values[-window:])) if len(values) else None


def stratum_shares(runs: list[RunData]) -> tuple[dict[int, float], str]:
    """Share of trajectories per stratum over whole runs, pooled over seeds: generated ones from
    accounting.json where every run has it, else trained ones summed from metrics.jsonl."""
    counts: dict[int, float] = defaultdict(float)
    if runs and all(r.accounting for r in runs):
        for r in runs:
            for stratum, row in r.accounting.get("per_stratum", {}).items():
                counts[int(stratum)] += row.get("generated", 0)
        source = "generated trajectories, accounting.json"
    else:
        for r in runs:
            for m in r.metrics:
                for key, value in m.items():
                    parts = key.split("/")
                    if (
                        len(parts) == 3
                        and parts[0] == "stratum"
                        and parts[2] == "count"
                        and math.isfinite(value)
                    ):
                        counts[int(parts[1])] += value
        source = "trained trajectories, metrics.jsonl"
    total = sum(counts.values())
    return ({k: counts[k] / total for k in sorted(counts)} if total else {}), source
