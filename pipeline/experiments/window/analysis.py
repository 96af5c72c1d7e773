"""The window study's analysis (docs/results/window.prereg.md), from its runs' directories: per
run its late L2 chain share and whether it escaped, the registered tests, the trap bandit's cell
at the start's figures and how `pipeline.diagnose` did beside each outcome. `render.py` writes
it out, `command.py` is the command.

Per run, its late L2 chain share is the share of two-hop training trajectories
(`pipeline/experiments/searches.py`) with two or more searches among those of policy versions
>= 3/4 of the steps (225 of 300); the run **escaped** when that share is at least its world's
start share p0 (the pooled figure of the frozen start runs: `python -m pipeline.start`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import stats as sps

from pipeline.experiments.data import RunData, is_grpo, level_accuracy, load_runs, setting
from pipeline.experiments.diagnose import (
    ALPHAS,
    DiagnoseError,
    HopSetting,
    diagnose,
    matched_depth,
)
from pipeline.experiments.searches import bucket, read_trajectories
from pipeline.experiments.stats import detectable, welch
from pipeline.experiments.trap import Trap, cell

LEVEL = 0.01  # the primary test's threshold, registered
RESAMPLES = 10_000  # bootstrap draws of the interaction, registered


class WindowError(ValueError):
    """Input the analysis cannot use; one line saying what to do."""


@dataclass(frozen=True)
class World:
    name: str
    out_dir: Path
    p0: float
    guess_pay: float | None  # what 0-1 search trajectories paid at the start (the bandit's)
    chain_pay: float | None  # what chains paid at the start (the bandit's depth)


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
class Difference:
    """Blend - GRPO over runs: Welch's 95% interval, two-sided p, the Welch-Satterthwaite
    degrees of freedom (0: no spread) and the difference these runs detect with 80% power."""

    value: float
    low: float
    high: float
    p: float
    df: float
    detectable: float


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
    hop_speed: float = 1.0  # the hops' speed the prediction took
    measured: float | None = None  # the hop speed measured from these versions (None: not)
    measured_ci: tuple[float, float] | None = None


# ------------------------------------------------------------------------------ the runs


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


def unfinished_line(worlds: dict[str, dict[str, list[RunData]]], steps: int) -> str | None:
    """One line naming every run not finished (None: all are), each with why: the registered
    analysis counts every run and drops none."""
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


def difference(blend: list[float], grpo: list[float]) -> Difference | None:
    """Blend - GRPO (held-out accuracy, late chain share); None with fewer than two runs a
    side."""
    a, b = np.asarray(blend, dtype=float), np.asarray(grpo, dtype=float)
    if len(a) < 2 or len(b) < 2:
        return None
    p, (low, high), df = welch(a, b)
    return Difference(float(a.mean() - b.mean()), low, high, p, df, detectable(a, b))


# ------------------------------------------------------------------------------ the models


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


def reading_kind(reading: str) -> str:
    """The reading's verdict in a few words, to count them."""
    for kind in ("stratify", "do not stratify", "deep trap", "no window", "too few"):
        if reading.startswith(kind):
            return kind
    return "no trap" if reading.startswith("chains already pay") else "no match"


def foretold(
    run: RunData,
    result: RunResult,
    alpha: float,
    versions: int,
    seeds: int,
    hop_speed: HopSetting = 1.0,
) -> Foretold:
    """Diagnose `run` from its first `versions` policy versions, as `python -m pipeline.diagnose`
    does with the same arguments, and take the prediction at `alpha`, the run's own."""
    try:
        d = diagnose(run.run_dir, versions, seeds=seeds, hop_speed=hop_speed)
    except DiagnoseError as exc:
        raise WindowError(str(exc)) from None
    at = next((p.escape for p in d.predictions if p.alpha == alpha), None)
    return Foretold(
        result.world,
        result.arm,
        result.name,
        reading_kind(d.reading),
        at,
        result.escaped,
        d.hop_speed,
        None if d.hop is None else d.hop.speed,
        None if d.hop is None else d.hop.speed_ci,
    )


