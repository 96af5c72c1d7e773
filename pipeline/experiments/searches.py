"""How a run's training trajectories split by the number of searches they made, read from its
`trajectories/*.parquet` (`buffer.spill`): the trap condition at the start and the share of
chains later on.

The trap (docs/results/trap_gaia.md) is a start where chaining searches pays less than not
chaining: on two-hop (L2) training questions, trajectories with two or more searches earn less
than those with none or one of the same question. "Does a stratum pay" has one estimator here,
the within-question gap

    g = sum_q n_c,q (mu_c,q - mu_n,q) / sum_q n_c,q

(chains against non-chains of the same question, weighted by the question's chains, over the
questions that have both), with a bootstrap over questions. A ratio of pooled sums,
mean(chains) - mean(the rest), would be confounded by which questions get chained: a policy that
chains on hard questions makes chains look poor whatever they earn on any one question.

Policy version 0 is the warm start, the
same weights in every run of an experiment whatever its estimator, so its trajectories are pooled
over all runs and the condition is a property of the experiment, untouched by the treatment. A
run whose learner.lr is at most FROZEN_LR keeps the warm start's weights all run long (its
policy versions count steps, not changes): all its trajectories join the start, and it is
left out of the endpoints' tests (it does not learn).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as ds

SOURCE = "minigaia_l2"  # two-hop questions: one search cannot answer them, a chain of two can
BUCKETS = ("0", "1", ">=2")
COLUMNS = ["data_source", "policy_version", "prompt_id", "tool_names", "reward"]
FROZEN_LR = 1e-9  # Adam moves a weight by about lr a step: 1e-9 for 200 steps is below float32's


@dataclass(frozen=True)
class Trajectories:
    """L2 training trajectories of one run: per trajectory its policy version, question,
    number of searches and reward."""

    version: np.ndarray
    question: np.ndarray  # the question's id (the prompt id before "@"): the same in every run
    searches: np.ndarray
    reward: np.ndarray

    def where(self, keep: np.ndarray) -> Trajectories:
        return Trajectories(
            self.version[keep], self.question[keep], self.searches[keep], self.reward[keep]
        )

    def __len__(self) -> int:
        return len(self.reward)


def read_trajectories(run_dir: Path, source: str = SOURCE) -> Trajectories | None:
    """The run's `source` trajectories, None when it kept none (`buffer.spill` off)."""
    files = sorted((run_dir / "trajectories").glob("*.parquet"))
    if not files:
        return None
    table = ds.dataset(files, format="parquet").to_table(
        columns=COLUMNS, filter=pc.field("data_source") == source
    )
    names = table.column("tool_names").to_pylist()
    prompts = table.column("prompt_id").to_pylist()
    return Trajectories(
        table.column("policy_version").to_numpy(zero_copy_only=False).astype(int),
        np.array([p.split("@")[0] for p in prompts], dtype=str),
        np.array([sum(n == "search" for n in row or ()) for row in names], dtype=int),
        table.column("reward").to_numpy(zero_copy_only=False).astype(float),
    )


def bucket(searches: np.ndarray) -> np.ndarray:
    """0, 1 or 2 (two or more searches)."""
    return np.minimum(searches, 2)


@dataclass(frozen=True)
class Split:
    """Mean reward and count per bucket of searches."""

    mean: dict[str, float]  # NaN where a bucket is empty
    count: dict[str, int]

    @property
    def chain_share(self) -> float:
        total = sum(self.count[b] for b in BUCKETS)
        return self.count[">=2"] / total if total else float("nan")

    def cell(self, name: str) -> str:
        n = self.count[name]
        return f"{self.mean[name]:.2f} ({n})" if n else "– (0)"


def split(t: Trajectories) -> Split:
    b = bucket(t.searches)
    mean, count = {}, {}
    for i, name in enumerate(BUCKETS):
        sel = b == i
        count[name] = int(sel.sum())
        mean[name] = float(t.reward[sel].mean()) if sel.any() else float("nan")
    sel = b < 2
    count["0-1"] = int(sel.sum())
    mean["0-1"] = float(t.reward[sel].mean()) if sel.any() else float("nan")
    return Split(mean, count)


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


def chain_share(t: Trajectories, first_version: int) -> float | None:
    """Share of trajectories with two or more searches among those of policy versions >=
    `first_version` (None without any)."""
    later = t.where(t.version >= first_version)
    return float((bucket(later.searches) == 2).mean()) if len(later) else None


