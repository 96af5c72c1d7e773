"""`python -m pipeline.launch CONFIG [--set k=v ...] [--run-dir DIR] [--dry-run]`.

Today it validates the config, writes the resolved config into a fresh run directory and says so:
the streaming pipeline (actors, buffer, learner) lands with the issues that build it.
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
    print(f"strata: config {args.config} is valid; resolved config written to {written}")
    print(
        "strata: the streaming pipeline (actors -> buffer -> learner) is not built yet; "
        "this run only validated the config. Try `make bench` for the advantage benchmark."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
