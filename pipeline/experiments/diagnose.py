"""`python -m pipeline.diagnose RUN_DIR [RUN_DIR ...]`: should this run stratify?

From a run's first policy versions (every trajectory of a frozen run, learner.lr <= FROZEN_LR),
read from its `trajectories/*.parquet`, or from several runs of one world and setting pooled
(a short pilot's):

- per stratum (the run's own stratifier, the `stratum` column): its share of the trajectories,
  the share of its trajectories alone in their stratum within their group (what SAN gives 0,
  so the blend trains them with its (1 - alpha) GRPO part only), and what it pays;
- on the two-hop questions (`--source`), the chain share p0, what chains and the rest pay, and
  the within-question gap with its bootstrap interval (`searches.within_gap_ci`);
- the hop's speed relative to the stratum's, with its interval (`hop_speed.py`);
- the trap bandit's predicted escape for alpha 0, 0.6 and 0.8 at the matched start
  (`pipeline/experiments/trap.py`): P(chain) p0, a guess paying what the rest pay, a chain
  paying 1/M^2 with M the depth whose 1/M^2 is nearest what chains pay, the run's group size
  and groups a step, and the hops learning at `--hop-speed` (1, as fast as the stratum, unless
  given; `measured`: the speed measured here, the escape at its interval's ends beside it);

and one line of reading. The bandit is a model: its prediction is a statement about a world
that behaves like it, to be checked against the run's outcome. Every figure the diagnosis prints
is the command's with the same arguments: a run's report and the window analysis print the
command line that gives them.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as ds
import yaml

from pipeline.experiments import hop_speed as hops
from pipeline.experiments.searches import SOURCE, Trajectories, is_frozen, within_gap_ci
from pipeline.experiments.trap import Trap, cell

ALPHAS = (0.0, 0.6, 0.8)
MAX_DEPTH = 12  # a chain that never paid is matched to this depth (1/144 a start)
MIN_QUESTIONS = 5
"""Two-hop questions with both chains and the rest that a prediction needs: a gap read off
fewer is a few questions' accidents."""
WORTH = 0.5
"""The blend's predicted escape below which the reading is "deep trap", not "stratify": a blend
that the model sees rescuing fewer than half the runs is not a recommendation, however far its
interval lies above GRPO's (0.13 against 0.01 separates two rare events)."""
VERSIONS = 5
"""Policy versions read by default: a run's start, before its estimator has moved it far."""
HopSetting = float | Literal["measured"]


@dataclass(frozen=True)
class Stratum:
    stratum: int
    share: float
    alone: float  # share of its trajectories alone in their stratum within their group
    pays: float
    count: int


@dataclass(frozen=True)
class Prediction:
    alpha: float
    escape: float
    low: float
    high: float
    speed_range: tuple[float, float] | None = None
    """The escape with the hops at the ends of the measured speed's interval (`--hop-speed
    measured` only)."""


@dataclass(frozen=True)
class Diagnosis:
    runs: int
    trajectories: int
    versions: str  # which policy versions were read
    group_size: int
    strata: list[Stratum]
    p0: float | None  # chains' share on `source` (None: no such trajectory)
    chains_pay: float | None
    rest_pay: float | None
    gap: float | None
    gap_ci: tuple[float, float] | None
    depth: int | None  # the bandit's M
    hop: hops.HopSpeed | None  # None: not matched, or a frozen run (it does not learn)
    hop_speed: float  # the hops' speed the predictions take
    predictions: list[Prediction]
    reading: str


def alone_shares(group: np.ndarray, stratum: np.ndarray) -> np.ndarray:
    """Per trajectory: True when no other member of its group shares its stratum."""
    keys = np.char.add(np.char.add(group.astype(str), "\x00"), stratum.astype(str))
    _, index, counts = np.unique(keys, return_inverse=True, return_counts=True)
    return counts[index] == 1


