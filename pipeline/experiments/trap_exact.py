"""The trap bandit's expected update, computed exactly (no sampling), against its true policy
gradient.

A trajectory of the trap (pipeline/experiments/trap.py) ends in one of four outcomes: a guess
that paid or did not, a chain that paid (both hops right) or did not. A group of G trajectories
is a multinomial draw of those outcomes, so its every composition, its probability and its
advantages (by the registered estimator; all members with one outcome get the same one) can be
enumerated: C(G + 3, 3) compositions, 165 for G = 8. Averaging the REINFORCE update over them
gives the expected update per trajectory exactly, on

- the stratum logit, E[A (1[chain] - c)], against the true gradient dJ/dtheta_chain =
  c (1 - c) (q - p_guess), with c = P(chain) and q = P(both hops right);
- a hop logit, E[A 1[chain] (1[a1 = 0] - p1)], against dJ/dh1_0 = c p2 p1 (1 - p1).

Theorem 3 of the paper says pure SAN (alpha = 1) moves no probability between strata: its
stratum component is exactly 0, whatever the policy.

`expected_path` follows the expected update from the trap's start, step by step (a run without
sampling noise: the mean-field path), and reports along it the policy, the stratum update over
the true gradient's and the cosine between the whole expected update and the true gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product

import torch

from learner.estimators import estimate

OUTCOMES = (("guess", 0.0), ("guess", 1.0), ("chain", 0.0), ("chain", 1.0))


@dataclass(frozen=True)
class Expected:
    stratum: float
    """E[A (1[chain] - c)] per trajectory: the update of the chain logit (the guess logit gets
    minus it)."""
    hop: float
    """E[A 1[chain] (1[a1 = 0] - p1)] per trajectory: the update of the right first hop's logit."""
    true_stratum: float
    """dJ/dtheta_chain."""
    true_hop: float
    """dJ/dh1_0."""


def compositions(size: int, parts: int = 4):
    """Every way to split `size` trajectories among `parts` outcomes."""
    for cut in product(range(size + 1), repeat=parts - 1):
        if sum(cut) <= size:
            yield (*cut, size - sum(cut))


def expected_update(
    chain: float,
    hop: float,
    p_guess: float,
    group_size: int,
    estimator: str = "stratified",
    **params: float,
) -> Expected:
    """The expected REINFORCE update per trajectory of a policy with P(chain) = `chain` and
    P(right hop) = `hop` for both hops, groups of `group_size`, advantages by `estimator`."""
    q = hop * hop
    probs = ((1 - chain) * (1 - p_guess), (1 - chain) * p_guess, chain * (1 - q), chain * q)
    # E[1[a1 = 0] - p1 | outcome]: a paid chain had a1 = 0; a chain that did not pay had
    # a1 = 0 with probability p1 (1 - p2) / (1 - q)
    hop_score = (0.0, 0.0, (hop * (1 - hop) / (1 - q) if q < 1 else 0.0) - hop, 1 - hop)
    is_chain = (0.0, 0.0, 1.0, 1.0)
    stratum = hop_total = 0.0
    for counts in compositions(group_size):
        weight = math.factorial(group_size)
        for n, p in zip(counts, probs, strict=True):
            weight *= p**n / math.factorial(n)
        if weight == 0.0:
            continue
        rewards = torch.tensor(
            [OUTCOMES[t][1] for t, n in enumerate(counts) for _ in range(n)], dtype=torch.float64
        )
        strata = torch.tensor(
            [int(OUTCOMES[t][0] == "chain") for t, n in enumerate(counts) for _ in range(n)]
        )
        advantages = estimate(
            estimator, rewards, torch.zeros(group_size, dtype=torch.int64), strata, **params
        ).advantages
        first, total_s, total_h = 0, 0.0, 0.0
        for t, n in enumerate(counts):
            if n:
                a = float(advantages[first])
                total_s += n * a * (is_chain[t] - chain)
                total_h += n * a * is_chain[t] * hop_score[t]
                first += n
        stratum += weight * total_s / group_size
        hop_total += weight * total_h / group_size
    return Expected(
        stratum,
        hop_total,
        chain * (1 - chain) * (q - p_guess),
        chain * hop * hop * (1 - hop),
    )


def _cosine(found: Expected, choices: int) -> float:
    """Cosine between the whole expected update and the true gradient, over every logit: the
    stratum pair (+s, -s) and two hop vectors, each (u, -u / (M - 1) on the M - 1 wrong
    choices): the hops are symmetric, so both vectors move alike."""
    hop_weight = 2 * (1 + 1 / (choices - 1))  # two hops, the right entry and the spread rest
    dot = 2 * found.stratum * found.true_stratum + hop_weight * found.hop * found.true_hop
    mine = 2 * found.stratum**2 + hop_weight * found.hop**2
    true = 2 * found.true_stratum**2 + hop_weight * found.true_hop**2
    return dot / math.sqrt(mine * true) if mine > 0 and true > 0 else float("nan")


