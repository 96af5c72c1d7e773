"""Log-probs and entropy of the tokens the loss reads, without a [B, L, V] float32 tensor.

The model is asked for logits only at the positions that predict a trained token
(`logits_to_keep`, learner/packing.py), so prompts, tool observations and padding cost
no vocabulary projection. Those logits ([n, V], the model's dtype) are turned into float32
log-probs a chunk of `CHUNK` positions at a time: the chunk's log-softmax is recomputed in the
backward pass (activation checkpointing) instead of being kept, and the entropy (telemetry, no
gradient) is computed chunk by chunk too. Peak float32 memory is a few chunks x V instead of
twice B x L x V (log_softmax and its exp), about 24 GB for two 20k-token trajectories at a
151,936-word vocabulary.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

CHUNK = 256  # positions a chunk: 256 x 151,936 x 4 bytes = 0.16 GB of float32 at a time


def _target_logprob(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    scaled = logits.float() / temperature
    return scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, -1)


def _entropy_of(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    scaled = logits.float() / temperature
    lse = torch.logsumexp(scaled, -1, keepdim=True)
    return lse.squeeze(-1) - (torch.exp(scaled - lse) * scaled).sum(-1)


@torch.no_grad()
def _entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return _entropy_of(logits, temperature).detach()


def _target_logprob_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    return _target_logprob(logits, targets, temperature), _entropy_of(logits, temperature)


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = CHUNK,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature)[target] per position (float32, with gradient) and the
    distribution's entropy (float32; with gradient only if `entropy_grad`, for an entropy bonus),
    for `logits` [n, V] and `targets` [n]. Chunked along n; with a gradient, each chunk's float32
    work is recomputed in the backward pass."""
    logps, entropies = [], []
    for first in range(0, logits.shape[0], chunk):
        part, wanted = logits[first : first + chunk], targets[first : first + chunk]
        if part.requires_grad and entropy_grad:
            logp, entropy = checkpoint(
                _target_logprob_and_entropy, part, wanted, temperature, use_reentrant=False
            )
            logps.append(logp)
            entropies.append(entropy)
            continue
        if part.requires_grad:
            logps.append(
                checkpoint(_target_logprob, part, wanted, temperature, use_reentrant=False)
            )
        else:
            logps.append(_target_logprob(part, wanted, temperature))
        entropies.append(_entropy(part, temperature))
    if not logps:  # no trained token: [0], still attached to the graph so backward runs
        empty = logits.float().sum(-1)
        return empty, (empty if entropy_grad else empty.detach())
    return torch.cat(logps), torch.cat(entropies)