def strata_table(group: np.ndarray, stratum: np.ndarray, reward: np.ndarray) -> list[Stratum]:
    alone = alone_shares(group, stratum)
    rows = []
    for s in np.unique(stratum):
        sel = stratum == s
        rows.append(
            Stratum(
                int(s),
                float(sel.mean()),
                float(alone[sel].mean()),
                float(reward[sel].mean()),
                int(sel.sum()),
            )
        )
    return rows


def matched_depth(chains_pay: float) -> int:
    """The trap depth M whose chain start 1/M^2 is nearest `chains_pay` (2 to MAX_DEPTH)."""
    if chains_pay <= 0:
        return MAX_DEPTH
    return int(min(MAX_DEPTH, max(2, round(1 / math.sqrt(chains_pay)))))


def reading_line(
    matched: str,
    predictions: list[Prediction],
    gap: float | None,
    gap_ci: tuple[float, float] | None,
) -> str:
    """The one-line reading; `matched` says what the bandit was matched to."""
    if gap is None or not predictions:
        return "no chains and non-chains on the same questions: the trap model cannot be matched"
    grpo = next(p for p in predictions if p.alpha == 0.0)
    best = max((p for p in predictions if p.alpha > 0), key=lambda p: p.escape)
    if gap_ci is not None and gap_ci[0] > 0:
        return (
            "chains already pay more than the rest of their questions (gap interval above 0): "
            "no trap to escape; stratification is not predicted to matter"
        )
    if best.alpha > 0 and best.low > grpo.high:
        if best.escape >= WORTH:
            return (
                f"stratify: the trap model predicts escape {best.escape:.2f} at alpha "
                f"{best.alpha:g} against {grpo.escape:.2f} under GRPO ({matched})"
            )
        return (
            f"deep trap: the trap model predicts the blend escapes more often than GRPO but "
            f"rarely ({best.escape:.2f} at alpha {best.alpha:g} against {grpo.escape:.2f}): "
            f"stratifying would rescue few runs; read more versions once chains pay "
            f"({matched})"
        )
    if grpo.escape > 0 and grpo.low > max(p.high for p in predictions if p.alpha > 0):
        return (
            f"do not stratify: GRPO is predicted to escape more often ({grpo.escape:.2f}) than "
            f"any blend ({matched})"
        )
    return (
        f"no window: the trap model predicts no clear difference (GRPO {grpo.escape:.2f}, "
        f"best blend {best.escape:.2f} at alpha {best.alpha:g}; {matched})"
    )


class DiagnoseError(ValueError):
    """A run directory that cannot be diagnosed; one line saying what to do."""


@dataclass(frozen=True)
class _Read:
    """The runs' trajectories of the versions read, pooled, and the setting they share."""

    group: np.ndarray  # a group's id, told apart between runs
    stratum: np.ndarray
    reward: np.ndarray
    source: np.ndarray
    searches: np.ndarray
    version: np.ndarray
    question: np.ndarray
    frozen: bool
    group_size: int
    groups: int  # a step
    advantage: dict


def _setting(config: dict, group: np.ndarray) -> tuple[int, int, dict, bool]:
    learner, buffer = config.get("learner") or {}, config.get("buffer") or {}
    size = int(
        buffer.get("group_size") or np.bincount(np.unique(group, return_inverse=True)[1]).max()
    )
    advantage = learner.get("advantage") or {}
    return size, int(learner.get("groups_per_step") or 1), advantage, is_frozen(learner.get("lr"))


