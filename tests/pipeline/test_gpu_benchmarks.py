"""The one-GPU measurements (benchmarks/learner_gpu_cost.py and decode_gpu_cost.py, which the
cluster simulation is calibrated to or set beside, and engine_gpu.py, the GPU tier's figure): each
says in one line that it needs a GPU, and its --tiny check runs the same passes on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
NEEDS = {
    "learner_gpu_cost": "an 8B model's training passes",
    "decode_gpu_cost": "an 8B model's decode step",
    "engine_gpu": "the embedded engine's tokens/s",
}


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{script}.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("script", sorted(NEEDS))
def test_without_a_gpu_it_says_what_it_needs(script):
    done = run(script)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"{script}: no CUDA GPU here; this measures {NEEDS[script]} on one GPU (--tiny checks the "
        "script on CPU)"
    ]


def test_the_tiny_learner_measures_every_pass(tmp_path):
    done = run(
        "learner_gpu_cost",
        "--tiny",
        "--seq",
        "64",
        "--repeats",
        "1",
        "--mix",
        "4",
        "--json",
        str(tmp_path / "f.json"),
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads((tmp_path / "f.json").read_text())
    for key in ("train_checkpointed", "train", "forward"):
        assert figures[key]["s_per_token"] > 0, key
    assert figures["tiny"] and figures["seq"] == 64 and figures["batch"] == 2
    # the length mix: padded rows carry padding, packed ones none
    assert figures["mix_padded"]["padding_share"] > 0 == figures["mix_packed"]["padding_share"]
    packed, padded = figures["mix_packed"], figures["mix_padded"]
    ratio = packed["tokens_per_s"] / padded["tokens_per_s"]
    assert figures["mix_packed_over_padded"] == pytest.approx(ratio)


def test_the_tiny_grid_turns_each_switch_of_the_learners_path(tmp_path):
    """Issue 62's grid on a two-layer model on CPU: every row ran with the switch it names."""
    done = run(
        "learner_gpu_cost",
        *("--tiny", "--grid", "4", "--means", "40", "--budget", "120", "--repeats", "1"),
        *("--warmup", "0"),
        *("--json", str(tmp_path / "f.json")),
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "f.json").read_text())["grid"]["4x40"]
    packed = rows["packed"]
    assert rows["padded"]["padding_share"] > 0 == packed["padding_share"]
    assert packed["head"] == "chunks" and packed["checkpointing"] and packed["micro_batches"] == 1
    assert rows["packed_own_head"]["head"] == "own logits"
    assert rows["packed_segments"]["attention"] == "strata_segments"
    assert not rows["packed_no_checkpointing"]["checkpointing"]
    assert rows["packed_budget"]["micro_batches"] > 1 and rows["packed_budget"]["budget"] == 120
    for name, row in rows.items():
        if name != "lengths":
            assert row["tokens_per_s"] > 0 and row["real_tokens"] == packed["real_tokens"], name


def test_the_tiny_decoder_times_every_batch_and_fits_a_line(tmp_path):
    done = run(
        "decode_gpu_cost",
        "--tiny",
        "--context",
        "64",
        "--batches",
        "1,4",
        "--steps",
        "2",
        "--json",
        str(tmp_path / "f.json"),
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads((tmp_path / "f.json").read_text())
    assert set(figures["steps"]) == {"1", "4"} and all(s > 0 for s in figures["steps"].values())
    fit = figures["fit"]
    for batch, seconds in figures["steps"].items():  # two points: the line passes through both
        assert fit["step_s"] + fit["step_per_seq_s"] * int(batch) == pytest.approx(seconds)


def test_the_tiny_engine_figures_compare_equal_work(tmp_path):
    done = run(
        "engine_gpu", "--tiny", "--batch", "4", "--tokens", "24", "--json", str(tmp_path / "f.json")
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads((tmp_path / "f.json").read_text())
    for key in ("engine", "generate", "agent_continuous", "agent_waves"):
        assert figures[f"{key}_tokens_per_s"] > 0, key
    assert figures["engine_vs_generate"] == pytest.approx(
        figures["engine_tokens_per_s"] / figures["generate_tokens_per_s"]
    )
    assert "model.generate" in done.stderr and "continuous" in done.stderr
