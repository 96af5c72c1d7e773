"""Stratified advantages: the vectorised function against a per-group Python loop, in one run.

1,000,000 trajectories in groups of 8 with up to 5 strata (tool-call counts 0-4). The loop is
written the way common GRPO code computes group advantages (verl's `compute_grpo_outcome_advantage`:
a dict of per-group score lists, torch mean/std per group), extended to strata. Both run on the same
input; the script checks they agree before it prints the ratio.

Then every other estimator of learner/estimators.py (grpo, dr_grpo, rloo, mc_grpo) on the same
input, beside its loop reference (learner/reference.py), checked to agree.

    python benchmarks/advantages.py [--n 1000000] [--group-size 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from learner.advantages import stratified_advantages
from learner.estimators import ESTIMATORS, estimate
from learner.reference import loop_estimate


def loop_advantages(rewards, group_ids, strata, alpha=0.6, eps=1e-6):
    """Per-group / per-stratum Python loop, as GRPO code commonly does it (population std)."""
    scores = rewards.tolist()
    index = group_ids.tolist()
    kinds = strata.tolist()
    by_group, by_cell = defaultdict(list), defaultdict(list)
    for i, (g, k) in enumerate(zip(index, kinds, strict=True)):
        by_group[g].append(scores[i])
        by_cell[(g, k)].append(scores[i])
    group_stats, cell_stats = {}, {}
    for g, values in by_group.items():
        t = torch.tensor(values, dtype=rewards.dtype)
        group_stats[g] = (t.mean(), t.std(unbiased=False), len(values))
    for key, values in by_cell.items():
        t = torch.tensor(values, dtype=rewards.dtype)
        cell_stats[key] = (t.mean(), t.std(unbiased=False), len(values))
    out = torch.empty_like(rewards)
    for i, (g, k) in enumerate(zip(index, kinds, strict=True)):
        g_mean, g_std, g_n = group_stats[g]
        c_mean, c_std, c_n = cell_stats[(g, k)]
        gn = (scores[i] - g_mean) / (g_std + eps) if g_n > 1 else 0.0
        san = (scores[i] - c_mean) / (c_std + eps) if c_n > 1 else 0.0
        out[i] = alpha * san + (1 - alpha) * gn
    return out


def make_batch(n: int, group_size: int, seed: int = 0):
    """Rewards in {0, 1} whose success rate rises with the number of tool calls, like a search agent."""
    gen = torch.Generator().manual_seed(seed)
    group_ids = torch.arange(n, dtype=torch.int64) // group_size
    group_ids = group_ids[torch.randperm(n, generator=gen)]  # arrival order, not sorted
    strata = torch.randint(0, 5, (n,), generator=gen)
    p = 0.2 + 0.15 * strata.to(torch.float32)
    rewards = (torch.rand(n, generator=gen) < p).to(torch.float32)
    return rewards, group_ids, strata


def time_vectorised(rewards, group_ids, strata, repeats):
    stratified_advantages(rewards, group_ids, strata)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = stratified_advantages(rewards, group_ids, strata)
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    rewards, group_ids, strata = make_batch(args.n, args.group_size)
    fast, vectorised = time_vectorised(rewards, group_ids, strata, args.repeats)
    # Hash-like prompt ids (no small range): the function falls back to sorting them.
    sparse_ids = group_ids * 2_654_435_761 + 97
    fast_sparse, vectorised_sparse = time_vectorised(rewards, sparse_ids, strata, args.repeats)
    if not torch.equal(fast, fast_sparse):
        raise SystemExit("results depend on the id values")

    start = time.perf_counter()
    slow = loop_advantages(rewards, group_ids, strata)
    looped = time.perf_counter() - start

    diff = (fast - slow).abs().max().item()
    if diff > 1e-4:
        raise SystemExit(f"results disagree: max |difference| = {diff:.3g}")
    print(
        f"stratified_advantages, {args.n:,} trajectories, groups of {args.group_size}, 5 strata, "
        f"float32, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"  vectorised, prompt ids 0..G-1 : {vectorised * 1e3:9.1f} ms  (median of {args.repeats})"
    )
    print(
        f"  vectorised, hash-like ids    : {vectorised_sparse * 1e3:9.1f} ms  (median of {args.repeats})"
    )
    print(f"  python loop                  : {looped * 1e3:9.1f} ms  (one run)")
    print(f"  max |vectorised - loop| = {diff:.2e}")
    print(
        f"  speed-up: {looped / vectorised:.0f}x with dense ids, "
        f"{looped / vectorised_sparse:.0f}x with hash-like ids  (target >= 100x)"
    )
    print("other estimators, same input (vectorised: median of repeats; loop: one run)")
    for name in sorted(set(ESTIMATORS) - {"stratified"}):
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            got = estimate(name, rewards, group_ids, strata)
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        want, keep = loop_estimate(name, rewards.tolist(), group_ids.tolist())
        loop_s = time.perf_counter() - start
        gap = (got.advantages - torch.tensor(want, dtype=rewards.dtype)).abs().max().item()
        if gap > 1e-4 or got.keep.tolist() != keep:
            raise SystemExit(f"{name}: results disagree (max |difference| {gap:.3g})")
        fast_s = statistics.median(times)
        print(f"  {name:<8} vectorised {fast_s * 1e3:8.1f} ms   loop {loop_s * 1e3:9.1f} ms   "
              f"{loop_s / fast_s:6.0f}x   max |difference| {gap:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