def _read(run_dirs: Sequence[Path], first_versions: int) -> _Read:
    columns = ["prompt_id", "data_source", "policy_version", "stratum", "reward", "tool_names"]
    parts, settings = [], []
    for i, run_dir in enumerate(run_dirs):
        config_file = run_dir / "config.yaml"
        if not config_file.is_file():
            raise DiagnoseError(f"{run_dir} holds no config.yaml: pass a run directory")
        config = yaml.safe_load(config_file.read_text()) or {}
        files = sorted((run_dir / "trajectories").glob("*.parquet"))
        if not files:
            raise DiagnoseError(f"{run_dir} kept no trajectories: run it with buffer.spill true")
        table = ds.dataset(files, format="parquet").to_table(columns=columns)
        frozen = is_frozen((config.get("learner") or {}).get("lr"))
        if not frozen:
            table = table.filter(pc.field("policy_version") < first_versions)
        if not table.num_rows:
            raise DiagnoseError(f"{run_dir} has no trajectories of versions 0-{first_versions - 1}")
        prompts = np.array(table.column("prompt_id").to_pylist(), dtype=str)
        settings.append(_setting(config, prompts))
        parts.append((np.char.add(f"{i}\x00", prompts), prompts, table))
    differ = [
        name
        for k, name in enumerate(("buffer.group_size", "learner.groups_per_step"))
        if len({s[k] for s in settings}) > 1
    ]
    differ += ["learner.advantage"] if len({repr(s[2]) for s in settings}) > 1 else []
    differ += ["frozen or not (learner.lr)"] if len({s[3] for s in settings}) > 1 else []
    if differ:
        raise DiagnoseError(
            f"the runs differ in {', '.join(differ)}: pool only runs of one world and setting"
        )

    def column(name: str, kind: type) -> np.ndarray:
        return np.concatenate(
            [t.column(name).to_numpy(zero_copy_only=False).astype(kind) for _, _, t in parts]
        )

    names = [row or () for _, _, t in parts for row in t.column("tool_names").to_pylist()]
    sources = [x for _, _, t in parts for x in t.column("data_source").to_pylist()]
    size, groups, advantage, frozen = settings[0]
    return _Read(
        np.concatenate([g for g, _, _ in parts]),
        column("stratum", int),
        column("reward", float),
        np.array(sources, dtype=str),
        np.array([sum(n == "search" for n in row) for row in names], dtype=int),
        column("policy_version", int),
        np.array([p.split("@")[0] for _, ps, _ in parts for p in ps], dtype=str),
        frozen,
        size,
        groups,
        advantage,
    )


def _prediction(trap: Trap, seeds: int, ends: tuple[float, float] | None) -> Prediction:
    """The trap model's escape, and where `ends` are given the escape with the hops at each."""
    c = cell(trap, seeds)
    around = None
    if ends is not None:
        low, high = (cell(replace(trap, hop_speed=e), seeds).escape for e in ends)
        around = (low, high)
    return Prediction(trap.alpha, c.escape, c.escape_low, c.escape_high, around)


