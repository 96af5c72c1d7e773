"""Learner throughput (ZeRO 0 vs 2, 1 rank vs 2 on CPU, the proximal log-probs from the training
forward vs a pass of their own) and weight publishing to 4 local engines vs one copy.

The policy is the embedded default's tiny Qwen2 (2 layers, hidden 128) unless --hidden/--layers
say otherwise; each step trains 4 groups of 8 trajectories of 256 response tokens. Two ranks
(learner.num_ranks 2: gloo over loopback, each rank half the groups and half the threads) run in
a child process of their own, since a process holds one process group; on 2 cores expect no
speed-up: the figure is there to catch regressions in the ranks' overhead.

    python benchmarks/learner_step.py [--steps 5] [--hidden 128] [--layers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import tempfile
import time

import torch

from actors.embedded import EmbeddedEngine
from buffers.records import Group
from buffers.testing import synthetic_trajectory
from learner.ranked import ranked_learner
from learner.trainer import Learner
from learner.weight_sync import InProcessSync
from pipeline.assets.tiny_policy import build_tiny_policy
from pipeline.config.schema import LearnerConfig

TEXTS = [
    f"Question {i}: <search> Varno Telik </search> <answer> Quorvex {i} </answer>"
    for i in range(2000)
]


def batch(seed: int, vocab: int) -> list[Group]:
    out = []
    for g in range(4):
        members = []
        for i in range(8):
            t = synthetic_trajectory(
                f"b{seed}g{g}", i, tokens=256, reward=float(i % 2), seed=seed * 10 + g
            )
            t.token_ids %= vocab
            t.prompt_token_ids %= vocab
            members.append(t)
        out.append(Group(f"b{seed}g{g}", tuple(members)))
    return out


def tokens_per_second(
    path: str, stage: int, steps: int, vocab: int, ranks: int = 1, reuse: bool = True, **options
) -> float:
    """Trained tokens/s; `reuse` False (one rank only) makes the proximal pass of its own."""
    assert ranks == 1 or reuse, "the ranks' processes read their own Learner class"
    config = LearnerConfig(micro_batch_size=8, zero_stage=stage, max_steps=100, **options)
    if ranks == 1:
        learner = Learner(path, config, group_size=8)
        learner.reuse_forward_for_proximal = reuse
    else:
        threads = max(1, torch.get_num_threads() // ranks)
        torch.set_num_threads(threads)
        learner = ranked_learner(path, config, ranks, threads, group_size=8)
    learner.step(batch(0, vocab))  # warm-up
    tokens, elapsed = 0.0, 0.0
    for s in range(steps):
        start = time.perf_counter()
        metrics = learner.step(batch(s + 1, vocab))
        elapsed += time.perf_counter() - start
        tokens += metrics["trained_tokens"]
    if learner.peers is not None:
        learner.peers.close()
    return tokens / elapsed


def _ranks_child(path: str, steps: int, vocab: int, ranks: int, queue) -> None:
    queue.put(tokens_per_second(path, 0, steps, vocab, ranks))


def ranked_tokens_per_second(path: str, steps: int, vocab: int, ranks: int) -> float:
    context = mp.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_ranks_child, args=(path, steps, vocab, ranks, queue))
    child.start()
    result = queue.get(timeout=1800)
    child.join()
    return result


def publish_times(path: str, repeats: int) -> tuple[float, float, int]:
    """(median publish to 4 embedded engines, median plain state-dict copy, bytes)."""
    learner = Learner(path, LearnerConfig(micro_batch_size=8, max_steps=100), group_size=8)
    engines = [EmbeddedEngine.from_pretrained(path) for _ in range(4)]
    sync = InProcessSync(engines)
    state = learner.state_dict()
    size = sum(t.numel() * t.element_size() for t in state.values())

    async def publish_all() -> list[float]:
        return [
            (await sync.publish(learner.state_dict(), version)).seconds
            for version in range(1, repeats + 1)
        ]

    published = asyncio.run(publish_all())
    copies = []
    for _ in range(repeats):
        start = time.perf_counter()
        _ = {k: v.detach().clone() for k, v in state.items()}
        copies.append(time.perf_counter() - start)
    assert all(e.version == repeats for e in engines)
    return statistics.median(published), statistics.median(copies), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        heads = max(2, args.hidden // 32)
        path = str(
            build_tiny_policy(
                f"{tmp}/policy",
                TEXTS,
                layers=args.layers,
                hidden_size=args.hidden,
                heads=heads,
                kv_heads=heads // 2,
                intermediate_size=4 * args.hidden,
            )
        )
        vocab = 1900
        two_ranks = ranked_tokens_per_second(path, args.steps, vocab, 2)
        zero0 = tokens_per_second(path, 0, args.steps, vocab)
        zero2 = tokens_per_second(path, 2, args.steps, vocab)
        # configs/gaia.yaml's loss: proximal log-probs from the first forward or a pass of their
        # own, alternating, best of two each (a process's first runs are the slowest)
        gaia = {"importance": {"type": "tis"}, "kl_coef": 0.001}
        proximal = {False: 0.0, True: 0.0}
        for _ in range(2):
            for reuse in (False, True):
                proximal[reuse] = max(
                    proximal[reuse],
                    tokens_per_second(path, 0, args.steps, vocab, reuse=reuse, **gaia),
                )
        published, copied, size = publish_times(path, args.repeats)
    print(
        f"learner on CPU, Qwen2 {args.layers} layers x hidden {args.hidden}, {torch.get_num_threads()} threads"
    )
    print(f"  ZeRO 0 : {zero0:8.0f} trained tokens/s")
    print(f"  ZeRO 2 : {zero2:8.0f} trained tokens/s  ({zero2 / zero0:.2f}x of ZeRO 0)")
    print(
        f"  2 ranks, ZeRO 0 : {two_ranks:8.0f} trained tokens/s  ({two_ranks / zero0:.2f}x of 1 rank)"
    )
    print(
        f"  importance tis + KL, proximal pass of its own : {proximal[False]:8.0f} trained tokens/s"
    )
    print(
        f"  importance tis + KL, proximal from the forward: {proximal[True]:8.0f} trained tokens/s  "
        f"({proximal[True] / proximal[False]:.2f}x)"
    )
    print(
        f"  publish to 4 embedded engines : {published * 1e3:7.2f} ms  ({size / 1e6:.1f} MB state dict)"
    )
    print(f"  plain copy of the state dict  : {copied * 1e3:7.2f} ms")
    print(f"  ratio: {published / copied:.2f}x (target <= 2x)")


if __name__ == "__main__":
    main()
