"""How a run's training trajectories split by the number of searches they made, read from its
`trajectories/*.parquet` (`buffer.spill`): the trap condition at the start and the share of
chains later on.

The trap (docs/results/trap_gaia.md) is a start where chaining searches pays less than not
chaining: on two-hop (L2) training questions, the mean reward of trajectories with two or more
searches below that of trajectories with none or one. Policy version 0 is the warm start, the
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
class TrapCheck:
    """μ(>= 2 searches) − μ(0-1 search) at the start, with a bootstrap interval over questions."""

    gap: float
    ci: tuple[float, float]
    holds: bool  # the whole interval below 0: chains pay less than not chaining
    questions: int


def trap_check(
    pooled: list[Trajectories], resamples: int = 2000, seed: int = 0
) -> TrapCheck | None:
    """The trap condition on `pooled` runs' trajectories. A question's trajectories share what
    makes it easy or hard, in every run (the runs meet the same questions in the same order), so
    questions, not trajectories, are resampled. None without both kinds."""
    joined = _join(pooled)
    chain = bucket(joined.searches) == 2
    cells = []  # per question: reward sum and count of chains, and of the rest
    for q in np.unique(joined.question):
        sel = joined.question == q
        cells.append(
            (
                joined.reward[sel & chain].sum(),
                (sel & chain).sum(),
                joined.reward[sel & ~chain].sum(),
                (sel & ~chain).sum(),
            )
        )
    if not cells:
        return None
    c = np.array(cells, dtype=float)

    def gap(rows: np.ndarray) -> float:
        s = rows.sum(axis=0)
        return s[0] / s[1] - s[2] / s[3] if s[1] and s[3] else float("nan")

    found = gap(c)
    if not np.isfinite(found):
        return None
    rng = np.random.default_rng(seed)
    draws = np.array([gap(c[rng.integers(0, len(c), len(c))]) for _ in range(resamples)])
    lo, hi = np.nanpercentile(draws, [2.5, 97.5])
    return TrapCheck(found, (float(lo), float(hi)), bool(hi < 0), len(c))


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
        joined = _join(parts)
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
    check = trap_check(start)
    lines.append("")
    if check is None:
        lines.append(
            "Trap condition at the start: not testable (no version-0 trajectory with two or "
            "more searches, or none with fewer)."
        )
    else:
        verdict = (
            "holds: chains pay less than not chaining at the start, so GRPO's group-wide "
            "baseline pushes away from chaining"
            if check.holds
            else "does not hold: chains do not pay less than not chaining at the start "
            "(the interval reaches 0 or above), so these runs do not test the trap"
        )
        lines.append(
            f"Trap condition at the start, μ(2 or more) − μ(0-1) = {check.gap:+.3f}, 95% "
            f"interval [{check.ci[0]:+.3f}, {check.ci[1]:+.3f}] (bootstrap over its "
            f"{check.questions} questions): "
            f"{verdict}."
        )
    return lines


def _early(version: np.ndarray, q: int) -> np.ndarray:
    return (version >= 1) & (version < q)


def _late(version: np.ndarray, q: int) -> np.ndarray:
    return version >= 3 * q


def _join(parts: list[Trajectories]) -> Trajectories:
    """One set of trajectories from several runs'."""
    if not parts:
        return Trajectories(np.zeros(0, int), np.zeros(0, str), np.zeros(0, int), np.zeros(0))
    cat = np.concatenate
    return Trajectories(
        cat([t.version for t in parts]),
        cat([t.question for t in parts]),
        cat([t.searches for t in parts]),
        cat([t.reward for t in parts]),
    )
