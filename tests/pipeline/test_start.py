"""The start measurement (pipeline/experiments/start.py): the within-question gap
(pipeline/experiments/searches.py) on a case computed by hand, its bootstrap over questions,
the strata's pay apart, and the command on trajectories written as a run spills them."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from buffers.spill import spill_table
from buffers.testing import synthetic_trajectory
from pipeline.assets.world import build_world, write_world
from pipeline.experiments.searches import Trajectories, within_gap, within_gap_ci
from pipeline.experiments.start import bridge_answers, bridge_of, main, measure, names_bridge

# (question, searches, reward): q1 and q2 have chains and non-chains; q3 only chains, q4 none
HAND = [
    ("q1", 2, 0.0),
    ("q1", 2, 0.0),
    ("q1", 0, 1.0),
    ("q1", 1, 0.0),
    ("q2", 3, 1.0),
    ("q2", 0, 0.0),
    ("q2", 1, 0.0),
    ("q2", 1, 1.0),
    ("q3", 2, 1.0),
    ("q3", 2, 1.0),
    ("q4", 1, 1.0),
]


def trajectories(rows, version=0) -> Trajectories:
    q, s, r = zip(*rows, strict=True)
    return Trajectories(
        np.full(len(rows), version), np.array(q), np.array(s), np.array(r, dtype=float)
    )


def test_the_within_question_gap_weights_each_question_by_its_chains():
    t = trajectories(HAND)
    # q1: 2 chains, mu_c 0, mu_n 0.5 -> 2 x -0.5; q2: 1 chain, mu_c 1, mu_n 1/3 -> +2/3
    expected = (2 * (0 - 0.5) + 1 * (1 - 1 / 3)) / 3
    assert within_gap(t.question, t.searches >= 2, t.reward) == pytest.approx(expected)
    assert expected == pytest.approx(-1 / 9)
    # pooled over questions the sign flips: q3's chains pay and q3 has no non-chain
    chain = t.searches >= 2
    assert t.reward[chain].mean() - t.reward[~chain].mean() == pytest.approx(0.6 - 0.5)
    assert np.isnan(within_gap(np.array(["a"]), np.array([True]), np.array([1.0])))


def test_the_bootstrap_draws_questions_and_covers_the_gap():
    rng = np.random.default_rng(0)
    rows = []
    for q in range(120):  # chains pay 0.2 less than the rest of their question
        base = rng.uniform(0.3, 0.7)
        for i in range(16):
            chain = i < 5
            rows.append((f"q{q}", 2 if chain else i % 2, float(rng.random() < base - 0.2 * chain)))
    t = trajectories(rows)
    gap = within_gap_ci(t.question, t.searches >= 2, t.reward, resamples=1000)
    assert gap is not None and (gap.questions, gap.chains) == (120, 600)
    assert gap.ci[0] < gap.value < gap.ci[1] < -0.1
    assert gap.ci[0] < -0.2 < gap.ci[1]
    one = trajectories(HAND[:4])  # one question with both: every draw is that question
    assert within_gap_ci(one.question, one.searches >= 2, one.reward).ci == (-0.5, -0.5)
    assert within_gap_ci(np.array(["a"]), np.array([True]), np.array([1.0])) is None


def test_measure_pays_each_stratum_apart():
    start = measure([trajectories(HAND[:8]), trajectories(HAND[8:])])
    assert (start.runs, start.trajectories, start.questions) == (2, 11, 4)
    assert (start.rollouts_min, start.rollouts_median) == (1, 3.0)
    assert start.chain_share == pytest.approx(5 / 11)
    assert start.count == {"0": 2, "1": 4, ">=2": 5, "0-1": 6}
    assert start.pay["0"] == pytest.approx(0.5) and start.pay["1"] == pytest.approx(0.5)
    assert start.pay[">=2"] == pytest.approx(0.6)
    assert start.gap.value == pytest.approx(-1 / 9)


def write_run(run_dir, lr: float) -> None:
    """HAND at version 0, and a version-3 chain that paid on q1; an L1 trajectory left out."""
    rows = [
        replace(
            synthetic_trajectory(q, i, reward=r, tool_names=["search"] * s),
            data_source="minigaia_l2",
        )
        for i, (q, s, r) in enumerate(HAND)
    ]
    late = synthetic_trajectory("q1", 20, reward=1.0, version=3, tool_names=["search"] * 2)
    rows.append(replace(late, data_source="minigaia_l2"))
    rows.append(replace(synthetic_trajectory("one", 0), data_source="minigaia_l1"))
    (run_dir / "trajectories").mkdir(parents=True)
    table = spill_table([(t, "trained", t.policy_version) for t in rows])
    pq.write_table(table, run_dir / "trajectories" / "part-000001.parquet")
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"learner": {"lr": lr}}))


def test_the_command_reads_version_0_or_a_frozen_run_whole(tmp_path, capsys):
    write_run(tmp_path / "learns", 1e-4)
    write_run(tmp_path / "frozen", 1e-12)
    out = tmp_path / "start.json"
    assert main([str(tmp_path / "learns"), "--json", str(out), "--resamples", "200"]) == 0
    found = json.loads(out.read_text())
    assert found["trajectories"] == 11 and found["gap"]["value"] == pytest.approx(-1 / 9)
    assert "chain share p0 (2 or more searches): 0.455" in capsys.readouterr().out
    assert main([str(tmp_path / "frozen"), "--json", str(out)]) == 0  # version 3 counts too
    found = json.loads(out.read_text())
    assert found["trajectories"] == 12 and found["chain_share"] == pytest.approx(6 / 12)
    capsys.readouterr()
    assert main([str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no config.yaml" in err


def test_an_answer_names_the_bridge_only_when_it_is_the_whole_name():
    assert bridge_of("Zade Nipebru birth year") == "Zade Nipebru"
    assert bridge_of("Kaivu Loorith city founding year") == "Kaivu Loorith"  # not "... city"
    assert names_bridge(" zade nipebru.", "Zade Nipebru birth year")
    assert not names_bridge("Zade", "Zade Nipebru birth year")
    assert not names_bridge(None, "Zade Nipebru birth year")


def test_bridge_answers_count_each_stratum_on_the_world_questions(tmp_path, capsys):
    world = build_world(7, "small")
    write_world(world, tmp_path / "world")
    q = next(q for q in world.split("train") if q.level == 2)
    rows = []
    for i, (searches, answer) in enumerate([(1, q.bridge), (1, "x"), (2, q.answer[0]), (0, "y")]):
        t = synthetic_trajectory(f"{q.id}@0", i, tool_names=["search"] * searches)
        rows.append(replace(t, data_source="minigaia_l2", text=f"<answer> {answer}</answer>"))
    run = tmp_path / "run"
    (run / "trajectories").mkdir(parents=True)
    table = spill_table([(t, "trained", 0) for t in rows])
    pq.write_table(table, run / "trajectories" / "part-000001.parquet")
    (run / "config.yaml").write_text(yaml.safe_dump({"learner": {"lr": 1e-12}}))
    found = bridge_answers([run], tmp_path / "world")
    assert found == {"0": (0.0, 1), "1": (0.5, 2), ">=2": (0.0, 1)}
    assert main([str(run), "--world", str(tmp_path / "world"), "--resamples", "100"]) == 0
    assert (
        "answers naming the bridge entity (share, count): 0 searches 0.000 (1); 1 searches 0.500 (2)"
        in capsys.readouterr().out
    )
    assert main([str(run), "--world", str(tmp_path)]) == 2
    assert "holds no train.parquet" in capsys.readouterr().err
