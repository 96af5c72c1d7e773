"""Advantage estimators against a plain bincount GRPO, a Python loop and the memory bandwidth, in one run.

1,000,000 trajectories in groups of 8 with up to 5 strata (tool-call counts 0-4), float32 rewards,
prompt ids in arrival order (not sorted; the `grouped` rows put each group's members side by
side, as the learner's batches do, which keeps the scatters and gathers in cache). Timed side by
side, each a median of `--repeats`, the contenders interleaved so that a busy machine slows them
alike:
- `peer`: one-normalisation GRPO written here the way the fastest vectorised GRPO code does it
  (three `bincount`s over dense group ids: count, sum, sum of squares). It does half the blend's work.
- `stratified` (the blend, learner/advantages.py) and every other estimator of learner/estimators.py,
  each with dense ids (0..G-1) and hash-like ids (which need a sort to become dense). The blend's
  two passes over the trajectories, and the per-group map of grpo, dr_grpo and rloo, are C loops
  (learner/advantages.c) when a compiler is at hand; `stratified dense, torch` is the same blend
  on its torch path (STRATA_NATIVE=0), same bits.
- the Python loops: the blend's as common GRPO code writes it (a dict of per-group lists), the other
  estimators' from learner/estimator_loops.py; one run each, checked to agree with the vectorised results.
- a memory floor: the bytes a function must read and write at least (rewards, group ids, strata in,
  advantages out) over the machine's copy bandwidth, measured here with a 256 MB tensor copy.

    python benchmarks/advantages.py [--n 1000000] [--group-size 8] [--repeats 7] [--no-loop]

Fresh megabyte-sized temporaries come from mmap and are unmapped on free, so every call pays the
kernel's first-touch page faults, which on a small VM swing the ratios 2x from run to run. The
peer and the blend are first timed that way (glibc's defaults), then with glibc keeping freed
memory in its heap (`mallopt` mmap and trim thresholds of 1 GiB, as a long-running learner's heap
settles): the table and the last line are the latter, the arithmetic rather than the page faults.

The last line is the blend against the peer (target <= 2x; it does twice the peer's normalisations),
the ratio of medians, then the lowest and highest ratio within one round. On the shared 2-core VMs
it was measured on, the ratio moved between sessions by more than one run's rounds show: with
torch ops alone, 1.95-2.46x in one session, 2.68-2.78x and 2.29-2.41x in later ones. With the C
loops, 1.66-1.96x over sixteen runs in one session (2026-11-25; the torch path, timed beside
them in fourteen of those, 1.95-3.04x). Left out after side-by-side measurement: threads for the
C loops (no gain on the 2-core VM: 1.63-1.68x the peer against 1.57-1.59x on one thread, in a
script timing only those), and making the cells' moments and rows in C as well (scalar divisions
and roots cost more than torch's vectorised ops on the 625k cells).
Why torch ops stay about 2x: summing 1M trajectories straight into 625k cells' 15 MB of tables
misses the cache and TLB on nearly every access (the peer's 125k groups fit), whatever the loop;
the C loop first copies the trajectories into buckets of 4096 cells, in order, and sums each
bucket in L2.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from buffers.testing import synthetic_trajectory
from learner import native
from learner.estimator_loops import loop_estimate, loop_gae
from learner.estimators import ESTIMATORS, estimate
from learner.gae import gae, outcome_rewards
from learner.step_credit import step_advantages


def peer_grpo(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO over dense group ids with three bincounts (no sort, no checks): the speed to beat."""
    count = torch.bincount(group_ids).to(rewards.dtype)
    mean = torch.bincount(group_ids, weights=rewards) / count
    var = torch.bincount(group_ids, weights=rewards * rewards) / count - mean * mean
    std = var.clamp(min=0).sqrt()
    return (rewards - mean[group_ids]) / (std[group_ids] + eps)


