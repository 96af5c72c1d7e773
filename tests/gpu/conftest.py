"""The GPU tier (`make test-gpu`): paths that only a CUDA machine exercises, on one GPU.

Every test here is marked `gpu` (`MARKS`) and skips where torch sees no CUDA device. To check the tier's
own logic on a CPU machine, `STRATA_GPU_TIER_DEVICE=cpu pytest tests/gpu` runs it on the CPU
(the comparisons then hold trivially or in float32; nothing about a GPU is shown by that).
"""

import os

import pytest

TIER_DEVICE = os.environ.get("STRATA_GPU_TIER_DEVICE", "cuda")
MARKS = [pytest.mark.gpu] if TIER_DEVICE == "cuda" else []
"""The tier's test modules' `pytestmark`."""


@pytest.fixture(scope="session")
def device() -> str:
    return TIER_DEVICE


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """The tiny policy's shape with random weights and a tokenizer trained on a few texts."""
    from pipeline.assets.tiny_policy import build_tiny_policy

    texts = [
        f"Question {i}: <search> Varno Telik </search> <answer> Quorvex {i} </answer>"
        for i in range(1500)
    ]
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny", texts, vocab_size=500)
