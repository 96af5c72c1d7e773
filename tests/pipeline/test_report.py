"""The report: its initial-policy row (where the weights came from and a digest of them), and
its "Should this run stratify?" section, written whether or not the diagnosis can be made."""

import hashlib
import json
from types import SimpleNamespace

import yaml

from pipeline.evaluation.report import initial_policy, write_report
from tests.pipeline.test_start import write_run


def test_initial_policy_names_the_warm_start_and_digests_its_weights(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    record = {
        "steps": 1470,
        "epochs": [{"epoch": e} for e in range(30)],
        "first_loss": 7.6,
        "final_loss": 0.1057,
    }
    (tmp_path / "warm_start.json").write_text(json.dumps(record))
    line = initial_policy(tmp_path)
    digest = hashlib.sha256(b"weights").hexdigest()[:16]
    assert line == (
        f"`{tmp_path}`, warm start of 30 epochs (1470 steps), loss 7.600 -> 0.106, "
        f"weights sha256 {digest}"
    )


def test_initial_policy_of_a_plain_hf_directory_or_none(tmp_path):
    assert initial_policy(tmp_path) == f"`{tmp_path}`"  # sharded or no weights file: path only
    (tmp_path / "warm_start.json").write_text('{"steps": 0, "first_loss": null}')  # no step fitted
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert initial_policy(tmp_path).endswith(
        f"weights sha256 {hashlib.sha256(b'x').hexdigest()[:16]}"
    )
    assert initial_policy(None) == "not recorded"


def summary(steps: int) -> SimpleNamespace:
    return SimpleNamespace(
        metrics=[{"step": s, "reward_mean": 0.5} for s in range(1, steps + 1)],
        steps=steps,
        trajectories=16 * steps,
        seconds=1.0,
        busy_fraction=0.5,
        empty_steps=0,
        skipped_prompts=0,
        checkpoint=None,
        accounting={},
    )


def test_the_report_says_whether_the_run_should_stratify(tmp_path):
    run = tmp_path / "run"
    write_run(run, 1e-4)
    config = {"learner": {"lr": 1e-4, "groups_per_step": 1}, "buffer": {"group_size": 4}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    text = write_report(run, "c.yaml", summary(10), plots=False).read_text()
    section = text.split("## Should this run stratify?\n", 1)[1]
    assert "first 5 policy versions" in section and "\nreading: " in section
    bare = tmp_path / "bare"  # no spill: the report is written, the section says why not
    bare.mkdir()
    (bare / "config.yaml").write_text(yaml.safe_dump(config))
    text = write_report(bare, "c.yaml", summary(10), plots=False).read_text()
    assert f"## Should this run stratify?\n\nNot diagnosed: {bare} kept no trajectories" in text