def diagnose(
    run_dirs: Path | Sequence[Path],
    first_versions: int = VERSIONS,
    source: str = SOURCE,
    seeds: int = 100,
    resamples: int = 2000,
    min_questions: int = MIN_QUESTIONS,
    hop_speed: HopSetting = 1.0,
) -> Diagnosis:
    """The diagnosis of one run, or of several runs of one world and setting pooled; the trap
    model is matched only where at least `min_questions` two-hop questions have both chains and
    the rest (fewer: a gap of a few questions, no prediction). `hop_speed`: the hops' speed the
    predictions take, or "measured" (the measured one where it is measured, else 1)."""
    dirs = [run_dirs] if isinstance(run_dirs, Path) else list(run_dirs)
    read = _read(dirs, first_versions)
    versions = "all (a frozen run)" if read.frozen else f"versions 0-{first_versions - 1}"
    strata = strata_table(read.group, read.stratum, read.reward)
    on = read.source == source
    p0 = chains_pay = rest_pay = gap = depth = hop = None
    gap_ci, predictions, matched, reading = None, [], "", None
    speed = 1.0 if hop_speed == "measured" else float(hop_speed)
    if on.any():
        chain = read.searches[on] >= 2
        p0 = float(chain.mean())
        chains_pay = float(read.reward[on][chain].mean()) if chain.any() else None
        rest_pay = float(read.reward[on][~chain].mean()) if (~chain).any() else None
        found = within_gap_ci(read.question[on], chain, read.reward[on], resamples)
        if found is not None and chains_pay is not None and rest_pay is not None and 0 < p0 < 1:
            gap, gap_ci = found.value, found.ci
        if gap is not None and found.questions < min_questions:
            reading = (
                f"too few two-hop questions with both chains and the rest ({found.questions}; a "
                f"prediction needs {min_questions}): read more versions (--first-versions)"
            )
        elif gap is not None:
            depth = matched_depth(chains_pay)
            start, guess = min(max(p0, 0.01), 0.99), min(max(rest_pay, 0.0), 1.0)
            if not read.frozen:
                estimator, params = hops.estimator_of(read.advantage)
                share_v, pay_v = hops.bandit_velocities(
                    start, depth, guess, read.group_size, estimator, params
                )
                early = Trajectories(
                    read.version[on], read.question[on], read.searches[on], read.reward[on]
                )
                hop = hops.measure(early, first_versions, share_v, pay_v, resamples)
            ends = None
            if hop_speed == "measured" and hop is not None and hop.speed is not None:
                speed, ends = hop.speed, hop.speed_ci
            matched = (
                f"matched: p0 {p0:.2f}, a guess pays {rest_pay:.2f}, M {depth} "
                f"(a chain pays {1 / depth**2:.3f} against {chains_pay:.3f}), groups of "
                f"{read.group_size}, hop speed {speed:.2g}"
            )
            for alpha in ALPHAS:
                trap = Trap(
                    depth,
                    guess,
                    read.group_size,
                    read.groups,
                    alpha=alpha,
                    start_chain=start,
                    hop_speed=speed,
                )
                predictions.append(_prediction(trap, seeds, ends))
    return Diagnosis(
        len(dirs),
        len(read.reward),
        versions,
        read.group_size,
        strata,
        p0,
        chains_pay,
        rest_pay,
        gap,
        gap_ci,
        depth,
        hop,
        speed,
        predictions,
        reading or reading_line(matched, predictions, gap, gap_ci),
    )


def lines(d: Diagnosis) -> list[str]:
    runs = f"{d.runs} runs pooled, " if d.runs > 1 else ""
    out = [f"{runs}{d.trajectories} trajectories ({d.versions}), groups of {d.group_size}", ""]
    out += [
        "| stratum | share | alone in its group (A_SAN = 0) | pays | n |",
        "|---|---|---|---|---|",
    ]
    out += [
        f"| {s.stratum} | {s.share:.3f} | {s.alone:.3f} | {s.pays:.3f} | {s.count} |"
        for s in d.strata
    ]
    out.append("")
    if d.p0 is None:
        out.append("two-hop questions: none among these trajectories")
    else:
        out.append(
            f"two-hop questions: chain share p0 {d.p0:.3f}, chains pay {_pay(d.chains_pay)}, "
            f"the rest {_pay(d.rest_pay)}"
        )
    if d.gap is not None and d.gap_ci is not None:
        out.append(
            f"within-question gap {d.gap:+.3f}, 95% interval [{d.gap_ci[0]:+.3f}, "
            f"{d.gap_ci[1]:+.3f}] (bootstrap over questions)"
        )
    if d.hop is not None:
        out.append(hops.line(d.hop))
    for p in d.predictions:
        ends = (
            ""
            if p.speed_range is None
            else f" ({p.speed_range[0]:.2f} to {p.speed_range[1]:.2f} over the hop speed's "
            "interval)"
        )
        out.append(
            f"trap model, alpha {p.alpha:g}, hop speed {d.hop_speed:.2g}: escape {p.escape:.2f} "
            f"[{p.low:.2f}, {p.high:.2f}]{ends}"
        )
    out += ["", f"reading: {d.reading}"]
    return out


