"""A launch's imports with Python's cyclic garbage collector running and paused, side by side.

Each round starts two fresh interpreters that import what a launch imports before its run
(`pipeline.runtime.run`: torch, transformers, DeepSpeed, pyarrow, faiss, matplotlib): one as
Python runs it, one inside `pipeline.runtime.startup.uncollected` (the collector paused, what
the imports made frozen after), which is how `python -m pipeline.launch` imports it. The two are
interleaved so that a busy machine slows them alike; each figure is the process's CPU time
(user + system) from start to exit, the median over `--rounds`.

    python benchmarks/startup.py [--rounds 5]

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
PLAIN = "import pipeline.runtime.run"
PAUSED = (
    "from pipeline.runtime.startup import uncollected\n"
    "with uncollected():\n"
    "    import pipeline.runtime.run"
)


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
    args = parser.parse_args(argv)
    if args.rounds < 1:
        print("startup: error: --rounds must be at least 1", file=sys.stderr)
        return 2
    plain, paused = [], []
    for i in range(args.rounds):
        first, second = (PLAIN, PAUSED) if i % 2 == 0 else (PAUSED, PLAIN)
        times = {first: cpu_seconds(first), second: cpu_seconds(second)}
        plain.append(times[PLAIN])
        paused.append(times[PAUSED])
        print(f"round {i + 1}: collector running {plain[-1]:.2f} s, paused {paused[-1]:.2f} s")
    ratios = [p / q for p, q in zip(paused, plain, strict=True)]
    print(
        f"imports' CPU, paused / running: {statistics.median(paused) / statistics.median(plain):.2f}x "
        f"(medians {statistics.median(paused):.2f} s / {statistics.median(plain):.2f} s; "
        f"rounds {min(ratios):.2f}-{max(ratios):.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
