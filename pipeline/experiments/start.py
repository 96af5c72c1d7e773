"""`python -m pipeline.start RUN_DIR...`: where a run starts, measured before an experiment is
designed on it (a comparison decides only from a start where the trap bandit predicts a
difference): on the warm start (policy version 0, or every trajectory of a frozen run,
learner.lr <= FROZEN_LR), over its two-hop (L2) training questions,

- the chain share p0: the share of trajectories with two or more searches;
- what trajectories with 0, 1, 0-1 and 2 or more searches pay, each stratum apart;
- the within-question gap of chains against the rest (`searches.within_gap_ci`: the one estimator
  of whether a stratum pays), with a bootstrap over questions.

With `--world DIR` (the run's mini-GAIA world, e.g. runs/cache/world-...), it also says how
often each stratum answers with the bridge entity, the one its first search finds: a policy
taught by demonstrations that answer with the bridge may answer with whatever it just found,
and such chains pay nothing.

`pipeline/experiments/searches.py` reads the trajectories and holds the gap; this module holds
the measurement and the command. Launch the frozen runs first, e.g.
`configs/experiments/window_start.yaml`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import yaml

from actors.rewards import extract_answer, normalize_answer
from pipeline.assets.world_questions import RELATIONS
from pipeline.experiments.searches import (
    BUCKETS,
    SOURCE,
    Gap,
    Trajectories,
    bucket,
    is_frozen,
    pooled,
    read_trajectories,
    within_gap_ci,
)


@dataclass(frozen=True)
class Start:
    """The start of one or more runs, pooled (the same warm start)."""

    runs: int
    trajectories: int
    questions: int
    rollouts_min: int  # trajectories of the question with fewest
    rollouts_median: float
    chain_share: float  # p0: two or more searches
    pay: dict[str, float]  # bucket ("0", "1", ">=2", "0-1") -> mean reward (NaN: none)
    count: dict[str, int]
    gap: Gap | None


def measure(parts: list[Trajectories], resamples: int = 2000, seed: int = 0) -> Start:
    """The start of these runs' trajectories (already the start's: see `start_of`)."""
    t = pooled(parts)
    b = bucket(t.searches)
    masks = {name: b == i for i, name in enumerate(BUCKETS)} | {"0-1": b < 2}
    pay = {k: float(t.reward[m].mean()) if m.any() else float("nan") for k, m in masks.items()}
    count = {k: int(m.sum()) for k, m in masks.items()}
    _, per_question = np.unique(t.question, return_counts=True)
    chain = b == 2
    return Start(
        len(parts),
        len(t),
        len(per_question),
        int(per_question.min()) if len(per_question) else 0,
        float(np.median(per_question)) if len(per_question) else 0.0,
        float(chain.mean()) if len(t) else float("nan"),
        pay,
        count,
        within_gap_ci(t.question, chain, t.reward, resamples, seed),
    )


class StartError(ValueError):
    """A run directory that cannot be measured; one line saying what to do."""


def start_of(run_dir: Path) -> Trajectories:
    """The run's L2 training trajectories of the warm start: all of a frozen run's, version 0's
    of any other."""
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise StartError(f"{run_dir} holds no config.yaml: pass a run directory")
    config = yaml.safe_load(config_file.read_text()) or {}
    found = read_trajectories(run_dir)
    if found is None or not len(found):
        raise StartError(
            f"{run_dir} kept no two-hop training trajectories (trajectories/*.parquet): "
            "run it with buffer.spill true on the mini_gaia world"
        )
    if is_frozen((config.get("learner") or {}).get("lr")):
        return found
    return found.where(found.version == 0)


# The words a hop's query puts after the entity's name, longest first ("city founding year"
# before "founding year").
_QUERY_WORDS = sorted({words for words, *_ in RELATIONS.values()}, key=len, reverse=True)


def bridge_of(second_hop_query: str) -> str:
    """The bridge entity's name: the second hop's query is it followed by the relation's words
    (`WorldQuestion.hop_queries`)."""
    for words in _QUERY_WORDS:
        if second_hop_query.endswith(" " + words):
            return second_hop_query[: -len(words) - 1]
    return second_hop_query


def names_bridge(answer: str | None, second_hop_query: str) -> bool:
    """Whether `answer` is the bridge entity (as exact match compares answers)."""
    said = normalize_answer(answer or "")
    return bool(said) and said == normalize_answer(bridge_of(second_hop_query))


def bridge_answers(run_dirs: list[Path], world_dir: Path) -> dict[str, tuple[float, int]]:
    """Per bucket of searches ("0", "1", ">=2"): the share of the warm start's L2 trajectories
    whose final answer is the question's bridge entity, and how many there are."""
    if not (world_dir / "train.parquet").is_file():
        raise StartError(f"--world {world_dir} holds no train.parquet: pass a mini-GAIA world")
    second = {
        row["id"]: row["extra_info"]["hop_queries"][1]
        for row in pq.read_table(world_dir / "train.parquet").to_pylist()
        if len(row["extra_info"]["hop_queries"]) > 1
    }
    hits, counts = np.zeros(3), np.zeros(3)
    for run_dir in run_dirs:
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        files = sorted((run_dir / "trajectories").glob("*.parquet"))
        columns = ["data_source", "policy_version", "prompt_id", "tool_names", "text"]
        table = ds.dataset(files, format="parquet").to_table(
            columns=columns, filter=pc.field("data_source") == SOURCE
        )
        frozen = is_frozen((config.get("learner") or {}).get("lr"))
        for row in table.to_pylist():
            question = row["prompt_id"].split("@")[0]
            if (not frozen and row["policy_version"] != 0) or question not in second:
                continue
            b = min(sum(n == "search" for n in row["tool_names"] or ()), 2)
            counts[b] += 1
            hits[b] += names_bridge(extract_answer(row["text"] or ""), second[question])
    return {
        name: (float(hits[i] / counts[i]) if counts[i] else float("nan"), int(counts[i]))
        for i, name in enumerate(BUCKETS)
    }


