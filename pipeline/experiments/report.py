"""`python -m pipeline.experiment_report OUT_DIR [--doc FILE.md] [--smooth N] [--baseline NAME]
[--notes FILE.md]`.

Reads every run directory of an experiment (`python -m pipeline.experiment`): metrics.jsonl,
eval.jsonl, accounting.json and config.yaml. Writes the results document (default
OUT_DIR/results.md) and, next to it, its figures: held-out accuracy by level at the first and last
evaluation (seed mean ± sample std, and the min–max over seeds), training curves, Theorem 1's
terms and strata sizes per variant, and a "what the numbers say" section computed from the data,
followed by the --notes file (a reading written by hand) if one is given.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pipeline.experiments.data import (
    LEVELS,
    RunData,
    Spread,
    by_variant,
    last_window,
    load_runs,
    setting,
    spread,
)
from pipeline.experiments.findings import (
    endpoint_findings,
    eval_spreads,
    findings,
    grpo_variant,
    held_out_last,
    step_range,
)
from pipeline.experiments.plots import all_figures
from pipeline.experiments.searches import chain_share, is_frozen, quarter, read_trajectories
from pipeline.experiments.searches import section as searches_section

Groups = dict[str, list[RunData]]


def accuracy_table(groups: Groups, which: int) -> list[str]:
    head = ["variant", "tools", "seeds", "step", *LEVELS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for tools in (True, False):
        for variant, runs in groups.items():
            spreads, steps = eval_spreads(runs, which, tools)
            if not spreads:
                continue
            n = max(s.n for s in spreads.values())
            cells = [spreads[c].text() if c in spreads else "–" for c in LEVELS]
            lines.append(
                f"| {variant} | {'yes' if tools else 'none'} | {n} | {step_range(steps)} | "
                + " | ".join(cells)
                + " |"
            )
    return lines


def end_table(groups: Groups, window: int) -> list[str]:
    head = [
        "variant",
        "seeds",
        "learner steps",
        f"training reward (last {window} steps)",
        f"tool calls per trajectory, training (last {window} steps)",
        "tool calls per question, held-out (last evaluation)",
        "malformed answers, held-out (last evaluation)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, runs in groups.items():
        done = [r for r in runs if r.metrics]
        cells = [
            variant,
            str(len(done)),
            step_range([int(r.metrics[-1]["step"]) for r in done]),
            *(
                _text(spread([last_window(r.metrics, k, window) for r in done]))
                for k in ("reward_mean", "tool_calls_mean")
            ),
            _text(held_out_last(runs, "tool_calls"), 2),
            _text(held_out_last(runs, "format_errors"), 2),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _text(s: Spread | None, digits: int = 3) -> str:
    return "–" if s is None else s.text(digits)


def render(
    out_dir: Path,
    doc: Path,
    groups: Groups,
    record: dict,
    figures,
    baseline: str | None,
    window: int,
    command: str,
    notes: str | None = None,
    frozen: Groups | None = None,
) -> str:
    """`groups`: the variants that learn; `frozen`: those whose every run keeps the warm
    start's weights (learner.lr <= searches.FROZEN_LR), listed and read for the start only."""
    frozen = frozen or {}
    variants = record.get("config", {}).get("variants", {})
    n_runs = sum(len(rs) for rs in groups.values())
    seeds = sorted({r.seed for rs in groups.values() for r in rs})
    title = Path(record.get("experiment", out_dir.name)).stem
    lines = [
        f"# Experiment: {title}",
        "",
        f"{n_runs} runs: {len(groups)} variants x seeds {seeds}, from `{out_dir}`"
        + (
            f", and {sum(len(rs) for rs in frozen.values())} frozen runs "
            f"({', '.join(frozen)}: the warm start sampled, read for the start only). "
            if frozen
            else ". "
        )
        + f"GRPO reference: {baseline or 'none found'}. Everything below is computed from the run "
        "directories by the command at the end; rerun it to refresh.",
        "",
        "## Runs",
        "",
        "| variant | overrides | runs | statuses |",
        "|---|---|---|---|",
    ]
    for v, rs in {**groups, **frozen}.items():
        overrides = ", ".join(f"`{k}={val}`" for k, val in variants.get(v, {}).items()) or "–"
        statuses = ", ".join(
            sorted({r.status or ("has metrics" if r.metrics else "no metrics") for r in rs})
        )
        lines.append(f"| {v} | {overrides} | {len(rs)} | {statuses} |")
    spread_note = (
        "Cells: mean over seeds ± sample standard deviation (ddof = 1), and in parentheses "
        "the lowest–highest seed. Accuracy is the mean reward of the held-out answers "
        "(greedy, or mean@K with eval.samples K). A level pools its data sources weighted "
        "by questions; L2+L3 pools both levels. `tools none` rows are the no-tools baseline."
    )
    for label, which in (("First", 0), ("Last", -1)):
        lines += [
            "",
            f"## Held-out accuracy, {label.lower()} evaluation of each run",
            "",
            spread_note,
            "",
        ]
        table = accuracy_table(groups, which)
        lines += table if len(table) > 2 else ["No evaluations (eval.jsonl) in these runs."]
    lines += [
        "",
        "## End of training",
        "",
        "Mean over seeds ± sample std (min–max).",
        "",
        *end_table(groups, window),
    ]
    every = {**groups, **frozen}
    kept = {r.name: read_trajectories(r.run_dir) for rs in every.values() for r in rs}
    max_steps = {
        r.name: setting(r.config, "learner.max_steps") for rs in every.values() for r in rs
    }
    frozen_runs = {r.name for rs in frozen.values() for r in rs}
    searches = searches_section(every, kept, max_steps, frozen_runs)
    if searches:
        lines += ["", *searches]
    endpoints = record.get("config", {}).get("endpoints") or []
    if endpoints:
        chains = {
            name: chain_share(t, 3 * quarter(max_steps[name], t.version)) if t else None
            for name, t in kept.items()
        }
        lines += [
            "",
            "## Pre-registered endpoints",
            "",
            f"Named before the runs in the experiment file ({', '.join(endpoints)}); each variant "
            f"against GRPO ({baseline or 'none'}): Welch's t and a permutation test over runs, a "
            "95% interval (hierarchical bootstrap over runs and questions for accuracy, Welch's "
            "for chains), and the difference these runs detect with 80% power.",
            "",
            *(f"- {s}" for s in endpoint_findings(groups, baseline, endpoints, chains)),
        ]
    lines += [
        "",
        "## What the numbers say",
        "",
        *(f"- {s}" for s in findings(groups, baseline, window)),
    ]
    if notes:  # the hand-written reading (--notes), kept across regenerations
        lines += ["", notes.strip()]
    lines += ["", "## Figures", ""]
    for name, caption in figures:
        lines += [f"![{Path(name).stem}]({name})", "", f"*{caption}*", ""]
    experiment = record.get("experiment")
    lines += [
        "## Regenerate",
        "",
        "```bash",
        f"python -m pipeline.experiment {experiment}  # the runs (skips finished ones)"
        if experiment
        else "# experiment.json is missing: the experiment command is unknown",
        command,
        "```",
        "",
    ]
    return "\n".join(lines)


