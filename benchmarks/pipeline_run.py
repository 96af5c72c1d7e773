"""Streaming vs synchronous on the embedded default: the same short workload in `local` mode twice.

Streaming keeps η = 2: actors run up to two versions ahead while the learner trains. The
synchronous baseline is the same run with η = 0: admission control then lets the actors start a
step's groups only after the previous step's weights are published, so generation and training
alternate (generate a batch, train on it). Trajectories/s and learner busy fraction of each, and
their ratio.

    python benchmarks/pipeline_run.py [--steps 12] [--cache runs/cache]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from pipeline.assets.cache import prepare_assets
from pipeline.config.loader import load_config
from pipeline.runtime.local import RunSummary, run_local

WORKLOAD = [
    "learner.groups_per_step=2",
    "buffer.group_size=4",
    "actors.concurrency=8",
    "actors.max_turns=2",
    "actors.max_new_tokens_per_turn=32",
    "actors.max_response_tokens=192",
    "learner.micro_batch_size=8",
    "metrics.loggers=[]",
]


def measure(steps: int, eta: int, cache: str, run_dir: Path) -> RunSummary:
    config = load_config(
        "configs/local.yaml",
        [
            *WORKLOAD,
            f"learner.max_steps={steps}",
            f"buffer.max_staleness={eta}",
            f"runtime.cache_dir={cache}",
        ],
    )
    assets = prepare_assets(config, quiet=True)
    run_dir.mkdir(parents=True)
    return asyncio.run(run_local(config, assets, run_dir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--cache", default="runs/cache", help="where the world, index and policy are (re)used"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        streaming = measure(args.steps, 2, args.cache, Path(tmp) / "streaming")
        synchronous = measure(args.steps, 0, args.cache, Path(tmp) / "synchronous")
    rows = [("streaming (eta 2)", streaming), ("synchronous (eta 0)", synchronous)]
    print(
        f"local runtime, embedded default, {args.steps} learner steps of 2 groups x 4 trajectories"
    )
    for name, s in rows:
        print(
            f"  {name:<20}: {s.trajectories / s.seconds:6.2f} trajectories/s, learner busy {s.busy_fraction:5.0%}, "
            f"{s.seconds:6.1f} s"
        )
    print(
        f"  streaming / synchronous: {streaming.trajectories / streaming.seconds / (synchronous.trajectories / synchronous.seconds):.2f}x "
        f"trajectories/s, busy fraction {streaming.busy_fraction / max(synchronous.busy_fraction, 1e-9):.2f}x"
    )


if __name__ == "__main__":
    main()
