"""The report's initial-policy row: where the weights came from and a digest of them."""

import hashlib
import json

from pipeline.evaluation.report import initial_policy


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
