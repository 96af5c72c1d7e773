"""Token-level policy loss with PPO clipping, dual clip and importance correction, and KL penalties.

Shapes are `[B, T]` (B sequences, T token positions). `loss_mask` is 1 where the policy generated
the token and 0 for tool observations and padding: only generated tokens carry loss.

Off-policy correction follows the decoupled objective of AReaL: the PPO ratio is taken against a
*proximal* policy (log-probs recomputed by the learner before the update) when one is given, and the
gap between proximal and *behaviour* policy (the actor that sampled the token, possibly several
versions old) is corrected with the weight w = exp(proximal - behaviour) of each token:

    tis       the loss times min(w, is_cap)                        (truncated importance sampling)
    mask      tokens with w > is_cap are dropped
    icepop    tokens with w outside [is_floor, is_cap] are dropped   (IcePop's two-sided mask)
    seq_mask  whole sequences whose geometric-mean weight exp(mean log w) leaves [is_floor, is_cap]
              are dropped                                          (sequence-level masked IS)

Without a proximal policy the ratio is against the behaviour policy. `ratio_level="sequence"` is
GSPO: one ratio per sequence, exp of the length-normalised log-ratio over its kept tokens, clipped
like the token ratio; each token carries its sequence's loss, so `seq-mean-token-mean`
aggregation is GSPO's mean over sequences.
"""

from __future__ import annotations

from typing import Literal

import torch

Importance = Literal["none", "tis", "mask", "icepop", "seq_mask"]
Ratio = Literal["token", "sequence"]
MASKS = ("mask", "icepop", "seq_mask")
"""The corrections that drop tokens (and so change what micro-batches weigh)."""
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLKind = Literal["k1", "k2", "k3"]


def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> float:
    picked = x[mask > 0]
    return picked.max().item() if picked.numel() else 0.0


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    n = mask.sum()
    return (_masked_sum(x, mask) / n).item() if n > 0 else 0.0


def aggregate(loss: torch.Tensor, mask: torch.Tensor, agg: Aggregation) -> torch.Tensor:
    """Reduce per-token losses to a scalar; zero (with a graph) when no token is masked in.

    `seq-mean-*` average over the sequences that have at least one masked-in token.
    """
    mask = mask.to(loss.dtype)
    zero = (loss * 0.0).sum()  # keeps the autograd graph connected for an empty batch
    if agg == "token-mean":
        n = mask.sum()
        return _masked_sum(loss, mask) / n if n > 0 else zero
    tokens = mask.sum(dim=-1)
    seq_sum = (loss * mask).sum(dim=-1)
    present = tokens > 0
    if not present.any():
        return zero
    if agg == "seq-mean-token-mean":
        per_seq = seq_sum[present] / tokens[present]
    elif agg == "seq-mean-token-sum":
        per_seq = seq_sum[present]
    else:
        raise ValueError(
            f"unknown agg {agg!r}: use token-mean, seq-mean-token-mean or seq-mean-token-sum"
        )
    return per_seq.mean()


