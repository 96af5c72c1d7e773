"""The experiment report's searches section (pipeline/experiments/searches.py) on trajectories
written as a run spills them: the trap condition at the start, the early and late tables, and the
pre-registered `chains` endpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from buffers.spill import spill_table
from buffers.testing import synthetic_trajectory
from pipeline.experiments.plan import read_experiment
from pipeline.experiments.report import main as report_main
from pipeline.experiments.searches import (
    Trajectories,
    pooled,
    read_trajectories,
    section,
    split,
    within_gap_ci,
)
from pipeline.experiments.stats import compare
from tests.pipeline.test_experiment import table_rows

STEPS = 8  # learner.max_steps of the synthetic runs: a quarter is 2 versions


@dataclass
class Run:
    name: str


def write_run(run_dir, chains_pay: float, late_chain_share: float, seed: int) -> None:
    """Version 0: 8 groups of 8 L2 trajectories, 2 chains a group paying `chains_pay` on
    average, 6 others paying 0.5; an L1 group that must be left out; versions 6-7 (the last
    quarter): `late_chain_share` of 16 trajectories chain."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(8):
        for i in range(8):
            chain = i < 2
            pays = chains_pay if chain else 0.5
            t = synthetic_trajectory(
                f"q{g}",
                i,
                reward=float(rng.random() < pays),
                tool_names=["search"] * (2 if chain else i % 2),
            )
            rows.append(replace(t, data_source="minigaia_l2"))
    for i in range(8):  # one-hop: not counted
        rows.append(
            replace(
                synthetic_trajectory("one", i, tool_names=["search"] * 3), data_source="minigaia_l1"
            )
        )
    chained = round(16 * late_chain_share)
    for i in range(16):
        names = ["search", "python", "search"] if i < chained else ["python"]
        t = synthetic_trajectory(f"late{i // 8}", i % 8, version=6 + i // 8, tool_names=names)
        rows.append(replace(t, data_source="minigaia_l2"))
    (run_dir / "trajectories").mkdir(parents=True)
    table = spill_table([(t, "trained", t.policy_version) for t in rows])
    pq.write_table(table, run_dir / "trajectories" / "part-000001.parquet")


def write_experiment(out, chains_pay: float, endpoints: list[str]) -> None:
    runs = []
    shares = {"grpo": (0.25, 0.3, 0.2, 0.25), "blend": (0.75, 0.8, 0.7, 0.75)}
    for variant, alpha in (("grpo", 0.0), ("blend", 0.8)):
        for seed, share in enumerate(shares[variant]):
            run_dir = out / f"{variant}-seed{seed}"
            write_run(run_dir, chains_pay, share, seed)
            config = {
                "learner": {"advantage": {"type": "stratified", "alpha": alpha}, "max_steps": STEPS}
            }
            (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
            runs.append({"name": run_dir.name, "variant": variant, "seed": seed, "status": "done"})
    body = {
        "experiment": "x.yaml",
        "runs": runs,
        "config": {"variants": {}, "endpoints": endpoints},
    }
    (out / "experiment.json").write_text(json.dumps(body))


def test_searches_are_counted_by_tool_name_on_two_hop_questions_only(tmp_path):
    write_run(tmp_path, chains_pay=0.0, late_chain_share=0.5, seed=0)
    t = read_trajectories(tmp_path)
    assert len(t) == 64 + 16  # the L1 group is left out
    start = split(t.where(t.version == 0))
    assert start.count == {"0": 24, "1": 24, ">=2": 16, "0-1": 48}
    assert start.mean[">=2"] == 0.0
    late = split(t.where(t.version >= 6))
    assert late.count[">=2"] == 8 and late.count["0"] == 8  # python calls are not searches
    assert read_trajectories(tmp_path / "elsewhere") is None


def test_the_trap_condition_is_a_bootstrap_over_questions():
    runs = []
    for seed in range(3):
        rng = np.random.default_rng(seed)
        group = np.repeat([f"minigaia-l2-{q:06d}" for q in range(20)], 8)  # the same in every run
        searches = np.tile([2, 2, 0, 0, 0, 1, 1, 1], 20)
        reward = np.where(searches == 2, rng.random(160) < 0.1, rng.random(160) < 0.5).astype(float)
        runs.append(Trajectories(np.zeros(160, int), group, searches, reward))
    t = pooled(runs)
    text = "\n".join(section({"grpo": [Run("a")]}, {"a": t}, {"a": STEPS}))
    gap = within_gap_ci(t.question, t.searches >= 2, t.reward)
    assert gap.ci[0] < gap.value < gap.ci[1] < 0 and gap.questions == 20
    assert (
        f"the within-question gap (2 or more searches against 0-1, question by question) "
        f"{gap.value:+.3f}, 95% interval [{gap.ci[0]:+.3f}, {gap.ci[1]:+.3f}] (bootstrap over "
        "questions; 20 questions with both, 120 chains): holds: chains pay less" in text
    )


def test_the_trap_condition_compares_chains_with_the_rest_of_their_own_question():
    """Chains pay what the rest of their question pays, but the policy chains mostly on hard
    questions: a difference of pooled means says chains pay 0.25 less (a trap), the
    within-question gap says they pay the same (no trap)."""
    hard = [(f"hard{q}", 2 if i < 6 else 0, 0.25) for q in range(10) for i in range(8)]
    easy = [(f"easy{q}", 2 if i < 2 else 1, 0.75) for q in range(10) for i in range(8)]
    question, searches, reward = (np.array(x) for x in zip(*hard, *easy, strict=True))
    t = Trajectories(np.zeros(len(reward), int), question, searches.astype(int), reward)
    chains = t.searches >= 2
    assert t.reward[chains].mean() - t.reward[~chains].mean() == pytest.approx(-0.25)
    gap = within_gap_ci(t.question, chains, t.reward)
    assert gap.value == pytest.approx(0.0) and gap.ci == pytest.approx((0.0, 0.0))
    text = "\n".join(section({"grpo": [Run("a")]}, {"a": t}, {"a": STEPS}))
    assert "Trap condition at the start, the within-question gap" in text
    assert "+0.000, 95% interval [+0.000, +0.000]" in text and "does not hold" in text


@pytest.mark.parametrize("chains_pay, holds", [(0.05, True), (0.95, False)])
def test_the_report_shows_the_start_and_tests_the_chains_endpoint(tmp_path, chains_pay, holds):
    out, doc = tmp_path / "exp", tmp_path / "doc.md"
    write_experiment(out, chains_pay, ["chains"])
    assert report_main([str(out), "--doc", str(doc)]) == 0
    text = doc.read_text()
    rows = table_rows(text, "Searches on two-hop training questions")
    start = rows["start (version 0, and frozen runs whole), all runs",]
    assert start[3].endswith("(128)") and start[4].endswith("(384)")  # 8 runs x 16 and x 48
    assert start[5] == "25%"
    assert rows["blend, late",][5] == f"{(12 + 13 + 11 + 12) / 64:.0%}"
    assert rows["grpo, late",][5] == f"{(4 + 5 + 3 + 4) / 64:.0%}"
    assert rows["grpo, early",][5] == "–" or "(0)" in rows["grpo, early",][1]
    assert ("holds: chains pay less" in text) is holds
    assert ("does not hold" in text) is not holds
    endpoints = text.split("## Pre-registered endpoints")[1].split("\n## ")[0]
    blend, grpo = [12 / 16, 13 / 16, 11 / 16, 12 / 16], [4 / 16, 5 / 16, 3 / 16, 4 / 16]
    expected = compare(blend, grpo).text("blend", "grpo")
    assert f"2 or more searches (late): {expected}." in endpoints
    assert "blend is above grpo" in expected


def test_an_unknown_endpoint_is_refused_in_one_line(tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text("base: b.yaml\nout: o\nvariants: {a: {}}\nendpoints: [L2, chain]\n")
    with pytest.raises(Exception, match=r"endpoints\.1") as info:
        read_experiment(path)
    assert "\n" not in str(info.value)


def test_a_frozen_variant_joins_the_start_whole_and_is_not_tested(tmp_path):
    """A variant whose runs keep the warm start's weights (learner.lr 1e-12): every trajectory
    of it is the start's; it is listed, but has no early or late rows and no endpoint test."""
    out, doc = tmp_path / "exp", tmp_path / "doc.md"
    write_experiment(out, 0.05, ["chains"])
    body = json.loads((out / "experiment.json").read_text())
    run_dir = out / "start-seed0"
    write_run(run_dir, 0.05, 0.5, seed=9)  # versions 0 and 6-7: all of them count as the start
    config = {"learner": {"advantage": {"type": "stratified", "alpha": 0.0}, "lr": 1e-12}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    body["runs"].append({"name": "start-seed0", "variant": "start", "seed": 0, "status": "done"})
    (out / "experiment.json").write_text(json.dumps(body))
    assert report_main([str(out), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "and 1 frozen runs (start: the warm start sampled" in text
    assert ("start",) in table_rows(text, "Runs")
    rows = table_rows(text, "Searches on two-hop training questions")
    start = rows["start (version 0, and frozen runs whole), all runs",]
    assert start[3].endswith("(152)")  # 8 learning runs x 16 at version 0, + 16 + its 8 late ones
    assert not any(key[0].startswith("start,") for key in rows)
    endpoints = text.split("## Pre-registered endpoints")[1].split("\n## ")[0]
    assert "start" not in endpoints and endpoints.count("- ") == 1