def lines(start: Start) -> list[str]:
    """The measurement in words, one figure a line."""
    pay = "; ".join(
        f"{name} searches {start.pay[name]:.3f} ({start.count[name]})"
        for name in ("0", "1", "0-1", ">=2")
    )
    out = [
        f"runs {start.runs}: {start.trajectories} L2 trajectories of the warm start over "
        f"{start.questions} questions ({start.rollouts_min}-{start.rollouts_median:g} rollouts "
        "a question, least-median)",
        f"chain share p0 (2 or more searches): {start.chain_share:.3f}",
        f"pay (mean reward, count): {pay}",
    ]
    if start.gap is None:
        out.append("within-question gap: not measurable (no question has both chains and not)")
    else:
        g = start.gap
        out.append(
            f"within-question gap g = {g.value:+.3f}, 95% interval [{g.ci[0]:+.3f}, "
            f"{g.ci[1]:+.3f}] (bootstrap over questions; {g.questions} questions with both, "
            f"{g.chains} chains)"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.start", description=__doc__.split("\n")[0])
    p.add_argument("run_dirs", nargs="+", type=Path, help="runs of one warm start, pooled")
    p.add_argument("--resamples", type=int, default=2000, help="bootstrap draws (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="of the bootstrap")
    p.add_argument("--json", type=Path, help="write the measurement here")
    p.add_argument(
        "--world", type=Path, help="the runs' mini-GAIA world: also count answers naming the bridge"
    )
    args = p.parse_args(argv)
    try:
        if args.resamples < 100:
            raise StartError(f"--resamples must be >= 100 (got {args.resamples})")
        parts = [start_of(d) for d in args.run_dirs]
        bridges = bridge_answers(args.run_dirs, args.world) if args.world else None
    except StartError as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    start = measure(parts, args.resamples, args.seed)
    printed = lines(start)
    if bridges is not None:
        printed.append(
            "answers naming the bridge entity (share, count): "
            + "; ".join(f"{k} searches {v:.3f} ({n})" for k, (v, n) in bridges.items())
        )
    print("\n".join(printed), flush=True)
    if args.json:
        found = asdict(start) | {"run_dirs": [str(d) for d in args.run_dirs]}
        found["bridge_answers"] = bridges
        args.json.write_text(json.dumps(found, indent=1) + "\n")
    return 0
