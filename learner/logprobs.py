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

Both take a chunk's logits to its log-probs and entropy in one autograd function
(`_LogSoftmaxAt`) that keeps nothing of size V for backward and writes the logits' gradient from
the softmax rebuilt in place: about half the passes over [chunk, V] of autograd's own chain
(division, log-softmax, exp, product, sum), and a fraction of its buffers.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

CHUNK = 256  # positions a chunk: 256 x 151,936 x 4 bytes = 0.16 GB of float32 at a time


class _LogSoftmaxAt(torch.autograd.Function):
    """Per row of `logits` [c, V]: log softmax(logits / T)[target] and the entropy of
    softmax(logits / T), float32. Only the logits (the caller's) and [c] vectors are kept for
    backward, which rebuilds the softmax p in place and returns the logits' gradient,
    ((onehot - p) g_logp - p (log p + H) g_entropy) / T, in the logits' dtype: a few [c, V]
    float32 buffers at a time, never autograd's chain of them."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, entropy_grad: bool):
        scaled = _scaled(logits, temperature)
        top = scaled.amax(-1, keepdim=True)
        p = torch.sub(scaled, top).exp_()  # one exponential for both the sum and p
        total = p.sum(-1, keepdim=True)
        lse = (top + total.log()).squeeze(-1)
        p.div_(total)
        # H = lse - sum(p s), the sum as a batched dot product: no [c, V] product tensor
        entropy = lse - torch.bmm(p[:, None, :], scaled[:, :, None]).flatten()
        del p
        logp = scaled.gather(-1, targets[:, None]).squeeze(-1) - lse
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature = temperature
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        scaled = _scaled(logits, ctx.temperature)
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        grad = torch.sub(scaled, lse[:, None]).exp_()  # p
        if g_entropy is not None:  # dH/ds = -p (log p + H), log p = s - lse
            inner = torch.sub(scaled, (lse - entropy)[:, None])
            grad.mul_(inner.mul_(g_entropy[:, None]).add_(g_logp[:, None]))
            del inner
            grad.neg_()
        else:
            grad.mul_(-g_logp[:, None])
        grad.scatter_add_(-1, targets[:, None], g_logp[:, None])
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(logits.dtype), None, None, None


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T in float32 (dividing by 1 is skipped: the same values, one [c, V] less)."""
    scaled = logits.float()
    return scaled if temperature == 1.0 else scaled / temperature


def _logprob_entropy(logits, targets, temperature: float, entropy_grad: bool):
    return _LogSoftmaxAt.apply(logits, targets, temperature, entropy_grad)


def _head_logprob_entropy(head, hidden, targets, temperature: float, entropy_grad: bool):
    return _LogSoftmaxAt.apply(head(hidden), targets, temperature, entropy_grad)


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = CHUNK,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature)[target] per position (float32, with gradient) and the
    distribution's entropy (float32; with gradient only if `entropy_grad`, for an entropy bonus),
    for `logits` [n, V] and `targets` [n]. Chunked along n: a chunk's float32 work exists only
    while the chunk is computed, forward or backward."""
    if logits.shape[0] == 0:  # no trained token: [0], still attached to the graph
        empty = logits.float().sum(-1)
        return empty, (empty if entropy_grad else empty.detach())
    # one split, not a slice per chunk: a slice's backward fills a zero [n, V] gradient per chunk
    pieces = [
        _logprob_entropy(part, wanted, temperature, entropy_grad)
        for part, wanted in zip(logits.split(chunk), targets.split(chunk), strict=True)
    ]
    return torch.cat([p for p, _ in pieces]), torch.cat([e for _, e in pieces])


def head_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = CHUNK,
    entropy_grad: bool = False,
    pieces: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` of the logits `head(hidden)`, for `hidden` [n, H] and `targets` [n],
    without ever holding those logits whole: `head` (the language-model head, an adapted one
    with LoRA) is called on a chunk of positions at a time, and with a gradient each chunk's
    logits are recomputed in the backward pass. Same values as `token_logprobs(head(hidden))`.

    `pieces`: the head is called exactly that many times, on near-equal chunks (some empty when
    n < pieces), instead of once per `chunk` positions. ZeRO-3 over several ranks needs it: each
    call gathers the head's weight from every rank, so every rank must make the same calls."""
    grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    if pieces is None and hidden.shape[0] == 0:  # no trained token: [0], still in the graph
        empty = head(hidden).float().sum(-1)
        return empty, (empty if entropy_grad else empty.detach())
    if pieces is None:
        chunks = zip(hidden.split(chunk), targets.split(chunk), strict=True)
    else:
        chunks = zip(hidden.tensor_split(pieces), targets.tensor_split(pieces), strict=True)
    out = [
        checkpoint(
            _head_logprob_entropy,
            head,
            part,
            wanted,
            temperature,
            entropy_grad,
            use_reentrant=False,
        )
        if grad
        else _head_logprob_entropy(head, part, wanted, temperature, entropy_grad)
        for part, wanted in chunks
    ]
    return torch.cat([p for p, _ in out]), torch.cat([e for _, e in out])
