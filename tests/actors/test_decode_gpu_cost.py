"""benchmarks/decode_gpu_cost.py, the floor the cluster simulation's server model is set beside:
it says in one line that it needs a GPU, and its --tiny check decodes on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "decode_gpu_cost.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_what_it_needs():
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "decode_gpu_cost: no CUDA GPU here; this measures an 8B model's decode step on one GPU "
        "(--tiny checks the script on CPU)"
    ]


def test_the_tiny_model_times_every_batch_and_fits_a_line(tmp_path):
    out = tmp_path / "decode.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--context", "64", "--batches", "1,4",
         "--steps", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())
    assert set(figures["steps"]) == {"1", "4"} and all(s > 0 for s in figures["steps"].values())
    fit = figures["fit"]
    for batch, seconds in figures["steps"].items():  # two points: the line passes through both
        assert fit["step_s"] + fit["step_per_seq_s"] * int(batch) == pytest.approx(seconds)
