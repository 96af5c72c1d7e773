"""The figures of an experiment's results document: one line per variant (the seed mean) with a
band from the lowest to the highest seed, against learner step; strata sizes as stacked bars.
Each function writes one PNG and returns its file name and caption, or None without data."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.experiments.data import (
    RunData,
    band,
    level_accuracy,
    moving_average,
    series,
    setting,
    stratum_shares,
)

Figure = tuple[str, str]  # (file name, caption)
THEOREM1 = {
    "theorem1_global_var": "Var[A_G]: group-centred rewards",
    "theorem1_in_stratum": "Var[A_S]: (group, stratum)-centred rewards",
    "theorem1_cross_stratum": "cross-stratum term = Var[A_G] − Var[A_S]",
    "theorem1_cross_stratum_chance": "cross-stratum term by chance (labels shuffled)",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _styles(variants: list[str]) -> dict[str, dict]:
    """Each variant's line style: ten colours, then the same ten dashed, then dotted, so no two
    variants of an experiment look alike."""
    plt = _pyplot()
    cmap = plt.get_cmap("tab10")
    dashes = ("-", "--", ":", "-.")
    return {
        v: {"color": cmap(i % 10), "linestyle": dashes[i // 10 % len(dashes)]}
        for i, v in enumerate(variants)
    }


def _lines(ax, groups: dict[str, list[RunData]], per_run, styles) -> bool:
    """Seed mean and min..max band of `per_run(run) -> (steps, values)` for every variant."""
    drawn = False
    for variant, runs in groups.items():
        points = [p for p in map(per_run, runs) if len(p[0])]
        if not points:
            continue
        steps, mean, low, high = band(points)
        ax.plot(
            steps,
            mean,
            **styles[variant],
            label=f"{variant} ({len(points)} seeds)",
            marker="o" if len(steps) <= 12 else None,
            markersize=3,
        )
        if len(points) > 1:
            ax.fill_between(
                steps, low, high, color=styles[variant]["color"], alpha=0.15, linewidth=0
            )
        drawn = True
    return drawn


def _save(fig, ax_list, path: Path) -> None:
    for ax in ax_list:
        ax.grid(alpha=0.3)
        ax.set_xlabel("learner step")
    ax_list[0].legend(loc="best", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def accuracy_plot(groups, styles, out: Path, stem: str) -> Figure | None:
    plt = _pyplot()
    columns = ["L2+L3", "all"]
    fig, axes = plt.subplots(1, len(columns), figsize=(11, 3.8), sharey=True)
    drawn = False
    for ax, column in zip(axes, columns, strict=True):

        def points(run: RunData, column: str = column) -> tuple[np.ndarray, np.ndarray]:
            pairs = [(e["step"], level_accuracy(e).get(column)) for e in run.evals]
            pairs = [(s, a) for s, a in pairs if a is not None]
            return np.array([s for s, _ in pairs], float), np.array([a for _, a in pairs], float)

        drawn |= _lines(ax, groups, points, styles)
        ax.set_title(f"held-out accuracy, {column} (with tools)")
        ax.set_ylabel("accuracy")
    if not drawn:
        plt.close(fig)
        return None
    name = f"{stem}-accuracy.png"
    _save(fig, list(axes), out / name)
    return name, (
        "Held-out accuracy against learner step (eval.jsonl): line = mean over seeds, band = "
        "lowest to highest seed. L2+L3 pools the level-2 and level-3 questions."
    )


def metric_plot(
    groups, styles, out: Path, stem: str, key: str, title: str, ylabel: str, smooth: int
) -> Figure | None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))

    def points(run: RunData) -> tuple[np.ndarray, np.ndarray]:
        steps, values = series(run.metrics, key)
        return steps, moving_average(values, smooth)

    if not _lines(ax, groups, points, styles):
        plt.close(fig)
        return None
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    name = f"{stem}-{key.replace('_', '-')}.png"
    _save(fig, [ax], out / name)
    return name, (
        f"{title[:1].upper()}{title[1:]} (`{key}` in metrics.jsonl), each run smoothed with a trailing moving average "
        f"over {smooth} learner steps; line = mean over seeds, band = lowest to highest seed."
    )


def theorem1_plot(groups, styles, out: Path, stem: str, smooth: int) -> Figure | None:
    runs = [r for rs in groups.values() for r in rs]
    keys = [k for k in THEOREM1 if any(k in m for r in runs for m in r.metrics)]
    if not keys:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):

        def points(run: RunData, key: str = key) -> tuple[np.ndarray, np.ndarray]:
            steps, values = series(run.metrics, key)
            return steps, moving_average(values, smooth)

        _lines(ax, groups, points, styles)
        ax.set_title(THEOREM1[key], fontsize=9)
        ax.set_ylabel("per-trajectory variance")
    if "theorem1_cross_stratum" in keys and "theorem1_cross_stratum_chance" in keys:
        # the term and its chance level on one scale, to be compared by eye
        term, chance = (
            keys.index("theorem1_cross_stratum"),
            keys.index("theorem1_cross_stratum_chance"),
        )
        axes[0][chance].sharey(axes[0][term])
        axes[0][term].autoscale()
    name = f"{stem}-theorem1.png"
    _save(fig, list(axes[0]), out / name)
    return name, (
        "Theorem 1 per learner step (" + ", ".join(f"`{k}`" for k in keys) + " in metrics.jsonl): "
        "Var[A_G] − Var[A_S] is the cross-stratum term: the part of GRPO's advantage that compares "
        "a trajectory with other strata, carrying the between-strata part of ∇J (not noise: the "
        "identity of docs/results/trap.md), which the blend damps by (1 − α); "
        "by chance is its expectation with each group's stratum labels shuffled (same cell sizes). "
        f"Trailing moving average over {smooth} steps; line = seed mean, band = lowest to highest seed."
    )


def strata_plot(groups, out: Path, stem: str) -> Figure | None:
    shares = {v: stratum_shares(rs) for v, rs in groups.items()}
    strata = sorted({k for s, _ in shares.values() for k in s})
    if not strata:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(groups) + 2), 3.8))
    variants = list(groups)
    bottom = np.zeros(len(variants))
    cmap = plt.get_cmap("viridis", max(2, len(strata)))
    for i, stratum in enumerate(strata):
        heights = np.array([shares[v][0].get(stratum, 0.0) for v in variants])
        ax.bar(variants, heights, bottom=bottom, color=cmap(i), label=f"stratum {stratum}")
        bottom += heights
    labels = [
        f"{v}\n({setting(groups[v][0].config, 'learner.stratifier.type', '?')})" for v in variants
    ]
    ax.set_xticks(range(len(variants)), labels, fontsize=8)
    ax.set_ylabel("share of trajectories")
    ax.set_ylim(0, 1)
    ax.set_title("strata sizes over the whole run")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7)
    fig.tight_layout()
    name = f"{stem}-strata.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    sources = sorted({source for _, source in shares.values()})
    return name, (
        "Share of trajectories per stratum over the whole run, pooled over seeds (counted: "
        + "; ".join(sources)
        + "). Under each variant its stratifier: with tool_calls a stratum is the number of tool "
        "calls; with random it is a random label, so strata ids are not comparable across "
        "stratifiers."
    )


def all_figures(
    groups: dict[str, list[RunData]], out: Path, stem: str, smooth: int
) -> list[Figure]:
    styles = _styles(list(groups))
    made = [
        accuracy_plot(groups, styles, out, stem),
        metric_plot(
            groups,
            styles,
            out,
            stem,
            "reward_mean",
            "training reward per trajectory",
            "mean reward",
            smooth,
        ),
        metric_plot(
            groups,
            styles,
            out,
            stem,
            "tool_calls_mean",
            "tool calls per trajectory (training)",
            "tool calls",
            smooth,
        ),
        theorem1_plot(groups, styles, out, stem, smooth),
        strata_plot(groups, out, stem),
    ]
    return [f for f in made if f is not None]
