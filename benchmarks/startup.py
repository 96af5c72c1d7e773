"""A launch's imports with Python's cyclic garbage collector running and paused, side by side.

Each round starts two fresh interpreters that import what a launch imports before its run
(`pipeline.runtime.run`: torch, transformers, DeepSpeed, pyarrow, faiss, matplotlib): one as
Python runs it, one inside `pipeline.runtime.startup.uncollected` (the collector paused, what
the imports made frozen after), which is how `python -m pipeline.launch` imports it. The two are
interleaved so that a busy machine slows them alike; each figure is the process's CPU time
(user + system) from start to exit, the median over `--rounds`.

    python benchmarks/startup.py [--rounds 5] [--module pipeline.runtime.ray]

`--module` imports that module instead: a Ray worker's import of its actor's module, which the
cluster's setup hook pauses the collector for (pipeline/runtime/startup.py; pipeline.runtime.ray
holds the generation actor, learner.ray_ranks a learner rank).

The last line is the paused imports' CPU time over the plain ones (lower is better), the ratio
of medians, then the lowest and highest ratio within one round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = "pipeline.runtime.run"


def plain(module: str) -> str:
    return f"import {module}"


def paused(module: str) -> str:
    return f"from pipeline.runtime.startup import uncollected\nwith uncollected():\n    import {module}"


def cpu_seconds(code: str) -> float:
    """User + system CPU seconds of a fresh interpreter running `code`, from start to exit."""
    before = os.times()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
    after = os.times()
    return (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--module", default=LAUNCH, help="the module imported (a launch's)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        print("startup: error: --rounds must be at least 1", file=sys.stderr)
        return 2
    code = {"plain": plain(args.module), "paused": paused(args.module)}
    running, stopped = [], []
    for i in range(args.rounds):
        order = ("plain", "paused") if i % 2 == 0 else ("paused", "plain")
        times = {kind: cpu_seconds(code[kind]) for kind in order}
        running.append(times["plain"])
        stopped.append(times["paused"])
        print(f"round {i + 1}: collector running {running[-1]:.2f} s, paused {stopped[-1]:.2f} s")
    ratios = [p / q for p, q in zip(stopped, running, strict=True)]
    median_paused, median_plain = statistics.median(stopped), statistics.median(running)
    print(
        f"{args.module} imports' CPU, paused / running: {median_paused / median_plain:.2f}x "
        f"(medians {median_paused:.2f} s / {median_plain:.2f} s; "
        f"rounds {min(ratios):.2f}-{max(ratios):.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
