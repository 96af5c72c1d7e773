"""Suite-wide settings: nothing downloads, and GPU-only tests skip on machines without CUDA."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (this machine has none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
