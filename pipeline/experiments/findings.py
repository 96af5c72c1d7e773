"""The "what the numbers say" section of an experiment's results document: sentences computed from
the runs, each saying only what the data shows (which variant leads and how it compares with
GRPO, how the random-strata controls compare with GRPO, tool calls at the end, Theorem 1's
cross-stratum term, the in-stratum advantage variance of the paper's Figure 3), and the spreads
they use. A comparison is a test (pipeline/experiments/stats.py: Welch, permutation, a
hierarchical bootstrap interval over runs and questions, the power); "above" and "below" are
said only where the test says so."""

from __future__ import annotations

import numpy as np

from pipeline.experiments.data import (
    LEVELS,
    RunData,
    Spread,
    eval_row,
    is_grpo,
    last_window,
    level_accuracy,
    question_scores,
    series,
    setting,
    spread,
)
from pipeline.experiments.stats import compare

Groups = dict[str, list[RunData]]


def compared(groups: Groups, a: str, b: str, column: str) -> str | None:
    """The test of variant `a` against `b` on `column` accuracy at the last evaluation, as a
    sentence; None with fewer than two runs a side."""
    runs_a = [r for r in groups[a] if r.evals]
    runs_b = [r for r in groups[b] if r.evals]
    acc_a = [level_accuracy(r.evals[-1]).get(column) for r in runs_a]
    acc_b = [level_accuracy(r.evals[-1]).get(column) for r in runs_b]
    if None in acc_a or None in acc_b:
        return None
    scores_a = [question_scores(r, column) for r in runs_a]
    scores_b = [question_scores(r, column) for r in runs_b]
    complete = all(x is not None for x in (*scores_a, *scores_b))
    found = compare(acc_a, acc_b, scores_a if complete else None, scores_b if complete else None)
    return None if found is None else found.text(a, b)


def step_range(values: list[int]) -> str:
    values = sorted(set(values))
    if not values:
        return "–"
    return str(values[0]) if len(values) == 1 else f"{values[0]}–{values[-1]}"


def eval_spreads(
    runs: list[RunData], which: int, tools: bool = True
) -> tuple[dict[str, Spread], list[int]]:
    """Per LEVELS column, the spread over seeds at each run's first (0) or last (-1) evaluation,
    and the steps those evaluations were at."""
    records = [r.evals[which] for r in runs if r.evals]
    per_column = {c: [level_accuracy(e, tools).get(c) for e in records] for c in LEVELS}
    spreads = {c: s for c, v in per_column.items() if (s := spread(v)) is not None}
    return spreads, [e["step"] for e in records]


def held_out_last(runs: list[RunData], key: str) -> Spread | None:
    """`key` of the held-out `all` row (with tools) at each run's last evaluation, e.g.
    `tool_calls` per question or `format_errors` (the share of malformed answers; evaluations
    written before that column existed have none)."""
    rows = [eval_row(r.evals[-1]) for r in runs if r.evals]
    return spread([row[key] for row in rows if row is not None and key in row])


def grpo_variant(groups: Groups, named: str | None) -> str | None:
    """The GRPO reference: `named`, else the variant whose every run is plain GRPO (one named
    grpo first)."""
    if named is not None:
        return named if named in groups else None
    found = [v for v, runs in groups.items() if runs and all(is_grpo(r.config) for r in runs)]
    return "grpo" if "grpo" in found else (found[0] if found else None)


def _listed(head: str, items: list[str]) -> str | None:
    return f"{head}: {'; '.join(items)}." if items else None


def compute_finding(groups: Groups) -> list[str]:
    runs = [r for rs in groups.values() for r in rs]
    steps = {r.name: int(r.metrics[-1]["step"]) for r in runs if r.metrics}
    says = []
    if len(set(steps.values())) == 1:
        says.append(
            f"Every run with metrics ({len(steps)} of {len(runs)}) trained "
            f"{next(iter(steps.values()))} learner steps: equal compute in steps."
        )
    elif steps:
        listed = ", ".join(f"{n} {s}" for n, s in steps.items())
        says.append(
            f"The runs trained different numbers of learner steps ({listed}): compare "
            "the curves at equal steps, not the final numbers."
        )
    tokens = []
    for v, rs in groups.items():
        made = spread([_generated_tokens(r) for r in rs])
        if made is not None:
            tokens.append(f"{v} {made.mean / 1e6:.2f}M")
    says.append(
        _listed(
            "Tokens generated per run (seed means; equal steps are not equal tokens: a variant "
            "that calls more tools generates more)",
            tokens,
        )
    )
    unfinished = sorted(
        {r.name for r in runs if not r.metrics or r.status in ("failed", "interrupted")}
    )
    if unfinished:
        says.append(
            f"Not complete: {', '.join(unfinished)} (no metrics.jsonl, or failed or "
            "interrupted in experiment.json)."
        )
    return [s for s in says if s]


