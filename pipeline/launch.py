"""`python -m pipeline.launch CONFIG [--set k=v ...] [--run-dir DIR] [--dry-run] [--resume]`.

Parses the command line and dispatches: validate the config (`pipeline.config`), print it with
`--dry-run`, refuse in one line what this machine cannot run (`pipeline.runtime.preflight`),
write the resolved config into a fresh run directory (`pipeline.runtime.run_dir`) and run it
(`pipeline.runtime.run`): build or reuse the assets and stream until `learner.max_steps`.
`--resume --run-dir DIR` goes on from DIR's latest checkpoint with DIR's own settings (only
`learner.max_steps` may change).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.config.loader import ConfigError, dump_config, load_config, write_resolved_config
from pipeline.config.schema import StrataConfig
from pipeline.runtime.allocator import cap_arenas
from pipeline.runtime.preflight import refused_for_training, unavailable
from pipeline.runtime.run_dir import discard_if_unstarted, new_run_dir, resumable_run_dir
from pipeline.runtime.startup import uncollected


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
        help="override a dotted key, typed: --set learner.advantage.alpha=0.8 --set actors.tools=[search,python]",
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


def run(config: StrataConfig, config_path: str, run_dir: Path, resume: bool = False) -> int:
    """The run itself (`pipeline.runtime.run`), imported when it starts: --dry-run imports no torch.
    Its imports (torch, transformers, DeepSpeed) are not scanned by the garbage collector:
    ~2 s less CPU a launch (pipeline/runtime/startup.py)."""
    with uncollected():
        from pipeline.runtime.run import run as run_config

    return run_config(config, config_path, run_dir, resume)


if __name__ == "__main__":
    sys.exit(main())
