"""The window study's registered analysis (pipeline/experiments/window/) on small
synthetic experiments written as runs spill them: who escaped, the one-sided Fisher test and
what the design can reach, the interaction's bootstrap, the accuracy difference, unfinished
runs refused in one line, a GRPO-only pilot, and the bandit's cell."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from scipy import stats as sps

from buffers.spill import spill_table
from buffers.testing import synthetic_trajectory
from pipeline.experiments.diagnose import diagnose
from pipeline.experiments.diagnose import main as diagnose_main
from pipeline.experiments.stats import detectable
from pipeline.experiments.window.analysis import (
    Foretold,
    RunResult,
    bandit,
    brier,
    difference,
    fisher_greater,
    interaction,
    late_from,
    needed,
    primary,
)
from pipeline.experiments.window.command import main

STEPS = 8  # a quarter is 2 versions: late is versions 6-7


def write_run(
    run_dir, alpha: float, late_chains: int, l2: float, steps: int = STEPS, final_eval=True
):
    """Versions 0-5: 8 L2 trajectories, half of them chains (not late: never counted); versions
    6-7: 10 L2 trajectories, `late_chains` of them chains, the chains paying 1 and the rest 0;
    an L1 chain at version 7 that must be left out."""
    rows = []
    for v in range(6):
        for i in range(8):
            t = synthetic_trajectory(f"e{v}", i, version=v, tool_names=["search"] * (2 * (i % 2)))
            rows.append(replace(t, data_source="minigaia_l2"))
    for i in range(10):
        chain = i < late_chains
        names = ["search", "python", "search"] if chain else ["search"] * (i % 2)
        t = synthetic_trajectory(
            f"l{i}", i, version=6 + i % 2, reward=float(chain), tool_names=names
        )
        rows.append(replace(t, data_source="minigaia_l2"))
    one = synthetic_trajectory("one", 0, version=7, tool_names=["search"] * 2)
    rows.append(replace(one, data_source="minigaia_l1"))
    (run_dir / "trajectories").mkdir(parents=True)
    table = spill_table([(t, "released", t.policy_version) for t in rows])
    pq.write_table(table, run_dir / "trajectories" / "part-000001.parquet")
    config = {
        "learner": {
            "advantage": {"type": "stratified", "alpha": alpha},
            "max_steps": steps,
            "groups_per_step": 1,
        },
        "buffer": {"group_size": 4},
    }
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    metrics = [{"step": s, "reward_mean": 0.1} for s in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    evals = [0, STEPS] if final_eval else [0]
    (run_dir / "eval.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "step": s,
                    "rows": [
                        {"name": "minigaia_l2", "tools": True, "questions": 32, "accuracy": l2},
                        {"name": "minigaia_l2", "tools": False, "questions": 32, "accuracy": 0.9},
                    ],
                }
            )
            + "\n"
            for s in evals
        )
    )


def write_experiment(out, arms: dict[str, list[tuple[int, float]]], alphas=None) -> None:
    """`arms`: variant -> per seed (late chains of 10, held-out L2 at the end)."""
    alphas = alphas or {"grpo": 0.0, "blend": 0.8}
    runs = []
    for variant, seeds in arms.items():
        for seed, (chains, l2) in enumerate(seeds):
            run_dir = out / f"{variant}-seed{seed}"
            write_run(run_dir, alphas[variant], chains, l2)
            runs.append({"name": run_dir.name, "variant": variant, "seed": seed, "status": "done"})
    (out / "experiment.json").write_text(json.dumps({"experiment": "x.yaml", "runs": runs}))


def test_the_late_window_is_the_last_quarter():
    assert late_from(300) == 225 and late_from(8) == 6 and late_from(10) == 6


def test_fisher_is_one_sided_and_the_design_says_what_it_can_reach():
    # the pre-registration's reachable outcomes at 12 against 12, p < 0.01
    assert [needed(12, g, 12) for g in range(8)] == [6, 8, 9, 10, 11, 12, 12, None]
    assert fisher_greater(6, 12, 0, 12) < 0.01 < fisher_greater(5, 12, 0, 12)
    assert fisher_greater(0, 12, 6, 12) == pytest.approx(1.0)  # the wrong way: no evidence
    test = primary([True] * 9 + [False] * 3, [True] * 2 + [False] * 10)
    assert (test.blend, test.grpo, test.needed, test.significant) == (9, 2, 9, True)
    assert test.p == pytest.approx(fisher_greater(9, 12, 2, 12))


def test_the_interaction_resamples_runs_within_each_cell():
    window = ([True] * 8 + [False] * 4, [True] * 2 + [False] * 10)
    control = ([True] * 4 + [False] * 4, [True] * 4 + [False] * 4)
    found = interaction(window, control, resamples=4000)
    assert found.value == pytest.approx(8 / 12 - 2 / 12)
    # each cell's share varies as p (1 - p) / n; the four cells add
    sd = np.sqrt(sum(p * (1 - p) / n for p, n in ((8 / 12, 12), (2 / 12, 12), (0.5, 8), (0.5, 8))))
    assert found.low == pytest.approx(0.5 - 1.96 * sd, abs=0.05)
    assert found.high == pytest.approx(0.5 + 1.96 * sd, abs=0.05)
    flat = interaction(([True] * 3, [True] * 3), ([False] * 3, [False] * 3), resamples=100)
    assert (flat.value, flat.low, flat.high) == (0.0, 0.0, 0.0)  # no spread in any cell


def test_the_command_analyses_both_worlds(tmp_path, capsys):
    window, control = tmp_path / "window", tmp_path / "control"
    # p0 0.5 in the window: 5 chains of 10 escape; the blend escapes in 3 of 3, GRPO in 0 of 3
    write_experiment(
        window,
        {"grpo": [(1, 0.10), (2, 0.15), (4, 0.05)], "blend": [(5, 0.30), (7, 0.35), (9, 0.40)]},
    )
    write_experiment(
        control, {"grpo": [(3, 0.2), (4, 0.2), (2, 0.3)], "blend": [(3, 0.2), (4, 0.3), (2, 0.2)]}
    )
    out, png = tmp_path / "w.json", tmp_path / "w.png"
    argv = ["--window", str(window), "--control", str(control), "--p0-window", "0.5"]
    argv += ["--p0-control", "0.3", "--steps", str(STEPS), "--json", str(out), "--plot", str(png)]
    argv += ["--guess-pay-window", "0.2", "--chain-pay-window", "0.04", "--bandit-seeds", "5"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    found = json.loads(out.read_text())
    shares = {(r["world"], r["name"]): r["chain_share"] for r in found["runs"]}
    assert shares[("window", "blend-seed1")] == pytest.approx(0.7)  # the L1 chain left out
    escaped = {(r["world"], r["name"]): r["escaped"] for r in found["runs"]}
    assert escaped[("window", "blend-seed0")] and not escaped[("window", "grpo-seed2")]
    assert escaped[("control", "grpo-seed0")]  # 0.3 >= the control's own p0
    test = found["tests"]["window"]
    assert (test["blend"], test["grpo"], test["p"]) == (3, 0, pytest.approx(0.05))
    assert not test["significant"] and test["needed"] is None  # 3 against 3 never reaches 0.01
    assert "no outcome of the blend's 3 runs reaches p < 0.01: the design cannot decide" in printed
    assert found["interaction"]["value"] == pytest.approx(1.0 - (2 / 3 - 2 / 3))
    acc = found["accuracy"]["window"]
    assert acc["value"] == pytest.approx(0.35 - 0.10) and acc["low"] < 0.25 < acc["high"]
    assert found["accuracy"]["control"]["value"] == pytest.approx(0.0)
    assert acc["df"] == pytest.approx(
        sps.ttest_ind([0.3, 0.35, 0.4], [0.1, 0.15, 0.05], equal_var=False).df
    )
    assert acc["detectable"] == pytest.approx(
        detectable(np.array([0.3, 0.35, 0.4]), np.array([0.1, 0.15, 0.05]))
    )
    shares = found["chain_share"]["window"]  # late chain shares: 0.5-0.9 against 0.1-0.4
    assert shares["value"] == pytest.approx(0.7 - 0.7 / 3)
    assert "Late chain share, blend − GRPO, window (not a registered endpoint): +0.467" in printed
    assert "window grpo 0 / 3 [0.00, 0.71]; window blend 3 / 3 [0.29, 1.00]" in printed
    assert "| window | 0.500 | 0 / 3 | 3 / 3 |" in printed  # escape counts
    assert "1.000 (7) | 1.000 (21) | 0.100 (3 runs) | 0.350 (3 runs) |" in printed
    bandit = {b["alpha"]: b for b in found["bandit"]}
    assert set(bandit) == {0.0, 0.8} and bandit[0.8]["depth"] == 5
    assert (bandit[0.8]["group_size"], bandit[0.8]["groups"], bandit[0.8]["seeds"]) == (4, 1, 5)
    chance = sps.binom.pmf(3, 3, bandit[0.8]["escape"])  # the blend's 3 of 3 at its rate
    assert f"(5 seeds) | 3 / 3 | {chance:.2g} |" in printed
    assert "control: `python -m pipeline.trap --start-chain 0.3 --p-guess PAY01" in printed
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_unfinished_runs_are_refused_and_named_in_one_line(tmp_path, capsys):
    window = tmp_path / "window"
    write_experiment(window, {"grpo": [(1, 0.1), (2, 0.1)], "blend": [(5, 0.3), (6, 0.3)]})
    (window / "blend-seed1" / "eval.jsonl").write_text(json.dumps({"step": 0, "rows": []}) + "\n")
    metrics = window / "grpo-seed0" / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:5]))
    out = tmp_path / "w.json"
    argv = ["--window", str(window), "--p0-window", "0.5", "--steps", str(STEPS)]
    assert main([*argv, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 of 4 runs are not finished" in err
    assert "window/grpo-seed0 (step 5 of 8)" in err
    assert "window/blend-seed1 (no evaluation at step 8)" in err
    assert not out.exists()  # nothing written


def test_arms_must_be_there_and_be_what_they_are_named(tmp_path, capsys):
    window = tmp_path / "window"
    write_experiment(window, {"grpo": [(1, 0.1)], "blend": [(5, 0.3)]}, {"grpo": 0.0, "blend": 0.0})
    argv = ["--window", str(window), "--p0-window", "0.5", "--steps", str(STEPS)]
    assert main(argv) == 2
    assert "blend-seed0 is GRPO, yet --blend names its variant" in capsys.readouterr().err
    assert main([*argv, "--blend", "alpha08"]) == 2
    err = capsys.readouterr().err
    assert "no runs of variant 'alpha08' (variants: blend, grpo)" in err
    assert main([*argv, "--p0-window", "1.5"]) == 2
    assert "--p0-window 1.5 must be in (0, 1)" in capsys.readouterr().err
    assert main([*argv, "--control", str(window)]) == 2
    assert "--control and --p0-control go together" in capsys.readouterr().err


def test_a_grpo_only_pilot_is_read_without_a_test(tmp_path, capsys):
    pilot = tmp_path / "pilot"
    write_experiment(pilot, {"astray095": [(1, 0.1), (6, 0.2)]}, {"astray095": 0.0})
    argv = ["--window", str(pilot), "--p0-window", "0.5", "--steps", str(STEPS)]
    assert main([*argv, "--grpo", "astray095", "--grpo-only"]) == 0
    printed = capsys.readouterr().out
    assert "Primary test: not computed (GRPO only: no blend arm)." in printed
    assert "| window | 0.500 | 1 / 2 | – |" in printed
    assert "1 of 2 GRPO runs collapsed (late chain share below p0 / 2 = 0.250)" in printed
    assert "| window | grpo | astray095-seed1 | 10 | 0.600 | yes | 0.200 |" in printed


def test_the_diagnostic_is_set_beside_each_runs_outcome(tmp_path, capsys):
    window = tmp_path / "window"
    write_experiment(window, {"grpo": [(1, 0.1), (6, 0.2)], "blend": [(5, 0.3), (2, 0.3)]})
    out = tmp_path / "w.json"
    argv = ["--window", str(window), "--p0-window", "0.5", "--steps", str(STEPS)]
    argv += ["--json", str(out), "--diagnose-seeds", "5"]
    # versions 0-5 hold six two-hop questions with chains and the rest: enough to match
    assert main([*argv, "--diagnose-versions", "6"]) == 0
    printed = capsys.readouterr().out
    found = json.loads(out.read_text())["diagnosed"]
    assert (found["versions"], found["seeds"], len(found["runs"])) == (6, 5, 4)
    for run in found["runs"]:  # each run's prediction is the diagnosis at its own alpha
        d = diagnose(window / run["name"], 6, seeds=5)
        alpha = 0.8 if run["arm"] == "blend" else 0.0
        assert run["predicted"] == next(p.escape for p in d.predictions if p.alpha == alpha)
    outcome = {r["name"]: r["escaped"] for r in found["runs"]}
    assert outcome == {
        "grpo-seed0": False,
        "grpo-seed1": True,
        "blend-seed0": True,
        "blend-seed1": False,
    }
    expected = np.mean([(r["predicted"] - r["escaped"]) ** 2 for r in found["runs"]])
    assert found["brier"] == pytest.approx(expected)
    assert "| window | grpo | 2 |" in printed and "| 1 / 2 |" in printed
    # two versions meet two questions, fewer than a report predicts from: no prediction
    assert main([*argv, "--diagnose-versions", "2"]) == 0
    printed = capsys.readouterr().out
    found = json.loads(out.read_text())["diagnosed"]
    assert {r["reading"] for r in found["runs"]} == {"too few"}
    assert found["brier"] is None and all(r["predicted"] is None for r in found["runs"])
    # and the command the table names reads the same, run by run
    [quoted] = [q for q in printed.split("`")[1::2] if q.startswith("python -m pipeline.diagnose")]
    for run in found["runs"]:
        command = shlex.split(quoted.replace(" RUN ", f" {window / run['name']} "))
        assert diagnose_main(command[3:]) == 0
        assert "reading: too few two-hop questions" in capsys.readouterr().out
    assert main([*argv, "--diagnose-versions", "0"]) == 2
    assert "--diagnose-versions must be in 1..--steps (8)" in capsys.readouterr().err


def test_the_diagnostic_can_take_each_runs_measured_hop_speed(tmp_path, capsys):
    """These runs' chain share does not move in their first versions: the hop speed is not
    measured, and the trap model takes 1, as the table and the JSON say."""
    window = tmp_path / "window"
    write_experiment(window, {"grpo": [(1, 0.1), (6, 0.2)], "blend": [(5, 0.3), (2, 0.3)]})
    out = tmp_path / "w.json"
    argv = ["--window", str(window), "--p0-window", "0.5", "--steps", str(STEPS)]
    argv += ["--json", str(out), "--diagnose-seeds", "5", "--diagnose-versions", "6"]
    assert main([*argv, "--diagnose-hop-speed", "measured"]) == 0
    printed = capsys.readouterr().out
    found = json.loads(out.read_text())["diagnosed"]
    assert found["hop_speed"] == "measured"
    assert all(r["measured"] is None and r["hop_speed"] == 1.0 for r in found["runs"])
    assert "--hop-speed measured` on every run" in printed
    assert "| hop speed measured: runs, median [median interval] |" in printed
    assert "| 1 / 2 | 0 of 2 |" in printed


def test_the_registered_figures_follow_from_each_runs_row():
    """docs/results/window.json keeps every run's row: the registered test, the differences,
    the interaction, the bandit's cells and the diagnostic's Brier score computed from those rows
    by today's code are the ones registered (the run directories themselves are not in the
    repository). The command window.md prints is the one that wrote the file."""
    root = Path(__file__).resolve().parents[2] / "docs" / "results"
    registered = json.loads((root / "window.json").read_text())
    doc = (root / "window.md").read_text()
    printed = doc.split("    python -m pipeline.experiments.window ")[1].split("\n\n")[0]
    assert (
        "python -m pipeline.experiments.window " + " ".join(printed.replace("\\", " ").split())
        == registered["command"]
    )
    runs = [RunResult(**r) for r in registered["runs"]]

    def of(world, arm, key):
        return [getattr(r, key) for r in runs if (r.world, r.arm) == (world, arm)]

    assert (
        asdict(primary(of("window", "blend", "escaped"), of("window", "grpo", "escaped")))
        == (registered["tests"]["window"])
    )
    for world in ("window", "control"):
        for key, where in (("l2_accuracy", "accuracy"), ("chain_share", "chain_share")):
            found = difference(of(world, "blend", key), of(world, "grpo", key))
            assert asdict(found) == pytest.approx(registered[where][world], rel=1e-9)
    inter = interaction(
        (of("window", "blend", "escaped"), of("window", "grpo", "escaped")),
        (of("control", "blend", "escaped"), of("control", "grpo", "escaped")),
    )
    assert asdict(inter) == registered["interaction"]
    for b in registered["bandit"]:
        [found] = bandit(
            b["world"],
            b["start_chain"],
            b["p_guess"],
            0.2347 if b["world"] == "control" else 0.0329,  # the chains' pay the command gives
            [b["alpha"]],
            b["group_size"],
            b["groups"],
            b["seeds"],
        )
        found = asdict(found)
        assert {k: v for k, v in found.items() if k not in ("low", "high")} == {
            k: v for k, v in b.items() if k not in ("low", "high")
        }
        # Wilson's interval is scipy's now; the registered one took z 1.959964 for its 1.95996398
        assert (found["low"], found["high"]) == pytest.approx((b["low"], b["high"]), rel=1e-8)
    foretold = [Foretold(**f) for f in registered["diagnosed"]["runs"]]
    assert brier(foretold) == pytest.approx(registered["diagnosed"]["brier"], rel=1e-12)
