"""Stratum fairness under bounded staleness: due-first consumption vs plain first-complete-first-out.

The real buffer, admission, pools and streaming loop; a simulated agent whose trajectories take
longer the more tools they call (pipeline.runtime.fakes) and a learner step that sleeps. For η = 1 and 2
it prints, per stratum, the share of generated trajectories (those that left the buffer), the share
of trained ones and their ratio, with the stale drops and the run time, for both orders side by
side in one run.

    python benchmarks/fairness.py [--steps 60] [--per-call-s 0.02]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import time
from pathlib import Path

from actors.pool import ActorPool
from buffers.group_buffer import GroupBuffer
from pipeline.config.schema import BufferConfig, LearnerConfig, StrataConfig
from pipeline.runtime.fakes import SimulatedAgent, SimulatedEngine, SimulatedRoles, SimulatedTask
from pipeline.runtime.stream import RunSummary, stream


def run_once(eta: int, due_first: bool, steps: int, per_call_s: float) -> tuple[dict, float, int]:
    group_size, per_step = 8, 4
    config = StrataConfig(
        buffer=BufferConfig(group_size=group_size, max_staleness=eta),
        learner=LearnerConfig(groups_per_step=per_step, max_steps=steps),
    )
    engine = SimulatedEngine()
    buffer = GroupBuffer(
        group_size=group_size, max_staleness=eta, groups_per_step=per_step, due_first=due_first
    )
    tasks = (SimulatedTask(str(i)) for i in itertools.count())
    pools = [
        ActorPool(
            SimulatedAgent(engine, per_call_s=per_call_s, actor_id=f"pool-{i}"),
            buffer,
            tasks,
            group_size=group_size,
            concurrency=32,
            name=f"pool-{i}",
        )
        for i in range(2)
    ]
    summary = RunSummary()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        asyncio.run(
            stream(
                config, SimulatedRoles(engine, step_s=0.02), buffer, pools, Path(run_dir), summary
            )
        )
    return (
        summary.accounting["per_stratum"],
        time.perf_counter() - start,
        buffer.stats().dropped_stale,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--per-call-s", type=float, default=0.02)
    args = parser.parse_args()
    print("eta  order        stratum  generated  trained  trained/generated")
    for eta in (1, 2):
        for due_first in (True, False):
            books, seconds, dropped = run_once(eta, due_first, args.steps, args.per_call_s)
            order = "due-first" if due_first else "fifo"
            left = {s: r["trained"] + r["dropped_stale"] + r["abandoned"] for s, r in books.items()}
            trained = sum(r["trained"] for r in books.values())
            for stratum in sorted(books, key=int):
                generated_share = left[stratum] / sum(left.values())
                trained_share = books[stratum]["trained"] / trained
                print(
                    f"{eta:>3}  {order:<11} {stratum:>8}  {generated_share:9.3f}  {trained_share:7.3f}  "
                    f"{trained_share / generated_share:17.3f}"
                )
            print(
                f"{eta:>3}  {order:<11} dropped as stale {dropped}, {args.steps} steps in {seconds:.1f} s"
            )


if __name__ == "__main__":
    main()
