"""`python -m pipeline.experiments.window --window DIR --control DIR --p0-window P --p0-control P`:
the registered analysis of issue 59's window experiment (docs/results/window.prereg.md), once all
its runs are done.

Per run, its late L2 chain share: the share of two-hop training trajectories
(`pipeline/experiments/searches.py`) with two or more searches among those of policy versions
>= 3/4 of `--steps` (225 of 300), and whether it **escaped** (that share at least its world's
start share p0, the pooled figure of the frozen start runs: `python -m pipeline.start`). Then

- primary: escaped runs of the blend against GRPO in the window world, one-sided Fisher exact
  test (blend > GRPO), the verdict at p < 0.01, and what the design can reach at the GRPO count
  seen;
- the interaction (blend - GRPO escape share in the window) - (the same in the control), with a
  95% percentile interval from 10,000 bootstrap draws of runs within each world-arm cell;
- held-out L2 accuracy at the last step (each run's eval.jsonl), blend - GRPO per world, with
  Welch's t interval on the runs' degrees of freedom (`pipeline/experiments/stats.py`);
- what chains pay late, per arm, pooled over its runs;
- the trap bandit's prediction for the same cell where the start's pay is given
  (`--guess-pay-*`, `--chain-pay-*`: M the depth whose 1/M^2 is nearest what chains pay, as the
  pre-registration says), else the command that prints it;
- `--plot`: a strip plot of every run's late chain share per world and arm, with the p0 lines;
- `--diagnose-versions N`: how `python -m pipeline.diagnose` did (issue 59, item 6): each run
  diagnosed from its own first N policy versions, the trap model's predicted escape at the run's
  alpha set beside whether it escaped (per world and arm, and the Brier score over runs), and
  the readings counted.

A run that is not finished (fewer learner steps than `--steps`, no evaluation at the last step,
no late two-hop trajectory) is refused with the others like it, in one line: the registered
analysis counts every run and drops none. `--grpo-only` reads a GRPO-only pilot (no test).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy import stats as sps

from pipeline.evaluation.replay import write_atomically
from pipeline.experiments.data import RunData, is_grpo, level_accuracy, load_runs, setting
from pipeline.experiments.diagnose import (
    ALPHAS,
    DiagnoseError,
    diagnose,
    matched_depth,
)
from pipeline.experiments.proportions import clopper_pearson
from pipeline.experiments.searches import bucket, read_trajectories
from pipeline.experiments.stats import detectable, welch
from pipeline.experiments.trap import Trap, cell

LEVEL = 0.01  # the primary test's threshold, registered
RESAMPLES = 10_000  # bootstrap draws of the interaction, registered


class WindowError(ValueError):
    """Input the analysis cannot use; one line saying what to do."""


@dataclass(frozen=True)
class RunResult:
    world: str
    arm: str  # "grpo" or "blend"
    name: str
    seed: int
    late: int  # late L2 trajectories
    chain_share: float
    escaped: bool
    chains: int  # late L2 trajectories with two or more searches
    chains_paid: float  # their rewards' sum
    l2_accuracy: float | None  # held-out, at the last step


@dataclass(frozen=True)
class Test:
    """The primary test in one world: escaped runs of the blend against GRPO."""

    blend: int
    n_blend: int
    grpo: int
    n_grpo: int
    p: float
    significant: bool
    needed: int | None  # the fewest blend escapes that reach p < LEVEL at this GRPO count


@dataclass(frozen=True)
class Interval:
    value: float
    low: float
    high: float


@dataclass(frozen=True)
class Bandit:
    """The trap bandit's escape fraction for one world and alpha (Wilson 95%)."""

    world: str
    alpha: float
    depth: int
    p_guess: float
    start_chain: float
    group_size: int
    groups: int
    seeds: int
    escape: float
    low: float
    high: float


@dataclass(frozen=True)
class Foretold:
    """`pipeline.diagnose` on one run's first versions, beside the run's outcome."""

    world: str
    arm: str
    name: str
    reading: str  # the reading's first words: "stratify", "no window", ...
    predicted: float | None  # the trap model's escape at the run's alpha (None: no match)
    escaped: bool


# ------------------------------------------------------------------------------ per run


