"""`python -m pipeline.start RUN_DIR...`: where a run starts, measured so that it can decide
(issue 59): on the warm start (policy version 0, or every trajectory of a frozen run,
learner.lr <= FROZEN_LR), over its two-hop (L2) training questions,

- the chain share p0: the share of trajectories with two or more searches;
- what trajectories with 0, 1, 0-1 and 2 or more searches pay, each stratum apart;
- the within-question gap g = sum_q n_c,q (mu_c,q - mu_n,q) / sum_q n_c,q: chains against
  non-chains of the same question, weighted by the question's chains, over the questions that
  have both (a ratio of pooled sums would be confounded by which questions get chained), with a
  bootstrap over questions.

With `--world DIR` (the run's mini-GAIA world, e.g. runs/cache/world-...), it also says how
often each stratum answers with the bridge entity, the one its first search finds (issue 59's
hypothesis: the astray demos, which answer with the bridge, teach answering with whatever was
just found).

`pipeline/experiments/searches.py` reads the trajectories; this module holds the estimator and
the command. Launch the frozen runs first, e.g. `configs/experiments/window_start.yaml`.
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
    Trajectories,
    bucket,
    is_frozen,
    read_trajectories,
)


@dataclass(frozen=True)
class Gap:
    """The within-question gap, its bootstrap interval and what it stands on."""

    value: float
    ci: tuple[float, float]
    questions: int  # questions with both chains and non-chains: the ones that count
    chains: int  # their chains: the weights' sum


def question_cells(
    question: np.ndarray, chain: np.ndarray, reward: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per question (sorted ids): its chains n_c,q and n_c,q (mu_c,q - mu_n,q), both 0 where
    the question lacks chains or non-chains."""
    ids, index = np.unique(question, return_inverse=True)
    q = len(ids)
    n_c = np.bincount(index, weights=chain.astype(float), minlength=q)
    n_n = np.bincount(index, weights=(~chain).astype(float), minlength=q)
    r_c = np.bincount(index, weights=np.where(chain, reward, 0.0), minlength=q)
    r_n = np.bincount(index, weights=np.where(chain, 0.0, reward), minlength=q)
    both = (n_c > 0) & (n_n > 0)
    diff = np.divide(r_c, n_c, out=np.zeros(q), where=both) - np.divide(
        r_n, n_n, out=np.zeros(q), where=both
    )
    weight = np.where(both, n_c, 0.0)
    return weight, weight * diff


def within_gap(question: np.ndarray, chain: np.ndarray, reward: np.ndarray) -> float:
    """g = sum_q n_c,q (mu_c,q - mu_n,q) / sum_q n_c,q (NaN when no question has both kinds)."""
    weight, term = question_cells(question, chain, reward)
    return float(term.sum() / weight.sum()) if weight.sum() else float("nan")


def within_gap_ci(
    question: np.ndarray,
    chain: np.ndarray,
    reward: np.ndarray,
    resamples: int = 2000,
    seed: int = 0,
) -> Gap | None:
    """`within_gap` with a 95% percentile bootstrap over questions (every question the runs met
    is drawn, so how many have both kinds varies with the draw). None without any."""
    weight, term = question_cells(question, chain, reward)
    if not weight.sum():
        return None
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(weight), (resamples, len(weight)))
    w, t = weight[draws].sum(axis=1), term[draws].sum(axis=1)
    values = t[w > 0] / w[w > 0]
    lo, hi = np.percentile(values, [2.5, 97.5])
    return Gap(
        float(term.sum() / weight.sum()),
        (float(lo), float(hi)),
        int((weight > 0).sum()),
        int(weight.sum()),
    )


_FIELDS = ("version", "question", "searches", "reward")


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
    t = Trajectories(*(np.concatenate([getattr(p, k) for p in parts]) for k in _FIELDS))
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
