"""`python -m pipeline.launch CONFIG [--set k=v ...] [--run-dir DIR] [--dry-run]`.

Validates the config, writes the resolved config into a fresh run directory, builds or reuses the
assets (world, index, warm-started policy) and streams: actors generate, the learner trains on
each complete group, weights go back to the actors, until `learner.max_steps`. The `local` runtime
runs here; the `ray` runtime and the GPU recipes say what they need when it is missing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pipeline.config import StrataConfig
from pipeline.config_loader import ConfigError, dump_config, load_config, write_resolved_config


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
    try:
        config = load_config(args.config, args.overrides)
        if args.dry_run:
            sys.stdout.write(dump_config(config))
            return 0
        run_dir = new_run_dir(config, args.config, args.run_dir)
        written = write_resolved_config(config, run_dir)
    except ConfigError as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"strata: error: cannot write the run directory: {exc}", file=sys.stderr)
        return 2
    problem = unavailable(config)
    if problem:
        print(f"strata: error: {problem}", file=sys.stderr)
        return 2
    print(
        f"strata: config {args.config} is valid; resolved config written to {written}", flush=True
    )
    return run(config, args.config, run_dir)


def unavailable(config: StrataConfig) -> str | None:
    """Why this machine cannot run `config`, in one line, or None."""
    import torch

    from pipeline.config import RayRuntime, SGLangEngine

    gpu = torch.cuda.is_available()
    if isinstance(config.actors.engine, SGLangEngine) and not gpu:
        return (
            "this config generates with SGLang servers and trains with ZeRO-3, which need CUDA GPUs; "
            "this machine has none: run configs/local.yaml (the embedded CPU default) instead"
        )
    if config.learner.zero_stage == 3 and not gpu:
        return "learner.zero_stage 3 needs CUDA GPUs here: use --set learner.zero_stage=2 on CPU"
    if isinstance(config.runtime, RayRuntime):
        return "runtime.type ray is not built yet in this version: use runtime.type local (--set runtime.type=local)"
    return None


def _progress_line(metrics: dict, max_steps: int) -> None:
    print(
        f"step {metrics['step']:>4}/{max_steps}  {metrics['elapsed_s']:6.1f}s  "
        f"{metrics['generated_tokens_per_s']:6.0f} tok/s  {metrics['trajectories_per_s']:5.2f} traj/s  "
        f"reward {metrics.get('reward_mean', float('nan')):.3f}  tool calls {metrics.get('tool_calls_mean', 0):.2f}  "
        f"staleness {metrics.get('staleness_mean', 0):.2f}  buffer {metrics['buffer_ready']}r/{metrics['buffer_open']}o  "
        f"loss {metrics.get('loss', float('nan')):+.4f}",
        flush=True,
    )


def run(config: StrataConfig, config_path: str, run_dir: Path) -> int:
    import asyncio
    import signal

    from pipeline.assets import prepare_assets
    from pipeline.local_runtime import RunSummary, run_local
    from pipeline.report import learning_signal, write_report

    def terminate(signum, frame):  # SIGTERM ends the run like Ctrl-C: checkpoint, flush, stop
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    try:
        assets = prepare_assets(config)
    except (OSError, ValueError) as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    summary = RunSummary()

    async def main():
        await run_local(
            config, assets, run_dir, lambda m: _progress_line(m, config.learner.max_steps), summary
        )

    interrupted = False
    try:
        asyncio.run(main())
    except OSError as exc:  # e.g. the metrics port is taken
        print(f"strata: error: {exc} (set metrics.port, or metrics.enabled=false)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        interrupted = True
        print("strata: interrupted: checkpointed and flushed what was running", file=sys.stderr)
    if not summary.steps and not interrupted:
        return 1
    report = write_report(run_dir, config_path, summary)
    first, last = learning_signal(summary.metrics)
    print(
        f"strata: {summary.steps} steps, {summary.trajectories} trajectories in {summary.seconds:.0f}s; "
        f"learner busy {summary.busy_fraction:.0%}; mean reward first 20% {first:.3f} -> last 20% {last:.3f}; "
        f"report {report}"
    )
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
