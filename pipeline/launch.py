"""`python -m pipeline.launch CONFIG [--set k=v ...] [--run-dir DIR] [--dry-run] [--resume]`.

Validates the config, writes the resolved config into a fresh run directory, builds or reuses the
assets (world, index, warm-started policy) and streams: actors generate, the learner trains on
each complete group, weights go back to the actors, until `learner.max_steps`. Runtimes: `local`
(one process) and `ray` (roles as Ray actors); the GPU recipes say what they need when it is
missing. `--resume --run-dir DIR` goes on from DIR's latest checkpoint with DIR's own settings
(only `learner.max_steps` may change).
"""

from __future__ import annotations

import argparse
import errno
import sys
import time
from pathlib import Path

from pipeline.config.loader import ConfigError, dump_config, load_config, write_resolved_config
from pipeline.config.schema import StrataConfig
from pipeline.runtime.allocator import cap_arenas


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.launch",
        description="Train an LLM search agent with Stratified GRPO.",
    )
    parser.add_argument("config", help="YAML config, e.g. configs/local.yaml")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a dotted key, typed: --set learner.alpha=0.8 --set actors.tools=[search,python]",
    )
    parser.add_argument(
        "--run-dir", help="run directory (default: <runtime.runs_dir>/<config>-<time>)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="validate, print the resolved config as YAML, exit"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="go on with the run in --run-dir from its latest checkpoint (raise learner.max_steps to train longer)",
    )
    return parser


