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
causal) needs none either, since no real token attends to a later pad.

On a GPU a loop of one sdpa call per trajectory is many small kernels. "strata_varlen" gives the
whole packed row to one variable-length kernel instead, cut at the same restarts (cumulative
sequence lengths): torch's own flash-attention varlen kernel on CUDA
(`torch.nn.attention.varlen.varlen_attn`, grouped-query heads shared without copies). Other
devices have no such kernel (FlexAttention has no backward on the CPU in torch 2.13): there it is
sdpa over the row with the block-diagonal causal mask built from the same cuts, every score
computed, slower than the segments and never chosen, the reference the tests compare on CPU.

Which one the learner loads its models with (`implementation`): packed on CUDA, flash-attn's
`flash_attention_2` where flash-attn is installed (the same restarts read as variable-length
boundaries), else "strata_varlen" where this torch has its varlen kernel, else
"strata_segments"; on the CPU "strata_segments"; padded rows, the model's default.
"""

from __future__ import annotations

import importlib.util
import inspect
from itertools import pairwise

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

try:  # torch >= 2.9
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None
VARLEN_KEYWORDS = set(inspect.signature(varlen_attn).parameters) if varlen_attn else set()

NAME = "strata_segments"
VARLEN = "strata_varlen"
FLASH = "flash_attention_2"
HALF = (torch.float16, torch.bfloat16)  # the dtypes flash kernels take


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


def varlen_attention(
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
    """`segment_attention`'s values from one variable-length kernel over a packed row (query
    [1, H, N, D], key and value [1, H_kv, N, D]; returns [1, N, H, D]). What the flash kernel
    does not take goes to `segment_attention`: padded rows (more than one), attention dropout,
    float32 on CUDA."""
    if attention_mask is not None:
        raise ValueError(
            f"{VARLEN} builds no mask; it got one of shape {tuple(attention_mask.shape)}"
        )
    flash = query.is_cuda and varlen_attn is not None and query.dtype in HALF
    if query.shape[0] != 1 or (dropout and module.training) or (query.is_cuda and not flash):
        return segment_attention(
            module, query, key, value, None, dropout, scaling, position_ids, **kwargs
        )
    length = query.shape[2]
    bounds = segment_starts(position_ids, length)
    cut = torch.tensor(bounds, dtype=torch.int32, device=query.device)
    longest = max(b - a for a, b in pairwise(bounds))
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, heads, D]
    out = (_flash_varlen if flash else _masked_varlen)(q, k, v, cut, longest, scaling)
    return out[None], None


def _flash_varlen(q, k, v, cut, longest: int, scale: float | None) -> torch.Tensor:
    """torch's flash-attention varlen kernel, causal: [N, H, D]. Its keywords changed between
    torch releases (causality as `is_causal` or a window; grouped-query heads shared or not):
    asked of its signature."""
    options = {}
    if "window_size" in VARLEN_KEYWORDS:
        options["window_size"] = (-1, 0)
    else:
        options["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in VARLEN_KEYWORDS:
            options["enable_gqa"] = True
        else:  # a copy of each shared head
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    if "scale" in VARLEN_KEYWORDS:
        options["scale"] = scale
    elif scale is not None:  # the kernel's own scale is 1/sqrt(D)
        q = q * (scale * q.shape[-1] ** 0.5)
    parts = (x.contiguous() for x in (q, k, v))
    return varlen_attn(*parts, cut, cut, longest, longest, **options)


def _masked_varlen(q, k, v, cut, longest: int, scale: float | None) -> torch.Tensor:
    """sdpa over the whole row with its block-diagonal causal mask, built from the cuts: [N, H, D].
    Every score of the row is computed: the reference the varlen kernel is held to off CUDA."""
    length = q.shape[0]
    document = torch.bucketize(
        torch.arange(length, device=q.device), cut[1:].to(torch.int64), right=True
    )
    mask = (document[:, None] == document[None, :]).tril_()
    out = F.scaled_dot_product_attention(
        *(x.transpose(0, 1)[None] for x in (q, k, v)),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


AttentionInterface.register(VARLEN, varlen_attention)


def choose(packing: bool, cuda: bool, flash_attn: bool, torch_varlen: bool) -> str | None:
    """The attention implementation for these facts about the machine (see the module doc)."""
    if not packing:
        return None
    if cuda and flash_attn:
        return FLASH
    if cuda and torch_varlen:
        return VARLEN
    return NAME


def implementation(packing: bool) -> str | None:
    """The attention implementation the learner loads its models with, on this machine: packed
    rows attend inside each trajectory; None (the model's default) for padded rows."""
    cuda = torch.cuda.is_available()
    flash_attn = cuda and importlib.util.find_spec("flash_attn") is not None
    return choose(packing, cuda, flash_attn, varlen_attn is not None)
