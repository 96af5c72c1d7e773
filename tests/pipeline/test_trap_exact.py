"""The trap's exact expected update against sampling, and Theorem 3 on it."""

import numpy as np
import pytest
import torch

from learner.estimators import estimate
from pipeline.experiments.trap_exact import compositions, expected_update


def sampled(chain, hop, p_guess, size, groups, alpha, seed=0):
    """The same expectations by sampling `groups` groups, trajectory by trajectory."""
    rng = np.random.default_rng(seed)
    n = size * groups
    is_chain = rng.random(n) < chain
    a1, a2 = rng.random(n) < hop, rng.random(n) < hop  # True: the right choice
    reward = np.where(is_chain, a1 & a2, rng.random(n) < p_guess).astype(np.float64)
    ids = torch.from_numpy(np.repeat(np.arange(groups), size))
    adv = estimate(
        "stratified",
        torch.from_numpy(reward),
        ids,
        torch.from_numpy(is_chain.astype(np.int64)),
        alpha=alpha,
        eps=1e-6,
    ).advantages.numpy()
    stratum = adv * (is_chain - chain)
    hop_term = adv * is_chain * (a1 - hop)
    return (stratum.mean(), stratum.std() / np.sqrt(n)), (
        hop_term.mean(),
        hop_term.std() / np.sqrt(n),
    )


def test_compositions_count_and_sum():
    assert len(list(compositions(8))) == 165
    assert all(sum(c) == 8 for c in compositions(8))


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_the_exact_update_is_what_sampling_averages_to(alpha):
    exact = expected_update(0.4, 0.35, 0.3, 4, alpha=alpha, eps=1e-6)
    (s, s_se), (h, h_se) = sampled(0.4, 0.35, 0.3, 4, 60_000, alpha)
    assert abs(exact.stratum - s) < 4 * s_se + 1e-12
    assert abs(exact.hop - h) < 4 * h_se + 1e-12


def test_theorem3_sans_alone_has_no_between_strata_component():
    for chain, hop in ((0.5, 1 / 3), (0.2, 0.7), (0.9, 0.1)):
        assert expected_update(chain, hop, 0.3, 8, alpha=1.0, eps=1e-6).stratum == pytest.approx(
            0.0, abs=1e-12
        )
        grpo = expected_update(chain, hop, 0.3, 8, alpha=0.0, eps=1e-6).stratum
        blend = expected_update(chain, hop, 0.3, 8, alpha=0.6, eps=1e-6).stratum
        assert blend == pytest.approx(0.4 * grpo, rel=1e-9)  # SAN adds nothing between strata