def brier(found: list[Foretold]) -> float | None:
    """Mean squared gap between predicted escape and the outcome (1 escaped, 0 not) over the
    runs with a prediction."""
    pairs = [(f.predicted, float(f.escaped)) for f in found if f.predicted is not None]
    return float(np.mean([(p - o) ** 2 for p, o in pairs])) if pairs else None


# ------------------------------------------------------------------------------ all of it


@dataclass(frozen=True)
class Diagnosed:
    """How the diagnostic did: each run read from its first `versions` policy versions."""

    versions: int
    seeds: int
    hop_speed: HopSetting
    runs: list[Foretold]
    brier: float | None


@dataclass(frozen=True)
class Analysis:
    steps: int
    worlds: list[World]
    results: list[RunResult]
    tests: dict[str, Test]  # the registered test is the window world's
    interaction: Interval | None
    accuracy: dict[str, Difference | None]  # held-out L2 at the last step, per world
    shares: dict[str, Difference | None]  # late chain share, per world (not registered)
    bandits: list[Bandit]
    commands: list[str]  # the bandit's command for worlds without the start's pay
    alpha: float | None  # the blend's
    diagnosed: Diagnosed | None


def analyse(
    worlds: list[World],
    arms: dict[str, dict[str, list[RunData]]],
    steps: int,
    seed: int = 0,
    bandit_seeds: int = 200,
    diagnose_versions: int | None = None,
    diagnose_seeds: int = 200,
    diagnose_hop_speed: HopSetting = 1.0,
) -> Analysis:
    """Every figure of the study from the worlds' runs by arm (`arms_of`, all finished)."""
    results = [
        run_result(r, w.name, arm, w.p0, steps)
        for w in worlds
        for arm, runs in arms[w.name].items()
        for r in sorted(runs, key=lambda r: r.seed)
    ]

    def of(world: str, arm: str) -> list[RunResult]:
        return [r for r in results if r.world == world and r.arm == arm]

    def escapes(world: str, arm: str) -> list[bool]:
        return [r.escaped for r in of(world, arm)]

    both = "blend" in arms["window"]
    tests = (
        {"window": primary(escapes("window", "blend"), escapes("window", "grpo"))} if both else {}
    )
    inter = None
    if both and len(worlds) == 2:
        inter = interaction(
            (escapes("window", "blend"), escapes("window", "grpo")),
            (escapes("control", "blend"), escapes("control", "grpo")),
            seed=seed,
        )
    accuracy, shares = {}, {}
    for w in worlds:
        acc = {
            arm: [r.l2_accuracy for r in of(w.name, arm) if r.l2_accuracy is not None]
            for arm in ("blend", "grpo")
        }
        share = {arm: [r.chain_share for r in of(w.name, arm)] for arm in ("blend", "grpo")}
        accuracy[w.name] = difference(acc["blend"], acc["grpo"]) if both else None
        shares[w.name] = difference(share["blend"], share["grpo"]) if both else None
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
                w.name, w.p0, w.guess_pay, w.chain_pay, alphas, size, groups, bandit_seeds
            )
        else:
            commands.append(
                f"{w.name}: `{bandit_command(w.p0, alphas, size, groups)}`, or give "
                f"--guess-pay-{w.name} and --chain-pay-{w.name} here"
            )
    diagnosed = None
    if diagnose_versions is not None:
        if alpha is not None and alpha not in ALPHAS:
            raise WindowError(
                f"the blend's alpha {alpha:g} is not one the diagnostic predicts "
                f"({', '.join(f'{a:g}' for a in ALPHAS)}): leave out --diagnose-versions"
            )
        alpha_of = {"grpo": 0.0, "blend": alpha}
        by_name = {(w.name, r.name): r for w in worlds for rs in arms[w.name].values() for r in rs}
        found = [
            foretold(
                by_name[(r.world, r.name)],
                r,
                alpha_of[r.arm],
                diagnose_versions,
                diagnose_seeds,
                diagnose_hop_speed,
            )
            for r in results
        ]
        diagnosed = Diagnosed(
            diagnose_versions, diagnose_seeds, diagnose_hop_speed, found, brier(found)
        )
    return Analysis(
        steps,
        worlds,
        results,
        tests,
        inter,
        accuracy,
        shares,
        bandits,
        commands,
        alpha,
        diagnosed,
    )