def _write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.experiment_report",
        description="The results document of an experiment.",
    )
    parser.add_argument("out_dir", help="the experiment's `out` directory")
    parser.add_argument(
        "--doc", help="markdown file to write; figures go beside it (default OUT_DIR/results.md)"
    )
    parser.add_argument(
        "--smooth", type=int, default=5, help="moving-average window, in learner steps"
    )
    parser.add_argument(
        "--baseline", help="the GRPO variant (default: found from the runs' configs)"
    )
    parser.add_argument(
        "--notes",
        help="a markdown file written by hand (its own ## heading), put after the computed findings",
    )
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir)
    runs, record = load_runs(out_dir) if out_dir.is_dir() else ([], {})
    if not runs:
        print(
            f"strata: error: {out_dir}: no runs (no experiment.json, no VARIANT-seedK run directories): pass the `out` of an experiment",
            file=sys.stderr,
        )
        return 2
    if args.smooth < 1:
        print(
            f"strata: error: --smooth {args.smooth}: the window must be at least 1 step",
            file=sys.stderr,
        )
        return 2
    every = by_variant(runs)
    frozen = {
        v: rs
        for v, rs in every.items()
        if rs and all(is_frozen(setting(r.config, "learner.lr")) for r in rs)
    }
    groups = {v: rs for v, rs in every.items() if v not in frozen}
    baseline = grpo_variant(groups, args.baseline)
    if args.baseline and baseline is None:
        print(
            f"strata: error: --baseline {args.baseline}: no such variant (variants: {', '.join(groups)})",
            file=sys.stderr,
        )
        return 2
    notes = None
    if args.notes:
        try:
            notes = Path(args.notes).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            print(f"strata: error: --notes {args.notes}: cannot read it ({exc})", file=sys.stderr)
            return 2
    doc = Path(args.doc) if args.doc else out_dir / "results.md"
    doc.parent.mkdir(parents=True, exist_ok=True)
    figures = all_figures(groups, doc.parent, doc.stem, args.smooth)
    command = shlex.join(
        ["python", "-m", "pipeline.experiment_report", str(out_dir), "--doc", str(doc)]
        + (["--smooth", str(args.smooth)] if args.smooth != 5 else [])
        + (["--baseline", args.baseline] if args.baseline else [])
        + (["--notes", args.notes] if args.notes else [])
    )
    text = render(
        out_dir, doc, groups, record, figures, baseline, args.smooth, command, notes, frozen
    )
    _write(doc, text)
    print(f"strata: experiment report {doc} ({len(runs)} runs, {len(figures)} figures)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
