"""The per-token surrogate of the policy loss (`learner.surrogate.type`), on the ratio r of the
policy to the proximal (or behaviour) policy, the advantage A and the token's log-prob:

    ppo_clip  max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), and for A < 0 at most
              -A dual_clip (PPO's clipped objective with dual clip)
    cispo     -sg(clip(r, 1 - clip_low, 1 + clip_high)) A log pi  (CISPO, MiniMax-M1,
              arXiv 2506.13585): the clipped ratio is a weight without gradient, so every
              token keeps its gradient; PPO's clip instead zeroes the gradient of a token whose
              ratio has left the range in the direction A pushes it
    clip_cov  ppo_clip without dual clip, and a random `share` of the trained tokens whose
              covariance (A - mean A)(log pi - mean log pi) lies in (low_cov, high_cov), PPO's
              clip aside, carry no loss (Clip-Cov, arXiv 2505.22617, eq. 10)
    kl_cov    -A r, plus coef |log r| on the top `share` of the trained tokens by that
              covariance (KL-Cov, the same paper, eq. 11; no clip, as the paper has none)

At r = 1 cispo gives ppo_clip's gradient -A grad log pi. CISPO's paper clips only above (its lower
bound is not used); `learner.clip_low: 1.0` is that reading, the default 0.2 keeps a floor of 0.8.
The covariance is taken over the tokens of the micro-batch the loss sees (as the paper's
implementation in verl does over its micro-batch), so the tokens chosen, and the step's gradient,
depend on how the step is cut into micro-batches (learner.micro_batch_size,
max_tokens_per_micro_batch), unlike every other surrogate here; at least one token is chosen, and
the random choice draws from a generator seeded by the candidates' positions (the same step chosen
alike on a rerun, other steps differently). Only ppo_clip has a dual clip: Clip-Cov's paper and
its implementation in verl clip as PPO without one (with one, a token of A < 0 and r > dual_clip
would lose less than theirs), and only ppo_clip takes GSPO's sequence ratio (the others weigh or
choose tokens): pipeline/config/schema.py refuses the other combinations in one line.

Each registers itself with `register_surrogate(name, fn, *params)` right after its def (a
call, not a decorator: mutmut 3 does not mutate decorated functions): a function
`(ratio, log_ratio, advantages, logprobs, mask, clip_low, clip_high, dual_clip, **params)
-> Surrogate` whose keyword parameters are the fields of its config section
(`learner.surrogate: {type: NAME, ...}`, pipeline/config/algorithm.py).
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
    selected: torch.Tensor | None = None
    """bool [B, T]: the tokens Clip-Cov or KL-Cov chose (telemetry: cov_selected_fraction)."""


@dataclass(frozen=True)
class Registered:
    fn: Callable[..., Surrogate]
    params: tuple[str, ...]


SURROGATES: dict[str, Registered] = {}
"""`learner.surrogate.type` -> its function; filled by `register_surrogate`."""


def register_surrogate(name: str, fn: Callable[..., Surrogate], *params: str) -> None:
    """Register `fn` as surrogate `name`, taking keyword `params`: called right after its def
    (not a decorator, which mutmut would not mutate behind)."""
    if name in SURROGATES:
        raise ValueError(f"surrogate {name!r} is registered twice")
    SURROGATES[name] = Registered(fn, params)


def ppo_clip(ratio, log_ratio, advantages, logprobs, mask, clip_low, clip_high, dual_clip):
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (loss > cap)
        loss = torch.where(advantages < 0, torch.minimum(loss, cap), loss)
    return Surrogate(loss, clipped > unclipped, dual_clipped)


register_surrogate("ppo_clip", ppo_clip)


def cispo(ratio, log_ratio, advantages, logprobs, mask, clip_low, clip_high, dual_clip):
    _no_dual_clip("cispo", dual_clip, "its weight is capped at 1 + clip_high")
    weight = torch.clamp(ratio.detach(), 1.0 - clip_low, 1.0 + clip_high)
    loss = -advantages * weight * logprobs
    clipped = weight != ratio.detach()
    return Surrogate(loss, clipped, torch.zeros_like(clipped))


register_surrogate("cispo", cispo)


def covariance(advantages, logprobs, mask) -> torch.Tensor:
    """(A - mean A)(log pi - mean log pi) per token, the means over the trained tokens (`mask`)."""
    weight = mask.to(logprobs.dtype)
    count = weight.sum().clamp(min=1)
    advantages = advantages.expand_as(logprobs).detach()
    logprobs = logprobs.detach()
    mean_a = (advantages * weight).sum() / count
    mean_l = (logprobs * weight).sum() / count
    return (advantages - mean_a) * (logprobs - mean_l)


def _share(mask, share: float) -> int:
    return max(int(share * float(mask.sum())), 1)


def clip_cov(
    ratio, log_ratio, advantages, logprobs, mask, clip_low, clip_high, dual_clip, **params
):
    _no_dual_clip("clip_cov", dual_clip, "Clip-Cov's paper and verl clip as PPO without one")
    ppo = ppo_clip(ratio, log_ratio, advantages, logprobs, mask, clip_low, clip_high, None)
    cov = covariance(advantages, logprobs, mask)
    eligible = (mask > 0) & ~ppo.clipped & (cov > params["low_cov"]) & (cov < params["high_cov"])
    candidates = eligible.flatten().nonzero().squeeze(-1)
    draw = torch.Generator().manual_seed(int(candidates.sum()) * 7919 + len(candidates))
    order = torch.randperm(len(candidates), generator=draw).to(candidates.device)
    chosen = candidates[order[: _share(mask, params["share"])]]
    selected = torch.zeros_like(eligible).flatten()
    selected[chosen] = True
    selected = selected.view_as(eligible)
    loss = torch.where(selected, ppo.loss.detach() * 0, ppo.loss)
    return Surrogate(loss, ppo.clipped, ppo.dual_clipped, selected)


register_surrogate("clip_cov", clip_cov, "share", "low_cov", "high_cov")


def kl_cov(ratio, log_ratio, advantages, logprobs, mask, clip_low, clip_high, dual_clip, **params):
    _no_dual_clip("kl_cov", dual_clip, "it does not clip")
    cov = covariance(advantages, logprobs, mask).masked_fill(mask <= 0, -torch.inf)
    count = min(_share(mask, params["share"]), int((mask > 0).sum()))
    top = cov.flatten().topk(count).indices if count else cov.new_zeros(0, dtype=torch.long)
    selected = torch.zeros_like(cov, dtype=torch.bool).flatten()
    selected[top] = True
    selected = selected.view_as(cov)
    loss = -advantages * ratio + params["coef"] * log_ratio.abs() * selected
    nothing = torch.zeros_like(selected)
    return Surrogate(loss, nothing, nothing, selected)


register_surrogate("kl_cov", kl_cov, "share", "coef")


def _no_dual_clip(name: str, dual_clip, why: str) -> None:
    if dual_clip is not None:
        raise ValueError(f"surrogate {name} has no dual clip: {why}")


def surrogate_params(section) -> dict:
    """The keyword parameters of the section's surrogate, read by attribute (the learner never
    imports the pipeline's config classes)."""
    return {p: getattr(section, p) for p in SURROGATES[section.type].params}
