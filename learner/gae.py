"""Generalised advantage estimation (GAE, arXiv 1506.02438) over a multi-turn response: PPO's
advantage with a learned critic (learner/critic.py), the estimator of Search-R1's PPO baseline.

A trajectory's time steps are its generated tokens, in order; observation tokens are not steps
(the policy did not choose them): the recursion skips them, so the token before an observation
bootstraps from the value of the first generated token after it. With the outcome reward R on the
last generated token and r_t the per-token rewards before it (0, or minus kl_coef times the KL
when `learner.kl_in_reward` is on),

    delta_t = r_t + gamma * V(t+1) - V(t)          V past the last generated token: 0
    A_t     = delta_t + gamma * lam * A(t+1)
    G_t     = A_t + V(t)                            the critic's regression target

where t+1 is the next generated token of the same trajectory. With gamma = lam = 1 (the default,
as in verl's and Search-R1's PPO) A_t = R - V(t) + the sum of the later r's: the Monte Carlo return
with the critic as baseline. The advantages are then whitened over the step's trained tokens
(all ranks together), as verl and OpenRLHF do; the returns are not.
"""

from __future__ import annotations

import torch


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, T] float32 and 0 where `mask` is 0, from per-token
    `rewards` and `values` [B, T] (read where `mask`, the generated tokens, is 1). Each row's
    generated tokens are first gathered to its front, in order (a stable sort of the mask), so
    every delta is one vectorised expression; only A's recursion runs step by step, one fused
    multiply-add over all rows each; a scatter puts the results back in the tokens' places."""
    on = mask.cpu() > 0
    width = on.shape[1]
    order = torch.argsort((~on).to(torch.int8), dim=-1, stable=True)  # generated first, in order
    live = (torch.arange(width) < on.sum(-1, keepdim=True)).float()
    v = torch.zeros(width + 1, on.shape[0])  # [step, row]: each step's rows contiguous
    v[:width] = (torch.gather(values.float().cpu(), 1, order) * live).T
    r = (torch.gather(rewards.float().cpu(), 1, order) * live).T
    delta = r + gamma * v[1:] - v[:-1]  # past a row's last step all three are 0
    a = torch.zeros_like(v)
    decay = gamma * lam
    steps = int(live.sum(-1).max()) if live.numel() else 0  # the longest row's
    for t in range(steps - 1, -1, -1):
        torch.add(delta[t], a[t + 1], alpha=decay, out=a[t])
    # back to the tokens' own places; the slots past a row's steps hold 0 for its observations
    advantages = torch.zeros(on.shape).scatter_(1, order, a[:width].T.contiguous())
    returns = torch.zeros(on.shape).scatter_(1, order, (a[:width] + v[:width]).T.contiguous())
    return advantages, returns


def outcome_rewards(
    generated: torch.Tensor, rewards: torch.Tensor, per_token: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, T] per-token rewards: each row's outcome reward (`rewards` [B]) on its last generated
    token (`generated` [B, T], 1 where the policy generated the token), plus `per_token` [B, T]
    when given (a KL penalty). A row with no generated token gets no outcome reward."""
    out = torch.zeros(generated.shape, dtype=torch.float32)
    if per_token is not None:
        out += per_token.float().cpu()
    on = generated.cpu() > 0
    rows = on.any(-1).nonzero().flatten()
    last = on.shape[1] - 1 - on.flip(-1).int().argmax(-1)
    out[rows, last[rows]] += rewards.float().cpu()[rows]
    return out


def whiten(
    advantages: torch.Tensor, mask: torch.Tensor, sums: tuple[float, float, float]
) -> torch.Tensor:
    """(A - mean) / sqrt(var + 1e-8) where `mask` is 1, from the step's (count, sum, sum of
    squares) of A over its trained tokens (over all ranks: the caller reduces them); 0 elsewhere.
    Population variance; no tokens: 0 everywhere."""
    count, total, squares = sums
    if count <= 0:
        return torch.zeros_like(advantages)
    mean = total / count
    var = max(squares / count - mean * mean, 0.0)
    return torch.where(mask > 0, (advantages - mean) / (var + 1e-8) ** 0.5, 0.0)


def explained_variance(
    returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> list[float]:
    """The sums `explained` reads, over the tokens where `mask` is 1: (count, sum G, sum G^2,
    sum (G - V), sum (G - V)^2); summed over the ranks before use."""
    on = mask > 0
    g, e = returns[on].double(), (returns - values)[on].double()
    return [
        float(on.sum()),
        float(g.sum()),
        float((g * g).sum()),
        float(e.sum()),
        float((e * e).sum()),
    ]


def explained(sums: list[float]) -> float:
    """1 - Var(G - V) / Var(G) from `explained_variance`'s sums: 1 is a perfect critic, 0 one no
    better than the returns' mean, below 0 worse; NaN when the returns do not vary."""
    n, g, g2, e, e2 = sums
    if n <= 0:
        return float("nan")
    var_g = g2 / n - (g / n) ** 2
    var_e = e2 / n - (e / n) ** 2
    return 1.0 - var_e / var_g if var_g > 1e-12 else float("nan")
