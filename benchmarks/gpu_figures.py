"""What the one-GPU measurements (learner_gpu_cost.py, decode_gpu_cost.py) share: their --tiny and
--json options, which device to measure on (refused in one line when there is no GPU), how a call
is timed, and where the figures go."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tiny", action="store_true", help="two layers, any device: checks the script"
    )
    parser.add_argument("--json", help="also write the figures here")


def device_for(script: str, what: str, tiny: bool) -> str | None:
    """ "cuda", or "cpu" for a --tiny check; None, after one line on stderr, for a real
    measurement on a machine without a GPU."""
    if torch.cuda.is_available():
        return "cuda"
    if tiny:
        return "cpu"
    print(
        f"{script}: no CUDA GPU here; this measures {what} on one GPU (--tiny checks the script "
        "on CPU)",
        file=sys.stderr,
    )
    return None


def describe(device: str) -> dict[str, object]:
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
    }


def report(figures: dict, path: str | None) -> None:
    """The figures as one JSON line on stdout, and indented into `path` if given."""
    print(json.dumps(figures))
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=1)


def timed(
    fn: Callable[[], object], device: str, repeats: int, calls: int = 1, warmup: int = 2
) -> float:
    """Median seconds a call of `fn`, over `repeats` timings of `calls` calls each, after `warmup`
    calls; the GPU's queue is drained before and after each timing."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls)
    return sorted(times)[len(times) // 2]


def timed_or_oom(
    fn: Callable[[], object],
    device: str,
    repeats: int,
    figures: dict,
    key: str,
    what: str,
    warmup: int = 2,
) -> float | None:
    """`timed(fn)`, or None after recording `figures[key] = "out of memory"` and saying so
    (`what`: the work that did not fit)."""
    try:
        return timed(fn, device, repeats, warmup=warmup)
    except torch.OutOfMemoryError:
        figures[key] = "out of memory"
        print(f"{key}: out of memory at {what}", flush=True)
        return None
