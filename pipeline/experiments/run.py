"""`python -m pipeline.experiment CONFIG [--only NAME ...] [--dry-run] [--runner sequential|ray]`.

Runs every variant x seed of an experiment file (configs/experiments/*.yaml) as its own
`python -m pipeline.launch BASE --run-dir OUT/VARIANT-seedK --set ...`, exactly what a user would
type, with its output in OUT/logs/VARIANT-seedK.log. Every run's resolved config is validated
before the first one starts. It resumes: a finished run is skipped, one with a checkpoint goes on
(`--resume`), a directory without one is removed and started again. A failed run is reported and
the others go on. OUT/experiment.json records each run's overrides, status and seconds, rewritten
whole after every run. `python -m pipeline.experiment_report OUT` makes the results document.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pipeline.config.loader import ConfigError
from pipeline.experiments.plan import ExperimentConfig, Run, parallel_problem, plan, read_experiment
from pipeline.runtime.ray_cluster import import_ray

RunFn = Callable[[list[str], Path, Path], int]
"""Runs a command line (argv) with its output appended to a log file, in a working directory;
returns its exit status. The subprocess boundary: tests pass a fake."""


def run_logged(argv: list[str], log: Path, cwd: Path) -> int:
    """Run `argv` in `cwd`, stdout and stderr appended to `log`. If the experiment is stopped
    (Ctrl-C, SIGTERM), the run is asked to stop too and waited for: it checkpoints on the way out."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a", encoding="utf-8") as fh:
        fh.write(f"$ {shlex.join(argv)}\n")
        fh.flush()
        proc = subprocess.Popen(
            argv, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            return proc.wait()
        except BaseException:
            proc.send_signal(signal.SIGTERM)  # launch stops once, however many signals arrive
            proc.wait()
            raise


def _timed(run: RunFn, argv: list[str], log: Path, cwd: Path) -> tuple[int, float]:
    started = time.monotonic()
    return run(argv, log, cwd), time.monotonic() - started


def launch_argv(base: str, run: Run) -> list[str]:
    argv = [sys.executable, "-m", "pipeline.launch", base, "--run-dir", str(run.run_dir)]
    argv += ["--resume"] if run.action == "resume" else []
    return argv + [arg for text in run.overrides for arg in ("--set", text)]


Finished = Callable[[Run, int, float], None]  # called with each run's exit status and seconds
Jobs = list[tuple[Run, list[str]]]  # each run with its launch command line
Runner = Callable[[Jobs, RunFn, Finished], None]


def run_sequential(jobs: Jobs, run: RunFn, finished: Finished) -> None:
    """One run after another, in this process's working directory."""
    for job, argv in jobs:
        _say(f"start {job.name} ({job.action}), log {job.log}")
        job.status = "running"
        finished(job, *_timed(run, argv, job.log, Path.cwd()))


def run_on_ray(jobs: Jobs, run: RunFn, finished: Finished) -> None:
    """Each run a Ray task (one CPU) on a private cluster bound to 127.0.0.1. The first run goes
    alone: it builds the assets cache (world, index, warm start) the others then share."""

    ray = import_ray("127.0.0.1")
    handler = signal.getsignal(signal.SIGTERM)
    ray.init(
        address="local",
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        logging_level="WARNING",
        log_to_driver=False,
    )
    signal.signal(signal.SIGTERM, handler)  # ours: stop the runs, record them, exit 130
    task = ray.remote(num_cpus=1, max_retries=0)(_timed)
    pending: dict = {}
    try:
        for batch in (jobs[:1], jobs[1:]):
            for job, argv in batch:
                _say(f"submit {job.name} ({job.action}) as a Ray task, log {job.log}")
                job.status = "running"  # or queued until a CPU is free
                pending[task.remote(run, argv, job.log, Path.cwd())] = job
            while pending:
                [ref], _ = ray.wait(list(pending), num_returns=1)
                job = pending.pop(ref)
                try:
                    finished(job, *ray.get(ref))
                except ray.exceptions.RayError as exc:  # the task died; its run is not lost
                    _say(f"{job.name}: its Ray task failed: {str(exc).splitlines()[0]}")
                    finished(job, -1, float("nan"))
    except BaseException:
        for ref in pending:
            ray.cancel(ref)  # raises KeyboardInterrupt in the task: run_logged stops its run
        ray.wait(list(pending), num_returns=len(pending), timeout=600)
        raise
    finally:
        ray.shutdown()


RUNNERS: dict[str, Runner] = {"sequential": run_sequential, "ray": run_on_ray}


def _say(message: str) -> None:
    print(f"strata: experiment: {message}", flush=True)


def write_record(experiment: ExperimentConfig, source: str, runs: list[Run]) -> Path:
    """OUT/experiment.json, written whole (temporary file, rename); runs of variants left out by
    --only keep their earlier records."""
    target = Path(experiment.out) / "experiment.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        earlier = json.loads(target.read_text()).get("runs", []) if target.is_file() else []
    except json.JSONDecodeError:
        earlier = []  # unreadable: the run directories themselves say what is done
    fields = ("name", "variant", "seed", "overrides", "action", "status", "rc", "seconds")
    current = {
        r.name: {k: getattr(r, k) for k in fields} | {"run_dir": str(r.run_dir), "log": str(r.log)}
        for r in runs
    }
    records = [current.pop(r["name"], r) for r in earlier] + list(current.values())
    body = {
        "experiment": source,
        "config": experiment.model_dump(mode="json"),
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "runs": records,
    }
    fd, tmp = tempfile.mkstemp(prefix=".experiment.", suffix=".json", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(body, indent=1) + "\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.experiment",
        description="Run every variant x seed of an experiment file as its own launch run.",
    )
    parser.add_argument("config", help="experiment YAML, e.g. configs/experiments/ablation.yaml")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these variants")
    parser.add_argument("--dry-run", action="store_true", help="validate, print the runs, exit")
    parser.add_argument("--runner", choices=sorted(RUNNERS), help="overrides the file's runner")
    return parser


def main(argv: Sequence[str] | None = None, run: RunFn = run_logged) -> int:
    args = _parser().parse_args(argv)
    try:
        experiment = read_experiment(args.config)
        runs = plan(experiment, args.config, args.only)
        runner = args.runner or experiment.runner
        problem = parallel_problem(runs) if runner == "ray" else None
        if problem:
            raise ConfigError(f"{args.config}: {problem}")
    except ConfigError as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    counts = {a: sum(r.action == a for r in runs) for a in ("start", "restart", "resume", "skip")}
    _say(
        f"{args.config}: {len(runs)} runs in {experiment.out} (runner {runner}): "
        + ", ".join(f"{n} to {a}" for a, n in counts.items() if n)
    )
    if args.dry_run:
        for r in runs:
            sets = " ".join(f"--set {shlex.quote(o)}" for o in r.overrides)
            print(f"  {r.name:<24} {r.action:<8} {sets}")
        print(
            f"each: python -m pipeline.launch {experiment.base} --run-dir {experiment.out}/NAME [--resume] --set ..."
        )
        return 0
    return execute(experiment, args.config, runs, RUNNERS[runner], run)


def execute(
    experiment: ExperimentConfig, source: str, runs: list[Run], runner: Runner, run: RunFn
) -> int:
    """Skip, remove and run as planned; record after each run; 0 if every run finished, 130 if
    stopped, else 1."""
    for r in runs:
        if r.action == "skip":
            r.status, r.rc = "done", 0
            _say(f"skip {r.name}: done (report.md, checkpoint at step {r.max_steps} or later)")
        elif r.action == "restart":
            _say(
                f"{r.name}: {r.run_dir} holds no checkpoint (an attempt that never got one): removed, starting again"
            )
            shutil.rmtree(r.run_dir)
    write_record(experiment, source, runs)

    def finished(r: Run, rc: int, seconds: float) -> None:
        r.rc, r.seconds = rc, round(seconds, 1) if seconds == seconds else None
        r.status = "done" if rc == 0 else "interrupted" if rc == 130 else "failed"
        _say(f"end {r.name} rc {rc} in {seconds:.0f} s" + ("" if rc == 0 else f": see {r.log}"))
        write_record(experiment, source, runs)

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)  # like Ctrl-C: running runs checkpoint first
    jobs = [(r, launch_argv(experiment.base, r)) for r in runs if r.action != "skip"]
    try:
        runner(jobs, run, finished)
    except KeyboardInterrupt:
        for r in runs:
            r.status = "interrupted" if r.status == "running" else r.status
        write_record(experiment, source, runs)
        _say("interrupted: the running runs checkpointed; run the same command again to go on")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    failed = [r for r in runs if r.status != "done"]
    _say(
        f"{len(runs) - len(failed)} of {len(runs)} runs done"
        + (f"; not done: {', '.join(f'{r.name} (rc {r.rc})' for r in failed)}" if failed else "")
        + f"; {Path(experiment.out) / 'experiment.json'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