def kept_by_importance(
    loss_mask: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor | None,
    importance: Importance,
    is_cap: float,
    is_floor: float = 0.0,
) -> torch.Tensor:
    """The tokens the loss is taken over: `loss_mask`, less those a masking correction drops (see
    the module doc). The learner weights micro-batches by these counts, so it must decide exactly
    as `policy_loss` does: both call this."""
    if importance not in MASKS or proximal_logprobs is None:
        return loss_mask
    log_w = (proximal_logprobs - behavior_logprobs).detach()
    if importance == "seq_mask":
        mask = loss_mask.to(log_w.dtype)
        mean_log_w = (log_w * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        geo = torch.exp(mean_log_w).unsqueeze(-1)
        return loss_mask * ((geo >= is_floor) & (geo <= is_cap)).to(loss_mask.dtype)
    weight = torch.exp(log_w)
    keep = weight <= is_cap if importance == "mask" else (weight >= is_floor) & (weight <= is_cap)
    return loss_mask * keep.to(loss_mask.dtype)


def policy_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    proximal_logprobs: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
    importance: Importance = "none",
    is_cap: float = 2.0,
    is_floor: float = 0.0,
    ratio_level: Ratio = "token",
    agg: Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate loss (to minimise) and its diagnostics.

    Per token: `max(-A*r, -A*clip(r, 1-clip_low, 1+clip_high))`, capped at `-A*dual_clip` when A < 0,
    with `r = exp(logprobs - base)` and base = proximal if given, else behaviour log-probs.
    `importance="tis"` multiplies by `min(exp(proximal - behaviour), is_cap)`; `"mask"` drops tokens
    whose `exp(proximal - behaviour)` exceeds `is_cap`. Importance weights carry no gradient.
    """
    if logprobs.shape != behavior_logprobs.shape or logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, behavior_logprobs "
            f"{tuple(behavior_logprobs.shape)} and loss_mask {tuple(loss_mask.shape)} must match"
        )
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    if proximal_logprobs is not None and proximal_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"proximal_logprobs {tuple(proximal_logprobs.shape)} must match "
            f"logprobs {tuple(logprobs.shape)}"
        )
    if advantages.dim() == 1:
        if advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(
                f"advantages [B] has B={advantages.shape[0]}, logprobs has B={logprobs.shape[0]}"
            )
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != logprobs.shape:
        raise ValueError(
            f"advantages must be [B] or [B, T], got {tuple(advantages.shape)} for logprobs "
            f"{tuple(logprobs.shape)}"
        )
    if importance not in ("none", "tis", *MASKS):
        raise ValueError(f"unknown importance {importance!r}: use none, tis, {', '.join(MASKS)}")
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"unknown ratio level {ratio_level!r}: use token or sequence")
    if importance != "none" and proximal_logprobs is None:
        raise ValueError(f"importance={importance!r} needs proximal_logprobs")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")

    mask = loss_mask.to(logprobs.dtype)
    advantages = advantages.to(logprobs.dtype).detach()
    base = (proximal_logprobs if proximal_logprobs is not None else behavior_logprobs).detach()
    kept = kept_by_importance(
        mask, behavior_logprobs, proximal_logprobs, importance, is_cap, is_floor
    )
    if ratio_level == "sequence":  # GSPO: exp of the mean log-ratio over the sequence's kept tokens
        log_s = ((logprobs - base) * kept).sum(-1) / kept.sum(-1).clamp(min=1)
        ratio = torch.exp(log_s).unsqueeze(-1).expand_as(logprobs)
    else:
        ratio = torch.exp(logprobs - base)

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (loss > cap)
        loss = torch.where(advantages < 0, torch.minimum(loss, cap), loss)

    weight = torch.ones_like(mask)
    dropped = torch.zeros_like(mask)
    if importance != "none":
        raw_weight = torch.exp(proximal_logprobs - behavior_logprobs).detach()
        weight = raw_weight
        if importance == "tis":
            loss = loss * torch.clamp(raw_weight, max=is_cap)
        elif importance in MASKS:
            dropped, mask = mask - kept, kept

    total = aggregate(loss, mask, agg)
    tokens = loss_mask.to(logprobs.dtype)
    with torch.no_grad():
        gap = (logprobs - behavior_logprobs).detach()  # the learner's log-prob minus the actor's
        truncated = (
            (weight > is_cap).to(mask.dtype) if importance == "tis" else torch.zeros_like(mask)
        )
        has_tokens = tokens.sum(-1) > 0
        emptied = has_tokens & (mask.sum(-1) == 0)  # every token of the sequence dropped
        metrics = {
            "logprob_gap_mean": _masked_mean(gap, tokens),
            "logprob_gap_abs_mean": _masked_mean(gap.abs(), tokens),
            "logprob_gap_tail_fraction": _masked_mean((gap.abs() > 1.0).to(mask.dtype), tokens),
            "truncated_fraction": _masked_mean(truncated, tokens),
            "sequence_drop_fraction": float(emptied.sum() / has_tokens.sum().clamp(min=1)),
            "clip_fraction": _masked_mean((clipped > unclipped).to(mask.dtype), mask),
            "dual_clip_fraction": _masked_mean(dual_clipped.to(mask.dtype), mask),
            "ratio_mean": _masked_mean(ratio.detach(), mask),
            "ratio_max": _masked_max(ratio.detach(), mask),
            "importance_weight_mean": _masked_mean(weight, tokens),
            "importance_weight_max": _masked_max(weight, tokens),
            "mask_drop_fraction": _masked_mean(dropped, tokens),
            "tokens": float(mask.sum().item()),
        }
    return total, metrics


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "k3"
) -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference, from sampled-token log-probs.

    k1: log p - log q; k2: (log p - log q)^2 / 2; k3 ("low_var_kl"): exp(log q - log p) - (log q -
    log p) - 1, with the log-ratio clamped to [-20, 20] and the result to [0, 10] (verl clamps to
    [-10, 10]; k3 is never negative, but exp(x) - x - 1 rounds to -1e-16 for |x| ~ 1e-11).
    Mask the result yourself: tool-observation tokens carry no KL.
    """
    diff = logprobs - ref_logprobs
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        log_ratio = torch.clamp(-diff, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, min=0.0, max=10.0)
    raise ValueError(f"unknown KL kind {kind!r}: use k1, k2 or k3")
