"""The per-token surrogate of the policy loss (`learner.surrogate`), on the ratio r of the policy
to the proximal (or behaviour) policy, the advantage A and the token's log-prob:

    ppo_clip  max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), and for A < 0 at most
              -A dual_clip (PPO's clipped objective with dual clip)
    cispo     -sg(clip(r, 1 - clip_low, 1 + clip_high)) A log pi  (CISPO, MiniMax-M1,
              arXiv 2506.13585): the clipped ratio is a weight without gradient, so every
              token keeps its gradient; PPO's clip instead zeroes the gradient of a token whose
              ratio has left the range in the direction A pushes it

At r = 1 both give the gradient -A grad log pi. The paper clips only above (its lower bound is
not used); `learner.clip_low: 1.0` is that reading (a weight never below 0), the default 0.2
keeps a floor of 0.8. Dual clip has nothing to cap under CISPO (the weight is already at most
1 + clip_high), and CISPO weighs tokens, not GSPO's sequences: pipeline/config/schema.py refuses
both combinations.

Each registers itself with `@register_surrogate(name)`: a function
`(ratio, advantages, logprobs, clip_low, clip_high, dual_clip) -> Surrogate`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Surrogate:
    loss: torch.Tensor
    """[B, T] per-token loss to minimise (before masks, weights and aggregation)."""
    clipped: torch.Tensor
    """bool [B, T]: the tokens the clip changed (telemetry: clip_fraction)."""
    dual_clipped: torch.Tensor
    """bool [B, T]: the tokens the dual clip capped (telemetry)."""


SURROGATES: dict[str, Callable[..., Surrogate]] = {}
"""`learner.surrogate` -> its function; filled by `register_surrogate`."""


def register_surrogate(name: str) -> Callable[[Callable[..., Surrogate]], Callable[..., Surrogate]]:
    def register(fn: Callable[..., Surrogate]) -> Callable[..., Surrogate]:
        if name in SURROGATES:
            raise ValueError(f"surrogate {name!r} is registered twice")
        SURROGATES[name] = fn
        return fn

    return register


@register_surrogate("ppo_clip")
def ppo_clip(ratio, advantages, logprobs, clip_low, clip_high, dual_clip) -> Surrogate:
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (loss > cap)
        loss = torch.where(advantages < 0, torch.minimum(loss, cap), loss)
    return Surrogate(loss, clipped > unclipped, dual_clipped)


@register_surrogate("cispo")
def cispo(ratio, advantages, logprobs, clip_low, clip_high, dual_clip) -> Surrogate:
    if dual_clip is not None:
        raise ValueError("surrogate cispo has no dual clip: its weight is capped at 1 + clip_high")
    weight = torch.clamp(ratio.detach(), 1.0 - clip_low, 1.0 + clip_high)
    loss = -advantages * weight * logprobs
    clipped = weight != ratio.detach()
    return Surrogate(loss, clipped, torch.zeros_like(clipped))