def new_run_dir(config: StrataConfig, config_path: str, requested: str | None) -> Path:
    """A run directory that holds nothing yet: the requested one, or a fresh timestamped one."""
    if requested is not None:
        run_dir = Path(requested)
        if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
            raise ConfigError(
                f"--run-dir {run_dir} already exists and is not an empty directory: "
                "pick a new one so no earlier run is overwritten"
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir
    stem = f"{Path(config_path).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    parent = Path(config.runtime.runs_dir)
    for attempt in range(1000):
        run_dir = parent / (stem if attempt == 0 else f"{stem}-{attempt}")
        try:
            run_dir.mkdir(parents=True, exist_ok=False)
            return run_dir
        except FileExistsError:
            continue
    raise ConfigError(f"could not create a fresh run directory under {parent}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cap_arenas()  # resident memory stays flat over long runs (pipeline/runtime/allocator.py)
    notes: list[str] = []
    try:
        config = load_config(args.config, args.overrides, notes)
        for note in notes:
            print(f"strata: note: {note}", file=sys.stderr)
        if args.dry_run:
            sys.stdout.write(dump_config(config, notes))
            return 0
        problem = unavailable(config) or refused_for_training(config)
        if problem:  # before the run directory exists: a refused launch leaves nothing behind
            print(f"strata: error: {problem}", file=sys.stderr)
            return 2
        created = args.run_dir is None or not Path(args.run_dir).exists()
        if args.resume:
            run_dir = resumable_run_dir(config, args.run_dir)
        else:
            run_dir = new_run_dir(config, args.config, args.run_dir)
        written = write_resolved_config(config, run_dir, notes)
    except ConfigError as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"strata: error: cannot write the run directory: {exc}", file=sys.stderr)
        return 2
    print(
        f"strata: config {args.config} is valid; resolved config written to {written}", flush=True
    )
    code = run(config, args.config, run_dir, resume=args.resume)
    if code != 0 and not args.resume:
        discard_if_unstarted(run_dir, created)
    return code


def discard_if_unstarted(run_dir: Path, created: bool) -> None:
    """After a launch that failed before the run started (e.g. a data file the assets cannot
    read), the run directory holds only its config.yaml: remove it, and the directory when this
    launch created it, so a refused launch leaves nothing behind. Anything more (a server's log,
    a step's metrics) is what the user needs to see why, and stays."""
    if sorted(p.name for p in run_dir.iterdir()) != ["config.yaml"]:
        return
    (run_dir / "config.yaml").unlink()
    if created:
        run_dir.rmdir()


RESUMABLE_CHANGES = {"learner.max_steps"}


def _flat(data: dict, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def resumable_run_dir(config: StrataConfig, requested: str | None) -> Path:
    """The run directory to resume, checked: it has a checkpoint and was run with `config`'s
    settings (apart from `RESUMABLE_CHANGES`)."""
    if requested is None:
        raise ConfigError("--resume needs --run-dir DIR: the directory of the run to go on with")
    run_dir = Path(requested)
    if not (run_dir / "checkpoints" / "latest").is_file():
        raise ConfigError(
            f"--resume: {run_dir} holds no checkpoint (no checkpoints/latest): start it without --resume"
        )
    saved = load_config(run_dir / "config.yaml")
    old, new = _flat(saved.model_dump(mode="json")), _flat(config.model_dump(mode="json"))
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    changed = [k for k in changed if k not in RESUMABLE_CHANGES]
    if changed:
        raise ConfigError(
            f"--resume: the settings differ from the run's own {run_dir / 'config.yaml'} in "
            f"{', '.join(changed)}: resume with the same config (only learner.max_steps may change)"
        )
    return run_dir


def refused_for_training(config: StrataConfig) -> str | None:
    """Settings that evaluation takes but training cannot, in one line, or None."""
    if config.actors.top_p < 1:
        return (
            f"actors.top_p {config.actors.top_p:g} < 1 cannot train correctly: the embedded engine "
            "records behaviour log-probs before the nucleus cut, vLLM after it, and the learner "
            "recomputes them uncut, so the importance ratios would be wrong: set actors.top_p=1.0 "
            "(pipeline.evaluate may still sample with top_p < 1)"
        )
    return None


def unavailable(config: StrataConfig) -> str | None:
    """Why this machine cannot run `config`, in one line, or None."""
    import torch

    from pipeline.config.schema import (
        EmbeddedEngine,
        PretrainedModel,
        RayRuntime,
        SGLangEngine,
        SimulatedEngine,
        VLLMEngine,
    )

    gpu = torch.cuda.is_available()
    engine = config.actors.engine
    if isinstance(engine, SimulatedEngine) and isinstance(config.runtime, RayRuntime):
        return "actors.engine.type simulated runs on the local runtime only: use --set runtime.type=local"
    if isinstance(engine, SGLangEngine) and not engine.urls:
        from actors.sglang_server import launch_problem

        cluster = None
        if isinstance(config.runtime, RayRuntime):
            cluster = "joined" if config.runtime.address else "private"
        problem = launch_problem(engine, engine.python, torch.cuda.device_count(), cluster)
        if problem is not None:
            return problem
    if isinstance(engine, EmbeddedEngine) and engine.device == "cuda" and not gpu:
        return "actors.engine.device cuda: this machine has no CUDA GPU: use --set actors.engine.device=cpu"
    if isinstance(config.model, PretrainedModel) and config.model.dtype == "float16" and not gpu:
        return (
            "model.dtype float16 trains only on CUDA GPUs (DeepSpeed refuses fp16 on CPU): "
            "use --set model.dtype=bfloat16 or float32 here"
        )
    if config.learner.zero_stage == 3 and not gpu:
        return "learner.zero_stage 3 needs CUDA GPUs here: use --set learner.zero_stage=2 on CPU"
    local = not isinstance(config.runtime, RayRuntime)  # under Ray: the learner node's GPUs
    if gpu and local and config.learner.num_ranks > torch.cuda.device_count():
        return (
            f"learner.num_ranks {config.learner.num_ranks} needs a GPU per rank, this machine has "
            f"{torch.cuda.device_count()}: lower learner.num_ranks"
        )
    nccl = isinstance(engine, SGLangEngine) and engine.weight_sync == "nccl"
    if nccl and isinstance(config.runtime, RayRuntime):
        return (
            "actors.engine.weight_sync nccl broadcasts from the process that holds both the "
            "learner and the engine client, which runtime.type ray splits: use weight_sync "
            "disk under Ray, or runtime.type local"
        )
    if isinstance(config.runtime, RayRuntime):
        try:
            import ray  # noqa: F401
        except ImportError:
            return "runtime.type ray needs the ray package: pip install 'ray>=2.30', or use --set runtime.type=local"
    if isinstance(engine, VLLMEngine) and not engine.urls:
        from actors.servers import ServerStartError
        from actors.vllm_server import vllm_python

        try:
            vllm_python(engine.python)
        except ServerStartError as exc:
            return str(exc)
    if isinstance(engine, VLLMEngine | SGLangEngine) and engine.urls:
        return unreachable(engine.urls)
    return None


def unreachable(urls: list[str], timeout_s: float = 5.0) -> str | None:
    """One line naming the servers in `urls` whose /health does not answer, or None."""
    from concurrent.futures import ThreadPoolExecutor

    from actors.servers import healthy

    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        answers = list(pool.map(lambda url: healthy(url, timeout_s), urls))
    silent = [url for url, ok in zip(urls, answers, strict=True) if not ok]
    if not silent:
        return None
    return (
        f"actors.engine.urls: no answer from {', '.join(f'{u.rstrip(chr(47))}/health' for u in silent)} "
        f"({len(silent)} of {len(urls)} servers) within {timeout_s:g} s: start them, or fix the URLs"
    )


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
    from rich.console import Console

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


def run(config: StrataConfig, config_path: str, run_dir: Path, resume: bool = False) -> int:
    import asyncio
    import signal

    from actors.pool import PoolFailure
    from actors.servers import ServerStartError
    from learner.checkpoint import CheckpointError
    from pipeline.assets.cache import prepare_assets
    from pipeline.config.schema import RayRuntime
    from pipeline.evaluation.heldout import EvalError
    from pipeline.evaluation.report import learning_signal, write_report
    from pipeline.runtime.stream import RunSummary, RuntimeUnavailable

    def terminate(signum, frame):  # SIGTERM while the assets are built: stop like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    from pipeline.config.schema import SimulatedEngine

    if isinstance(config.actors.engine, SimulatedEngine):
        from pipeline.runtime.simulated import run_simulated

        return run_simulated(config, run_dir)
    try:
        assets = prepare_assets(config)
    except (OSError, ValueError) as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    summary = RunSummary()
    from rich.console import Console

    console = Console(soft_wrap=True, highlight=False)

    progress = progress_printer(config, console)
    if isinstance(config.runtime, RayRuntime):
        from pipeline.runtime.ray import run_ray as runtime
    else:
        from pipeline.runtime.local import run_local as runtime

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
            await runtime(config, assets, run_dir, progress, summary, resume=resume)
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
    except OSError as exc:  # e.g. the metrics port is taken
        print(f"strata: error: {exc} (set metrics.port, or metrics.enabled=false)", file=sys.stderr)
        return 2
    except (RuntimeUnavailable, ServerStartError) as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"strata: error: --resume: {exc}", file=sys.stderr)
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
    report = write_report(run_dir, config_path, summary, assets.policy_dir)
    first, last = learning_signal(summary.metrics)
    restarts = (
        f"actor restarts {summary.actor_restarts}, retrieval restarts {summary.retrieval_restarts}; "
        if isinstance(config.runtime, RayRuntime)
        else ""
    )
    resumed = f" (resumed at step {summary.resumed_from})" if summary.resumed_from else ""
    print(
        f"strata: {summary.steps} steps{resumed}, {summary.trajectories} trajectories in {summary.seconds:.0f}s; "
        f"learner busy {summary.busy_fraction:.0%}; {restarts}mean reward first 20% {first:.3f} -> last 20% {last:.3f}; "
        f"report {report}"
    )
    return 130 if interrupted else 0


def stop_line(exc: BaseException, run_dir: Path) -> str | None:
    """The one line for a run stopped by a full disk (ENOSPC anywhere in the exception's chain:
    the spill, a checkpoint, metrics) or by a learner rank that died, naming the checkpoint to
    go on from; None for any other error."""
    from learner.ranks import RankError

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


def _then(run_dir: Path, remedy: str) -> str:
    latest = run_dir / "checkpoints" / "latest"
    if latest.is_file():
        return (
            f"at its last complete checkpoint, checkpoints/{latest.read_text().strip()}: "
            f"{remedy}, then go on with --resume --run-dir {run_dir}"
        )
    return f"before its first checkpoint: {remedy} and start it again"


if __name__ == "__main__":
    sys.exit(main())
