"""Token-level policy loss with PPO clipping, dual clip and importance correction, and KL penalties.

Shapes are `[B, T]` (B sequences, T token positions). `loss_mask` is 1 where the policy generated
the token and 0 for tool observations and padding: only generated tokens carry loss.

Off-policy correction follows the decoupled objective of AReaL: the PPO ratio is taken against a
*proximal* policy (log-probs recomputed by the learner before the update) when one is given, and the
gap between proximal and *behaviour* policy (the actor that sampled the token, possibly several
versions old) is corrected with the weight w = exp(proximal - behaviour) of each token by the
chosen correction (learner/corrections.py: tis, mask, icepop, seq_mask).

Without a proximal policy the ratio is against the behaviour policy. `ratio_level="sequence"` is
GSPO: one ratio per sequence, exp of the length-normalised log-ratio over its kept tokens, clipped
like the token ratio; each token carries its sequence's loss, so `seq-mean-token-mean`
aggregation is GSPO's mean over sequences.
"""

from __future__ import annotations

from typing import Literal

import torch

from learner.corrections import NO_CORRECTION, Correction
from learner.surrogates import SURROGATES

Ratio = Literal["token", "sequence"]
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
    correction: Correction = NO_CORRECTION,
) -> torch.Tensor:
    """The tokens the loss is taken over: `loss_mask`, less those a dropping correction drops.
    The learner weights micro-batches by these counts, so it must decide exactly as
    `policy_loss` does: both call this."""
    if not correction.drops or proximal_logprobs is None:
        return loss_mask
    return correction.apply(proximal_logprobs - behavior_logprobs, loss_mask)[1]


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
    correction: Correction = NO_CORRECTION,
    ratio_level: Ratio = "token",
    agg: Aggregation = "token-mean",
    surrogate: str = "ppo_clip",
    surrogate_params: dict | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate loss (to minimise) and its diagnostics.

    Per token (`surrogate` ppo_clip): `max(-A*r, -A*clip(r, 1-clip_low, 1+clip_high))`, capped at
    `-A*dual_clip` when A < 0; cispo, clip_cov and kl_cov with `surrogate_params` (their
    sections' fields; no dual clip: pass None): learner/surrogates.py;
    with `r = exp(logprobs - base)` and base = proximal if given, else behaviour log-probs.
    `correction` weighs or drops tokens by their weight exp(proximal - behaviour) (e.g. tis
    multiplies by min(w, cap), mask drops tokens with w > cap). Weights carry no gradient.
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
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"unknown ratio level {ratio_level!r}: use token or sequence")
    if correction.active and proximal_logprobs is None:
        raise ValueError(f"importance correction {correction.name!r} needs proximal_logprobs")
    if surrogate not in SURROGATES:
        raise ValueError(f"unknown surrogate {surrogate!r}: use {', '.join(SURROGATES)}")
    if surrogate != "ppo_clip" and ratio_level == "sequence":
        raise ValueError(f"surrogate {surrogate} weighs or chooses tokens: use ratio token with it")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")

    mask = loss_mask.to(logprobs.dtype)
    advantages = advantages.to(logprobs.dtype).detach()
    base = (proximal_logprobs if proximal_logprobs is not None else behavior_logprobs).detach()
    kept = kept_by_importance(mask, behavior_logprobs, proximal_logprobs, correction)
    if ratio_level == "sequence":  # GSPO: exp of the mean log-ratio over the sequence's kept tokens
        log_s = ((logprobs - base) * kept).sum(-1) / kept.sum(-1).clamp(min=1)
        log_ratio = log_s.unsqueeze(-1).expand_as(logprobs)
    else:
        log_ratio = logprobs - base
    ratio = torch.exp(log_ratio)

    chosen = SURROGATES[surrogate].fn(
        ratio,
        log_ratio,
        advantages,
        logprobs,
        kept,
        clip_low,
        clip_high,
        dual_clip,
        **(surrogate_params or {}),
    )
    loss = chosen.loss

    weight = torch.ones_like(mask)
    dropped = torch.zeros_like(mask)
    truncated = torch.zeros_like(mask)  # tokens whose weight was cut (tis: above its cap)
    if correction.active:
        log_w = (proximal_logprobs - behavior_logprobs).detach()
        weight = torch.exp(log_w)
        if correction.drops:
            dropped, mask = mask - kept, kept
        else:
            multiplier = correction.apply(log_w, mask)[0]
            loss = loss * multiplier
            truncated = (multiplier < weight).to(mask.dtype)

    total = aggregate(loss, mask, agg)
    tokens = loss_mask.to(logprobs.dtype)
    with torch.no_grad():
        gap = (logprobs - behavior_logprobs).detach()  # the learner's log-prob minus the actor's
        has_tokens = tokens.sum(-1) > 0
        emptied = has_tokens & (mask.sum(-1) == 0)  # every token of the sequence dropped
        metrics = {
            "logprob_gap_mean": _masked_mean(gap, tokens),
            "logprob_gap_abs_mean": _masked_mean(gap.abs(), tokens),
            "logprob_gap_tail_fraction": _masked_mean((gap.abs() > 1.0).to(mask.dtype), tokens),
            "truncated_fraction": _masked_mean(truncated, tokens),
            "sequence_drop_fraction": float(emptied.sum() / has_tokens.sum().clamp(min=1)),
            "clip_fraction": _masked_mean(chosen.clipped.to(mask.dtype), mask),
            "dual_clip_fraction": _masked_mean(chosen.dual_clipped.to(mask.dtype), mask),
            "cov_selected_fraction": (
                0.0
                if chosen.selected is None
                else _masked_mean(chosen.selected.to(mask.dtype), mask)
            ),
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
