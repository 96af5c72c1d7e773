"""`python -m pipeline.diagnose` (pipeline/experiments/diagnose.py): who is alone in their
stratum, the matched trap depth, the reading's branches, the command on a spilled run and on
several pooled, the command a report prints giving the report's diagnosis, and the hop's speed
(pipeline/experiments/hop_speed.py) against numpy's fit and the bandit's mean-field path."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from buffers.spill import spill_table
from buffers.testing import synthetic_trajectory
from pipeline.experiments import hop_speed as hops
from pipeline.experiments.diagnose import (
    Prediction,
    alone_shares,
    diagnose,
    main,
    matched_depth,
    reading_line,
    report_section,
    report_versions,
    strata_table,
)
from pipeline.experiments.searches import Trajectories
from pipeline.experiments.trap import Trap, cell
from pipeline.experiments.trap_exact import expected_path
from tests.pipeline.test_start import write_run
from tests.pipeline.test_window import write_run as write_window_run


def test_alone_means_no_other_member_of_the_group_in_the_stratum():
    group = np.array(["a", "a", "a", "b", "c", "c"])
    stratum = np.array([0, 0, 2, 1, 2, 2])
    assert alone_shares(group, stratum).tolist() == [False, False, True, True, False, False]
    rows = {r.stratum: r for r in strata_table(group, stratum, np.array([1, 0, 1, 0, 0, 1.0]))}
    assert (rows[2].share, rows[2].alone, rows[2].pays) == (pytest.approx(0.5), 1 / 3, 2 / 3)
    assert (rows[0].alone, rows[1].alone, rows[1].count) == (0.0, 1.0, 1)


def test_the_matched_depth_is_the_nearest_start_of_a_chain():
    assert matched_depth(1 / 25) == 5 and matched_depth(0.07) == 4  # 1/16 = 0.0625
    assert matched_depth(0.0) == 12 and matched_depth(0.9) == 2


def test_the_reading_follows_the_predictions():
    def predicted(grpo, blend):
        return [Prediction(0.0, *grpo), Prediction(0.6, *blend), Prediction(0.8, *blend)]

    stratify = reading_line("m", predicted((0.0, 0.0, 0.04), (0.8, 0.7, 0.9)), -0.2, (-0.3, -0.1))
    assert stratify.startswith("stratify: the trap model predicts escape 0.80 at alpha 0.6")
    harm = reading_line("m", predicted((0.86, 0.8, 0.9), (0.5, 0.4, 0.6)), -0.2, (-0.3, -0.1))
    assert harm.startswith("do not stratify")
    level = reading_line("m", predicted((0.0, 0.0, 0.04), (0.01, 0.0, 0.05)), -0.2, (-0.3, -0.1))
    assert level.startswith("no window")
    # above GRPO's interval but rarely escaping (the window experiment's first versions)
    deep = reading_line("m", predicted((0.01, 0.0, 0.05), (0.13, 0.08, 0.21)), -0.3, (-0.6, -0.1))
    assert deep.startswith("deep trap: the trap model predicts the blend escapes more often")
    assert "(0.13 at alpha 0.6 against 0.01)" in deep
    at_worth = reading_line("m", predicted((0.1, 0.05, 0.2), (0.5, 0.4, 0.6)), -0.3, (-0.6, -0.1))
    assert at_worth.startswith("stratify")
    assert reading_line("m", predicted((1, 1, 1), (1, 1, 1)), 0.2, (0.1, 0.3)).startswith(
        "chains already pay more"
    )
    assert reading_line("m", [], None, None).startswith("no chains and non-chains")


def test_the_command_diagnoses_a_spilled_run(tmp_path, capsys):
    run = tmp_path / "frozen"
    write_run(run, 1e-12)
    config = {"learner": {"lr": 1e-12, "groups_per_step": 1}, "buffer": {"group_size": 4}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "d.json"
    assert main([str(run), "--seeds", "10"]) == 0  # two questions with both kinds: too few
    assert "reading: too few two-hop questions with both chains and the rest (2; a " in (
        capsys.readouterr().out
    )
    assert main([str(run), "--seeds", "10", "--min-questions", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "13 trajectories (all (a frozen run)), groups of 4" in printed
    assert "trap model, alpha 0.8, hop speed 1: escape" in printed and "reading: " in printed
    found = json.loads(out.read_text())
    assert found["p0"] == pytest.approx(6 / 12) and found["depth"] == 2  # chains pay 0.667
    assert [p["alpha"] for p in found["predictions"]] == [0.0, 0.6, 0.8]
    assert main([str(tmp_path / "none")]) == 2
    assert "holds no config.yaml" in capsys.readouterr().err


def test_a_tie_names_the_best_blend_not_grpo():
    tie = [Prediction(0.0, 1.0, 0.98, 1.0), Prediction(0.6, 1.0, 0.98, 1.0)]
    assert "best blend 1.00 at alpha 0.6" in reading_line("m", tie, -0.05, (-0.17, 0.07))


def test_the_report_section_diagnoses_the_run_or_says_in_one_line_why_not(tmp_path):
    run = tmp_path / "run"
    write_window_run(run, 0.8, late_chains=2, l2=0.2)  # versions 0-5: 6 questions, half chains
    section = report_section(run, steps=60, seeds=10)
    assert section[0] == "## Should this run stratify?"
    text = "\n".join(section)
    assert "first 6 policy versions" in text and "runs 10 seeds a prediction" in text
    assert "48 trajectories (versions 0-5), groups of 4" in text  # versions 6-7 are late
    assert "trap model, alpha 0.8, hop speed 1: escape" in text and "\nreading: " in text
    assert report_versions(20) == 5  # at least the command's default
    few = tmp_path / "few"  # two questions with both kinds: a gap, but no prediction
    write_run(few, 1e-4)
    (few / "config.yaml").write_text(yaml.safe_dump({"learner": {"lr": 1e-4}}))
    text = "\n".join(report_section(few, steps=200, seeds=10))
    assert "within-question gap +0.042" in text and "trap model, alpha" not in text
    assert "reading: too few two-hop questions with both chains and the rest (2; a " in text
    (run / "config.yaml").write_text("learner: [")  # whatever breaks, the report goes on
    broken = report_section(run, steps=60, seeds=10)
    assert [line for line in broken if line.startswith("Not diagnosed: ")] == broken[2:3]
    assert broken[2].startswith("Not diagnosed: ParserError: ")
    empty = tmp_path / "nothing"
    empty.mkdir()
    (empty / "config.yaml").write_text(yaml.safe_dump({"learner": {"lr": 1e-4}}))
    assert report_section(empty, steps=200)[2] == (
        f"Not diagnosed: {empty} kept no trajectories: run it with buffer.spill true."
    )


def printed_command(text: str) -> list[str]:
    """The arguments of the `python -m pipeline.diagnose RUN ...` quoted in `text`."""
    quoted = [q for q in text.split("`")[1::2] if q.startswith("python -m pipeline.diagnose ")]
    return shlex.split(quoted[0])[3:]


def test_the_report_prints_the_command_that_gives_its_diagnosis(tmp_path, capsys):
    """The report predicts from at least five questions with both kinds, at its own seeds: the
    command it prints must read the same, so that a reader who reruns it sees the report's
    reading. Two questions with both kinds: no prediction in either."""
    few = tmp_path / "few"
    write_run(few, 1e-4)
    section = report_section(few, steps=200, seeds=10)
    assert main(printed_command(section[2])) == 0
    assert capsys.readouterr().out.splitlines() == section[4:-1]
    assert "reading: too few two-hop questions" in section[-2]


def spill(run_dir, rows, config) -> None:
    (run_dir / "trajectories").mkdir(parents=True)
    table = spill_table([(t, "trained", t.policy_version) for t in rows])
    pq.write_table(table, run_dir / "trajectories" / "part-000001.parquet")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))


def learning_run(run_dir, seed: int, group_size: int = 8, versions: int = 20) -> None:
    """Two groups a version of two-hop questions (a new question each): the chain share falls
    from 5/8 to 2/8 over the versions, and chains pay from 0 to about 0.5, the rest 0.5."""
    rng = np.random.default_rng(seed)
    rows = []
    for v in range(versions):
        chains = round(group_size * (0.625 - 0.375 * v / (versions - 1)))
        for g in range(2):
            for i in range(group_size):
                chain = i < chains
                pays = 0.5 * v / (versions - 1) if chain else 0.5
                t = synthetic_trajectory(
                    f"minigaia-l2-{v:03d}{g}@0",  # the same ids in every run
                    i,
                    version=v,
                    reward=float(rng.random() < pays),
                    tool_names=["search"] * (2 if chain else i % 2),
                )
                rows.append(replace(t, data_source="minigaia_l2"))
    config = {
        "learner": {"lr": 1e-4, "advantage": {"type": "stratified", "alpha": 0.0}},
        "buffer": {"group_size": group_size},
    }
    spill(run_dir, rows, config)


def test_the_bandits_velocities_are_its_mean_field_paths_first_step():
    """At lr 1e-4 one step of the mean-field path moves P(chain) and the chains' pay (hop^2) by
    lr times the velocities `bandit_velocities` gives, at hop speed 1."""
    lr = 1e-4
    for p0, depth, alpha in ((0.54, 6, 0.0), (0.3, 4, 0.8)):
        share, pay = hops.bandit_velocities(p0, depth, 0.2, 4, "stratified", {"alpha": alpha})
        path = expected_path(alpha, depth, 0.2, 4, 2, lr=lr, start_chain=p0)
        assert (path[1]["chain"] - path[0]["chain"]) / lr == pytest.approx(share, rel=1e-3)
        moved = path[1]["hop"] ** 2 - path[0]["hop"] ** 2
        assert moved / lr == pytest.approx(pay, rel=1e-3)
        assert share < 0 < pay  # a trap: the chain share falls while the hops learn


def test_the_hop_speed_is_the_ratio_of_the_two_speeds_against_the_bandits():
    rng = np.random.default_rng(0)
    version = np.repeat(np.arange(20), 16)
    question = np.repeat([f"q{i}" for i in range(40)], 8)
    chain = rng.random(320) < 0.6 - 0.015 * version
    reward = (rng.random(320) < np.where(chain, 0.02 * version, 0.5)).astype(float)
    early = Trajectories(version, question, np.where(chain, 2, 1), reward)
    found = hops.measure(early, 20, bandit_share=-0.05, bandit_pay=0.004, resamples=500)
    share = np.polyfit(version, chain.astype(float), 1)[0]
    pay = np.polyfit(version[chain], reward[chain], 1)[0]
    assert found.share_slope == pytest.approx(share) and found.pay_slope == pytest.approx(pay)
    assert found.speed == pytest.approx((pay / 0.004) / (share / -0.05))
    assert found.speed_ci[0] < found.speed < found.speed_ci[1]
    assert found.share_slope_ci[1] < 0 and found.reason == ""
    assert (found.questions, found.chains) == (40, int(chain.sum()))
    assert "hop speed " in hops.line(found) and "the hops' speed over the stratum's" in hops.line(
        found
    )
    against = hops.measure(early, 20, bandit_share=0.05, bandit_pay=0.004, resamples=500)
    assert against.speed is None and "where the matched bandit's moves up" in against.reason
    flat = replace(early, searches=np.tile([2, 2, 1, 1], 80))  # the share does not move
    found = hops.measure(flat, 20, bandit_share=-0.05, bandit_pay=0.004, resamples=500)
    assert found.speed is None and found.reason.startswith("the chain share did not move")
    assert "hop speed: not measured, the chain share did not move" in hops.line(found)
    one = early.where(early.version == 3)
    assert "one policy version" in hops.measure(one, 20, -0.05, 0.004, resamples=50).reason
    still = hops.measure(early, 20, bandit_share=0.0, bandit_pay=0.004, resamples=50)
    assert "does not move at its start (no trap to race)" in still.reason


def test_chains_whose_pay_fell_learn_at_speed_0():
    version = np.repeat(np.arange(10), 20)
    question = np.array([f"q{v}-{i % 5}" for v, i in zip(version, range(200), strict=True)])
    chain = np.arange(200) % 20 < 12 - version
    reward = np.where(chain, version < 3, np.arange(200) % 2 == 0).astype(float)
    found = hops.measure(
        Trajectories(version, question, np.where(chain, 2, 0), reward), 10, -0.05, 0.01
    )
    assert found.pay_slope < 0 and found.speed == 0.0 and found.speed_ci[0] == 0.0


def test_a_measured_hop_speed_feeds_the_trap_model(tmp_path, capsys):
    run = tmp_path / "run"
    learning_run(run, 0)
    measured = diagnose(run, 20, seeds=10, resamples=500, hop_speed="measured")
    hop = measured.hop
    assert hop is not None and hop.versions == 20 and hop.speed is not None
    assert measured.hop_speed == hop.speed and f"hop speed {hop.speed:.2g})" in measured.reading
    for p in measured.predictions:  # the escape with the hops at the interval's ends
        trap = Trap(measured.depth, measured.rest_pay, 8, 1, alpha=p.alpha, start_chain=measured.p0)
        assert p.speed_range == tuple(
            cell(replace(trap, hop_speed=e), 10).escape for e in hop.speed_ci
        )
    slow = diagnose(run, 20, seeds=10, resamples=500, hop_speed=0.0)
    assert slow.hop == hop and slow.hop_speed == 0.0  # measured whatever the model takes
    assert [p.escape for p in slow.predictions] == [0.0, 0.0, 0.0]  # hops that never learn
    assert all(p.speed_range is None for p in slow.predictions)
    assert main([str(run), "--first-versions", "20", "--seeds", "10", "--hop-speed", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert "trap model, alpha 0.8, hop speed 0.5: escape" in printed
    assert f"hop speed {hop.speed:.2f}, 95% interval [" in printed
    for bad in ("fast", "-1"):
        with pytest.raises(SystemExit):
            main([str(run), "--hop-speed", bad])
        assert f"{bad!r}: give a speed >= 0 or 'measured'" in capsys.readouterr().err


def test_runs_of_one_world_are_pooled_and_runs_of_two_settings_refused(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    learning_run(a, 0)
    learning_run(b, 1)
    no_model = 10**6  # questions with both kinds a prediction needs: none here, no trap model
    both = diagnose([a, b], 20, min_questions=no_model)
    one = [diagnose(r, 20, min_questions=no_model) for r in (a, b)]
    assert both.runs == 2 and both.trajectories == one[0].trajectories + one[1].trajectories
    # the runs' groups are told apart, though their prompt ids are the same: the share of
    # trajectories alone in their stratum is each run's, pooled
    for s in both.strata:
        mine = [next(x for x in o.strata if x.stratum == s.stratum) for o in one]
        alone = sum(x.alone * x.count for x in mine) / sum(x.count for x in mine)
        assert s.alone == pytest.approx(alone) and s.count == sum(x.count for x in mine)
    assert both.p0 == pytest.approx((one[0].p0 + one[1].p0) / 2)
    assert main([str(a), str(b), "--first-versions", "20", "--min-questions", str(no_model)]) == 0
    assert capsys.readouterr().out.startswith("2 runs pooled, 640 trajectories (versions 0-19)")
    c = tmp_path / "c"
    learning_run(c, 2, group_size=4)
    assert main([str(a), str(c), "--first-versions", "20"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the runs differ in buffer.group_size" in err