def quarter(config_max_steps: int | None, versions: np.ndarray) -> int:
    """A quarter of the run's learner steps (of its highest policy version if unset), at least 1."""
    steps = config_max_steps or (int(versions.max()) if len(versions) else 0)
    return max(1, steps // 4)


def is_frozen(lr: float | None) -> bool:
    """A run with this learner.lr keeps the warm start's weights (see FROZEN_LR)."""
    return lr is not None and lr <= FROZEN_LR


def section(
    groups: dict[str, list],
    kept: dict[str, Trajectories | None],
    max_steps: dict[str, int],
    frozen: set[str] = frozenset(),
) -> list[str]:
    """The report's section: the start pooled over all runs, then each variant's early and late
    quarters, and the trap condition's test. `kept`: run name -> its trajectories;
    `max_steps`: run name -> learner.max_steps; `frozen`: the runs that keep the warm start's
    weights (all their trajectories are the start's). [] when no run kept trajectories."""
    if not any(t is not None and len(t) for t in kept.values()):
        return []
    start = [
        t if name in frozen else t.where(t.version == 0)
        for name, t in kept.items()
        if t is not None
    ]
    lines = [
        "## Searches on two-hop training questions",
        "",
        "Mean reward (count) of the L2 training trajectories by number of searches, from each "
        "run's trajectories/*.parquet. Start: policy version 0, the warm start, the same weights "
        "in every run whatever its estimator, so pooled over all runs (with every trajectory "
        f"of a frozen run, learner.lr <= {FROZEN_LR:g}). Early: versions 1 to "
        "Q − 1; late: versions from 3Q on (Q: a quarter of learner.max_steps), pooled over a "
        "variant's seeds.",
        "",
        "| trajectories | 0 searches | 1 search | 2 or more | 0-1 | share of 2 or more |",
        "|---|---|---|---|---|---|",
    ]

    def row(label: str, parts: list[Trajectories]) -> str:
        joined = pooled(parts)
        s = split(joined)
        cells = [s.cell(b) for b in (*BUCKETS, "0-1")]
        share = f"{s.chain_share:.0%}" if len(joined) else "–"
        return f"| {label} | " + " | ".join(cells) + f" | {share} |"

    lines.append(row("start (version 0, and frozen runs whole), all runs", start))
    for variant, runs in groups.items():
        if all(r.name in frozen for r in runs):
            continue
        for label, window in (("early", _early), ("late", _late)):
            parts = []
            for r in runs:
                t = kept.get(r.name)
                if t is not None:
                    parts.append(
                        t.where(window(t.version, quarter(max_steps.get(r.name), t.version)))
                    )
            if parts:
                lines.append(row(f"{variant}, {label}", parts))
    joined = pooled(start)
    gap = within_gap_ci(joined.question, bucket(joined.searches) == 2, joined.reward)
    lines.append("")
    if gap is None:
        lines.append(
            "Trap condition at the start: not testable (no two-hop question has both "
            "trajectories with two or more searches and trajectories with fewer at the start)."
        )
    else:
        verdict = (
            "holds: chains pay less than not chaining at the start, so GRPO's group-wide "
            "baseline pushes away from chaining"
            if gap.ci[1] < 0
            else "does not hold: chains do not pay less than not chaining at the start "
            "(the interval reaches 0 or above), so these runs do not test the trap"
        )
        lines.append(
            f"Trap condition at the start, the within-question gap (2 or more searches against "
            f"0-1, question by question) {gap.value:+.3f}, 95% interval [{gap.ci[0]:+.3f}, "
            f"{gap.ci[1]:+.3f}] (bootstrap over questions; {gap.questions} questions with both, "
            f"{gap.chains} chains): {verdict}."
        )
    return lines


def _early(version: np.ndarray, q: int) -> np.ndarray:
    return (version >= 1) & (version < q)


def _late(version: np.ndarray, q: int) -> np.ndarray:
    return version >= 3 * q


def pooled(parts: list[Trajectories]) -> Trajectories:
    """One set of trajectories from several runs' (a question keeps its id across runs)."""
    if not parts:
        return Trajectories(np.zeros(0, int), np.zeros(0, str), np.zeros(0, int), np.zeros(0))
    cat = np.concatenate
    return Trajectories(
        cat([t.version for t in parts]),
        cat([t.question for t in parts]),
        cat([t.searches for t in parts]),
        cat([t.reward for t in parts]),
    )
