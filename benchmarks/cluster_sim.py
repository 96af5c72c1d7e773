"""Streaming vs synchronous at cluster scale, by simulation (`actors.engine.type: simulated`).

The real streaming loop, group buffer, admission control, agent loop and weight publishing run
over simulated GPU inference servers, tools and learner (`actors.simulated`, `pipeline.runtime.simulated`)
on a virtual clock: a simulated hour costs only the Python work it causes. Synchronous is the same
pipeline at η = 0 (a step's groups are admitted only once the previous step's weights are
published: generate a batch, then train); streaming is η > 0.

The workload is a long-tailed agentic one: 0-6 tool calls per trajectory (a geometric number,
P(call) = 0.6 a turn), log-normal turn lengths (median 200 tokens), tool latency log-uniform in
0.2-2 s, 512-token observations; servers as an 8B model on H100-class GPUs (10 ms decode step +
0.3 ms per running sequence, 64 sequences a server, 10k tokens/s prefill); the learner at
1.81e-4 s per trained token on one rank (configs/gaia.yaml's loss on an 8B model, measured on an
H100: LEARNER_S_PER_TOKEN), divided among its ranks, plus 1 s a step; weights (16 GB) broadcast
at 25 GB/s. Tokens are coarse: one simulated token stands for
TOKEN_SCALE real ones (lengths divided, per-token times multiplied), which leaves every timing as
it is and divides the Python work per trajectory.

Figures, all in simulated time: trajectories/s after warm-up, learner idle fraction (waiting for
groups), server busy fraction, staleness of the trained trajectories, per-stratum share of
trained vs generated trajectories, and against the ideal overlap: T_gen is a step's generation
time on the servers alone (the synchronous run's learner wait per step), T_train its learner step
(+ publish); the ideal streaming step takes max(T_gen, T_train), the synchronous one T_gen +
T_train, so the overlap bound on the speed-up is (T_gen + T_train) / max(T_gen, T_train).

Cases run as many at a time as there are CPUs (--jobs); each is seeded and on its own virtual
clock, so the figures do not depend on it, only the wall time.

    python benchmarks/cluster_sim.py [--quick] [--jobs N] [--doc docs/results/throughput.md [--notes NOTES.md]]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.config.loader import load_config
from pipeline.runtime.simulated import SimResult, simulate

TOKEN_SCALE = 4
GROUP_SIZE = 8
LEARNER_S_PER_TOKEN = 1.436e-4 + 3.71e-5
"""configs/gaia.yaml's learner on one H100 80GB, measured by benchmarks/learner_gpu_cost.py
(docs/results/learner_gpu_cost.json: Qwen3-8B's shape, 2 x 4096-token micro-batches): a training
forward and backward with gradient checkpointing, 1.436e-4 s a token, plus the reference policy's
forward for the KL term, 3.71e-5 s. The proximal log-probs come from the training forward
(learner/trainer.py). Not in it: ZeRO-3's communication, and the optimiser (in the 1 s a step)."""


@dataclass(frozen=True)
class Case:
    servers: int
    ranks: int
    eta: int
    partial: bool = True
    steps: int = 12
    groups_per_step: int | None = None  # None: enough to keep the servers' batches full

    def groups(self) -> int:
        if self.groups_per_step is not None:
            return self.groups_per_step
        # (η + 1) steps' groups are in flight at most: a synchronous step has one step's
        return max(4, self.servers * 64 // GROUP_SIZE // 2)

    def overrides(self) -> list[str]:
        s = TOKEN_SCALE
        return [
            "actors.engine.type=simulated",
            f"actors.engine.num_servers={self.servers}",
            f"actors.engine.step_s={0.010 * s}",
            f"actors.engine.step_per_seq_s={0.0003 * s}",
            f"actors.engine.prefill_per_token_s={0.0001 * s}",
            "actors.engine.max_batch=64",
            f"actors.engine.turn_tokens_median={200 / s}",
            "actors.engine.turn_tokens_sigma=0.8",
            "actors.engine.tool_call_p=0.6",
            "actors.engine.tool_latency_s=[0.2,2.0]",
            f"actors.engine.partial_rollouts={str(self.partial).lower()}",
            f"actors.engine.train_s_per_token={LEARNER_S_PER_TOKEN * s}",
            "actors.engine.train_step_s=1.0",
            f"actors.engine.learner_ranks={self.ranks}",
            "actors.engine.params_b=8",
            "actors.engine.sync_gb_per_s=25",
            "actors.tools=[search]",
            "actors.max_turns=6",
            f"actors.max_new_tokens_per_turn={2048 // s}",
            f"actors.max_response_tokens={16384 // s}",
            f"actors.max_observation_tokens={512 // s}",
            f"actors.concurrency={self.servers * 64 * 4}",
            f"buffer.group_size={GROUP_SIZE}",
            f"buffer.max_staleness={self.eta}",
            "buffer.max_groups_in_flight=100000",
            "buffer.spill=false",
            f"learner.groups_per_step={self.groups()}",
            f"learner.max_steps={self.steps}",
            "data.num_questions=100000",
            "eval.every_steps=0",
            "metrics.loggers=[]",
        ]


def run(case: Case, root: Path) -> SimResult:
    config = load_config("configs/local.yaml", case.overrides())
    name = f"s{case.servers}-r{case.ranks}-eta{case.eta}-{'partial' if case.partial else 'drain'}"
    return simulate(config, root / name)


def run_all(cases: list[Case], root: Path, jobs: int) -> Iterator[SimResult]:
    """Each case's result, in the cases' order, run `jobs` at a time in worker processes. A case
    is one process's Python on a virtual clock, seeded: its figures are the same however many
    run beside it (only its real seconds grow)."""
    if jobs <= 1:
        yield from (run(case, root) for case in cases)
        return
    spawn = multiprocessing.get_context("spawn")  # no fork of a parent that may hold threads
    with ProcessPoolExecutor(max_workers=jobs, mp_context=spawn) as pool:
        yield from pool.map(run, cases, [root] * len(cases))


def per_step(result: SimResult) -> tuple[float, float]:
    """(T_gen, T_train) per step: the learner's wait for groups and its busy + publish time."""
    steps = max(result.steps, 1)
    return result.learner_idle_s / steps, (result.learner_busy_s + result.learner_sync_s) / steps


def share_gap(result: SimResult) -> float:
    """The largest shortfall of a stratum's trained share below its generated share (finished
    trajectories that left the buffer), in percentage points."""
    rows = result.per_stratum.values()
    left = {
        k: r["trained"] + r["dropped_stale"] + r["abandoned"] for k, r in result.per_stratum.items()
    }
    generated, trained = sum(left.values()), sum(r["trained"] for r in rows)
    if not generated or not trained:
        return float("nan")
    return max(
        100 * (left[k] / generated - r["trained"] / trained) for k, r in result.per_stratum.items()
    )


def grid(quick: bool) -> list[Case]:
    """η 0 (synchronous), 1, 2 and 4 at 8, 32 and 128 servers (2, 8, 8 learner ranks), at 32
    also η 2 without partial rollouts; learner ranks 1, 2 and 4 at 32 servers (the learner from
    the bottleneck towards balance), synchronous and η 2; and 8 servers for 8 ranks (generation
    the bottleneck), with and without partial rollouts; 16 and 24 servers for 8 ranks,
    synchronous and η 2 (generation the bottleneck but close to the learner's demand: the
    highest speed-ups measured). 128 servers run fewer steps (each has 4096 trajectories). `quick`: 8 and
    32 servers, 8 ranks only."""
    cases = []
    for servers, ranks in [(8, 2), (32, 8)] + ([] if quick else [(128, 8)]):
        steps = 6 if servers == 128 else 12
        cases += [Case(servers, ranks, eta, steps=steps) for eta in (0, 1, 2, 4)]
        if servers == 32:
            cases.append(Case(32, ranks, 2, partial=False))
    for ranks in [] if quick else [1, 2, 4]:
        cases += [Case(32, ranks, 0), Case(32, ranks, 2)]
    cases += [Case(8, 8, 0), Case(8, 8, 2), Case(8, 8, 2, partial=False)]
    for servers in [] if quick else [16, 24]:
        cases += [Case(servers, 8, 0), Case(servers, 8, 2)]
    return cases


def mode(case: Case) -> str:
    return (
        "sync"
        if case.eta == 0
        else f"stream η={case.eta}" + ("" if case.partial else ", no partial")
    )


def bound(sync: SimResult) -> float:
    """The overlap bound (T_gen + T_train) / max(T_gen, T_train) of a synchronous run."""
    t_gen, t_train = per_step(sync)
    return (t_gen + t_train) / max(t_gen, t_train, 1e-9)


def row(case: Case, r: SimResult, sync: SimResult | None) -> list[str]:
    stale = "/".join(str(r.staleness.get(k, 0)) for k in range(max(r.staleness, default=0) + 1))
    gain = r.trajectories_per_s / sync.trajectories_per_s if sync and case.eta else None
    return [
        str(case.servers),
        str(case.ranks),
        mode(case),
        f"{r.trajectories_per_s:.2f}",
        "–" if gain is None else f"{gain:.2f}x",
        "–" if gain is None else f"{gain / bound(sync):.0%}",
        f"{r.learner_idle_fraction:.0%}",
        f"{r.server_busy_fraction:.0%}",
        f"{r.server_draining_fraction:.0%}",
        stale,
        f"{share_gap(r):.1f}",
        f"{r.real_seconds:.0f}",
    ]


HEAD = [
    "servers",
    "learner ranks",
    "mode",
    "trajectories/s",
    "vs sync",
    "of overlap bound",
    "learner idle",
    "servers busy",
    "servers draining",
    "staleness 0/1/2/..",
    "worst stratum gap (pp)",
    "real s",
]


def plot(results: list[tuple[Case, SimResult]], path: Path) -> None:
    """Four panels: trajectories/s of each case; the speed-up over synchronous against η at each
    cluster size; against learner ranks at 32 servers (with the learner's idle fraction); the
    staleness the learner saw at 32 servers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((bars, stale), (by_eta, by_ranks)) = plt.subplots(
        2, 2, figsize=(13, 10), gridspec_kw={"width_ratios": [3, 2]}
    )
    ys = list(range(len(results)))[::-1]
    colours = [
        "tab:grey" if c.eta == 0 else ("tab:orange" if not c.partial else "tab:blue")
        for c, _ in results
    ]
    bars.barh(ys, [r.trajectories_per_s for _, r in results], color=colours)
    bars.set_yticks(
        ys, [f"{c.servers} servers, {c.ranks} ranks, {mode(c)}" for c, _ in results], fontsize=7
    )
    bars.set_xlabel("trajectories/s (simulated time)")
    bars.set_title("grey: synchronous; blue: streaming; orange: no partial rollouts", fontsize=9)
    for y, (_, r) in zip(ys, results, strict=True):
        bars.text(r.trajectories_per_s, y, f" {r.trajectories_per_s:.2f}", va="center", fontsize=6)
    sync = {(c.servers, c.ranks): r for c, r in results if c.eta == 0}

    def speedup(c: Case, r: SimResult) -> float:
        return r.trajectories_per_s / sync[c.servers, c.ranks].trajectories_per_s

    for servers, ranks in sorted({(c.servers, c.ranks) for c, _ in results if c.eta > 1}):
        line = sorted(
            (c.eta, speedup(c, r))
            for c, r in results
            if (c.servers, c.ranks) == (servers, ranks) and c.eta and c.partial
        )
        if len(line) > 1:
            by_eta.plot(
                *zip(*line, strict=True), marker="o", label=f"{servers} servers, {ranks} ranks"
            )
    by_eta.axhline(2.5, color="grey", linestyle=":", label="target 2.5x")
    by_eta.set_xlabel("η (max staleness)")
    by_eta.set_ylabel("trajectories/s over synchronous")
    by_eta.set_xticks([1, 2, 4])
    by_eta.legend(fontsize=8)
    scan = sorted(
        (c.ranks, speedup(c, r), r.learner_idle_fraction, bound(sync[c.servers, c.ranks]))
        for c, r in results
        if c.servers == 32 and c.eta == 2 and c.partial
    )
    if scan:
        ranks_, gains, idle, bounds = zip(*scan, strict=True)
        by_ranks.plot(ranks_, gains, marker="o", label="streaming η=2 over synchronous")
        by_ranks.plot(ranks_, bounds, linestyle="--", color="tab:blue", label="overlap bound")
        by_ranks.set_xscale("log", base=2)
        by_ranks.set_xticks(ranks_, [str(k) for k in ranks_])
        by_ranks.set_xlabel("learner ranks (32 servers)")
        by_ranks.set_ylabel("speed-up")
        twin = by_ranks.twinx()
        twin.plot(
            ranks_,
            [100 * i for i in idle],
            marker="s",
            color="tab:red",
            label="learner idle (streaming)",
        )
        twin.set_ylabel("learner idle %", color="tab:red")
        by_ranks.legend(loc="upper left", fontsize=8)
        twin.legend(loc="lower right", fontsize=8)
    shown = [(c, r) for c, r in results if c.servers == 32 and c.ranks == 8 and c.eta > 0]
    width = 0.8 / max(len(shown), 1)
    for i, (case, r) in enumerate(shown):
        total = sum(r.staleness.values())
        ks = sorted(r.staleness)
        stale.bar(
            [k + (i - (len(shown) - 1) / 2) * width for k in ks],
            [r.staleness[k] / total for k in ks],
            width,
            label=mode(case),
        )
    stale.set_xticks(range(max((max(r.staleness, default=0) for _, r in shown), default=0) + 1))
    stale.set_xlabel("staleness (learner version - oldest token version)")
    stale.set_ylabel("share of trained trajectories")
    stale.set_title("staleness at 32 servers, 8 ranks", fontsize=9)
    stale.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 and 32 servers only")
    parser.add_argument("--doc", help="also write the table to this markdown file")
    parser.add_argument(
        "--notes", help="a hand-written reading (markdown) put into --doc after the figures"
    )
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="cases run at once (default: CPUs)"
    )
    args = parser.parse_args()
    began = time.perf_counter()
    results: list[tuple[Case, SimResult]] = []
    syncs: dict[tuple[int, int], SimResult] = {}
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    print(" | ".join(HEAD), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        cases = grid(args.quick)
        for case, r in zip(cases, run_all(cases, Path(tmp), args.jobs), strict=True):
            results.append((case, r))
            if case.eta == 0:
                syncs[case.servers, case.ranks] = r
            cells = row(case, r, syncs.get((case.servers, case.ranks)))
            lines.append("| " + " | ".join(cells) + " |")
            print(" | ".join(cells), flush=True)
    sync = syncs[32, 8]
    stream = next(r for c, r in results if (c.servers, c.eta, c.partial) == (32, 2, True))
    t_gen, t_train = per_step(sync)
    speedup = stream.trajectories_per_s / sync.trajectories_per_s
    print(
        f"32 servers, synchronous: T_gen {t_gen:.1f} s (learner waiting), T_train {t_train:.1f} s "
        f"(step + publish) per step; overlap bound {bound(sync):.2f}x; {time.perf_counter() - began:.0f} s in all"
    )
    last = f"streaming vs sync at eta=2: {speedup:.2f}x, {speedup / bound(sync):.0%} of the overlap bound"
    if args.doc:
        doc = Path(args.doc)
        doc.parent.mkdir(parents=True, exist_ok=True)
        plot(results, doc.with_suffix(".png"))
        about = "\n\n".join(__doc__.split("\n\n")[1:-1])  # without the title and usage
        json_path = doc.with_suffix(".json")
        json_path.write_text(
            json.dumps([{"case": asdict(c), "result": asdict(r)} for c, r in results], indent=1)
            + "\n"
        )
        text = [
            "# Throughput at cluster scale, by simulation",
            "",
            about,
            "",
            "Staleness counts trained trajectories by learner version minus their oldest token's "
            "version. The stratum gap is the largest amount (percentage points) by which a "
            "stratum's share of the trained trajectories falls below its share of those generated.",
            "",
            *lines,
            "",
            f"![throughput]({doc.with_suffix('.png').name})",
            "",
            f"32 servers, synchronous: T_gen {t_gen:.1f} s, T_train {t_train:.1f} s per step; "
            f"overlap bound {bound(sync):.2f}x.",
            "",
            f"`{last}`",
            "",
            *([Path(args.notes).read_text().strip(), ""] if args.notes else []),
            f"Every run's figures: `{json_path.name}`. Regenerate (about "
            f"{time.perf_counter() - began:.0f} s on {os.cpu_count()} cores, {args.jobs} cases at a time):",
            "",
            "```bash",
            f"python benchmarks/cluster_sim.py --doc {args.doc}"
            + (f" --notes {args.notes}" if args.notes else ""),
            "```",
            "",
        ]
        doc.write_text("\n".join(text))
    print(last)


if __name__ == "__main__":
    main()
