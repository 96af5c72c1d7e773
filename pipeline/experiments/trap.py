"""`python -m pipeline.trap`: the trap bandit, a controlled model of when stratified advantages
help, trained with the project's own registered estimators.

The model. A policy first picks a stratum, "guess" or "chain", from logits theta = (0, 0) (or
theta = (0, logit p0) with `--start-chain p0`: P(chain) starts at p0 instead of 0.5). A guess
pays Bernoulli(p_guess). A chain makes two M-way choices a1 ~ softmax(h1), a2 ~ softmax(h2)
(hop logits of length M, zeros at the start) and pays 1 only if both are 0, so it starts paying
1 / M^2 with a ceiling of 1: the deeper the trap (larger M), the longer guessing looks better. Each
step draws `groups` groups of `group_size` trajectories; advantages are computed per group by the
registered estimator (learner/estimators.py) with the stratum as the stratum label; plain SGD
REINFORCE then moves

    theta += lr * sum_i A_i (onehot(S_i) - softmax(theta)) / K
    h_j   += lr * sum_{i chain} A_i (onehot(a_ij) - softmax(h_j)) / K     (j = 1, 2)

with K all trajectories of the step (`--hop-speed k` multiplies the hops' step by k: hops that
learn k times faster than the stratum logits). A seed "escapes" when its final P(chain) > 0.9. Seeds run
side by side (one estimator call per step for all of them), each with its own groups.

    python -m pipeline.trap --alphas 0,0.8,1 --chain-choices 4,6 --p-guess 0.3 --group-size 8 \\
        --groups 4 --steps 300 --lr 1.0 --seeds 60 [--start-chain 0.1,0.5] [--hop-speed 1] \
        [--estimator stratified] [--json FILE]
    python -m pipeline.trap --exact --start-chain 0.1,0.5 --alphas 0,0.6,0.8 --chain-choices 5

`--exact` prints the expected update at the start instead of sampling (trap_exact.start_table);
`--exact-plot` draws each alpha's over the true gradient's (trap_exact.bias_table, plot_bias).
After the cells it prints each alpha against alpha 0 (the same other settings): the difference
in escape fraction, its Newcombe 95% interval and Fisher's exact p (pipeline/experiments/
proportions.py); `python -m pipeline.experiments.trap_tables` writes docs/results/trap.md's
tables from the JSON.
The JSON holds `cells`, one per (p_guess, group size, start share, hop speed, M, alpha): the escape fraction over seeds with its
Wilson 95% interval, and the final expected reward's mean and standard deviation over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from itertools import product
from pathlib import Path

import numpy as np
import torch

from learner.estimators import ESTIMATORS, estimate, section_params
from pipeline.experiments.proportions import fisher_p, newcombe, wilson
from pipeline.experiments.trap_exact import (
    bias_table,
    expected_path,
    plot_bias,
    plot_path,
    start_table,
)

GUESS, CHAIN = 0, 1


@dataclass(frozen=True)
class Trap:
    """One cell's settings."""

    chain_choices: int = 4
    p_guess: float = 0.3
    group_size: int = 8
    groups: int = 4
    steps: int = 300
    lr: float = 1.0
    estimator: str = "stratified"
    alpha: float = 0.6
    eps: float = 1e-6
    start_chain: float = 0.5
    hop_speed: float = 1.0


@dataclass(frozen=True)
class Cell:
    estimator: str
    alpha: float | None
    chain_choices: int
    p_guess: float
    group_size: int
    seeds: int
    escape: float
    escape_low: float
    escape_high: float
    final_reward_mean: float
    final_reward_std: float
    start_chain: float = 0.5
    """P(chain) at the start (the stratum logits (0, logit p0))."""
    hop_speed: float = 1.0
    """How many times faster the hop logits learn than the stratum logits."""


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def expected_reward(
    theta: np.ndarray, h1: np.ndarray, h2: np.ndarray, p_guess: float
) -> np.ndarray:
    """E[reward] of each seed's policy: P(guess) p_guess + P(chain) P(a1 = 0) P(a2 = 0)."""
    strata = softmax(theta)
    return strata[:, GUESS] * p_guess + strata[:, CHAIN] * softmax(h1)[:, 0] * softmax(h2)[:, 0]