def _generated_tokens(run: RunData) -> float | None:
    """Tokens the run generated, from its last step's rate and elapsed time (None without)."""
    last = run.metrics[-1] if run.metrics else {}
    rate, elapsed = last.get("generated_tokens_per_s"), last.get("elapsed_s")
    return (
        rate * elapsed
        if isinstance(rate, int | float) and isinstance(elapsed, int | float)
        else None
    )


def accuracy_findings(groups: Groups, baseline: str | None) -> list[str]:
    last = {v: eval_spreads(rs, -1)[0] for v, rs in groups.items()}
    column = "L2+L3" if any("L2+L3" in s for s in last.values()) else "all"
    ranked = sorted(((s[column].mean, v) for v, s in last.items() if column in s), reverse=True)
    if not ranked:
        return [
            "No run has a held-out evaluation (eval.jsonl): set eval.every_steps in the base "
            "config or in the experiment's `set`."
        ]
    top = ranked[0][0]
    leaders = [v for v, s in last.items() if column in s and s[column].mean == top]  # file order
    best = leaders[0]
    if len(leaders) > 1:
        line = (
            f"At the last evaluation the highest {column} accuracy (seed mean), {top:.3f}, is "
            f"shared by {', '.join(leaders)}."
        )
    else:
        line = (
            f"At the last evaluation the highest {column} accuracy (seed mean) is {best}'s, "
            f"{last[best][column].text()}."
        )
    if baseline is None:
        line += (
            " No variant is plain GRPO (α = 0 or advantage.type grpo, without latent "
            "reward): there is no GRPO range to compare with."
        )
    elif baseline in leaders:
        line += f" GRPO ({baseline}) is {'among them' if len(leaders) > 1 else 'that variant'}."
    elif column in last.get(baseline, {}):
        ref = last[baseline][column]
        test = compared(groups, best, baseline, column)
        line += f" GRPO ({baseline}) has {ref.text()}. " + (
            f"{column} accuracy, {test}." if test else "Too few runs a side for a test."
        )
    says = [line]
    first = {v: eval_spreads(rs, 0) for v, rs in groups.items()}
    starts = sorted({s for _, steps in first.values() for s in steps})
    start = "step 0, before any training" if starts == [0] else f"step {step_range(starts)}"
    moves = [
        f"{v} {first[v][0]['all'].mean:.3f} → {last[v]['all'].mean:.3f}"
        for v in groups
        if "all" in first[v][0] and "all" in last[v]
    ]
    says.append(
        _listed(
            f"Accuracy on all held-out questions from the first evaluation ({start}) "
            "to the last, seed means",
            moves,
        )
    )
    gains = []
    for v, rs in groups.items():
        without = eval_spreads(rs, -1, tools=False)[0]
        if "all" in without and "all" in last[v]:
            gains.append(f"{v} {last[v]['all'].mean - without['all'].mean:+.3f}")
    says.append(
        _listed(
            "At the last evaluation, accuracy on all questions with tools minus "
            "without (the no-tools baseline), seed means",
            gains,
        )
    )
    return [s for s in says if s]


def control_finding(groups: Groups, baseline: str | None) -> str | None:
    """The random-strata variants (stratifier.type random: labels that say nothing about the
    trajectory) against GRPO at the last evaluation: the paper finds them about equal (Table 7)."""
    controls = [
        v
        for v, rs in groups.items()
        if rs and all(setting(r.config, "learner.stratifier.type", "") == "random" for r in rs)
    ]
    if not controls or baseline is None:
        return None
    ref_spreads = eval_spreads(groups[baseline], -1)[0]
    column = "L2+L3" if "L2+L3" in ref_spreads else "all"
    if column not in ref_spreads:
        return None
    ref = ref_spreads[column]
    placed = []
    for v in controls:
        mine = eval_spreads(groups[v], -1)[0].get(column)
        if mine is not None:
            test = compared(groups, v, baseline, column)
            placed.append(f"{v} {mine.text()}" + (f" ({test})" if test else ""))
    return _listed(
        f"Random strata (a control) at the last evaluation, {column} accuracy against GRPO's "
        f"{ref.text()}",
        placed,
    )


def _stratum_variance(run: RunData) -> float | None:
    """Mean over steps of the mean over strata of `stratum/K/in_stratum_adv_var` (cells whose
    rewards vary; NaN where a stratum had none)."""
    per_step = []
    for m in run.metrics:
        values = [
            v
            for k, v in m.items()
            if k.startswith("stratum/")
            and k.endswith("/in_stratum_adv_var")
            and isinstance(v, int | float)
            and np.isfinite(v)
        ]
        if values:
            per_step.append(float(np.mean(values)))
    return float(np.mean(per_step)) if per_step else None


