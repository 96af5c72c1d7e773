"""`python -m pipeline.diagnose` (pipeline/experiments/diagnose.py): who is alone in their
stratum, the matched trap depth, the reading's branches, and the command on a spilled run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from pipeline.experiments.diagnose import (
    Prediction,
    alone_shares,
    main,
    matched_depth,
    reading_line,
    report_section,
    report_versions,
    strata_table,
)
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
    assert main([str(run), "--seeds", "10", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "13 trajectories (all (a frozen run)), groups of 4" in printed
    assert "trap model, alpha 0.8: escape" in printed and "reading: " in printed
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
    assert "first 6 policy versions" in text and "at 10 seeds a prediction" in text
    assert "48 trajectories (versions 0-5), groups of 4" in text  # versions 6-7 are late
    assert "trap model, alpha 0.8: escape" in text and "\nreading: " in text
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
