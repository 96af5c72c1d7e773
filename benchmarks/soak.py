"""`make soak`: the embedded default at full concurrency for 30 minutes, watched from outside.

    python benchmarks/soak.py [--minutes 30] [--interval 10] [--out runs/soak] [--set key=value ...]

Launches `python -m pipeline.launch configs/local.yaml` with no step limit and a learning rate of
1e-8 (every step, publish, checkpoint and evaluation runs, but the policy stays put: a drifting
policy's answers lengthen and a step's working set with them, which the memory rule would read as
a leak; `--set learner.lr=...` puts learning back), samples its process
tree every `--interval` seconds (resident memory of the launcher and of the whole tree, open file
descriptors, threads, processes), stops it with SIGTERM `--minutes` after its first learner step
(set-up and the warm start are not the soak) and checks, after a warm-up (the first 20% of the
samples):
- resident memory is flat: the last third's median within 10% of the first third's (the buffer's
  limits bound what the run holds; a leak grows with time);
- file descriptors and processes do not grow: the last third's median at most 4 above the first's;
- the run stopped cleanly (exit 130), left no process behind, and its books balance against its
  spill (`pipeline.runtime.accounting.audit`).
Writes OUT/soak.json (every sample and the verdict) and OUT/soak.png; the last line says PASS or
FAIL with the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.runtime.accounting import audit  # noqa: E402

WARMUP_SHARE = 0.2
RSS_TOLERANCE = 0.10
COUNT_SLACK = 4


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the first learner step
    rss_mb: float  # the launcher's resident memory
    tree_rss_mb: float  # summed over the launcher and every process under it
    fds: int  # the launcher's open file descriptors
    threads: int
    processes: int  # the launcher and every process under it


def sample(proc: psutil.Process, t: float) -> Sample:
    tree = [proc]
    with contextlib.suppress(psutil.NoSuchProcess):
        tree += proc.children(recursive=True)
    tree_rss = 0
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):  # a sandboxed python call that just ended
            tree_rss += p.memory_info().rss
    rss = proc.memory_info().rss
    return Sample(
        round(t, 1), rss / 2**20, tree_rss / 2**20, proc.num_fds(), proc.num_threads(), len(tree)
    )


def _alive(pid: int) -> bool:
    """Running (a zombie has ended; only its entry waits for its parent)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def verdict(samples: list[Sample]) -> dict:
    """Flat or growing, from the samples after warm-up: the first third's median against the
    last third's, for resident memory (relative) and for descriptors and processes (absolute)."""
    after = samples[max(1, int(len(samples) * WARMUP_SHARE)) :]
    if len(after) < 3:
        return {
            "pass": False,
            "problems": [f"only {len(after)} samples after warm-up: soak longer"],
        }
    third = max(1, len(after) // 3)
    first, last = after[:third], after[-third:]

    def median(rows, key):
        return statistics.median(getattr(s, key) for s in rows)

    rss_growth = median(last, "rss_mb") / median(first, "rss_mb") - 1
    rss = [s.rss_mb for s in after]
    figures = {
        "samples_after_warmup": len(after),
        "rss_mb_after_warmup": [round(min(rss), 1), round(max(rss), 1)],
        "rss_growth": round(rss_growth, 4),
        "fds_growth": median(last, "fds") - median(first, "fds"),
        "processes_growth": median(last, "processes") - median(first, "processes"),
    }
    problems = []
    if rss_growth > RSS_TOLERANCE:
        problems.append(
            f"resident memory grew {rss_growth:+.1%} after warm-up (limit {RSS_TOLERANCE:.0%})"
        )
    for key in ("fds", "processes"):
        if figures[f"{key}_growth"] > COUNT_SLACK:
            problems.append(
                f"{key} grew by {figures[f'{key}_growth']:g} after warm-up (limit {COUNT_SLACK})"
            )
    return {**figures, "pass": not problems, "problems": problems}


def plot(samples: list[Sample], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t / 60 for s in samples]
    cut = t[max(1, int(len(samples) * WARMUP_SHARE))]
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    axes[0].plot(t, [s.rss_mb for s in samples], label="launcher")
    axes[0].plot(t, [s.tree_rss_mb for s in samples], label="launcher + children")
    axes[0].set_ylabel("resident memory (MB)")
    axes[0].legend(loc="lower right")
    axes[1].plot(t, [s.fds for s in samples])
    axes[1].set_ylabel("open file descriptors")
    axes[2].plot(t, [s.processes for s in samples], label="processes")
    axes[2].plot(t, [s.threads for s in samples], label="threads")
    axes[2].set_ylabel("count")
    axes[2].legend(loc="upper right")
    axes[2].set_xlabel("minutes since the first learner step")
    for ax in axes:
        ax.axvline(cut, color="grey", linestyle=":")
        ax.set_ylim(bottom=0)
    axes[0].set_title("Soak of the embedded default (dotted line: end of warm-up)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def soak(minutes: float, interval: float, out: Path, sets: list[str]) -> dict:
    run_dir = out / "run"
    argv = [
        sys.executable,
        "-m",
        "pipeline.launch",
        "configs/local.yaml",
        "--run-dir",
        str(run_dir),
        "--set",
        "learner.max_steps=100000000",
        "--set",
        "learner.lr=1e-8",
        "--set",
        "metrics.port=0",
    ]
    for item in sets:
        argv += ["--set", item]
    log = (out / "launch.log").open("w", buffering=1)
    child = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    proc = psutil.Process(child.pid)
    stepping = threading.Event()

    def copy_output() -> None:  # read all of it: a full pipe would stall the run
        for line in child.stdout:
            log.write(line)
            if line.startswith("step "):
                stepping.set()

    copying = threading.Thread(target=copy_output, daemon=True)
    copying.start()
    while not stepping.wait(1.0):  # set-up and the warm start first: not the soak
        if child.poll() is not None:
            raise SystemExit(
                f"soak: the run ended before its first step (see {out / 'launch.log'})"
            )
    seen: set[int] = set()
    samples: list[Sample] = []
    started = time.monotonic()
    while (now := time.monotonic() - started) < minutes * 60 and child.poll() is None:
        samples.append(sample(proc, now))
        seen.update(p.pid for p in proc.children(recursive=True))
        print(
            f"soak: {now / 60:5.1f} min  rss {samples[-1].rss_mb:7.1f} MB  fds {samples[-1].fds:4d}  "
            f"processes {samples[-1].processes:3d}",
            flush=True,
        )
        time.sleep(interval)
    child.send_signal(signal.SIGTERM)
    child.wait(timeout=300)
    copying.join(timeout=30)
    log.close()
    time.sleep(1)
    left = sorted(pid for pid in seen if _alive(pid))
    result = verdict(samples)
    problems = result["problems"]
    if child.returncode != 130:
        problems.append(
            f"the run exited {child.returncode}, not 130 after SIGTERM (see {out / 'launch.log'})"
        )
    if left:
        problems.append(f"processes left behind: {left}")
    problems += audit(run_dir)
    result.update(
        {"pass": not problems, "minutes": round(samples[-1].t / 60, 1) if samples else 0.0}
    )
    (out / "soak.json").write_text(
        json.dumps({**result, "samples": [asdict(s) for s in samples]}, indent=1)
    )
    if samples:
        plot(samples, out / "soak.png")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--out", type=Path, default=Path("runs/soak"))
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="passed to pipeline.launch"
    )
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"soak: {args.out} exists: name a new --out")
    args.out.mkdir(parents=True)
    result = soak(args.minutes, args.interval, args.out.resolve(), args.set)
    for problem in result["problems"]:
        print(f"soak: problem: {problem}")
    low, high = result.get("rss_mb_after_warmup", [0, 0])
    print(
        f"soak: {result['minutes']:.1f} min, launcher RSS after warm-up {low:.0f}-{high:.0f} MB "
        f"({result.get('rss_growth', 0):+.1%} last third vs first), fds {result.get('fds_growth', 0):+g}, "
        f"processes {result.get('processes_growth', 0):+g}: {'PASS' if result['pass'] else 'FAIL'} "
        f"({args.out / 'soak.png'})"
    )
    sys.exit(0 if result["pass"] else 1)


if __name__ == "__main__":
    main()
