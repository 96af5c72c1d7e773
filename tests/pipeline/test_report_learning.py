"""The report's "did it learn?" figures, on hand-made run directories."""

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.evaluation.report_learning import (
    _verdict,
    accuracy_changes,
    learning_section,
    reward_change,
)


def write_eval(run_dir, step, rewards, training=None):
    """One evaluation: `rewards` maps prompt id -> (data source, [reward per sample]) of the
    held-out questions (with and without tools), `training` the same for training questions."""
    rows = [
        {"prompt_id": p, "data_source": source, "reward": r, "actor_id": actor}
        for p, (source, samples) in rewards.items()
        for r in samples
        for actor in ("eval", "eval-no-tools")
    ]
    rows += [
        {"prompt_id": p, "data_source": source, "reward": r, "actor_id": "eval-train"}
        for p, (source, samples) in (training or {}).items()
        for r in samples
    ]
    (run_dir / "eval").mkdir(exist_ok=True)
    pq.write_table(
        pa.Table.from_pylist(rows), run_dir / "eval" / f"step-{step:06d}.trajectories.parquet"
    )
    with (run_dir / "eval.jsonl").open("a") as fh:
        fh.write(json.dumps({"step": step, "rows": []}) + "\n")


def test_reward_change_compares_the_first_and_last_fifth_with_its_standard_error():
    metrics = [{"reward_mean": r} for r in [0.0, 0.2, 0.5, 0.5, 0.5, 0.5, 0.6, 0.8, 1.0, 1.0]]
    first, last, se = reward_change(metrics)
    assert (first, last) == (0.1, 1.0)
    assert math.isclose(se, math.sqrt(0.02 / 2 + 0.0 / 2))  # sample variances 0.02 and 0


def test_accuracy_changes_are_paired_over_the_same_questions(tmp_path):
    write_eval(tmp_path, 0, {"a": ("l1", [0, 0]), "b": ("l1", [1, 1]), "c": ("l2", [0, 1])})
    write_eval(
        tmp_path,
        50,
        {"a": ("l1", [1, 1]), "b": ("l1", [1, 1]), "c": ("l2", [1, 1]), "d": ("l2", [1, 1])},
    )
    first, last, rows = accuracy_changes(tmp_path)
    assert (first, last) == (0, 50)
    by_name = {r[0]: r[1:] for r in rows}
    assert by_name["l1"][:3] == (2, 0.5, 1.0)  # "d" was not asked at step 0: left out
    changes = [1.0, 0.0, 0.5]  # a, b, c
    mean = sum(changes) / 3
    se = math.sqrt(sum((c - mean) ** 2 for c in changes) / 2 / 3)
    assert by_name["all"][0] == 3 and math.isclose(by_name["all"][3], se)
    section = "\n".join(learning_section(tmp_path, [{"reward_mean": 0.1}, {"reward_mean": 0.2}]))
    assert "held-out accuracy all (3 q, step 0 -> 50)" in section
    assert "training questions" not in section  # none were evaluated


def test_training_questions_are_paired_apart_from_the_held_out_ones(tmp_path):
    write_eval(
        tmp_path,
        0,
        {"a": ("l1", [0])},
        training={"t1": ("l1", [0]), "t2": ("l2", [0]), "t3": ("l2", [1])},
    )
    write_eval(
        tmp_path,
        9,
        {"a": ("l1", [1])},
        training={"t1": ("l1", [1]), "t2": ("l2", [1]), "t3": ("l2", [1])},
    )
    _, _, rows = accuracy_changes(tmp_path)
    by_name = {r[0]: r[1:] for r in rows}
    assert by_name["all"][:3] == (1, 0.0, 1.0)  # held-out only
    n, before, after, se = by_name["training questions"]
    assert (n, before, after) == (3, 1 / 3, 1.0)
    assert math.isclose(se, math.sqrt(sum((c - 2 / 3) ** 2 for c in (1, 1, 0)) / 2 / 3))
    section = "\n".join(learning_section(tmp_path, [{"reward_mean": 0.1}, {"reward_mean": 0.2}]))
    assert "| accuracy on training questions (3 q, step 0 -> 9) | 0.333 | 1.000 |" in section


def test_a_change_counts_only_beyond_two_standard_errors():
    assert _verdict(0.3, 0.1).startswith("yes") and _verdict(0.1, 0.1).startswith("no")
    assert _verdict(float("nan"), 0.1) == "-" and _verdict(0.1, 0.0) == "yes"
