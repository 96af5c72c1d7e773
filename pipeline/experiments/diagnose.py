"""`python -m pipeline.diagnose RUN_DIR`: should this run stratify? (issue 59, item 6)

From a run's first policy versions (every trajectory of a frozen run, learner.lr <= FROZEN_LR),
read from its `trajectories/*.parquet`:

- per stratum (the run's own stratifier, the `stratum` column): its share of the trajectories,
  the share of its trajectories alone in their stratum within their group (what SAN gives 0,
  so the blend trains them with its (1 - alpha) GRPO part only), and what it pays;
- on the two-hop questions (`--source`), the chain share p0, what chains and the rest pay, and
  the within-question gap with its bootstrap interval (`pipeline/experiments/start.py`);
- the trap bandit's predicted escape for alpha 0, 0.6 and 0.8 at the matched start
  (`pipeline/experiments/trap.py`): P(chain) p0, a guess paying what the rest pay, a chain
  paying 1/M^2 with M the depth whose 1/M^2 is nearest what chains pay, the run's group size
  and groups a step;

and one line of reading. The bandit is a model: its prediction is a statement about a world
that behaves like it, to be checked against the run's outcome.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as ds
import yaml

from pipeline.experiments.searches import SOURCE, is_frozen
from pipeline.experiments.start import within_gap_ci
from pipeline.experiments.trap import Trap, cell

ALPHAS = (0.0, 0.6, 0.8)
MAX_DEPTH = 12  # a chain that never paid is matched to this depth (1/144 a start)
WORTH = 0.5
"""The blend's predicted escape below which the reading is "deep trap", not "stratify": the
window experiment's runs read "stratify" at 0.13 against 0.01 from their first 30 versions, and
none of them escaped (docs/results/window.md)."""


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


@dataclass(frozen=True)
class Diagnosis:
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


def diagnose(
    run_dir: Path,
    first_versions: int = 5,
    source: str = SOURCE,
    seeds: int = 100,
    resamples: int = 2000,
    min_questions: int = 1,
) -> Diagnosis:
    """The diagnosis; the trap model is matched only where at least `min_questions` two-hop
    questions have both chains and the rest (fewer: a gap of a few questions, no prediction)."""
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise DiagnoseError(f"{run_dir} holds no config.yaml: pass a run directory")
    config = yaml.safe_load(config_file.read_text()) or {}
    learner, buffer = config.get("learner") or {}, config.get("buffer") or {}
    files = sorted((run_dir / "trajectories").glob("*.parquet"))
    if not files:
        raise DiagnoseError(f"{run_dir} kept no trajectories: run it with buffer.spill true")
    columns = ["prompt_id", "data_source", "policy_version", "stratum", "reward", "tool_names"]
    table = ds.dataset(files, format="parquet").to_table(columns=columns)
    frozen = is_frozen(learner.get("lr"))
    if not frozen:
        table = table.filter(pc.field("policy_version") < first_versions)
    versions = "all (a frozen run)" if frozen else f"versions 0-{first_versions - 1}"
    if not table.num_rows:
        raise DiagnoseError(f"{run_dir} has no trajectories of {versions}")
    group = np.array(table.column("prompt_id").to_pylist(), dtype=str)
    stratum = table.column("stratum").to_numpy(zero_copy_only=False).astype(int)
    reward = table.column("reward").to_numpy(zero_copy_only=False).astype(float)
    sources = np.array(table.column("data_source").to_pylist(), dtype=str)
    searches = np.array(
        [sum(n == "search" for n in row or ()) for row in table.column("tool_names").to_pylist()]
    )
    strata = strata_table(group, stratum, reward)
    size = int(
        buffer.get("group_size") or np.bincount(np.unique(group, return_inverse=True)[1]).max()
    )
    on = sources == source
    p0 = chains_pay = rest_pay = gap = depth = None
    gap_ci, predictions, matched, reading = None, [], "", None
    if on.any():
        chain = searches[on] >= 2
        p0 = float(chain.mean())
        chains_pay = float(reward[on][chain].mean()) if chain.any() else None
        rest_pay = float(reward[on][~chain].mean()) if (~chain).any() else None
        question = np.array([g.split("@")[0] for g in group[on]], dtype=str)
        found = within_gap_ci(question, chain, reward[on], resamples)
        if found is not None and chains_pay is not None and rest_pay is not None and 0 < p0 < 1:
            gap, gap_ci = found.value, found.ci
        if gap is not None and found.questions < min_questions:
            reading = (
                f"too few two-hop questions with both chains and the rest ({found.questions}; a "
                f"prediction needs {min_questions}): read more versions (--first-versions)"
            )
        elif gap is not None:
            depth = matched_depth(chains_pay)
            matched = (
                f"matched: p0 {p0:.2f}, a guess pays {rest_pay:.2f}, M {depth} "
                f"(a chain pays {1 / depth**2:.3f} against {chains_pay:.3f}), groups of {size}"
            )
            groups = int(learner.get("groups_per_step") or 1)
            for alpha in ALPHAS:
                trap = Trap(
                    depth,
                    min(max(rest_pay, 0.0), 1.0),
                    size,
                    groups,
                    alpha=alpha,
                    start_chain=min(max(p0, 0.01), 0.99),
                )
                c = cell(trap, seeds)
                predictions.append(Prediction(alpha, c.escape, c.escape_low, c.escape_high))
    return Diagnosis(
        len(reward),
        versions,
        size,
        strata,
        p0,
        chains_pay,
        rest_pay,
        gap,
        gap_ci,
        depth,
        predictions,
        reading or reading_line(matched, predictions, gap, gap_ci),
    )


def lines(d: Diagnosis) -> list[str]:
    out = [f"{d.trajectories} trajectories ({d.versions}), groups of {d.group_size}", ""]
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
    for p in d.predictions:
        out.append(
            f"trap model, alpha {p.alpha:g}: escape {p.escape:.2f} [{p.low:.2f}, {p.high:.2f}]"
        )
    out += ["", f"reading: {d.reading}"]
    return out


def _pay(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


REPORT_SEEDS = 100  # bandit seeds a prediction in a run's report: about 1 s at groups of 16
REPORT_QUESTIONS = 5  # a report predicts from at least this many questions with both kinds


def report_versions(steps: int) -> int:
    """The versions a run's report reads: its first tenth of steps, at least 5 (the command's
    default), so that a short group a step still meets a few two-hop questions."""
    return max(5, steps // 10)


def report_section(run_dir: Path, steps: int, seeds: int = REPORT_SEEDS) -> list[str]:
    """report.md's "Should this run stratify?" from the run's own trajectories. It never fails
    the report: a diagnosis that cannot be made is one line saying why."""
    head = ["## Should this run stratify?", ""]
    first = report_versions(steps)
    try:
        d = diagnose(run_dir, first, seeds=seeds, min_questions=REPORT_QUESTIONS)
    except DiagnoseError as exc:
        return [*head, f"Not diagnosed: {exc}.", ""]
    except Exception as exc:  # the report is written whatever goes wrong here
        return [*head, f"Not diagnosed: {type(exc).__name__}: {exc}.", ""]
    command = f"python -m pipeline.diagnose {run_dir} --first-versions {first} --seeds 400"
    return [
        *head,
        f"`python -m pipeline.diagnose` on this run's first {first} policy versions (its "
        "start, before the estimator has moved it far; all of a frozen run's), with the trap "
        f"model at {seeds} seeds a prediction, fewer than docs/results use, so its intervals "
        f"are wide; `{command}` narrows them.",
        "",
        *lines(d),
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.diagnose", description=__doc__.split("\n")[0]
    )
    p.add_argument("run_dir", type=Path)
    p.add_argument(
        "--first-versions",
        type=int,
        default=5,
        help="read policy versions below this (a frozen run: all; default 5)",
    )
    p.add_argument("--source", default=SOURCE, help=f"the two-hop questions (default {SOURCE})")
    p.add_argument("--seeds", type=int, default=100, help="bandit seeds a prediction (default 100)")
    p.add_argument("--json", type=Path, help="write the diagnosis here")
    args = p.parse_args(argv)
    try:
        if args.first_versions < 1 or args.seeds < 1:
            raise DiagnoseError("--first-versions and --seeds must be >= 1")
        found = diagnose(args.run_dir, args.first_versions, args.source, args.seeds)
    except DiagnoseError as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines(found)), flush=True)
    if args.json:
        args.json.write_text(json.dumps(asdict(found), indent=1) + "\n")
    return 0
