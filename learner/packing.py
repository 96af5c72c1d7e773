"""A step's micro-batches, by tokens, and each one's model input: packed end to end or padded.

**Micro-batches.** With `learner.max_tokens_per_micro_batch` set, a step's trajectories are
placed first fit in decreasing length into micro-batches of at most that many tokens (prompt +
response) and `learner.micro_batch_size` trajectories; a trajectory longer than the budget is a
micro-batch of its own. Unset, micro-batches are `micro_batch_size` trajectories in step order,
as before. The step's gradient is the same either way: every micro-batch's loss is weighted by
its share of the whole step's tokens (learner/trainer.py).

**Model input.** Packed (`learner.packing`, the default): the micro-batch's trajectories laid end
to end in one row, position ids restarting at 0 for each; with no attention mask given,
transformers reads the restarts as sequence boundaries and keeps attention inside each
trajectory (a block-diagonal causal mask with sdpa or eager attention, variable-length kernels
with flash attention). Padded: one row per trajectory, right-padded to the longest. Either way
the model computes logits only at the positions that predict a trained token (`logits_to_keep`,
given as a 1-D tensor of positions: the form every transformers release we support reads; padded
rows share one list, the union of theirs, and the logits then kept are picked out of the
[rows, positions] block), and their log-probs go back to the response-aligned [b, R] layout the
loss reads, so the loss code cannot tell the two apart. The learner's models call their backbone
and head apart (learner/head.py): the hidden states at those positions go through the head a
chunk at a time, so not even the kept logits are ever whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from learner.batch import TrainBatch
from learner.head import split_logprobs
from learner.logprobs import token_logprobs


def plan_micro_batches(
    lengths: Sequence[int], max_rows: int, max_tokens: int | None
) -> list[list[int]]:
    """Row indices of each micro-batch (each list ascending)."""
    n = len(lengths)
    if max_tokens is None:
        return [list(range(i, min(i + max_rows, n))) for i in range(0, n, max_rows)]
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        for b, rows in enumerate(bins):
            if len(rows) < max_rows and room[b] >= lengths[i]:
                rows.append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(rows) for rows in bins]


@dataclass
class ModelInput:
    """What the model is called with, and where its log-probs go."""

    kwargs: dict[str, torch.Tensor]
    """input_ids, position_ids (packed) or attention_mask (padded), logits_to_keep."""
    select: torch.Tensor | None
    """Which of the model's logits, flattened to [rows x kept positions, V], predict the trained
    tokens, in `targets`' order; None when all of them do (packed)."""
    targets: torch.Tensor
    """[n] the trained tokens, in the order the kept logits come out."""
    rows: torch.Tensor
    """[n] each trained token's row in the micro-batch."""
    cols: torch.Tensor
    """[n] and its index in the row's response."""
    tokens: int
    """Tokens the model reads (padding included)."""


def model_input(micro: TrainBatch, packed: bool) -> ModelInput:
    """The model input of a micro-batch: its trained tokens are those of `response_mask`."""
    lengths = micro.attention_mask.sum(-1)
    rows, cols = (micro.response_mask > 0).nonzero(as_tuple=True)  # row-major: the logits' order
    predicting = micro.response_start[rows] - 1 + cols  # the position whose logits give the token
    if packed:
        offsets = torch.cumsum(lengths, 0) - lengths
        ids = torch.cat([micro.input_ids[i, : int(n)] for i, n in enumerate(lengths)])
        positions = torch.cat([torch.arange(int(n)) for n in lengths])
        at = offsets[rows] + predicting  # ascending: the rows lie in order end to end
        return ModelInput(
            {"input_ids": ids[None], "position_ids": positions[None], "logits_to_keep": at},
            None,
            ids[at + 1],
            rows,
            cols,
            int(ids.shape[0]),
        )
    keep = torch.unique(predicting)  # sorted
    return ModelInput(
        {
            "input_ids": micro.input_ids,
            "attention_mask": micro.attention_mask,
            "logits_to_keep": keep,
        },
        rows * len(keep) + torch.searchsorted(keep, predicting),
        micro.input_ids[rows, predicting + 1],
        rows,
        cols,
        int(micro.input_ids.numel()),
    )


def response_logprobs(
    model,
    micro: TrainBatch,
    packed: bool,
    temperature: float,
    device: torch.device,
    entropy_grad: bool = False,
    split: bool = False,
    agree: Callable[[int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """log pi(r_j | p, r_<j) and the entropy of that distribution (with a gradient only if
    `entropy_grad`: an entropy bonus trains it), both [b, R]
    float32 and 0 where `response_mask` is 0, from one forward pass of `model` (an HF causal LM
    or a DeepSpeed engine around one), and the tokens it read. `split`: the backbone and the
    head called apart, the head a chunk of positions at a time (learner/head.py: only for a
    model that `splits`); else the model's own logits at the trained positions. `agree`, with
    `split`: the number of head calls, given this micro-batch's trained tokens (ZeRO-3 over
    several ranks: the same on every rank, learner/trainer.py)."""
    given = model_input(micro, packed)
    kwargs = {k: v.to(device) for k, v in given.kwargs.items()}
    targets = given.targets.to(device)
    select = None if given.select is None else given.select.to(device)
    if split:
        keep = kwargs.pop("logits_to_keep")

        def positions(hidden: torch.Tensor) -> torch.Tensor:  # [rows, length, H] -> [n, H]
            kept = hidden[:, keep].flatten(0, 1)
            return kept if select is None else kept[select]

        pieces = None if agree is None else agree(int(targets.numel()))
        logp, entropy = split_logprobs(
            model, kwargs, positions, targets, temperature, entropy_grad=entropy_grad, pieces=pieces
        )
    else:
        logits = model(**kwargs, use_cache=False).logits
        logits = logits.reshape(-1, logits.shape[-1])
        if select is not None:
            logits = logits[select]
        logp, entropy = token_logprobs(logits, targets, temperature, entropy_grad=entropy_grad)
    shape = micro.response_mask.shape
    where = (given.rows.to(device), given.cols.to(device))
    full = torch.zeros(shape, dtype=torch.float32, device=device)
    return full.index_put(where, logp), full.index_put(where, entropy), given.tokens
