"""What a launch refuses before anything starts, each in one line: what this machine cannot run
(asked of the chosen engine and runtime, then the model's and learner's own needs) and the
settings evaluation takes but training cannot. A refused launch leaves nothing behind."""

from __future__ import annotations

from pipeline.config.schema import StrataConfig
from pipeline.runtime.startup import uncollected


def unavailable(config: StrataConfig) -> str | None:
    """Why this machine cannot run `config`, in one line, or None."""
    with uncollected():  # here, not at the top: --dry-run validates without importing torch
        import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    problem = config.actors.engine.refused(config, gpus)
    if problem is None and config.model.param_dtype == "float16" and not gpus:
        problem = (
            "model.dtype float16 trains only on CUDA GPUs (DeepSpeed refuses fp16 on CPU): "
            "use --set model.dtype=bfloat16 or float32 here"
        )
    return problem or config.runtime.refused(config, gpus)


def refused_for_training(config: StrataConfig) -> str | None:
    """Settings that evaluation takes but training cannot, in one line, or None."""
    if config.actors.top_p < 1:
        return (
            f"actors.top_p {config.actors.top_p:g} < 1 cannot train correctly: the embedded engine "
            "records behaviour log-probs before the nucleus cut, vLLM after it, and the learner "
            "recomputes them uncut, so the importance ratios would be wrong: set actors.top_p=1.0 "
            "(pipeline.evaluate may still sample with top_p < 1)"
        )
    return None
