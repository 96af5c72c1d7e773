"""`report.md` of a run: what it did, whether it learned, and plots against learner step."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from pipeline.evaluation.heldout import Row, markdown
from pipeline.evaluation.report_learning import calls_by_level_plot, learning_section
from pipeline.experiments.diagnose import report_section as stratify_section


def learning_signal(metrics: list[dict], key: str = "reward_mean") -> tuple[float, float]:
    """Mean of `key` (the reward) over the first and the last 20% of steps (at least one step
    each)."""
    values = [m[key] for m in metrics if key in m and m[key] == m[key]]  # NaN: not measured
    if not values:
        return float("nan"), float("nan")
    k = max(1, len(values) // 5)
    return float(np.mean(values[:k])), float(np.mean(values[-k:]))


SMOOTHED = ("reward_mean", "tool_calls_mean")  # per step a mean over a few groups: noisy by eye


def _series(metrics: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(m["step"], m[key]) for m in metrics if key in m and m[key] == m[key]]  # NaN dropped
    return [p[0] for p in points], [p[1] for p in points]


def _plots(metrics: list[dict], run_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward.png", "mean reward", ["reward_mean"]),
        ("tool_calls.png", "tool calls per trajectory", ["tool_calls_mean"]),
        ("staleness.png", "staleness (versions)", ["staleness_mean", "staleness_token_mean"]),
        (
            "offpolicy.png",
            "off-policy: learner vs behaviour log-probs, clipped and masked tokens",
            [
                "logprob_gap_abs_mean",
                "logprob_gap_tail_fraction",
                "clip_fraction",
                "mask_drop_fraction",
                "truncated_fraction",
                "sequence_drop_fraction",
            ],
        ),
        ("throughput.png", "throughput", ["trajectories_per_s", "generated_tokens_per_s"]),
        (
            "objective.png",
            "entropy (nats), share cut by the budget, step credit",
            ["entropy", "overlong_share", "step_advantage_abs_mean"],
        ),
        (
            "critic.png",
            "GAE's critic: value loss, explained variance of the returns",
            ["value_loss", "explained_variance"],
        ),
    ]
    strata = sorted(
        {
            k.split("/")[1]
            for m in metrics
            for k in m
            if k.startswith("stratum/") and k.endswith("/reward")
        },
        key=int,
    )
    names = []
    for name, title, keys in panels:
        if not any(_series(metrics, key)[1] for key in keys):  # e.g. no critic: no empty plot
            continue
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for key in keys:
            x, y = _series(metrics, key)
            if not y:  # a figure this run does not have (e.g. no step credit): no empty legend
                continue
            ax.plot(x, y, marker="o", label=key)
            window = len(y) // 10
            if key in SMOOTHED and window >= 3:
                mean = np.convolve(np.asarray(y, dtype=float), np.ones(window) / window, "valid")
                ax.plot(x[window - 1 :], mean, linewidth=2.5, label=f"moving mean ({window} steps)")
        ax.set_xlabel("learner step")
        ax.set_title(title)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        fig.savefig(run_dir / name, dpi=100)
        plt.close(fig)
        names.append(name)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for stratum in strata:
        ax.plot(
            *_series(metrics, f"stratum/{stratum}/reward"),
            marker=".",
            label=f"{stratum} tool calls",
        )
    ax.set_xlabel("learner step")
    ax.set_title("mean reward per stratum")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(run_dir / "strata.png", dpi=100)
    plt.close(fig)
    names.append("strata.png")
    counts = np.array([[m.get(f"stratum/{s}/count", 0.0) for s in strata] for m in metrics])
    if counts.size and counts.sum():
        window = max(1, len(metrics) // 20)  # a moving sum over ~5% of the run
        kernel = np.ones(window)
        smooth = np.stack([np.convolve(c, kernel, "valid") for c in counts.T])
        shares = smooth / np.maximum(smooth.sum(axis=0), 1e-12)
        steps = [m["step"] for m in metrics][window - 1 :]
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.stackplot(steps, shares, labels=[f"{s} tool calls" for s in strata])
        ax.set_xlabel("learner step")
        ax.set_ylabel("share of trained trajectories")
        ax.set_title(f"strata sizes (moving window of {window} steps)")
        ax.legend(loc="upper left", fontsize=7)
        ax.set_ylim(0, 1)
        fig.tight_layout()
        fig.savefig(run_dir / "strata_share.png", dpi=100)
        plt.close(fig)
        names.append("strata_share.png")
    return names


def weights_digest(policy_dir: Path) -> str | None:
    """The first 16 hex digits of the sha256 of `model.safetensors`; None where there is no such
    single file (a sharded checkpoint)."""
    weights = policy_dir / "model.safetensors"
    if not weights.is_file():
        return None
    with weights.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:16]


def initial_policy(policy_dir: Path | None) -> str:
    """Where the run's policy came from, with a digest of its weights: the same warm-start key
    gives other weights on another machine's float kernels, so two reports say by this whether
    their runs started from the same policy."""
    if policy_dir is None:
        return "not recorded"
    line = f"`{policy_dir}`"
    try:
        info = json.loads((policy_dir / "warm_start.json").read_text(encoding="utf-8"))
        line += (
            f", warm start of {len(info['epochs'])} epochs ({info['steps']} steps), loss "
            f"{info['first_loss']:.3f} -> {info['final_loss']:.3f}"
        )
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not a warm start (model.path), or one without a step: the path says enough
    if (digest := weights_digest(policy_dir)) is not None:
        line += f", weights sha256 {digest}"
    return line


def write_report(
    run_dir: Path,
    config_path: str,
    summary,
    policy_dir: Path | None = None,
    plots: bool = True,
) -> Path:
    """`run_dir/report.md`, with its plots beside it unless `plots` is false (metrics.plots)."""
    metrics = summary.metrics
    first, last = learning_signal(metrics)
    entropy = learning_signal(metrics, "entropy")
    overlong = learning_signal(metrics, "overlong_share")
    lines = [
        f"# Strata run: {run_dir.name}",
        "",
        f"Config `{config_path}`, resolved in `config.yaml`.",
        "",
        "| | |",
        "|---|---|",
        f"| learner steps | {summary.steps} |",
        f"| trajectories trained | {summary.trajectories} |",
        f"| wall time | {summary.seconds:.1f} s |",
        f"| learner busy fraction | {summary.busy_fraction:.2f} (training while the actors generate) |",
        f"| mean reward, first 20% of steps | {first:.3f} |",
        f"| mean reward, last 20% of steps | {last:.3f} |",
        f"| entropy of trained tokens, first -> last 20% of steps | {entropy[0]:.3f} -> {entropy[1]:.3f} |",
        f"| share cut by the response budget, first -> last 20% of steps | {overlong[0]:.3f} -> {overlong[1]:.3f} |",
        *_critic_rows(metrics),
        f"| steps with no usable group (nothing trained or published) | {summary.empty_steps} |",
        f"| training questions skipped (prompt over data.max_prompt_tokens) | {summary.skipped_prompts} |",
        f"| initial policy | {initial_policy(policy_dir)} |",
        f"| final checkpoint | `{summary.checkpoint}` |",
        "",
    ]
    lines += learning_section(run_dir, metrics)
    if metrics and plots:
        for name in _plots(metrics, run_dir):
            lines += [f"![{name}]({name})", ""]
        by_level = calls_by_level_plot(run_dir)
        if by_level is not None:
            lines += [f"![{by_level}]({by_level})", ""]
    lines += stratify_section(run_dir, summary.steps)
    lines += _accounting(summary.accounting)
    lines += _evaluations(run_dir, plots)
    target = run_dir / "report.md"
    target.write_text("\n".join(lines))
    return target


def _critic_rows(metrics: list[dict]) -> list[str]:
    """GAE's critic, first -> last 20% of steps, where the run had one."""
    if not any("value_loss" in m for m in metrics):
        return []
    rows = []
    for key, what in (
        ("value_loss", "critic's value loss"),
        ("explained_variance", "explained variance of the returns by the critic (1: perfect)"),
    ):
        first, last = learning_signal(metrics, key)
        rows.append(f"| {what}, first -> last 20% of steps | {first:.3f} -> {last:.3f} |")
    return rows


