"""What the one-GPU measurements (learner_gpu_cost.py, decode_gpu_cost.py) share: which device to
measure on, refused in one line when there is no GPU, and where their figures go."""

from __future__ import annotations

import json
import sys

import torch


def device_for(script: str, what: str, tiny: bool) -> str | None:
    """ "cuda", or "cpu" for a --tiny check; None, after one line on stderr, for a real
    measurement on a machine without a GPU."""
    if torch.cuda.is_available():
        return "cuda"
    if tiny:
        return "cpu"
    print(f"{script}: no CUDA GPU here; this measures {what} on one GPU (--tiny checks the script "
          "on CPU)", file=sys.stderr)  # fmt: skip
    return None


def describe(device: str) -> dict[str, object]:
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}  # fmt: skip


def report(figures: dict, path: str | None) -> None:
    """The figures as one JSON line on stdout, and indented into `path` if given."""
    print(json.dumps(figures))
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=1)