def run(trap: Trap, seeds: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Train `seeds` independent policies side by side; (final P(chain), final expected reward)
    per seed."""
    rng = np.random.default_rng(seed)
    m, per_seed = trap.chain_choices, trap.groups * trap.group_size
    theta = np.zeros((seeds, 2))
    theta[:, CHAIN] = math.log(trap.start_chain / (1 - trap.start_chain))
    h1, h2 = np.zeros((seeds, m)), np.zeros((seeds, m))
    # every trajectory's seed and group: groups are numbered across seeds, so one call does all
    owner = np.repeat(np.arange(seeds), per_seed)
    group_ids = torch.from_numpy(np.repeat(np.arange(seeds * trap.groups), trap.group_size))
    params = section_params(trap.estimator, trap)  # alpha, eps: those it takes
    for _ in range(trap.steps):
        p_strata, p1, p2 = softmax(theta)[owner], softmax(h1)[owner], softmax(h2)[owner]
        stratum = (rng.random(len(owner)) < p_strata[:, CHAIN]).astype(np.int64)
        a1 = (rng.random((len(owner), 1)) > np.cumsum(p1, axis=1)).sum(axis=1).clip(max=m - 1)
        a2 = (rng.random((len(owner), 1)) > np.cumsum(p2, axis=1)).sum(axis=1).clip(max=m - 1)
        guessed = rng.random(len(owner)) < trap.p_guess
        reward = np.where(stratum == CHAIN, (a1 == 0) & (a2 == 0), guessed).astype(np.float64)
        advantages = estimate(
            trap.estimator,
            torch.from_numpy(reward),
            group_ids,
            torch.from_numpy(stratum),
            **params,
        ).advantages.numpy()
        # REINFORCE: the score of each choice, weighted by its advantage, summed per seed / K
        theta += (
            trap.lr
            * _summed(advantages[:, None] * (_onehot(stratum, 2) - p_strata), owner, seeds)
            / per_seed
        )
        chain = (stratum == CHAIN).astype(np.float64)[:, None] * advantages[:, None]
        hop_lr = trap.lr * trap.hop_speed
        h1 += hop_lr * _summed(chain * (_onehot(a1, m) - p1), owner, seeds) / per_seed
        h2 += hop_lr * _summed(chain * (_onehot(a2, m) - p2), owner, seeds) / per_seed
    return softmax(theta)[:, CHAIN], expected_reward(theta, h1, h2, trap.p_guess)


def _onehot(index: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((len(index), width))
    out[np.arange(len(index)), index] = 1.0
    return out


def _summed(values: np.ndarray, owner: np.ndarray, seeds: int) -> np.ndarray:
    out = np.zeros((seeds, values.shape[1]))
    np.add.at(out, owner, values)
    return out


def cell(trap: Trap, seeds: int, seed: int = 0) -> Cell:
    p_chain, reward = run(trap, seeds, seed)
    escaped = int((p_chain > 0.9).sum())
    low, high = wilson(escaped, seeds)
    return Cell(
        trap.estimator,
        trap.alpha if "alpha" in ESTIMATORS[trap.estimator].params else None,
        trap.chain_choices,
        trap.p_guess,
        trap.group_size,
        seeds,
        escaped / seeds,
        low,
        high,
        float(reward.mean()),
        float(reward.std()),
        trap.start_chain,
        trap.hop_speed,
    )


def escaped(c: Cell) -> int:
    """How many of the cell's seeds escaped (the fraction is of whole seeds)."""
    return round(c.escape * c.seeds)


def comparisons(cells: list[Cell], against: float = 0.0) -> list[dict]:
    """Each stratified cell against the cell of alpha `against` with the same other settings:
    the difference in escape fraction, its Newcombe 95% interval and Fisher's exact p."""
    base = {
        (c.p_guess, c.group_size, c.start_chain, c.hop_speed, c.chain_choices): c
        for c in cells
        if c.alpha == against
    }
    out = []
    for c in cells:
        b = base.get((c.p_guess, c.group_size, c.start_chain, c.hop_speed, c.chain_choices))
        if b is None or c.alpha is None or c.alpha == against:
            continue
        x1, x2 = escaped(c), escaped(b)
        low, high = newcombe(x1, c.seeds, x2, b.seeds)
        out.append(
            {
                "p_guess": c.p_guess,
                "group_size": c.group_size,
                "start_chain": c.start_chain,
                "hop_speed": c.hop_speed,
                "chain_choices": c.chain_choices,
                "alpha": c.alpha,
                "against": against,
                "difference": c.escape - b.escape,
                "newcombe_low": low,
                "newcombe_high": high,
                "fisher_p": fisher_p(x1, c.seeds, x2, b.seeds),
            }
        )
    return out


# make mutation leaves the drawing out: no test reads a figure's pixels, and what it draws is
# computed and tested before it (cell, comparisons).
# pragma: no mutate start
def plot(cells: list[Cell], path: str) -> None:
    """One heat map per (p_guess, group size): escape fraction by alpha (x) and trap depth M (y)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(c.p_guess, c.group_size, c.start_chain, c.hop_speed) for c in cells})
    alphas = sorted({c.alpha if c.alpha is not None else -1.0 for c in cells})
    depths = sorted({c.chain_choices for c in cells})
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels) + 1, 3.2), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        p_guess, size, start, speed = panel
        grid = np.full((len(depths), len(alphas)), np.nan)
        for c in cells:
            if (c.p_guess, c.group_size, c.start_chain, c.hop_speed) == panel:
                a = c.alpha if c.alpha is not None else -1.0
                grid[depths.index(c.chain_choices), alphas.index(a)] = c.escape
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", origin="lower", aspect="auto")
        for (i, j), value in np.ndenumerate(grid):
            ax.text(
                j,
                i,
                f"{value:.2f}",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if value < 0.6 else "black",
            )
        ax.set_xticks(range(len(alphas)), [f"{a:g}" for a in alphas])
        ax.set_yticks(range(len(depths)), [str(m) for m in depths])
        ax.set_xlabel("alpha")
        if ax is axes[0][0]:
            ax.set_ylabel("trap depth M (a chain pays 1/M² at first)")
        title = f"p_guess {p_guess:g}, groups of {size}"
        title += f", p0 {start:g}" if start != 0.5 else ""
        title += f", hops x{speed:g}" if speed != 1 else ""
        ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=axes[0].tolist(), label="P(escape): final P(chain) > 0.9")
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)


# pragma: no mutate end
def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline.trap", description=__doc__.split("\n")[0])
    p.add_argument("--estimator", default="stratified", choices=sorted(ESTIMATORS))
    p.add_argument("--alphas", type=_floats, default=[0.0, 0.8, 1.0], help="stratified only")
    p.add_argument("--chain-choices", type=_ints, default=[4, 6], help="M: the trap's depth")
    p.add_argument("--p-guess", type=_floats, default=[0.3], help="what a guess pays, each")
    p.add_argument("--group-size", type=_ints, default=[8], help="trajectories per group, each")
    p.add_argument(
        "--start-chain", type=_floats, default=[0.5], help="P(chain) at the start, each (p0)"
    )
    p.add_argument(
        "--hop-speed",
        type=_floats,
        default=[1.0],
        help="hops learn this many times faster than the stratum logits, each",
    )
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--seeds", type=int, default=60)
    p.add_argument("--seed", type=int, default=0, help="of the random stream")
    p.add_argument("--json", help="write the cells here")
    p.add_argument("--plot", help="write a heat map of the escape fraction here (PNG)")
    p.add_argument(
        "--path",
        help="instead of sampling: the mean-field path of exact expected updates of each alpha "
        "(stratified; the first --chain-choices, --p-guess, --group-size, --start-chain and "
        "--hop-speed) to this JSON",
    )
    p.add_argument("--path-plot", help="with --path: plot P(chain), reward and cosine (PNG)")
    p.add_argument(
        "--exact-plot",
        help="with --exact: each alpha's expected updates over the true gradient's, one line per "
        "M (trap_exact.bias_table at the first --start-chain, --p-guess and --group-size; PNG)",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="instead of sampling: the exact expected update at the start of each --start-chain, "
        "--chain-choices and --group-size, by alpha, against GRPO's and the true gradient",
    )
    return p


def mean_field(args: argparse.Namespace) -> int:
    """`--path`: trap_exact.expected_path for each alpha, written and summarised."""
    m, p_guess, size = args.chain_choices[0], args.p_guess[0], args.group_size[0]
    start, speed = args.start_chain[0], args.hop_speed[0]
    paths = [
        expected_path(a, m, p_guess, size, args.steps, args.lr, start, speed) for a in args.alphas
    ]
    for rows in paths:
        end = rows[-1]
        print(
            f"alpha {rows[0]['alpha']:g}  M {m}  p_guess {p_guess:g}  group {size}: after "
            f"{args.steps} steps P(chain) {end['chain']:.3f}, E[reward] "
            f"{end['expected_reward']:.3f}, cosine to the true gradient {end['cosine']:.3f}",
            flush=True,
        )
    settings = {"chain_choices": m, "p_guess": p_guess, "group_size": size}
    settings |= {"start_chain": start, "hop_speed": speed}
    settings |= {"steps": args.steps, "lr": args.lr}
    Path(args.path).write_text(json.dumps({"settings": settings, "paths": paths}))
    if args.path_plot:
        plot_path(paths, args.path_plot)
    return 0


def exact_start(args: argparse.Namespace) -> int:
    """`--exact`: trap_exact.start_table for each group size, printed (and written with --json)."""
    rows = []
    for p_guess, size in product(args.p_guess, args.group_size):
        found = start_table(args.alphas, args.chain_choices, args.start_chain, p_guess, size)
        for r in found:
            print(
                f"p_guess {p_guess:g}  group {size}  p0 {r['start_chain']:g}  "
                f"M {r['chain_choices']}  alpha {r['alpha']:g}: stratum {r['stratum']:+.4f} "
                f"(x{r['stratum_over_grpo']:.2f} GRPO's, true {r['true_stratum']:+.4f})  "
                f"hop {r['hop']:+.4f} (x{r['hop_over_grpo']:.2f} GRPO's, true "
                f"{r['true_hop']:+.4f})  a chain alone {r['alone']:.3f}, a paid chain's SAN 0 "
                f"{r['paid_silent']:.3f}",
                flush=True,
            )
        rows += [{"p_guess": p_guess, **r} for r in found]
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
    if args.exact_plot:
        at = (args.p_guess[0], args.group_size[0], args.start_chain[0])
        plot_bias(bias_table(args.alphas, args.chain_choices, *at), args.exact_plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problems = [
        f"--{name} must be {rule}"
        for name, bad, rule in (
            ("p-guess", any(not 0 <= p <= 1 for p in args.p_guess), "in [0, 1] each"),
            ("group-size", any(g < 1 for g in args.group_size), ">= 1 each"),
            ("groups", args.groups < 1, ">= 1"),
            ("steps", args.steps < 0, ">= 0"),
            ("seeds", args.seeds < 1, ">= 1"),
            ("chain-choices", any(m < 1 for m in args.chain_choices), ">= 1 each"),
            ("alphas", any(not 0 <= a <= 1 for a in args.alphas), "in [0, 1] each"),
            ("start-chain", any(not 0 < p < 1 for p in args.start_chain), "in (0, 1) each"),
            ("hop-speed", any(not k > 0 for k in args.hop_speed), "> 0 each"),
        )
        if bad
    ]
    if args.exact_plot and not args.exact:
        problems.append("--exact-plot needs --exact (the expected updates it plots)")
    if args.path_plot and not args.path:
        problems.append("--path-plot needs --path (the JSON the paths are written to)")
    if args.path and args.steps < 1:
        problems.append("--path needs --steps >= 1 (a path of no step has no end to report)")
    if args.path and args.estimator != "stratified":
        problems.append("--path follows the stratified blend's alphas: leave --estimator out")
    if args.exact and args.estimator != "stratified":
        problems.append("--exact compares the stratified blend's alphas: leave --estimator out")
    if problems:
        print(f"strata: error: {problems[0]}", file=sys.stderr)
        return 2
    if args.exact:
        return exact_start(args)
    if args.path:
        return mean_field(args)
    alphas = args.alphas if "alpha" in ESTIMATORS[args.estimator].params else [0.0]
    cells = []
    for p_guess, size, start, speed, m, alpha in product(
        args.p_guess, args.group_size, args.start_chain, args.hop_speed, args.chain_choices, alphas
    ):
        trap = Trap(
            m,
            p_guess,
            size,
            args.groups,
            args.steps,
            args.lr,
            args.estimator,
            alpha,
            start_chain=start,
            hop_speed=speed,
        )
        found = cell(trap, args.seeds, args.seed)
        cells.append(found)
        shown = f"alpha {alpha:g}" if found.alpha is not None else args.estimator
        print(
            f"p_guess {p_guess:g}  group {size}  p0 {start:g}  hops x{speed:g}  M {m}  "
            f"{shown:>12}  escape {found.escape:.2f} "
            f"[{found.escape_low:.2f}, {found.escape_high:.2f}]  final E[reward] "
            f"{found.final_reward_mean:.3f} (sd {found.final_reward_std:.3f}) over {args.seeds} seeds",
            flush=True,
        )
    for d in comparisons(cells):
        print(
            f"p_guess {d['p_guess']:g}  group {d['group_size']}  p0 {d['start_chain']:g}  "
            f"hops x{d['hop_speed']:g}  M {d['chain_choices']}  alpha {d['alpha']:g} - alpha "
            f"{d['against']:g}: escape {d['difference']:+.2f} [{d['newcombe_low']:+.2f}, "
            f"{d['newcombe_high']:+.2f}] (Newcombe 95%), Fisher exact p {d['fisher_p']:.1e}",
            flush=True,
        )
    if args.plot:
        plot(cells, args.plot)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        Path(args.json).write_text(
            json.dumps({"settings": settings, "cells": [asdict(c) for c in cells]}, indent=1)
        )
    return 0
