"""The window study's analysis (`analysis.py`) written out: the printed tables and sentences,
and the strip plot of every run's late chain share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from scipy import stats as sps

from pipeline.experiments.diagnose import command as diagnose_command
from pipeline.experiments.proportions import clopper_pearson
from pipeline.experiments.window.analysis import (
    LEVEL,
    RESAMPLES,
    Analysis,
    Diagnosed,
    Difference,
    Foretold,
    RunResult,
    World,
    late_from,
)


def _pay(paid: float, n: int) -> str:
    return f"{paid / n:.3f} ({n})" if n else "– (0)"


def lines(a: Analysis) -> list[str]:
    """Every figure of the analysis, as the command prints it."""
    results, worlds, steps, alpha = a.results, a.worlds, a.steps, a.alpha
    first = late_from(steps)
    out = [
        f"Late: policy versions >= {first} of {steps} learner steps. Escaped: a run's late L2 "
        "chain share (two-hop training trajectories with two or more searches) at least its "
        "world's start share p0.",
        "",
        "| world | arm | run | late L2 trajectories | late chain share | escaped | "
        f"held-out L2 at step {steps} |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        acc = "–" if r.l2_accuracy is None else f"{r.l2_accuracy:.3f}"
        out.append(
            f"| {r.world} | {r.arm} | {r.name} | {r.late} | {r.chain_share:.3f} | "
            f"{'yes' if r.escaped else 'no'} | {acc} |"
        )
    blend_label = "blend" if alpha is None else f"blend (α {alpha:g})"
    out += [
        "",
        f"| world | p0 | GRPO escaped | {blend_label} escaped | GRPO chains pay late | "
        f"{blend_label} chains pay late | GRPO held-out L2 | {blend_label} held-out L2 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for w in worlds:
        by_arm = {
            arm: [r for r in results if r.world == w.name and r.arm == arm]
            for arm in ("grpo", "blend")
        }
        cells = [
            f"{sum(r.escaped for r in rs)} / {len(rs)}" if rs else "–" for rs in by_arm.values()
        ]
        cells += [
            _pay(sum(r.chains_paid for r in rs), sum(r.chains for r in rs)) if rs else "–"
            for rs in by_arm.values()
        ]
        for rs in by_arm.values():
            acc = [r.l2_accuracy for r in rs if r.l2_accuracy is not None]
            cells.append(f"{np.mean(acc):.3f} ({len(acc)} runs)" if acc else "–")
        out.append(f"| {w.name} | {w.p0:.3f} | " + " | ".join(cells) + " |")
    out += [
        "",
        "Chains pay late: mean reward (count) of the late L2 trajectories with two or more "
        f"searches, pooled over the arm's runs. Held-out L2: mean accuracy at step {steps}.",
        "",
    ]
    test = a.tests.get("window")
    if test is None:
        out.append("Primary test: not computed (GRPO only: no blend arm).")
        for w in worlds:  # the pilot's rule: a GRPO run collapses below p0 / 2
            mine = [r for r in results if r.world == w.name and r.arm == "grpo"]
            fell = sum(r.chain_share < w.p0 / 2 for r in mine)
            out.append(
                f"Pilot, {w.name}: {fell} of {len(mine)} GRPO runs collapsed (late chain share "
                f"below p0 / 2 = {w.p0 / 2:.3f})."
            )
    else:
        reach = (
            f"at {test.grpo} GRPO escapes of {test.n_grpo}, p < {LEVEL:g} needs at least "
            f"{test.needed} blend escapes of {test.n_blend}"
            if test.needed is not None
            else f"at {test.grpo} GRPO escapes of {test.n_grpo}, no outcome of the blend's "
            f"{test.n_blend} runs reaches p < {LEVEL:g}: the design cannot decide"
        )
        verdict = (
            "significant: stratification helps the agent here"
            if test.significant
            else f"not significant at p < {LEVEL:g}"
        )
        out.append(
            f"Primary, window world: blend {test.blend} / {test.n_blend} escaped against GRPO "
            f"{test.grpo} / {test.n_grpo}, one-sided Fisher exact p = {test.p:.3g}: {verdict} "
            f"({reach})."
        )
    out.append("")
    inter = a.interaction
    if inter is None:
        out.append("Interaction: not computed (it needs both arms in the window and the control).")
    else:
        out.append(
            f"Interaction, (blend − GRPO escape share, window) − (the same, control): "
            f"{inter.value:+.3f}, 95% interval [{inter.low:+.3f}, {inter.high:+.3f}] "
            f"({RESAMPLES:,} bootstrap draws of runs within each world-arm cell)."
        )
    for w in worlds:
        found = a.accuracy.get(w.name)
        if found is None:
            out.append(
                f"Held-out L2 accuracy at step {steps}, blend − GRPO, {w.name}: not computed "
                f"({'GRPO only' if test is None else 'fewer than two runs an arm'})."
            )
            continue
        out.append(
            f"Held-out L2 accuracy at step {steps}, blend − GRPO, {w.name}: "
            + _difference_text(found)
        )
    for w in worlds:
        found = a.shares.get(w.name)
        if found is not None:
            out.append(
                f"Late chain share, blend − GRPO, {w.name} (not a registered endpoint): "
                + _difference_text(found)
            )
    counted = [
        (w.name, arm, [r.escaped for r in results if r.world == w.name and r.arm == arm])
        for w in worlds
        for arm in ("grpo", "blend")
    ]
    out.append(
        "Escape rates, Clopper-Pearson 95%: "
        + "; ".join(
            f"{world} {arm} {sum(e)} / {len(e)} [{lo:.2f}, {hi:.2f}]"
            for world, arm, e in counted
            if e
            for lo, hi in [clopper_pearson(sum(e), len(e))]
        )
        + "."
    )
    out.append("")
    if a.bandits:
        out += [
            "The trap bandit at the start's figures (pre-registered: P(chain) p0, a guess pays "
            "what 0-1 search trajectories paid, M the depth whose 1/M² is nearest what chains "
            "paid), escape fraction [Wilson 95%], and the probability of the runs' escape count "
            "were that fraction each run's chance:",
            "",
            "| world | p0 | p_guess | M | groups | α | escape | the runs' escapes | P(that count) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for b in a.bandits:
            arm = "grpo" if b.alpha == 0 else "blend"
            mine = [r.escaped for r in results if r.world == b.world and r.arm == arm]
            seen = f"{sum(mine)} / {len(mine)}" if mine else "–"
            chance = f"{sps.binom.pmf(sum(mine), len(mine), b.escape):.2g}" if mine else "–"
            out.append(
                f"| {b.world} | {b.start_chain:.3f} | {b.p_guess:.3f} | {b.depth} | "
                f"{b.groups} of {b.group_size} | {b.alpha:g} | {b.escape:.2f} "
                f"[{b.low:.2f}, {b.high:.2f}] ({b.seeds} seeds) | {seen} | {chance} |"
            )
    for c in a.commands:
        out.append(f"The bandit's prediction: {c}")
    return out


def _difference_text(d: Difference) -> str:
    return (
        f"{d.value:+.3f}, 95% Welch interval [{d.low:+.3f}, {d.high:+.3f}], p = {d.p:.2g} "
        f"(df {d.df:.1f}; 80% power at two-sided 0.05 for {d.detectable:.3f})."
    )


def foretold_lines(d: Diagnosed) -> list[str]:
    """How the diagnostic did, per world and arm, and its Brier score."""
    found = d.runs
    command = diagnose_command([Path("RUN")], d.versions, d.seeds, hop_speed=d.hop_speed)
    measured = d.hop_speed == "measured"
    out = [
        f"How the diagnostic did: `{command}` on every run (its first {d.versions} policy "
        "versions), the trap model's escape at the run's own alpha against whether the run "
        "escaped"
        + (
            ", the hops at the speed measured from those versions (1 where it is not measured):"
            if measured
            else ":"
        ),
        "",
        "| world | arm | runs | readings | mean predicted escape | escaped |"
        + (" hop speed measured: runs, median [median interval] |" if measured else ""),
        "|---|---|---|---|---|---|" + ("---|" if measured else ""),
    ]
    for world in dict.fromkeys(f.world for f in found):
        for arm in ("grpo", "blend"):
            mine = [f for f in found if f.world == world and f.arm == arm]
            if not mine:
                continue
            kinds = {
                k: sum(f.reading == k for f in mine) for k in dict.fromkeys(f.reading for f in mine)
            }
            told = [f.predicted for f in mine if f.predicted is not None]
            mean = f"{np.mean(told):.2f} ({len(told)} runs)" if told else "–"
            out.append(
                f"| {world} | {arm} | {len(mine)} | "
                + ", ".join(f"{k} {n}" for k, n in kinds.items())
                + f" | {mean} | {sum(f.escaped for f in mine)} / {len(mine)} |"
                + (_speeds(mine) if measured else "")
            )
    score = d.brier
    out += [
        "",
        "Brier score over the runs with a prediction: "
        + ("–" if score is None else f"{score:.3f} (0 is perfect; always saying 0.5 scores 0.250)"),
        "",
    ]
    return out


def _speeds(mine: list[Foretold]) -> str:
    seen = [f for f in mine if f.measured is not None and f.measured_ci is not None]
    if not seen:
        return f" 0 of {len(mine)} |"
    low = np.median([f.measured_ci[0] for f in seen])
    high = np.median([f.measured_ci[1] for f in seen])
    middle = np.median([f.measured for f in seen])
    return f" {len(seen)} of {len(mine)}, {middle:.2f} [{low:.2f}, {high:.2f}] |"


def plot(results: list[RunResult], worlds: list[World], steps: int, path: Path) -> None:
    """Every run's late chain share, a column per world and arm, with each world's p0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    rng = np.random.default_rng(0)  # the jitter only: the same picture every time
    ticks, labels = [], []
    for i, w in enumerate(worlds):
        centre = 3.0 * i
        for j, arm in enumerate(("grpo", "blend")):
            mine = [r for r in results if r.world == w.name and r.arm == arm]
            if not mine:
                continue
            x = centre + j + rng.uniform(-0.18, 0.18, len(mine))
            y = np.array([r.chain_share for r in mine])
            out = np.array([r.escaped for r in mine])
            colour = f"C{j}"
            ax.scatter(x[out], y[out], color=colour, s=36, zorder=3)
            ax.scatter(x[~out], y[~out], facecolors="none", edgecolors=colour, s=36, zorder=3)
            ax.text(centre + j, 1.02, f"{int(out.sum())}/{len(mine)}", ha="center", fontsize=9)
            ticks.append(centre + j)
            labels.append(f"{w.name}\n{arm}")
        ax.hlines(w.p0, centre - 0.4, centre + 1.4, colors="grey", linestyles="--", zorder=2)
        ax.text(centre + 1.45, w.p0, f"p0 {w.p0:.3f}", va="center", fontsize=8, color="grey")
    ax.set_xticks(ticks, labels)
    ax.set_xlim(-0.7, 3.0 * len(worlds) - 0.9)
    ax.set_ylim(0, 1.08)
    ax.set_ylabel(f"late L2 chain share (versions ≥ {late_from(steps)})")
    ax.set_title(
        "Every run: filled escaped (share ≥ p0), hollow not; above: escaped / runs", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
