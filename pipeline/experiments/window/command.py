"""`python -m pipeline.experiments.window --window DIR --control DIR --p0-window P --p0-control P`:
the registered analysis of the window study (docs/results/window.prereg.md), once all its runs
are done.

It prints, and writes with `--json`:

- per run, its late L2 chain share and whether it escaped (`analysis.py`);
- primary: escaped runs of the blend against GRPO in the window world, one-sided Fisher exact
  test (blend > GRPO), the verdict at p < 0.01, and what the design can reach at the GRPO count
  seen;
- the interaction (blend - GRPO escape share in the window) - (the same in the control), with a
  95% percentile interval from 10,000 bootstrap draws of runs within each world-arm cell;
- held-out L2 accuracy at the last step (each run's eval.jsonl), blend - GRPO per world, with
  Welch's t interval on the runs' degrees of freedom (`pipeline/experiments/stats.py`);
- what chains pay late, per arm, pooled over its runs;
- the trap bandit's prediction for the same cell where the start's pay is given
  (`--guess-pay-*`, `--chain-pay-*`: M the depth whose 1/M^2 is nearest what chains pay, as the
  pre-registration says), else the command that prints it;
- `--plot`: a strip plot of every run's late chain share per world and arm, with the p0 lines;
- `--diagnose-versions N`: how `python -m pipeline.diagnose` did, each run diagnosed from its
  own first N policy versions as the printed command does, the trap model's predicted escape at
  the run's alpha beside whether it escaped (per world and arm, and the Brier score over runs),
  the readings counted; `--diagnose-hop-speed measured` has the model's hops learn at the speed
  each run's first versions show.

A run that is not finished (fewer learner steps than `--steps`, no evaluation at the last step,
no late two-hop trajectory) is refused with the others like it, in one line: the registered
analysis counts every run and drops none. `--grpo-only` reads a GRPO-only pilot (no test).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from pipeline.evaluation.replay import write_atomically
from pipeline.experiments.diagnose import hop_setting
from pipeline.experiments.window.analysis import (
    LEVEL,
    Analysis,
    WindowError,
    World,
    analyse,
    arms_of,
    late_from,
    unfinished_line,
)
from pipeline.experiments.window.render import foretold_lines, lines, plot


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.experiments.window", description=__doc__.split("\n")[0]
    )
    p.add_argument("--window", type=Path, required=True, help="the window world's experiment out")
    p.add_argument("--control", type=Path, help="the control world's experiment out")
    p.add_argument("--p0-window", type=float, required=True, help="the window's start share")
    p.add_argument("--p0-control", type=float, help="the control's start share")
    for world in ("window", "control"):
        p.add_argument(
            f"--guess-pay-{world}",
            type=float,
            help=f"what 0-1 search L2 trajectories paid at the {world}'s start (the bandit)",
        )
        p.add_argument(
            f"--chain-pay-{world}",
            type=float,
            help=f"what chains paid at the {world}'s start (the bandit's depth)",
        )
    p.add_argument("--grpo", default="grpo", help="the GRPO arm's variant (default grpo)")
    p.add_argument("--blend", default="blend", help="the blend arm's variant (default blend)")
    p.add_argument(
        "--grpo-only", action="store_true", help="a GRPO-only pilot: no blend arm, no test"
    )
    p.add_argument("--steps", type=int, default=300, help="learner steps a run (default 300)")
    p.add_argument("--seed", type=int, default=0, help="of the bootstrap")
    p.add_argument(
        "--bandit-seeds", type=int, default=200, help="bandit seeds a prediction (default 200)"
    )
    p.add_argument(
        "--diagnose-versions",
        type=int,
        help="also diagnose each run from its first N policy versions and set the diagnostic's "
        "prediction beside the outcome (the report's choice: a tenth of the steps)",
    )
    p.add_argument(
        "--diagnose-seeds", type=int, default=200, help="bandit seeds a diagnosis (default 200)"
    )
    p.add_argument(
        "--diagnose-hop-speed",
        type=hop_setting,
        default=1.0,
        help="the diagnosis's hop speed: a number (default 1) or 'measured' (each run's own)",
    )
    p.add_argument("--json", type=Path, help="write the analysis here")
    p.add_argument("--plot", type=Path, help="write the strip plot here (PNG)")
    return p


def _checked(args: argparse.Namespace) -> list[World]:
    problems = [
        f"--{flag} {value:g} must be in (0, 1)"
        for flag, value in (("p0-window", args.p0_window), ("p0-control", args.p0_control))
        if value is not None and not 0 < value < 1
    ]
    for world in ("window", "control"):
        pays = (getattr(args, f"guess_pay_{world}"), getattr(args, f"chain_pay_{world}"))
        if (pays[0] is None) != (pays[1] is None):
            problems.append(f"--guess-pay-{world} and --chain-pay-{world} go together")
        if any(x is not None and not 0 <= x <= 1 for x in pays):
            problems.append(f"--guess-pay-{world} and --chain-pay-{world} must be in [0, 1]")
    if (args.control is None) != (args.p0_control is None):
        problems.append("--control and --p0-control go together")
    if args.steps < 4:
        problems.append(f"--steps {args.steps} must be at least 4 (its last quarter is read)")
    if args.bandit_seeds < 1:
        problems.append("--bandit-seeds must be >= 1")
    if args.diagnose_versions is not None and not 1 <= args.diagnose_versions <= args.steps:
        problems.append(f"--diagnose-versions must be in 1..--steps ({args.steps})")
    if args.diagnose_seeds < 1:
        problems.append("--diagnose-seeds must be >= 1")
    for name, path in (("json", args.json), ("plot", args.plot)):
        if path is not None and not path.parent.is_dir():
            problems.append(f"--{name} {path}: its folder does not exist")
    if problems:
        raise WindowError(problems[0])
    worlds = [
        World("window", args.window, args.p0_window, args.guess_pay_window, args.chain_pay_window)
    ]
    if args.control is not None:
        worlds.append(
            World(
                "control",
                args.control,
                args.p0_control,
                args.guess_pay_control,
                args.chain_pay_control,
            )
        )
    return worlds


def as_json(a: Analysis, command: str) -> dict:
    """What `--json` writes."""
    d = a.diagnosed
    return {
        "command": command,
        "steps": a.steps,
        "late_from": late_from(a.steps),
        "level": LEVEL,
        "worlds": [asdict(w) | {"out_dir": str(w.out_dir)} for w in a.worlds],
        "runs": [asdict(r) for r in a.results],
        "tests": {k: asdict(t) for k, t in a.tests.items()},
        "interaction": None if a.interaction is None else asdict(a.interaction),
        "accuracy": {k: None if v is None else asdict(v) for k, v in a.accuracy.items()},
        "chain_share": {k: None if v is None else asdict(v) for k, v in a.shares.items()},
        "bandit": [asdict(b) for b in a.bandits],
        "diagnosed": None if d is None else asdict(d),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        worlds = _checked(args)
        blend = None if args.grpo_only else args.blend
        arms = {w.name: arms_of(w, args.grpo, blend) for w in worlds}
        if (line := unfinished_line(arms, args.steps)) is not None:
            raise WindowError(line)
        found = analyse(
            worlds,
            arms,
            args.steps,
            args.seed,
            args.bandit_seeds,
            args.diagnose_versions,
            args.diagnose_seeds,
            args.diagnose_hop_speed,
        )
    except WindowError as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    printed = lines(found)
    if found.diagnosed is not None:
        printed += ["", *foretold_lines(found.diagnosed)]
    print("\n".join(printed), flush=True)
    if args.plot:
        write_atomically(args.plot, lambda tmp: plot(found.results, found.worlds, found.steps, tmp))
    if args.json:
        command = shlex.join(
            ["python", "-m", "pipeline.experiments.window", *(argv or sys.argv[1:])]
        )
        text = json.dumps(as_json(found, command), indent=1) + "\n"
        write_atomically(args.json, lambda tmp: tmp.write_text(text))
    return 0
