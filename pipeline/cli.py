"""`strata COMMAND [ARGS...]`: one console script for the `python -m pipeline.*` commands.

`strata launch configs/local.yaml` is `python -m pipeline.launch configs/local.yaml`; every
command takes the same arguments as its module and returns its exit status. A command's module is
imported only when it runs, so `strata --help` starts at once.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "launch": ("pipeline.launch", "train: validate a config, make a run directory, run it"),
    "evaluate": (
        "pipeline.evaluate",
        "held-out evaluation of a checkpoint, by data source and GAIA level",
    ),
    "replay": ("pipeline.replay", "recompute a run's advantages offline from its trajectory files"),
    "experiment": ("pipeline.experiment", "run every variant x seed of an experiment file"),
    "experiment-report": (
        "pipeline.experiment_report",
        "an experiment's results document, from its run directories",
    ),
    "diagnose": (
        "pipeline.diagnose",
        "should this run stratify? read from its first policy versions",
    ),
    "start": ("pipeline.start", "where a run starts (the warm start's chain share)"),
    "trap": ("pipeline.trap", "the trap bandit: when stratified advantages help"),
    "trap-tables": (
        "pipeline.experiments.trap_tables",
        "docs/results/trap.md's tables from the trap's JSON files",
    ),
    "window": ("pipeline.experiments.window", "the window experiment's registered analysis"),
    "prepare": (
        "pipeline.assets.prepare",
        "a paper setting's question files from the published data",
    ),
    "world": ("pipeline.assets.world", "the offline mini-GAIA world"),
    "config-doc": ("pipeline.config_doc", "print the config reference (docs/config.md)"),
}
"""`strata NAME` -> (the module whose `main` runs it, what it does)."""


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: strata COMMAND [ARGS...]   (strata COMMAND --help: the command's own arguments)",
        "",
        "commands:",
        *(f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        (sys.stdout if argv else sys.stderr).write(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(
            f"strata: error: unknown command {name!r}; the commands are {', '.join(COMMANDS)} "
            "(strata --help)",
            file=sys.stderr,
        )
        return 2
    run = importlib.import_module(COMMANDS[name][0]).main
    if name == "config-doc":  # it takes no arguments
        if rest:
            print(f"strata: error: config-doc takes no arguments, not {rest[0]!r}", file=sys.stderr)
            return 2
        return run() or 0
    return run(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
