"""Synthetic trajectories for tests and benchmarks: well-formed records of any size and shape."""

from __future__ import annotations

import numpy as np

from buffers.records import Trajectory


def synthetic_trajectory(
    prompt_id: str,
    sample_index: int,
    *,
    tokens: int = 32,
    version: int = 0,
    reward: float = 1.0,
    tool_names: list[str] | None = None,
    observation_tokens: int | None = None,
    seed: int = 0,
) -> Trajectory:
    """A valid trajectory: generated tokens of `version` with one tool observation in the middle.

    The stratum is the number of tool calls, as the default stratifier would assign it.
    """
    rng = np.random.default_rng([seed, sample_index, len(prompt_id)])
    tool_names = ["search"] if tool_names is None else tool_names
    observed = tokens // 10 if observation_tokens is None else observation_tokens
    mask = np.ones(tokens, np.int8)
    if tool_names and observed:
        start = max(1, (tokens - observed) // 2)
        mask[start : start + observed] = 0
    versions = np.where(mask == 1, version, -1).astype(np.int32)
    logprobs = np.where(mask == 1, -rng.random(tokens, dtype=np.float32) * 3, 0).astype(np.float32)
    return Trajectory(
        prompt_id=prompt_id,
        sample_index=sample_index,
        token_ids=rng.integers(0, 32000, tokens, dtype=np.int32),
        loss_mask=mask,
        behavior_logprobs=logprobs,
        token_versions=versions,
        reward=reward,
        prompt_token_ids=rng.integers(0, 32000, 16, dtype=np.int32),
        tool_names=list(tool_names),
        stratum=len(tool_names),
        data_source="synthetic",
        question=f"question of {prompt_id}",
        ground_truth=["answer"],
        text=" ".join(f"<search>q{i}</search>" for i in range(len(tool_names)))
        + " <answer>a</answer>",
        actor_id="test",
    )
