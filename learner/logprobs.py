"""Log-probs and entropy of the tokens the loss reads, without a vocabulary-sized tensor.

`head_logprobs` (the learner's path, learner/head.py): the hidden states at the positions that
predict a trained token ([n, H]) go through the language-model head a chunk of `CHUNK` positions
at a time; each chunk's logits, float32 log-softmax and entropy live only while that chunk is
computed, and are recomputed from the chunk's hidden states in the backward pass (activation
checkpointing). No [n, V] tensor exists at any time, nor its gradient: the hidden states are cut
with one `split`, whose backward joins the chunks' gradients once (a slice per chunk would build
a zero-filled [n, H] gradient per chunk). Peak memory is a few chunks x V, whatever n.

`token_logprobs` (a model whose own forward changes its logits after the head, learner/head.py):
from the model's logits at the trained positions ([n, V], the model's dtype), chunk by chunk the
same way, so only the [n, V] logits and their gradient are whole.
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
    # one split, not a slice per chunk: a slice's backward fills a zero [n, V] gradient per chunk
    for part, wanted in zip(logits.split(chunk), targets.split(chunk), strict=True):
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


def _head_logprob(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden)
    with torch.no_grad():  # telemetry: recomputed with the chunk in backward, never differentiated
        entropy = _entropy_of(logits, temperature)
    return _target_logprob(logits, targets, temperature), entropy


def _head_logprob_and_entropy(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _target_logprob_and_entropy(head(hidden), targets, temperature)


def head_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = CHUNK,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` of the logits `head(hidden)`, for `hidden` [n, H] and `targets` [n],
    without ever holding those logits whole: `head` (the language-model head, an adapted one
    with LoRA) is called on a chunk of positions at a time, and with a gradient each chunk's
    logits are recomputed in the backward pass. Same values as `token_logprobs(head(hidden))`."""
    grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    if hidden.shape[0] == 0:  # no trained token: [0], still attached to the graph
        empty = head(hidden).float().sum(-1)
        return empty, (empty if entropy_grad else empty.detach())
    logps, entropies = [], []
    for part, wanted in zip(hidden.split(chunk), targets.split(chunk), strict=True):
        if not grad:
            logits = head(part)
            logps.append(_target_logprob(logits, wanted, temperature))
            entropies.append(_entropy_of(logits, temperature))
            continue
        fn = _head_logprob_and_entropy if entropy_grad else _head_logprob
        logp, entropy = checkpoint(fn, head, part, wanted, temperature, use_reentrant=False)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps), torch.cat(entropies)