def expected_path(
    alpha: float,
    choices: int,
    p_guess: float,
    group_size: int,
    steps: int,
    lr: float = 1.0,
    start_chain: float = 0.5,
    hop_speed: float = 1.0,
) -> list[dict]:
    """The trap's mean-field run under the blend with `alpha`: from hop logits 0 and P(chain)
    `start_chain`, each step adds lr times the expected update (the chain logit +s, the guess
    logit -s; a hop's right entry +u times `hop_speed`, each other entry -u / (M - 1) times it).
    One row per step, before its update."""
    # chain minus guess logit; right minus any wrong hop logit
    stratum_gap, hop_gap = math.log(start_chain / (1 - start_chain)), 0.0
    rows = []
    for step in range(steps):
        chain = 1 / (1 + math.exp(-stratum_gap))
        hop = 1 / (1 + (choices - 1) * math.exp(-hop_gap))
        found = expected_update(
            chain, hop, p_guess, group_size, "stratified", alpha=alpha, eps=1e-6
        )
        rows.append(
            {
                "step": step,
                "alpha": alpha,
                "chain": chain,
                "hop": hop,
                "expected_reward": (1 - chain) * p_guess + chain * hop * hop,
                "stratum_ratio": found.stratum / found.true_stratum
                if found.true_stratum
                else float("nan"),
                "cosine": _cosine(found, choices),
            }
        )
        stratum_gap += 2 * lr * found.stratum
        hop_gap += lr * hop_speed * found.hop * (1 + 1 / (choices - 1))
    return rows


# make mutation leaves the drawing out: no test reads a figure's pixels, and what it draws is
# computed and tested before it (expected_path).
# pragma: no mutate start
def plot_path(paths: list[list[dict]], path: str) -> None:
    """P(chain), expected reward and the cosine to the true gradient along each mean-field path
    (lists of `expected_path` rows, one per alpha)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for rows in paths:
        steps = [r["step"] for r in rows]
        label = f"α {rows[0]['alpha']:g}"
        for ax, key in zip(axes, ("chain", "expected_reward", "cosine"), strict=True):
            ax.plot(steps, [r[key] for r in rows], label=label)
    titles = ("P(chain)", "expected reward", "cosine(E[update], true gradient)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)


# pragma: no mutate end
def bias_table(
    alphas: list[float], depths: list[int], p_guess: float, group_size: int, chain: float = 0.5
) -> list[dict]:
    """At the trap's start (hop = 1 / M), each alpha's expected stratum and hop updates next to
    the true gradient's."""
    rows = []
    for m in depths:
        for alpha in alphas:
            found = expected_update(
                chain, 1 / m, p_guess, group_size, "stratified", alpha=alpha, eps=1e-6
            )
            rows.append({"chain_choices": m, "alpha": alpha, **found.__dict__})
    return rows


def silent_shares(chain: float, hop: float, group_size: int) -> dict[str, float]:
    """How often SAN gives a chain trajectory exactly 0 (its (group, stratum) cell has one
    reward only), at P(chain) `chain`, P(right hop) `hop` for both hops, groups of `group_size`:

    - `alone`: no other chain in its group, (1 - c)^(G - 1);
    - `paid_silent`: a chain that paid has no failed chain beside it, (1 - c (1 - q))^(G - 1);
    - `failed_silent`: a chain that failed has no paid chain beside it, (1 - c q)^(G - 1).

    Such a chain gets only the (1 - alpha) A_GN part of the blend."""
    q, others = hop * hop, group_size - 1
    return {
        "alone": (1 - chain) ** others,
        "paid_silent": (1 - chain * (1 - q)) ** others,
        "failed_silent": (1 - chain * q) ** others,
    }


def start_table(
    alphas: list[float],
    depths: list[int],
    starts: list[float],
    p_guess: float,
    group_size: int,
) -> list[dict]:
    """At the trap's start with P(chain) each of `starts` (hop = 1 / M): each alpha's expected
    stratum and hop updates, the same over GRPO's (alpha 0) and over the true gradient's, and
    how often SAN is silent on a chain (`silent_shares`)."""
    rows = []
    for start, m in product(starts, depths):
        grpo = expected_update(start, 1 / m, p_guess, group_size, "grpo", eps=1e-6)
        for alpha in alphas:
            found = expected_update(
                start, 1 / m, p_guess, group_size, "stratified", alpha=alpha, eps=1e-6
            )
            rows.append(
                {
                    "start_chain": start,
                    "chain_choices": m,
                    "group_size": group_size,
                    "alpha": alpha,
                    **found.__dict__,
                    "stratum_over_grpo": found.stratum / grpo.stratum,
                    "hop_over_grpo": found.hop / grpo.hop,
                    **silent_shares(start, 1 / m, group_size),
                }
            )
    return rows


# make mutation leaves the drawing out: no test reads a figure's pixels, and what it draws is
# computed and tested before it (bias_table).
# pragma: no mutate start
def plot_bias(rows: list[dict], path: str) -> None:
    """The expected stratum and hop updates over the true gradient's, against alpha, one line
    per trap depth M (rows of `bias_table`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(8.5, 3.2))
    for m in sorted({r["chain_choices"] for r in rows}):
        mine = [r for r in rows if r["chain_choices"] == m]
        alphas = [r["alpha"] for r in mine]
        left.plot(
            alphas, [r["stratum"] / r["true_stratum"] for r in mine], marker="o", label=f"M {m}"
        )
        right.plot(alphas, [r["hop"] / r["true_hop"] for r in mine], marker="o", label=f"M {m}")
    left.set_title("chain logit: E[update] / true gradient", fontsize=9)
    right.set_title("first hop's logit: E[update] / true gradient", fontsize=9)
    for ax in (left, right):
        ax.set_xlabel("alpha")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)


# pragma: no mutate end