def _pay(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def command(
    run_dirs: Sequence[Path],
    first_versions: int,
    seeds: int,
    min_questions: int = MIN_QUESTIONS,
    hop_speed: HopSetting = 1.0,
) -> str:
    """The command line that prints the diagnosis `diagnose` gives with these arguments."""
    argv = ["python", "-m", "pipeline.diagnose", *map(str, run_dirs)]
    argv += ["--first-versions", str(first_versions), "--seeds", str(seeds)]
    argv += ["--min-questions", str(min_questions)]
    if hop_speed != 1.0:
        argv += ["--hop-speed", hop_speed if isinstance(hop_speed, str) else f"{hop_speed:g}"]
    return shlex.join(argv)


REPORT_SEEDS = 100  # bandit seeds a prediction in a run's report: about 1 s at groups of 16


def report_versions(steps: int) -> int:
    """The versions a run's report reads: its first tenth of steps, at least the command's
    default, so that a short group a step still meets a few two-hop questions."""
    return max(VERSIONS, steps // 10)


def report_section(run_dir: Path, steps: int, seeds: int = REPORT_SEEDS) -> list[str]:
    """report.md's "Should this run stratify?" from the run's own trajectories. It never fails
    the report: a diagnosis that cannot be made is one line saying why."""
    head = ["## Should this run stratify?", ""]
    first = report_versions(steps)
    try:
        d = diagnose(run_dir, first, seeds=seeds)
    except DiagnoseError as exc:
        return [*head, f"Not diagnosed: {exc}.", ""]
    except Exception as exc:  # the report is written whatever goes wrong here
        return [*head, f"Not diagnosed: {type(exc).__name__}: {exc}.", ""]
    return [
        *head,
        f"`{command([run_dir], first, seeds)}` (this run's first {first} policy versions: its "
        "start, before the estimator has moved it far; all of a frozen run's). Its trap model "
        f"runs {seeds} seeds a prediction, fewer than docs/results use, so its intervals are "
        "wide: `--seeds 400` narrows them.",
        "",
        *lines(d),
        "",
    ]


def hop_setting(text: str) -> HopSetting:
    if text == "measured":
        return "measured"
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a speed >= 0 or 'measured'")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.diagnose", description=__doc__.split("\n")[0]
    )
    p.add_argument("run_dirs", type=Path, nargs="+", help="a run, or runs of one world pooled")
    p.add_argument(
        "--first-versions",
        type=int,
        default=VERSIONS,
        help=f"read policy versions below this (a frozen run: all; default {VERSIONS})",
    )
    p.add_argument("--source", default=SOURCE, help=f"the two-hop questions (default {SOURCE})")
    p.add_argument("--seeds", type=int, default=100, help="bandit seeds a prediction (default 100)")
    p.add_argument(
        "--min-questions",
        type=int,
        default=MIN_QUESTIONS,
        help="two-hop questions with chains and the rest a prediction needs "
        f"(default {MIN_QUESTIONS})",
    )
    p.add_argument(
        "--hop-speed",
        type=hop_setting,
        default=1.0,
        help="the hops' speed over the stratum's in the trap model: a number (default 1), or "
        "'measured' (the speed measured from these versions, where it is measured)",
    )
    p.add_argument("--json", type=Path, help="write the diagnosis here")
    args = p.parse_args(argv)
    try:
        if args.first_versions < 1 or args.seeds < 1 or args.min_questions < 1:
            raise DiagnoseError("--first-versions, --seeds and --min-questions must be >= 1")
        found = diagnose(
            args.run_dirs,
            args.first_versions,
            args.source,
            args.seeds,
            min_questions=args.min_questions,
            hop_speed=args.hop_speed,
        )
    except DiagnoseError as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines(found)), flush=True)
    if args.json:
        args.json.write_text(json.dumps(asdict(found), indent=1) + "\n")
    return 0
