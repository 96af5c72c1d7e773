"""`python -m pipeline.launch CONFIG [--set k=v ...] [--run-dir DIR] [--dry-run] [--resume]
[--list-plugins]`.

Parses the command line and dispatches: validate the config (`pipeline.config`), print it with
`--dry-run` (and the plug-ins it names, from where), list every registered name with
`--list-plugins` (`pipeline.plugins`), refuse in one line what this machine cannot run (`pipeline.runtime.preflight`),
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
from pipeline.plugins import (
    KINDS,
    PluginError,
    available,
    configured,
    is_import_string,
    plugin_origin,
)
from pipeline.runtime.allocator import cap_arenas
from pipeline.runtime.preflight import refused_for_training, unavailable
from pipeline.runtime.run_dir import discard_if_unstarted, new_run_dir, resumable_run_dir
from pipeline.runtime.startup import uncollected


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.launch",
        description="Train an LLM search agent with Stratified GRPO.",
    )
    parser.add_argument(
        "config",
        nargs="?",
        help="YAML config, e.g. configs/local.yaml (optional with --list-plugins)",
    )
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
    parser.add_argument(
        "--list-plugins",
        action="store_true",
        help="print every tool, reward, dataset loader, stratifier, estimator and agent name "
        "known (built-in or an installed package's entry point), from where, and exit",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.config is None and not args.list_plugins:
        parser.error("the following arguments are required: config")
    cap_arenas()  # resident memory stays flat over long runs (pipeline/runtime/allocator.py)
    notes: list[str] = []
    if args.list_plugins and args.config is None:
        return _list_plugins(None)
    try:
        config = load_config(args.config, args.overrides, notes)
        for note in notes:
            print(f"strata: note: {note}", file=sys.stderr)
        if args.list_plugins:
            return _list_plugins(config)
        if args.dry_run:
            sys.stdout.write(dump_config(config, notes) + _plugin_lines(config))
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


def _plugin_lines(config: StrataConfig) -> str:
    """The plug-ins `config` names, from where, as YAML comments (the dump still loads)."""
    lines = []
    for key, kind, spec in configured(config):
        where = plugin_origin(kind, spec)
        if where is not None:
            lines.append(f"# plug-in {key}: {spec} ({where})\n")
    return "".join(lines)


def _list_plugins(config: StrataConfig | None) -> int:
    """Every kind's names and where each comes from; with a config, which of them it uses."""
    from pipeline.runtime import parts  # noqa: F401  the built-in tools register there (torch)

    used = {(kind, spec): key for key, kind, spec in configured(config)} if config else {}
    for kind in KINDS:
        try:
            names = available(kind)
        except PluginError as exc:
            print(f"strata: error: {exc}", file=sys.stderr)
            return 2
        print(f"{kind} (entry points strata.{kind}):")
        width = max((len(name) for name, _ in names), default=0)
        for name, where in names:
            mark = f"  <- {used[kind, name]}" if (kind, name) in used else ""
            print(f"  {name:<{width}}  {where}{mark}")
        for (k, spec), key in used.items():
            if k == kind and is_import_string(spec):
                print(f"  {spec}  import string  <- {key}")
    return 0


def run(config: StrataConfig, config_path: str, run_dir: Path, resume: bool = False) -> int:
    """The run itself (`pipeline.runtime.run`), imported when it starts: --dry-run imports no torch.
    Its imports (torch, transformers, DeepSpeed) are not scanned by the garbage collector:
    ~2 s less CPU a launch (pipeline/runtime/startup.py)."""
    with uncollected():
        from pipeline.runtime.run import run as run_config

    return run_config(config, config_path, run_dir, resume)


if __name__ == "__main__":
    sys.exit(main())