def _accounting(books: dict) -> list[str]:
    """Where the trajectories went, per stratum, and whether staleness starved a stratum: its
    share of the trained trajectories against its share of those generated (that left the buffer)."""
    if not books or not books.get("per_stratum"):
        return []
    rows = books["per_stratum"]
    left = {s: r["trained"] + r["dropped_stale"] + r["abandoned"] for s, r in rows.items()}
    all_left, all_trained = (
        max(sum(left.values()), 1),
        max(sum(r["trained"] for r in rows.values()), 1),
    )
    lines = [
        "## Where the trajectories went, per stratum (tool calls)",
        "",
        "generated = trained + filtered (dynamic sampling) + dropped as stale + abandoned + "
        "failed + in flight at the end. Fairness is the stratum's share of the trained "
        "trajectories over its share of those generated (that left the buffer, filtered ones "
        "aside); below 1, staleness starved it.",
        "",
        "| stratum | generated | trained | filtered | dropped stale | abandoned | failed | in flight | generated share | trained share | fairness |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for stratum in sorted(rows, key=int):
        r = rows[stratum]
        generated_share, trained_share = left[stratum] / all_left, r["trained"] / all_trained
        fairness = f"{trained_share / generated_share:.3f}" if generated_share else "-"
        lines.append(
            f"| {stratum} | {r['generated']} | {r['trained']} | {r.get('filtered', 0)} | {r['dropped_stale']} | {r['abandoned']} | "
            f"{r['failed']} | {r['in_flight']} | {generated_share:.3f} | {trained_share:.3f} | {fairness} |"
        )
    aborted = books.get("total", {}).get("aborted", 0)
    lines += ["", f"Generations that failed before they had a stratum (aborted): {aborted}.", ""]
    return lines


def _evaluations(run_dir: Path, plot: bool) -> list[str]:
    """The held-out evaluations of the run (run_dir/eval.jsonl): the last one's table and, with
    `plot`, a plot of accuracy by data source or level against learner step (dashed: without
    tools)."""
    import json

    source = run_dir / "eval.jsonl"
    if not source.is_file():
        return []
    records = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    if not records:
        return []

    last = records[-1]
    lines = [
        f"## Held-out evaluation (step {last['step']}, {last['samples']} sample(s) per question)",
        "",
        markdown([Row(**r) for r in last["rows"]], last["samples"]).rstrip(),
        "",
    ]
    if not plot:
        return lines
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = list(dict.fromkeys(r["name"] for rec in records for r in rec["rows"]))
    for i, name in enumerate(names):
        for tools, style in ((True, "-"), (False, "--")):
            points = [
                (rec["step"], r["accuracy"])
                for rec in records
                for r in rec["rows"]
                if r["name"] == name and r["tools"] == tools
            ]
            if points:
                label = name if tools else f"{name}, no tools"
                ax.plot(*zip(*points, strict=True), style, color=f"C{i}", marker="o", label=label)
    ax.set_xlabel("learner step")
    ax.set_title("held-out accuracy")
    ax.legend(loc="best", fontsize=7)
    fig.tight_layout()
    fig.savefig(run_dir / "eval.png", dpi=100)
    plt.close(fig)
    return [*lines, "![eval.png](eval.png)", ""]
