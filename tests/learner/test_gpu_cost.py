"""benchmarks/learner_gpu_cost.py, which calibrates the cluster simulation's learner: it says in
one line that it needs a GPU, and its --tiny check runs the same passes on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "learner_gpu_cost.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_what_it_needs():
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "learner_gpu_cost: no CUDA GPU here; this measures an 8B model on one GPU "
        "(--tiny checks the script on CPU)"
    ]


def test_the_tiny_model_measures_every_pass(tmp_path):
    out = tmp_path / "cost.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--seq", "64", "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())
    for key in ("train_checkpointed", "train", "forward"):
        assert figures[key]["s_per_token"] > 0, key
    assert figures["tiny"] and figures["seq"] == 64 and figures["batch"] == 2
