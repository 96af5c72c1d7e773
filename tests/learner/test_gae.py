"""GAE over multi-turn responses (learner/gae.py) against the paper's recursion written as a
plain loop over each trajectory's generated tokens, on random inputs and the edge cases."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.estimator_loops import loop_gae
from learner.gae import explained, explained_variance, gae, outcome_rewards, whiten

rows = st.lists(
    st.tuples(
        st.floats(-2, 2, width=32), st.floats(-2, 2, width=32), st.booleans()
    ),  # (reward, value, generated)
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(rows, min_size=1, max_size=5),
    st.floats(0, 1),
    st.floats(0, 1),
)
def test_gae_equals_the_recursion_over_generated_tokens(batch, gamma, lam):
    width = max(len(r) for r in batch)
    rewards = torch.zeros(len(batch), width)
    values = torch.zeros(len(batch), width)
    mask = torch.zeros(len(batch), width)
    for i, row in enumerate(batch):
        for t, (r, v, on) in enumerate(row):
            rewards[i, t], values[i, t], mask[i, t] = r, v, float(on)
    got_a, got_g = gae(rewards, values, mask, gamma, lam)
    for i in range(len(batch)):
        want_a, want_g = loop_gae(
            rewards[i].tolist(), values[i].tolist(), mask[i].tolist(), gamma, lam
        )
        assert got_a[i].tolist() == pytest.approx(want_a, abs=1e-4)
        assert got_g[i].tolist() == pytest.approx(want_g, abs=1e-4)


def test_with_gamma_and_lambda_one_the_advantage_is_the_return_minus_the_value():
    """Monte Carlo: A_t = R - V(t) on every generated token, observation tokens 0 and skipped."""
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 1, 0]])
    values = torch.tensor([[0.3, -0.2, 9.0, 9.0, 0.5, 0.1, 9.0]])
    rewards = outcome_rewards(mask, torch.tensor([1.0]))
    assert rewards.tolist() == [[0, 0, 0, 0, 0, 1.0, 0]]
    a, g = gae(rewards, values, mask, 1.0, 1.0)
    assert a[0].tolist() == pytest.approx([0.7, 1.2, 0, 0, 0.5, 0.9, 0])
    assert g[0].tolist() == pytest.approx([1.0, 1.0, 0, 0, 1.0, 1.0, 0])
    # lam 0: one-step TD, the token before the observation bootstraps from the one after it
    a, _ = gae(rewards, values, mask, 1.0, 0.0)
    assert a[0, 1] == pytest.approx(0.5 - (-0.2))


def test_edge_cases_rows_without_generated_tokens_and_single_tokens():
    mask = torch.tensor([[0.0, 0, 0], [0, 1, 0], [1, 1, 1]])
    rewards = outcome_rewards(mask, torch.tensor([5.0, 2.0, 0.0]))
    assert rewards[0].tolist() == [0, 0, 0]  # no generated token: no outcome reward
    assert rewards[1].tolist() == [0, 2.0, 0]
    values = torch.tensor([[1.0, 1, 1], [0.5, 0.5, 0.5], [0, 0, 0]])
    a, g = gae(rewards, values, mask, 0.9, 0.8)
    assert a[0].tolist() == [0, 0, 0] and g[0].tolist() == [0, 0, 0]
    assert a[1].tolist() == pytest.approx([0, 1.5, 0])
    assert a[2].tolist() == [0, 0, 0]  # reward 0, values 0: nothing to credit
    # a KL penalty per token adds to the rewards before the outcome
    penalty = torch.tensor([[0.0, 0, 0], [0, -0.1, 0], [-0.1, -0.1, -0.1]])
    with_kl = outcome_rewards(mask, torch.tensor([5.0, 2.0, 0.0]), penalty)
    assert with_kl[1].tolist() == pytest.approx([0, 1.9, 0])
    assert with_kl[2].tolist() == pytest.approx([-0.1, -0.1, -0.1])
    assert penalty[1].tolist() == pytest.approx([0, -0.1, 0])  # the caller's, left as it was


def test_whitening_and_explained_variance():
    a = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0]])
    on = a[mask > 0]
    w = whiten(a, mask, (3.0, float(on.sum()), float((on**2).sum())))
    assert w[mask > 0].mean() == pytest.approx(0.0, abs=1e-6)
    assert w[mask > 0].pow(2).mean() == pytest.approx(1.0, abs=1e-5)
    assert w[mask == 0].abs().sum() == 0
    assert whiten(a, mask, (0.0, 0.0, 0.0)).abs().sum() == 0
    returns = torch.tensor([[1.0, 0.0, 9.0], [2.0, 0.0, 0.0]])
    assert explained(explained_variance(returns, returns, mask)) == pytest.approx(1.0)
    mean = torch.full_like(returns, 1.0)
    assert explained(explained_variance(returns, mean, mask)) == pytest.approx(0.0, abs=1e-9)
    flat = torch.ones_like(returns)
    assert math.isnan(explained(explained_variance(flat, mean, mask)))
    assert math.isnan(explained([0.0] * 5))


def test_explained_variance_is_one_minus_the_variance_ratio_over_the_trained_tokens():
    """Against numpy's population variances over the masked tokens, with errors whose mean is not
    0 and untrained tokens whose values would change the answer."""
    draw = torch.Generator().manual_seed(4)
    returns = torch.randn(5, 7, generator=draw) * 2 + 1
    values = returns - 0.5 + torch.randn(5, 7, generator=draw)  # biased, noisy critic
    mask = (torch.rand(5, 7, generator=draw) > 0.3).float()
    values[mask == 0] = 50.0  # never read
    g = returns[mask > 0].double().numpy()
    e = (returns - values)[mask > 0].double().numpy()
    want = 1 - np.var(e) / np.var(g)
    assert explained(explained_variance(returns, values, mask)) == pytest.approx(want, rel=1e-9)
    one = torch.zeros(5, 7)
    one[2, 3] = 1.0  # a single trained token: no variance, no answer
    assert math.isnan(explained(explained_variance(returns, values, one)))


def test_whitening_a_flat_or_single_token_step_gives_zeros_not_nans():
    a = torch.tensor([[0.7, 0.7, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    flat = whiten(a, mask, (2.0, 1.4, 0.98))  # variance 0: only eps under the root
    assert flat.tolist() == [[0.0, 0.0, 0.0]]
    single = whiten(torch.tensor([[3.0, 0.0]]), torch.tensor([[1.0, 0.0]]), (1.0, 2.0, 4.0))
    assert single[0, 0].item() == pytest.approx((3.0 - 2.0) / 1e-4) and single[0, 1] == 0


def test_gae_of_an_empty_batch_is_empty():
    for shape in ((0, 4), (2, 0)):
        empty = torch.zeros(shape)
        advantages, returns = gae(empty, empty, empty, 1.0, 0.9)
        assert advantages.shape == returns.shape == shape