def stratum_variance_finding(groups: Groups) -> str | None:
    """The paper's Figure 3: the advantages' variance inside each (group, stratum) cell whose
    rewards vary, which per-stratum normalisation (α = 1) makes 1 and GRPO leaves below it."""
    means = []
    for v, rs in groups.items():
        found = spread([_stratum_variance(r) for r in rs])
        if found is not None:
            means.append(f"{v} {found.mean:.2f}")
    return _listed(
        "In-stratum advantage variance (Figure 3 of the paper: 1 under per-stratum "
        "normalisation), mean over strata and steps of cells whose rewards vary, seed means",
        means,
    )


def tool_call_finding(groups: Groups, window: int) -> str | None:
    calls = []
    for v, rs in groups.items():
        held = held_out_last(rs, "tool_calls")
        train = spread([last_window(r.metrics, "tool_calls_mean", window) for r in rs if r.metrics])
        parts = [f"{held.mean:.2f} held-out"] if held else []
        parts += [f"{train.mean:.2f} in training"] if train else []
        if parts:
            calls.append(f"{v} {' / '.join(parts)}")
    return _listed(
        "Tool calls at the end, seed means (held-out: per question at the last evaluation; "
        f"training: per trajectory over the last {window} steps)",
        calls,
    )


def _run_mean(run: RunData, key: str) -> float | None:
    values = series(run.metrics, key)[1]
    return float(np.mean(values)) if len(values) else None


def theorem1_finding(groups: Groups) -> str:
    means, with_chance = [], False
    for v, rs in groups.items():
        cross = spread([_run_mean(r, "theorem1_cross_stratum") for r in rs])
        total = spread([_run_mean(r, "theorem1_global_var") for r in rs])
        chance = spread([_run_mean(r, "theorem1_cross_stratum_chance") for r in rs])
        if cross is not None:
            share = ""
            if total and total.mean > 0:
                # chance: the same strata's labels shuffled within each group (same cell sizes)
                against = f"; by chance {chance.mean / total.mean:.0%}" if chance else ""
                with_chance = with_chance or bool(chance)
                if chance and chance.n < cross.n:  # runs from before the chance term existed
                    against += f" in {chance.n} of {cross.n} runs"
                share = f" ({cross.mean / total.mean:.0%} of Var[A_G]{against})"
            means.append(f"{v} {cross.mean:.4f}{share}")
    if not means:
        return (
            "The runs' metrics.jsonl hold no Theorem 1 terms (theorem1_cross_stratum, "
            "theorem1_in_stratum): their figure is left out."
        )
    head = "Theorem 1's cross-stratum term, mean over steps and seeds"
    if with_chance:
        head += (
            " (by chance: what the same strata give with their labels shuffled within each group,"
            " so above it the strata tell rewards apart)"
        )
    return _listed(head, means) or ""


def endpoint_findings(
    groups: Groups, baseline: str | None, endpoints: list[str], chains: dict[str, float | None]
) -> list[str]:
    """Each variant against GRPO on each pre-registered endpoint (the experiment's `endpoints`):
    a held-out level's accuracy at the last evaluation, or `chains` (`chains`: run name -> its
    share of two-hop training trajectories with two or more searches, late in the run)."""
    if not endpoints:
        return []
    if baseline is None:
        return ["No variant is plain GRPO: the endpoints have no reference to be tested against."]
    says = []
    for v in groups:
        if v == baseline:
            continue
        for endpoint in endpoints:
            if endpoint == "chains":
                mine = [chains.get(r.name) for r in groups[v]]
                ref = [chains.get(r.name) for r in groups[baseline]]
                found = compare(
                    [x for x in mine if x is not None], [x for x in ref if x is not None]
                )
                test = None if found is None else found.text(v, baseline)
                what = "share of two-hop training trajectories with 2 or more searches (late)"
            else:
                test = compared(groups, v, baseline, endpoint)
                what = f"held-out {endpoint} accuracy (last evaluation)"
            says.append(f"{what}: {test or 'too few runs a side for a test'}.")
    return says


def findings(groups: Groups, baseline: str | None, window: int) -> list[str]:
    """Every sentence of the section, in order."""
    says = [*compute_finding(groups), *accuracy_findings(groups, baseline)]
    says += [control_finding(groups, baseline), tool_call_finding(groups, window)]
    says += [theorem1_finding(groups), stratum_variance_finding(groups)]
    return [s for s in says if s]