def late_from(steps: int) -> int:
    """The first policy version of the last quarter of `steps` learner steps."""
    return 3 * (steps // 4)


def final_eval(run: RunData, steps: int) -> dict | None:
    """The run's evaluation record at step `steps` (None: it has none)."""
    return next((e for e in run.evals if e.get("step") == steps), None)


def unfinished(run: RunData, steps: int) -> str | None:
    """Why `run` cannot be analysed yet (None: it can)."""
    if not run.metrics:
        return "no metrics.jsonl"
    last = int(run.metrics[-1].get("step", 0))
    if last < steps:
        return f"step {last} of {steps}"
    if final_eval(run, steps) is None:
        return f"no evaluation at step {steps}"
    return None


def run_result(run: RunData, world: str, arm: str, p0: float, steps: int) -> RunResult:
    found = read_trajectories(run.run_dir)
    late = None if found is None else found.where(found.version >= late_from(steps))
    if late is None or not len(late):
        raise WindowError(
            f"{run.run_dir} kept no two-hop training trajectory of versions >= "
            f"{late_from(steps)}: it needs buffer.spill true on the mini_gaia world"
        )
    chain = bucket(late.searches) == 2
    share = float(chain.mean())
    record = final_eval(run, steps)
    return RunResult(
        world,
        arm,
        run.name,
        run.seed,
        len(late),
        share,
        share >= p0,
        int(chain.sum()),
        float(late.reward[chain].sum()),
        None if record is None else level_accuracy(record).get("L2"),
    )


def reading_kind(reading: str) -> str:
    """The reading's verdict in a few words, to count them."""
    for kind in ("stratify", "do not stratify", "deep trap", "no window", "too few"):
        if reading.startswith(kind):
            return kind
    return "no trap" if reading.startswith("chains already pay") else "no match"


def foretold(run: RunData, result: RunResult, alpha: float, versions: int, seeds: int) -> Foretold:
    """Diagnose `run` from its first `versions` policy versions, as `python -m pipeline.diagnose`
    does with the same arguments, and take the prediction at `alpha`, the run's own."""
    try:
        d = diagnose(run.run_dir, versions, seeds=seeds)
    except DiagnoseError as exc:
        raise WindowError(str(exc)) from None
    at = next((p.escape for p in d.predictions if p.alpha == alpha), None)
    return Foretold(
        result.world, result.arm, result.name, reading_kind(d.reading), at, result.escaped
    )


def brier(found: list[Foretold]) -> float | None:
    """Mean squared gap between predicted escape and the outcome (1 escaped, 0 not) over the
    runs with a prediction."""
    pairs = [(f.predicted, float(f.escaped)) for f in found if f.predicted is not None]
    return float(np.mean([(p - o) ** 2 for p, o in pairs])) if pairs else None


def foretold_lines(found: list[Foretold], versions: int, seeds: int) -> list[str]:
    out = [
        f"How the diagnostic did: `python -m pipeline.diagnose RUN --first-versions {versions} "
        f"--seeds {seeds}` on every run (its first {versions} policy versions), the trap "
        "model's escape at the run's own alpha against whether the run escaped:",
        "",
        "| world | arm | runs | readings | mean predicted escape | escaped |",
        "|---|---|---|---|---|---|",
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
            )
    score = brier(found)
    out += [
        "",
        "Brier score over the runs with a prediction: "
        + ("–" if score is None else f"{score:.3f} (0 is perfect; always saying 0.5 scores 0.250)"),
        "",
    ]
    return out


# ------------------------------------------------------------------------------ the tests


def fisher_greater(blend: int, n_blend: int, grpo: int, n_grpo: int) -> float:
    """One-sided Fisher exact p that the blend escapes more often than GRPO."""
    table = [[blend, n_blend - blend], [grpo, n_grpo - grpo]]
    return float(sps.fisher_exact(table, alternative="greater").pvalue)


def needed(n_blend: int, grpo: int, n_grpo: int, level: float = LEVEL) -> int | None:
    """The fewest blend escapes of `n_blend` with p < `level` against `grpo` of `n_grpo`; None
    when no outcome of the blend reaches it."""
    return next(
        (b for b in range(n_blend + 1) if fisher_greater(b, n_blend, grpo, n_grpo) < level), None
    )


def primary(blend: list[bool], grpo: list[bool], level: float = LEVEL) -> Test:
    """The registered test on the runs' escapes (one bool a run)."""
    b, g = int(sum(blend)), int(sum(grpo))
    p = fisher_greater(b, len(blend), g, len(grpo))
    return Test(b, len(blend), g, len(grpo), p, p < level, needed(len(blend), g, len(grpo), level))


def interaction(
    window: tuple[list[bool], list[bool]],
    control: tuple[list[bool], list[bool]],
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Interval:
    """(blend - GRPO escape share in the window) - (the same in the control); each argument
    (blend's escapes, GRPO's). 95% percentile interval over `resamples` draws of runs with
    replacement within each of the four cells."""
    rng = np.random.default_rng(seed)

    def share(cell_: list[bool]) -> tuple[float, np.ndarray]:
        x = np.asarray(cell_, dtype=float)
        return float(x.mean()), x[rng.integers(0, len(x), (resamples, len(x)))].mean(axis=1)

    (wb, dwb), (wg, dwg) = share(window[0]), share(window[1])
    (cb, dcb), (cg, dcg) = share(control[0]), share(control[1])
    draws = (dwb - dwg) - (dcb - dcg)
    low, high = np.percentile(draws, [2.5, 97.5])
    return Interval((wb - wg) - (cb - cg), float(low), float(high))


@dataclass(frozen=True)
class Difference:
    """Blend - GRPO over runs: Welch's 95% interval, two-sided p, the Welch-Satterthwaite
    degrees of freedom (0: no spread) and the difference these runs detect with 80% power."""

    value: float
    low: float
    high: float
    p: float
    df: float
    detectable: float


def difference(blend: list[float], grpo: list[float]) -> Difference | None:
    """Blend - GRPO (held-out accuracy, late chain share); None with fewer than two runs a
    side."""
    a, b = np.asarray(blend, dtype=float), np.asarray(grpo, dtype=float)
    if len(a) < 2 or len(b) < 2:
        return None
    p, (low, high), df = welch(a, b)
    return Difference(float(a.mean() - b.mean()), low, high, p, df, detectable(a, b))


def bandit(
    world: str,
    p0: float,
    guess_pay: float,
    chain_pay: float,
    alphas: list[float],
    group_size: int,
    groups: int,
    seeds: int,
) -> list[Bandit]:
    """The pre-registered bandit cell: P(chain) p0, a guess paying what 0-1 search
    trajectories paid at the start, M the depth whose 1/M^2 is nearest what chains paid."""
    depth = matched_depth(chain_pay)
    out = []
    for alpha in alphas:
        c = cell(Trap(depth, guess_pay, group_size, groups, alpha=alpha, start_chain=p0), seeds)
        out.append(
            Bandit(
                world,
                alpha,
                depth,
                guess_pay,
                p0,
                group_size,
                groups,
                seeds,
                c.escape,
                c.escape_low,
                c.escape_high,
            )
        )
    return out


def bandit_command(p0: float, alphas: list[float], size: int, groups: int) -> str:
    """The pre-registered command, PAY01 and M left for the start's figures."""
    return (
        f"python -m pipeline.trap --start-chain {p0:g} --p-guess PAY01 --chain-choices M "
        f"--group-size {size} --groups {groups} --alphas {','.join(f'{a:g}' for a in alphas)} "
        "--seeds 200 (PAY01: what 0-1 search L2 trajectories paid at the start; M: the depth "
        "whose 1/M^2 is nearest what chains paid)"
    )


# ------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class World:
    name: str
    out_dir: Path
    p0: float
    guess_pay: float | None
    chain_pay: float | None


def arms_of(world: World, grpo: str, blend: str | None) -> dict[str, list[RunData]]:
    """The world's runs by arm ("grpo", "blend", the variants named so), checked: each arm
    present, each run's estimator its arm's (`unfinished_line` checks that they are done)."""
    if not world.out_dir.is_dir():
        raise WindowError(f"--{world.name} {world.out_dir}: no such directory")
    runs, _ = load_runs(world.out_dir)
    named = {"grpo": grpo} | ({"blend": blend} if blend else {})
    arms = {arm: [r for r in runs if r.variant == v] for arm, v in named.items()}
    variants = sorted({r.variant for r in runs}) or ["none"]
    for arm, variant in named.items():
        if not arms[arm]:
            raise WindowError(
                f"--{world.name} {world.out_dir} has no runs of variant {variant!r} (variants: "
                f"{', '.join(variants)}): name the {arm} arm's with --{arm}"
            )
        wrong = [r.name for r in arms[arm] if r.config and is_grpo(r.config) != (arm == "grpo")]
        if wrong:
            what = "is not GRPO (learner.advantage.alpha 0)" if arm == "grpo" else "is GRPO"
            raise WindowError(
                f"{world.out_dir}: {', '.join(wrong)} {what}, yet --{arm} names its variant"
            )
    return arms


def unfinished_line(worlds: dict[str, dict[str, list[RunData]]], steps: int) -> str | None:
    """One line naming every run not finished (None: all are), each with why."""
    behind = [
        f"{world}/{r.name} ({why})"
        for world, arms in worlds.items()
        for runs in arms.values()
        for r in sorted(runs, key=lambda r: r.seed)
        if (why := unfinished(r, steps)) is not None
    ]
    if not behind:
        return None
    total = sum(len(rs) for arms in worlds.values() for rs in arms.values())
    return (
        f"{len(behind)} of {total} runs are not finished: {', '.join(behind)}; finish them "
        "(python -m pipeline.experiment FILE resumes) before the registered analysis"
    )


# ------------------------------------------------------------------------------ writing


def _pay(paid: float, n: int) -> str:
    return f"{paid / n:.3f} ({n})" if n else "– (0)"


def lines(
    results: list[RunResult],
    worlds: list[World],
    tests: dict[str, Test],
    inter: Interval | None,
    accuracy: dict[str, Difference | None],
    shares: dict[str, Difference | None],
    bandits: list[Bandit],
    commands: list[str],
    steps: int,
    alpha: float | None,
) -> list[str]:
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
    test = tests.get("window")
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
    if inter is None:
        out.append("Interaction: not computed (it needs both arms in the window and the control).")
    else:
        out.append(
            f"Interaction, (blend − GRPO escape share, window) − (the same, control): "
            f"{inter.value:+.3f}, 95% interval [{inter.low:+.3f}, {inter.high:+.3f}] "
            f"({RESAMPLES:,} bootstrap draws of runs within each world-arm cell)."
        )
    for w in worlds:
        found = accuracy.get(w.name)
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
        found = shares.get(w.name)
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
    if bandits:
        out += [
            "The trap bandit at the start's figures (pre-registered: P(chain) p0, a guess pays "
            "what 0-1 search trajectories paid, M the depth whose 1/M² is nearest what chains "
            "paid), escape fraction [Wilson 95%], and the probability of the runs' escape count "
            "were that fraction each run's chance:",
            "",
            "| world | p0 | p_guess | M | groups | α | escape | the runs' escapes | P(that count) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for b in bandits:
            arm = "grpo" if b.alpha == 0 else "blend"
            mine = [r.escaped for r in results if r.world == b.world and r.arm == arm]
            seen = f"{sum(mine)} / {len(mine)}" if mine else "–"
            chance = f"{sps.binom.pmf(sum(mine), len(mine), b.escape):.2g}" if mine else "–"
            out.append(
                f"| {b.world} | {b.start_chain:.3f} | {b.p_guess:.3f} | {b.depth} | "
                f"{b.groups} of {b.group_size} | {b.alpha:g} | {b.escape:.2f} "
                f"[{b.low:.2f}, {b.high:.2f}] ({b.seeds} seeds) | {seen} | {chance} |"
            )
    for c in commands:
        out.append(f"The bandit's prediction: {c}")
    return out


def _difference_text(d: Difference) -> str:
    return (
        f"{d.value:+.3f}, 95% Welch interval [{d.low:+.3f}, {d.high:+.3f}], p = {d.p:.2g} "
        f"(df {d.df:.1f}; 80% power at two-sided 0.05 for {d.detectable:.3f})."
    )


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


# ------------------------------------------------------------------------------ the command


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.experiments.window", description=__doc__.split("\n")[0]
    )
    p.add_argument("--window", type=Path, required=True, help="the window world's experiment out")
    p.add_argument("--control", type=Path, help="the control world's experiment out")
    p.add_argument("--p0-window", type=float, required=True, help="the window's start share")
    p.add_argument("--p0-control", type=float, help="the control's start share")
    for world in ("window", "control"):
        p.add_argument(
            f"--guess-pay-{world}",
            type=float,
            help=f"what 0-1 search L2 trajectories paid at the {world}'s start (the bandit)",
        )
        p.add_argument(
            f"--chain-pay-{world}",
            type=float,
            help=f"what chains paid at the {world}'s start (the bandit's depth)",
        )
    p.add_argument("--grpo", default="grpo", help="the GRPO arm's variant (default grpo)")
    p.add_argument("--blend", default="blend", help="the blend arm's variant (default blend)")
    p.add_argument(
        "--grpo-only", action="store_true", help="a GRPO-only pilot: no blend arm, no test"
    )
    p.add_argument("--steps", type=int, default=300, help="learner steps a run (default 300)")
    p.add_argument("--seed", type=int, default=0, help="of the bootstrap")
    p.add_argument(
        "--bandit-seeds", type=int, default=200, help="bandit seeds a prediction (default 200)"
    )
    p.add_argument(
        "--diagnose-versions",
        type=int,
        help="also diagnose each run from its first N policy versions and set the diagnostic's "
        "prediction beside the outcome (the report's choice: a tenth of the steps)",
    )
    p.add_argument(
        "--diagnose-seeds", type=int, default=200, help="bandit seeds a diagnosis (default 200)"
    )
    p.add_argument("--json", type=Path, help="write the analysis here")
    p.add_argument("--plot", type=Path, help="write the strip plot here (PNG)")
    return p


def _checked(args: argparse.Namespace) -> list[World]:
    problems = [
        f"--{flag} {value:g} must be in (0, 1)"
        for flag, value in (("p0-window", args.p0_window), ("p0-control", args.p0_control))
        if value is not None and not 0 < value < 1
    ]
    for world in ("window", "control"):
        pays = (getattr(args, f"guess_pay_{world}"), getattr(args, f"chain_pay_{world}"))
        if (pays[0] is None) != (pays[1] is None):
            problems.append(f"--guess-pay-{world} and --chain-pay-{world} go together")
        if any(x is not None and not 0 <= x <= 1 for x in pays):
            problems.append(f"--guess-pay-{world} and --chain-pay-{world} must be in [0, 1]")
    if (args.control is None) != (args.p0_control is None):
        problems.append("--control and --p0-control go together")
    if args.steps < 4:
        problems.append(f"--steps {args.steps} must be at least 4 (its last quarter is read)")
    if args.bandit_seeds < 1:
        problems.append("--bandit-seeds must be >= 1")
    if args.diagnose_versions is not None and not 1 <= args.diagnose_versions <= args.steps:
        problems.append(f"--diagnose-versions must be in 1..--steps ({args.steps})")
    if args.diagnose_seeds < 1:
        problems.append("--diagnose-seeds must be >= 1")
    for name, path in (("json", args.json), ("plot", args.plot)):
        if path is not None and not path.parent.is_dir():
            problems.append(f"--{name} {path}: its folder does not exist")
    if problems:
        raise WindowError(problems[0])
    worlds = [
        World("window", args.window, args.p0_window, args.guess_pay_window, args.chain_pay_window)
    ]
    if args.control is not None:
        worlds.append(
            World(
                "control",
                args.control,
                args.p0_control,
                args.guess_pay_control,
                args.chain_pay_control,
            )
        )
    return worlds


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        worlds = _checked(args)
        blend_variant = None if args.grpo_only else args.blend
        arms = {w.name: arms_of(w, args.grpo, blend_variant) for w in worlds}
        if (line := unfinished_line(arms, args.steps)) is not None:
            raise WindowError(line)
        results = [
            run_result(r, w.name, arm, w.p0, args.steps)
            for w in worlds
            for arm, runs in arms[w.name].items()
            for r in sorted(runs, key=lambda r: r.seed)
        ]
    except WindowError as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2

    def escapes(world: str, arm: str) -> list[bool]:
        return [r.escaped for r in results if r.world == world and r.arm == arm]

    def accuracies(world: str, arm: str) -> list[float]:
        return [
            r.l2_accuracy
            for r in results
            if r.world == world and r.arm == arm and r.l2_accuracy is not None
        ]

    both = not args.grpo_only
    # the registered test is the window world's; the control enters through the interaction
    tests = (
        {"window": primary(escapes("window", "blend"), escapes("window", "grpo"))} if both else {}
    )
    inter = None
    if both and len(worlds) == 2:
        inter = interaction(
            (escapes("window", "blend"), escapes("window", "grpo")),
            (escapes("control", "blend"), escapes("control", "grpo")),
            seed=args.seed,
        )
    accuracy = {
        w.name: difference(accuracies(w.name, "blend"), accuracies(w.name, "grpo"))
        if both
        else None
        for w in worlds
    }

    def late_shares(world: str, arm: str) -> list[float]:
        return [r.chain_share for r in results if r.world == world and r.arm == arm]

    shares = {
        w.name: difference(late_shares(w.name, "blend"), late_shares(w.name, "grpo"))
        if both
        else None
        for w in worlds
    }
    sample = next(iter(arms["window"].values()))[0].config
    size = int(setting(sample, "buffer.group_size", 16))
    groups = int(setting(sample, "learner.groups_per_step", 1))
    alpha = None
    if both:
        alpha = float(setting(arms["window"]["blend"][0].config, "learner.advantage.alpha", 0.8))
    alphas = [0.0] + ([alpha] if alpha is not None else [])
    bandits, commands = [], []
    for w in worlds:
        if w.guess_pay is not None and w.chain_pay is not None:
            bandits += bandit(
                w.name, w.p0, w.guess_pay, w.chain_pay, alphas, size, groups, args.bandit_seeds
            )
        else:
            commands.append(
                f"{w.name}: `{bandit_command(w.p0, alphas, size, groups)}`, or give "
                f"--guess-pay-{w.name} and --chain-pay-{w.name} here"
            )
    diagnosed: list[Foretold] = []
    if args.diagnose_versions is not None:
        alpha_of = {"grpo": 0.0, "blend": alpha}
        if alpha is not None and alpha not in ALPHAS:
            print(
                f"strata: error: the blend's alpha {alpha:g} is not one the diagnostic predicts "
                f"({', '.join(f'{a:g}' for a in ALPHAS)}): leave out --diagnose-versions",
                file=sys.stderr,
            )
            return 2
        by_name = {(w.name, r.name): r for w in worlds for rs in arms[w.name].values() for r in rs}
        try:
            diagnosed = [
                foretold(
                    by_name[(r.world, r.name)],
                    r,
                    alpha_of[r.arm],
                    args.diagnose_versions,
                    args.diagnose_seeds,
                )
                for r in results
            ]
        except WindowError as exc:
            print(f"strata: error: {exc}", file=sys.stderr)
            return 2
    printed = lines(
        results, worlds, tests, inter, accuracy, shares, bandits, commands, args.steps, alpha
    )
    if diagnosed:
        printed += ["", *foretold_lines(diagnosed, args.diagnose_versions, args.diagnose_seeds)]
    command = shlex.join(["python", "-m", "pipeline.experiments.window", *(argv or sys.argv[1:])])
    print("\n".join(printed), flush=True)
    if args.plot:
        write_atomically(args.plot, lambda tmp: plot(results, worlds, args.steps, tmp))
    if args.json:
        found = {
            "command": command,
            "steps": args.steps,
            "late_from": late_from(args.steps),
            "level": LEVEL,
            "worlds": [asdict(w) | {"out_dir": str(w.out_dir)} for w in worlds],
            "runs": [asdict(r) for r in results],
            "tests": {k: asdict(t) for k, t in tests.items()},
            "interaction": None if inter is None else asdict(inter),
            "accuracy": {k: None if v is None else asdict(v) for k, v in accuracy.items()},
            "chain_share": {k: None if v is None else asdict(v) for k, v in shares.items()},
            "bandit": [asdict(b) for b in bandits],
            "diagnosed": None
            if args.diagnose_versions is None
            else {
                "versions": args.diagnose_versions,
                "seeds": args.diagnose_seeds,
                "runs": [asdict(f) for f in diagnosed],
                "brier": brier(diagnosed),
            },
        }
        text = json.dumps(found, indent=1) + "\n"
        write_atomically(args.json, lambda tmp: tmp.write_text(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
