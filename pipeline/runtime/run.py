"""One launch's run, after the config is valid and the run directory written: build or reuse the
assets, hand the run to the chosen runtime (or to an engine that replaces the whole run, the
simulated cluster), turn the ways a run stops into one line and an exit status, and write
`report.md`.

Exit statuses: 0 done; 1 the run failed (generation, a full disk, a dead learner rank, a stop
whose step under way outlasted STOP_WAIT_S), 2 it could not start (a port, Ray, a server, a
checkpoint to resume), 130 interrupted (checkpointed).
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import sys
from pathlib import Path

from rich.console import Console

from actors.pool import PoolFailure
from actors.servers import ServerStartError
from learner.checkpoint import CheckpointError
from learner.lora import LoraError
from learner.ranks import RankError
from pipeline.assets.cache import Assets, prepare_assets
from pipeline.backends.runtime import RuntimeUnavailable
from pipeline.config.schema import StrataConfig
from pipeline.evaluation.heldout import EvalError
from pipeline.evaluation.report import learning_signal, write_report
from pipeline.loggers import LoggerError, Loggers, open_loggers
from pipeline.runtime.local import run_local
from pipeline.runtime.ray import run_ray
from pipeline.runtime.simulated import run_simulated
from pipeline.runtime.stream import RunSummary, StopDeadline

RUNNERS = {"local": run_local, "ray": run_ray}
"""`runtime.type` -> the coroutine that streams a run there (its section: pipeline/backends/)."""
WHOLE_RUNS = {"simulated": run_simulated}
"""`actors.engine.type` -> a run of its own, for an engine that replaces the runtime."""


def run(config: StrataConfig, config_path: str, run_dir: Path, resume: bool = False) -> int:
    """Run `config` in `run_dir` (resuming it from its latest checkpoint with `resume`) and
    return the exit status."""

    def terminate(signum, frame):  # SIGTERM while the assets are built: stop like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    if config.actors.engine.replaces_run:
        return WHOLE_RUNS[config.actors.engine.type](config, run_dir)
    try:  # before anything is built: a taken port or a tracker that cannot start stops it here
        loggers = open_loggers(config, run_dir)
    except LoggerError as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            assets = prepare_assets(config)
        except (OSError, ValueError) as exc:
            print(f"strata: error: {exc}", file=sys.stderr)
            return 2
        return _run(config, config_path, run_dir, resume, assets, loggers)
    finally:
        loggers.close()


def _run(
    config: StrataConfig,
    config_path: str,
    run_dir: Path,
    resume: bool,
    assets: Assets,
    loggers: Loggers,
) -> int:
    summary = RunSummary()
    progress = progress_printer(config, Console(soft_wrap=True, highlight=False))

    def finishing(signum, frame):  # after streaming: the checkpoint is taken, the report is next
        print("strata: already stopping (writing the report); SIGKILL stops at once", flush=True)

    async def main():
        # While the run streams, SIGTERM cancels it as Ctrl-C does (asyncio turns SIGINT into a
        # cancel of this task): it stops at an await, never halfway through the buffer's books
        # as an exception raised from a signal handler could, then checkpoints and flushes.
        # One-shot: a second SIGTERM must not cancel the checkpoint the first one asked for.
        task, stopping = asyncio.current_task(), []

        def stop() -> None:
            if stopping:
                print("strata: already stopping (checkpointing); SIGKILL stops at once", flush=True)
                return
            stopping.append(True)
            task.cancel()

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop)
        try:
            await RUNNERS[config.runtime.type](
                config, assets, run_dir, progress, summary, resume=resume, loggers=loggers
            )
        except StopDeadline as exc:  # the runtime is closed; what hung may hold a thread
            print(f"strata: {exc}; exiting — {_intact(run_dir)}", file=sys.stderr, flush=True)
            loggers.close()
            sys.stdout.flush()
            os._exit(1)  # a thread still waiting on the hung call would hold the exit for good
        finally:  # closing, the loop would give SIGTERM back its default (die at once)
            loop.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, finishing)

    interrupted = False
    try:
        try:
            asyncio.run(main())
        except Exception as exc:
            if (line := stop_line(exc, run_dir)) is None:
                raise
            print(line, file=sys.stderr)
            return 1
    except OSError as exc:  # e.g. a server's port is taken
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeUnavailable, ServerStartError) as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"strata: error: --resume: {exc}", file=sys.stderr)
        return 2
    except LoraError as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    except EvalError as exc:
        print(f"strata: error: eval: {exc}", file=sys.stderr)
        return 2
    except PoolFailure as exc:  # checkpointed on the way out, like an interruption
        print(f"strata: error: generation failed: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        interrupted = True
        print("strata: interrupted: checkpointed and flushed what was running", file=sys.stderr)
    if not summary.steps and not interrupted:
        return 1
    report = write_report(run_dir, config_path, summary, assets.policy_dir, config.metrics.plots)
    loggers.log_report(summary.steps, sorted(run_dir.glob("*.png")))
    first, last = learning_signal(summary.metrics)
    resumed = f" (resumed at step {summary.resumed_from})" if summary.resumed_from else ""
    print(
        f"strata: {summary.steps} steps{resumed}, {summary.trajectories} trajectories in {summary.seconds:.0f}s; "
        f"learner busy {summary.busy_fraction:.0%}; {config.runtime.summary_note(summary)}"
        f"mean reward first 20% {first:.3f} -> last 20% {last:.3f}; report {report}"
    )
    return 130 if interrupted else 0


def progress_printer(config: StrataConfig, console=None):
    """What the run calls after each step: a progress line every `metrics.log_every` steps, and
    for the last step."""

    def progress(metrics: dict) -> None:
        step, last = metrics["step"], config.learner.max_steps
        if step % config.metrics.log_every == 0 or step == last:
            _progress_line(metrics, last, console)

    return progress


def _progress_line(metrics: dict, max_steps: int, console=None) -> None:
    """One line per learner step, through rich: coloured on a terminal, plain text in a pipe or a
    log (never wrapped, so each step stays one line to grep)."""
    console = console or Console(soft_wrap=True, highlight=False)
    console.print(
        f"[bold]step {metrics['step']:>4}/{max_steps}[/bold]  {metrics['elapsed_s']:6.1f}s  "
        f"{metrics['generated_tokens_per_s']:6.0f} tok/s  {metrics['trajectories_per_s']:5.2f} traj/s  "
        f"[green]reward {metrics.get('reward_mean', float('nan')):.3f}[/green]  "
        f"tool calls {metrics.get('tool_calls_mean', 0):.2f}  "
        f"staleness {metrics.get('staleness_mean', 0):.2f}  buffer {metrics['buffer_ready']}r/{metrics['buffer_open']}o  "
        f"loss {metrics.get('loss', float('nan')):+.4f}",
    )
    console.file.flush()


def stop_line(exc: BaseException, run_dir: Path) -> str | None:
    """The one line for a run stopped by a full disk (ENOSPC anywhere in the exception's chain:
    the spill, a checkpoint, metrics) or by a learner rank that died, naming the checkpoint to
    go on from; None for any other error."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"strata: error: the disk of {run_dir} is full (no space left on device): the run stopped {_then(run_dir, 'free space')}"
        if isinstance(exc, RankError):  # under Ray, a RayTaskError that is also a RankError
            said = str(getattr(exc, "cause", exc)).strip().splitlines()[0]
            return f"strata: error: {said}: the run stopped {_then(run_dir, 'see its log')}"
        exc = exc.__cause__ or exc.__context__
    return None


def _intact(run_dir: Path) -> str:
    """What a run given up at a stop leaves to go on from."""
    latest = run_dir / "checkpoints" / "latest"
    if not latest.is_file():
        return "no checkpoint was taken yet: start the run again"
    name = latest.read_text().strip()
    step = name.removeprefix("step-").lstrip("0") or "0"
    return (
        f"checkpoint step {step} (checkpoints/{name}) is intact: go on with "
        f"--resume --run-dir {run_dir}"
    )


def _then(run_dir: Path, remedy: str) -> str:
    latest = run_dir / "checkpoints" / "latest"
    if latest.is_file():
        return (
            f"at its last complete checkpoint, checkpoints/{latest.read_text().strip()}: "
            f"{remedy}, then go on with --resume --run-dir {run_dir}"
        )
    return f"before its first checkpoint: {remedy} and start it again"
