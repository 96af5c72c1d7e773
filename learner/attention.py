"""Attention over packed trajectories, one causal attention per trajectory.

A packed row (learner/packing.py) holds several trajectories end to end, their position ids
restarting at 0. Given the dense block-diagonal mask transformers builds for sdpa from those
restarts, torch's CPU attention computes the whole row's N x N scores and falls back to its
slowest kernel: a forward and backward of 16 of the embedded default's trajectories took 624 ms
packed that way against 184 ms padded (2 cores, 2026-11-26). `segment_attention` instead splits the row where the position ids restart and runs
plain causal sdpa on each piece: the same values, the work of the real tokens only (155 ms
there).

Registered as the attention implementation "strata_segments" (transformers' AttentionInterface)
without a mask function, so transformers builds no mask for it: a padded row (right-padded,
causal) needs none either, since no real token attends to a later pad. The learner uses it when
it packs and flash attention (which reads the same restarts as variable-length boundaries) is not
installed.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "strata_segments"


def segment_starts(position_ids: torch.Tensor | None, length: int) -> list[int]:
    """Where each trajectory of a packed row begins (position id 0), and the row's end."""
    if position_ids is None:
        return [0, length]
    starts = (position_ids.reshape(-1)[:length] == 0).nonzero().flatten().tolist()
    return ([0] if not starts or starts[0] != 0 else []) + starts + [length]


def segment_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention inside each segment of every row: query [B, H, N, D], key and value
    [B, H_kv, N, D] (grouped-query heads shared as sdpa's enable_gqa does). Returns
    [B, N, H, D], as transformers' sdpa does. Several rows share one segmentation: the rows
    of a packed input are one, padded rows have none."""
    if attention_mask is not None:
        raise ValueError(
            f"{NAME} builds no mask; it got one of shape {tuple(attention_mask.shape)}"
        )
    length = query.shape[2]
    bounds = segment_starts(position_ids if query.shape[0] == 1 else None, length)
    gqa = query.shape[1] != key.shape[1]
    parts = [
        F.scaled_dot_product_attention(
            query[:, :, a:b],
            key[:, :, a:b],
            value[:, :, a:b],
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        )
        for a, b in pairwise(bounds)
        if b > a
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, segment_attention)


def implementation(packing: bool) -> str | None:
    """The attention implementation the learner loads its models with: flash attention where it
    is installed on a GPU (variable-length over the restarts), else "strata_segments" when
    packing; None (the model's default) for padded rows."""
    if not packing:
        return None
    if torch.cuda.is_available():
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
    return NAME
