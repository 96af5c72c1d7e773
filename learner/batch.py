"""From complete groups to padded tensors, with the per-token alignment the loss relies on.

For a trajectory with prompt ids p (length P) and response ids r (length R), the model reads
p + r and the log-prob of r[j] is read from the logits at position P - 1 + j. Response-aligned
tensors ([B, R_max]) carry the loss mask, behaviour log-probs and versions exactly as the actor
recorded them; nothing is re-tokenised.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from buffers.records import Trajectory


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    response_start: torch.Tensor  # [B] = P, the index of the first response token
    response_mask: torch.Tensor  # [B, R] loss mask (1 generated, 0 observation / padding)
    behavior_logprobs: torch.Tensor  # [B, R]
    versions: torch.Tensor  # [B, R], -1 where masked
    advantages: torch.Tensor  # [B]

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: slice | torch.Tensor) -> TrainBatch:
        """A micro-batch (a slice or an index tensor of rows), trimmed to its own longest
        sequence and response."""
        lengths = self.attention_mask[rows].sum(-1)
        width = int(lengths.max())
        response_width = max(1, int((lengths - self.response_start[rows]).max()))
        return TrainBatch(
            input_ids=self.input_ids[rows, :width],
            attention_mask=self.attention_mask[rows, :width],
            response_start=self.response_start[rows],
            response_mask=self.response_mask[rows, :response_width],
            behavior_logprobs=self.behavior_logprobs[rows, :response_width],
            versions=self.versions[rows, :response_width],
            advantages=self.advantages[rows]
            if self.advantages.dim() == 1
            else self.advantages[rows, :response_width],  # per token (learner/turn_credit.py)
        )


def build_batch(
    trajectories: list[Trajectory], advantages: torch.Tensor, pad_id: int
) -> TrainBatch:
    lengths = [len(t.prompt_token_ids) + len(t.token_ids) for t in trajectories]
    rmax = max(len(t.token_ids) for t in trajectories)
    b, lmax = len(trajectories), max(lengths)
    input_ids = np.full((b, lmax), pad_id, dtype=np.int64)
    attention = np.zeros((b, lmax), dtype=np.int64)
    response_mask = np.zeros((b, rmax), dtype=np.float32)
    behavior = np.zeros((b, rmax), dtype=np.float32)
    versions = np.full((b, rmax), -1, dtype=np.int64)
    starts = np.zeros(b, dtype=np.int64)
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_token_ids), len(t.token_ids)
        input_ids[i, :p] = t.prompt_token_ids
        input_ids[i, p : p + r] = t.token_ids
        attention[i, : p + r] = 1
        response_mask[i, :r] = t.loss_mask
        behavior[i, :r] = t.behavior_logprobs
        versions[i, :r] = t.token_versions
        starts[i] = p
    return TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention),
        response_start=torch.from_numpy(starts),
        response_mask=torch.from_numpy(response_mask),
        behavior_logprobs=torch.from_numpy(behavior),
        versions=torch.from_numpy(versions),
        advantages=advantages.to(torch.float32),
    )


def response_logprobs(
    logits: torch.Tensor, batch: TrainBatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(r_j | p, r_<j) and the entropy of that distribution (no gradient), both [B, R],
    from the full logits of a padded batch: the plain reference the tests hold the learner's
    path (learner/packing.py: packed, trained positions only, chunked) to. It materialises
    [B, L, V] float32 twice; the learner does not use it.

    Uses log_softmax(logits / temperature), the quantity the engines report as behaviour
    log-probs, so ratios compare like with like.
    """
    device = logits.device
    logp_all = torch.log_softmax(
        logits[:, :-1].float() / temperature, dim=-1
    )  # predicts ids[:, 1:]
    token_logp = logp_all.gather(-1, batch.input_ids[:, 1:].to(device).unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    r = batch.response_mask.shape[1]
    positions = batch.response_start.to(device).unsqueeze(-1) - 1 + torch.arange(r, device=device)
    positions = positions.clamp(max=token_logp.shape[1] - 1)  # past a row's end: masked anyway
    return token_logp.gather(1, positions), entropy.gather(1, positions)