def loop_blend(rewards, group_ids, strata, alpha=0.6, eps=1e-6) -> list[float]:
    """Per-group / per-stratum Python loop, as GRPO code commonly does it (population std)."""
    scores, index, kinds = rewards.tolist(), group_ids.tolist(), strata.tolist()
    by_group, by_cell = defaultdict(list), defaultdict(list)
    for i, (g, k) in enumerate(zip(index, kinds, strict=True)):
        by_group[g].append(scores[i])
        by_cell[(g, k)].append(scores[i])

    def stats(values):
        mean = sum(values) / len(values)
        return mean, (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5, len(values)

    group_stats = {g: stats(v) for g, v in by_group.items()}
    cell_stats = {key: stats(v) for key, v in by_cell.items()}
    out = []
    for i, (g, k) in enumerate(zip(index, kinds, strict=True)):
        g_mean, g_std, g_n = group_stats[g]
        c_mean, c_std, c_n = cell_stats[(g, k)]
        gn = (scores[i] - g_mean) / (g_std + eps) if g_n > 1 else 0.0
        san = (scores[i] - c_mean) / (c_std + eps) if c_n > 1 else 0.0
        out.append(alpha * san + (1 - alpha) * gn)
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


def copy_bandwidth(repeats: int) -> float:
    """Bytes per second moved (read + write) by a 256 MB tensor copy: the machine's streaming limit."""
    src = torch.ones(64 * 2**20, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def interleaved(
    contenders: dict[str, Callable[[], torch.Tensor]], repeats: int
) -> dict[str, list[float]]:
    """Seconds of each, run in turns (one warm-up each first): one list per contender, one entry
    per round, so that entries of one round were timed seconds apart on the same machine state."""
    for run in contenders.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, run in contenders.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def round_ratios(times: dict[str, list[float]], name: str, base: str) -> str:
    """`name` over `base` within each round: lowest-highest, the run's own noise."""
    ratios = [a / b for a, b in zip(times[name], times[base], strict=True)]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x"


def keep_heap_warm() -> bool:
    """glibc: serve large allocations from the heap and keep freed memory there (see above)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = getattr(libc, "mallopt", None)
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # glibc's malloc.h
    settings = ((m_mmap_threshold, 1 << 30), (m_trim_threshold, 1 << 30), (m_top_pad, 64 << 20))
    return mallopt is not None and all(mallopt(k, v) == 1 for k, v in settings)


def token_level(repeats: int, with_loop: bool, rows: int = 512, width: int = 640) -> None:
    """GAE (learner/gae.py, one pass over the positions, every row at once) against its loop
    reference (learner/estimator_loops.py, one row at a time), and GiGPO's step credit
    (learner/step_credit.py, a plain loop over turns: there is no vectorised one), on a learner
    step's worth of synthetic multi-turn trajectories: `rows` responses of `width` tokens, a
    quarter of each an observation."""
    generator = torch.Generator().manual_seed(1)
    mask = (torch.rand(rows, width, generator=generator) > 0.25).float()
    values = torch.randn(rows, width, generator=generator)
    rewards = outcome_rewards(mask, (torch.rand(rows, generator=generator) > 0.5).float())
    times = interleaved({"gae": lambda: gae(rewards, values, mask, 1.0, 0.95)}, repeats)
    vectorised = statistics.median(times["gae"])
    print(f"token-level, one step of {rows} responses x {width} tokens (median of {repeats})")
    line = f"  {'gae vectorised':<21} {vectorised * 1e3:9.1f} ms"
    if with_loop:
        got, _ = gae(rewards, values, mask, 1.0, 0.95)
        start = time.perf_counter()
        want = [
            loop_gae(r.tolist(), v.tolist(), m.tolist(), 1.0, 0.95)[0]
            for r, v, m in zip(rewards, values, mask, strict=True)
        ]
        loop_s = time.perf_counter() - start
        diff = (got - torch.tensor(want)).abs().max().item()
        if diff > 1e-3:
            raise SystemExit(f"gae: the loop disagrees, max |difference| {diff:.3g}")
        line += f"; the loop {loop_s * 1e3:.0f} ms, {loop_s / vectorised:.0f}x, max |difference| {diff:.1e}"
    print(line)
    members = [
        synthetic_trajectory(f"p{i // 8}", i % 8, tokens=width, reward=float(i % 2), seed=i)
        for i in range(rows)
    ]
    group_ids = torch.tensor([i // 8 for i in range(rows)])
    times = interleaved(
        {
            "gigpo": lambda: step_advantages(
                "gigpo", members, group_ids, torch.zeros(rows), 1.0, gamma=0.95, eps=1e-6
            )
        },
        repeats,
    )
    print(
        f"  {'gigpo step credit':<21} {statistics.median(times['gigpo']) * 1e3:9.1f} ms (a loop over turns)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-loop", action="store_true", help="skip the Python loops (minutes)")
    args = parser.parse_args()

    rewards, dense, strata = make_batch(args.n, args.group_size)
    hashed = dense * 2_654_435_761 + 97  # hash-like prompt ids: no small range, so they are sorted
    contenders: dict[str, Callable[[], torch.Tensor]] = {"peer": lambda: peer_grpo(rewards, dense)}
    # each group's members side by side, as in the learner's batches
    order = torch.argsort(dense, stable=True)
    grouped = rewards[order], dense[order], strata[order]
    contenders["peer grouped"] = lambda: peer_grpo(grouped[0], grouped[1])
    contenders["stratified grouped"] = lambda: estimate("stratified", *grouped).advantages

    def torch_path() -> torch.Tensor:
        with native.torch_only():
            return estimate("stratified", rewards, dense, strata).advantages

    contenders["stratified dense, torch"] = torch_path
    for name in ESTIMATORS:
        for kind, ids in (("dense", dense), ("hashed", hashed)):
            contenders[f"{name} {kind}"] = lambda n=name, i=ids: (
                estimate(n, rewards, i, strata).advantages
            )
    results = {name: run() for name, run in contenders.items()}
    for name in ESTIMATORS:  # the id values must not matter
        if not torch.equal(results[f"{name} dense"], results[f"{name} hashed"]):
            raise SystemExit(f"{name}: the result depends on the id values")
    if not torch.equal(results["stratified grouped"], results["stratified dense"][order]):
        raise SystemExit("stratified: the result depends on the order of the trajectories")
    if not torch.equal(results["stratified dense, torch"], results["stratified dense"]):
        raise SystemExit("stratified: the C loops and the torch path disagree")
    gap = (results["grpo dense"] - results["peer"]).abs().max().item()
    if gap > 1e-4:
        raise SystemExit(f"the peer and grpo disagree: max |difference| {gap:.3g}")

    cold_times = interleaved({k: contenders[k] for k in ("peer", "stratified dense")}, args.repeats)
    cold = {name: statistics.median(t) for name, t in cold_times.items()}
    warm = keep_heap_warm()
    bandwidth = copy_bandwidth(args.repeats)
    times = interleaved(contenders, args.repeats)
    seconds = {name: statistics.median(t) for name, t in times.items()}
    # The least any of them must move: rewards (4 B) and strata (8 B) in, advantages (4 B) out, and
    # the group ids (8 B); the peer reads no strata.
    floor_bytes = {"peer": args.n * 16}
    print(
        f"advantages of {args.n:,} trajectories, groups of {args.group_size}, 5 strata, float32, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; copy bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s; median of {args.repeats}, interleaved; the blend's C loops "
        f"{'in use' if native.library() else 'unavailable (torch path only)'}"
    )
    print(
        f"  glibc's default heap (page faults on every fresh temporary): peer "
        f"{cold['peer'] * 1e3:.2f} ms, stratified dense {cold['stratified dense'] * 1e3:.2f} ms, "
        f"{cold['stratified dense'] / cold['peer']:.2f}x"
    )
    print(
        "  heap kept warm (mallopt):"
        if warm
        else "  (not glibc: the heap is as the C library keeps it)"
    )
    print(f"  {'':<30} {'ms':>8} {'vs peer':>8} {'memory floor':>13}")
    for name, s in seconds.items():
        floor = floor_bytes.get(name, args.n * 24) / bandwidth
        print(f"  {name:<30} {s * 1e3:8.2f} {s / seconds['peer']:7.2f}x {s / floor:11.1f}x")

    if not args.no_loop:
        print("python loops (one run each), checked against the vectorised results")
        start = time.perf_counter()
        want = loop_blend(rewards, dense, strata)
        loop_s = time.perf_counter() - start
        diff = (results["stratified dense"] - torch.tensor(want)).abs().max().item()
        if diff > 1e-4:
            raise SystemExit(f"stratified: the loop disagrees, max |difference| {diff:.3g}")
        print(
            f"  {'stratified':<21} {loop_s * 1e3:9.0f} ms  {loop_s / seconds['stratified dense']:6.0f}x "
            f"the vectorised  max |difference| {diff:.1e}"
        )
        for name in sorted(set(ESTIMATORS) - {"stratified"}):
            start = time.perf_counter()
            want, keep = loop_estimate(name, rewards.tolist(), dense.tolist())
            loop_s = time.perf_counter() - start
            got = estimate(name, rewards, dense, strata)
            diff = (got.advantages - torch.tensor(want)).abs().max().item()
            if diff > 1e-4 or got.keep.tolist() != keep:
                raise SystemExit(f"{name}: the loop disagrees, max |difference| {diff:.3g}")
            print(
                f"  {name:<21} {loop_s * 1e3:9.0f} ms  {loop_s / seconds[f'{name} dense']:6.0f}x "
                f"the vectorised  max |difference| {diff:.1e}"
            )

    token_level(args.repeats, with_loop=not args.no_loop)

    ratio = seconds["stratified dense"] / seconds["peer"]
    together = seconds["stratified grouped"] / seconds["peer grouped"]
    spread = round_ratios(times, "stratified dense", "peer")
    print(
        f"stratified blend vs bincount GRPO peer: {ratio:.2f}x (round by round {spread} over "
        f"{args.repeats}; hash-like ids {seconds['stratified hashed'] / seconds['peer']:.2f}x; "
        f"groups side by side as in the learner's batches {together:.2f}x; target <= 2x)"
    )


if __name__ == "__main__":
    main()
