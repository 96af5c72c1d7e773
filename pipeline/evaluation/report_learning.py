"""The "did it learn?" part of `report.md`: each change next to the noise it must beat.

Training reward: the mean of the first and of the last 20% of steps, the noise the standard error
of that difference over the steps' means. Held-out accuracy: the first evaluation (step 0, the
starting policy) against the last, on the same questions, so the noise is the paired standard
error of the per-question change. With `eval.train_questions`, the same is done for a fixed set of
training questions: the per-step training reward is over other questions at every step, so its
trend is mostly which questions came up. A change counts as learned when it exceeds twice its noise.
The run's own figures cannot show seed-to-seed spread; `docs/results/ablation.md` measures it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from buffers.reader import read_trajectories

# Which evaluation made a trajectory (its actor_id) and the training questions' table row: set by
# pipeline.evaluate, which imports them from here (this module stays light: no torch).
TOOLS_ACTOR, BASELINE_ACTOR, TRAIN_ACTOR = "eval", "eval-no-tools", "eval-train"
TRAIN_ROW = "training questions"

LEARNED_AT = 2.0  # standard errors


def _verdict(change: float, noise: float) -> str:
    if not math.isfinite(change) or not math.isfinite(noise):
        return "-"
    if noise == 0:
        return "yes" if change > 0 else "no"
    ratio = change / noise
    return f"{'yes' if ratio > LEARNED_AT else 'no'} ({ratio:+.1f} s.e.)"


def reward_change(metrics: list[dict]) -> tuple[float, float, float]:
    """(first 20% mean, last 20% mean, standard error of their difference)."""
    rewards = np.array([m["reward_mean"] for m in metrics if "reward_mean" in m], dtype=float)
    if len(rewards) < 2:
        return float("nan"), float("nan"), float("nan")
    k = max(1, len(rewards) // 5)
    first, last = rewards[:k], rewards[-k:]
    se = math.sqrt((first.var(ddof=1) if k > 1 else 0) / k + (last.var(ddof=1) if k > 1 else 0) / k)
    return float(first.mean()), float(last.mean()), se


def per_question(path: Path, actor: str) -> dict[str, tuple[str, float]]:
    """prompt_id -> (data source, mean reward over its samples) of one evaluation's trajectories
    made by `actor` (the held-out questions with tools, or the training questions)."""
    table = pq.read_table(path, columns=["prompt_id", "data_source", "reward", "actor_id"])
    table = table.filter(pc.equal(table["actor_id"], actor))
    sums: dict[str, list] = {}
    for prompt, source, reward in zip(
        table["prompt_id"].to_pylist(),
        table["data_source"].to_pylist(),
        table["reward"].to_pylist(),
        strict=True,
    ):
        entry = sums.setdefault(prompt, [source, 0.0, 0])
        entry[1] += reward
        entry[2] += 1
    return {p: (s, total / n) for p, (s, total, n) in sums.items()}


def _paired(before: dict, after: dict, name: str) -> tuple[str, int, float, float, float] | None:
    """(name, questions, mean before, mean after, paired standard error) over the questions in
    both of `name`'s data source ("all": every source); None if they share none."""
    chosen = [p for p in sorted(set(before) & set(after)) if name == "all" or before[p][0] == name]
    if not chosen:
        return None
    a = np.array([before[p][1] for p in chosen])
    b = np.array([after[p][1] for p in chosen])
    se = float(np.std(b - a, ddof=1) / math.sqrt(len(chosen))) if len(chosen) > 1 else math.nan
    return name, len(chosen), float(a.mean()), float(b.mean()), se


def accuracy_changes(run_dir: Path) -> tuple[int, int, list[tuple[str, int, float, float, float]]]:
    """(first step, last step, rows): per held-out data source and "all", then (with
    eval.train_questions) one row named TRAIN_ROW, each (name, questions, accuracy at the first
    evaluation, at the last, paired standard error of the change). No rows without two
    evaluations."""
    source = run_dir / "eval.jsonl"
    if not source.is_file():
        return 0, 0, []
    steps = [json.loads(line)["step"] for line in source.read_text().splitlines() if line.strip()]
    if len(steps) < 2:
        return 0, 0, []
    first, last = min(steps), max(steps)
    files = [run_dir / "eval" / f"step-{s:06d}.trajectories.parquet" for s in (first, last)]
    if not all(f.is_file() for f in files):
        return 0, 0, []
    before, after = (per_question(f, TOOLS_ACTOR) for f in files)
    names = sorted({before[p][0] for p in set(before) & set(after)})
    rows = [_paired(before, after, name) for name in [*names, "all"]]
    trained = _paired(*(per_question(f, TRAIN_ACTOR) for f in files), "all")
    if trained is not None:
        rows.append((TRAIN_ROW, *trained[1:]))
    return first, last, [r for r in rows if r is not None]


def learning_section(run_dir: Path, metrics: list[dict]) -> list[str]:
    """The report's "Did it learn?" table and one sentence per measure."""
    first, last, se = reward_change(metrics)
    lines = [
        "## Did it learn?",
        "",
        f"A change counts when it is more than {LEARNED_AT:g} standard errors (s.e.). Training "
        "reward: mean of the first vs the last 20% of steps (s.e. over the steps). Held-out "
        "accuracy (and training-question accuracy, with eval.train_questions): the first "
        "evaluation vs the last, on the same questions (paired s.e. over questions). Seed-to-seed spread is measured in docs/results/ablation.md.",
        "",
        "| measure | start | end | change | s.e. | learned |",
        "|---|---|---|---|---|---|",
        f"| training reward | {first:.3f} | {last:.3f} | {last - first:+.3f} | {se:.3f} | "
        f"{_verdict(last - first, se)} |",
    ]
    step_a, step_b, rows = accuracy_changes(run_dir)
    for name, n, a, b, pse in rows:
        what = (
            "accuracy on training questions" if name == TRAIN_ROW else f"held-out accuracy {name}"
        )
        lines.append(
            f"| {what} ({n} q, step {step_a} -> {step_b}) | {a:.3f} | {b:.3f} | "
            f"{b - a:+.3f} | {pse:.3f} | {_verdict(b - a, pse)} |"
        )
    return [*lines, ""]


def calls_by_level_plot(run_dir: Path) -> str | None:
    """tool_calls_by_level.png: mean tool calls per trajectory against the policy version that
    generated it, one line per data source (level), from the run's trajectory spill."""

    try:
        table, _ = read_trajectories(
            run_dir / "trajectories", ["data_source", "num_tool_calls", "policy_version"], True
        )
    except (OSError, ValueError):
        return None
    if table.num_rows == 0:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = table["data_source"].to_numpy(zero_copy_only=False)
    calls = table["num_tool_calls"].to_numpy()
    versions = table["policy_version"].to_numpy()
    width = max(1, int(versions.max()) // 20)  # about 20 points a line
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for name in sorted(set(sources)):
        rows = sources == name
        bins = versions[rows] // width
        xs = sorted(set(bins))
        ys = [calls[rows][bins == b].mean() for b in xs]
        ax.plot([x * width for x in xs], ys, marker=".", label=name)
    ax.set_xlabel(f"policy version that generated it (bins of {width})")
    ax.set_ylabel("tool calls per trajectory")
    ax.set_title("tool calls per question, by level")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(run_dir / "tool_calls_by_level.png", dpi=100)
    plt.close(fig)
    return "tool_calls_by_level.png"
