import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner import native
from learner.advantages import (
    _dense_ids,
    _sqrt_,
    segment_stats,
    stratified_advantages,
    stratified_advantages_with_stats,
)


def reference(rewards, group_ids, strata, alpha, eps):
    """Algorithm 1 written as the paper writes it: loops over prompts and strata (float64)."""
    out = [0.0] * len(rewards)
    for g in set(group_ids):
        members = [i for i, gid in enumerate(group_ids) if gid == g]
        mean = sum(rewards[i] for i in members) / len(members)
        std = math.sqrt(sum((rewards[i] - mean) ** 2 for i in members) / len(members))
        for k in {strata[i] for i in members}:
            cell = [i for i in members if strata[i] == k]
            c_mean = sum(rewards[i] for i in cell) / len(cell)
            c_std = math.sqrt(sum((rewards[i] - c_mean) ** 2 for i in cell) / len(cell))
            for i in cell:
                gn = (
                    (rewards[i] - mean) / (std + eps) if len(members) > 1 and std + eps > 0 else 0.0
                )
                san = (
                    (rewards[i] - c_mean) / (c_std + eps)
                    if len(cell) > 1 and c_std + eps > 0
                    else 0.0
                )
                out[i] = alpha * san + (1 - alpha) * gn
    return out


def t(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


def ids(values):
    return torch.tensor(values, dtype=torch.int64)


def test_hand_computed_group():
    # Group 7: rewards 1,0 | 1 | 1 in strata 0,0 | 1 | 2. Group mean 0.75, population std sqrt(3)/4.
    # SAN: stratum 0 -> (+1, -1); singleton strata -> 0. GN: (0.25, -0.75, 0.25, 0.25) / (sqrt(3)/4).
    # Group -3: equal rewards -> all advantages 0.
    rewards = t([1.0, 0.0, 1.0, 1.0, 2.0, 2.0])
    groups = ids([7, 7, 7, 7, -3, -3])
    strata = ids([0, 0, 1, 2, 5, 5])
    gn = [1 / math.sqrt(3), -3 / math.sqrt(3), 1 / math.sqrt(3), 1 / math.sqrt(3)]
    san = [1.0, -1.0, 0.0, 0.0]
    expected = [0.6 * s + 0.4 * g for s, g in zip(san, gn, strict=True)] + [0.0, 0.0]
    got = stratified_advantages(rewards, groups, strata, alpha=0.6, eps=0.0)
    torch.testing.assert_close(got, t(expected))
    # 0.6 * 1 + 0.4 / sqrt(3) = 0.830940..., written out once to catch a formula slip.
    assert got[0].item() == pytest.approx(0.8309401076758503)
    with_eps = stratified_advantages(rewards, groups, strata, alpha=0.6, eps=1e-6)
    torch.testing.assert_close(with_eps, t(expected), atol=1e-5, rtol=0)


def test_alpha_endpoints_are_grpo_and_san():
    rewards = t([1.0, 0.0, 0.0, 1.0, 0.5, 0.0])
    groups = ids([1, 1, 1, 1, 1, 1])
    strata = ids([0, 0, 1, 1, 1, 2])
    stats = stratified_advantages_with_stats(rewards, groups, strata, alpha=0.3)
    torch.testing.assert_close(stratified_advantages(rewards, groups, strata, alpha=0.0), stats.gn)
    torch.testing.assert_close(stratified_advantages(rewards, groups, strata, alpha=1.0), stats.san)
    # GRPO ignores strata entirely.
    torch.testing.assert_close(
        stratified_advantages(rewards, groups, torch.zeros(6, dtype=torch.int64), alpha=0.0),
        stats.gn,
    )


def test_singleton_stratum_is_zero_not_nan_even_without_eps():
    got = stratified_advantages(t([3.0]), ids([0]), ids([0]), alpha=1.0, eps=0.0)
    assert got.tolist() == [0.0]
    got = stratified_advantages(t([1.0, 0.0]), ids([0, 0]), ids([0, 1]), alpha=0.5, eps=0.0)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, t([0.5, -0.5]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_dtype_is_preserved(dtype):
    # 16-bit rewards: a zero-spread cell (stratum 1) gave NaN in float16 (1 / eps overflowed)
    got = stratified_advantages(t([1.0, 0.0, 1.0, 1.0], dtype), ids([0] * 4), ids([0, 0, 1, 1]))
    assert got.dtype == dtype
    want = stratified_advantages(t([1.0, 0.0, 1.0, 1.0]), ids([0] * 4), ids([0, 0, 1, 1]))
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)


def test_empty_batch():
    got = stratified_advantages(t([]), ids([]), ids([]))
    assert got.shape == (0,)


def test_statistics_for_telemetry():
    stats = stratified_advantages_with_stats(
        t([1.0, 0.0, 1.0, 4.0]), ids([9, 9, 9, 2]), ids([1, 1, 3, 1]), alpha=0.6
    )
    cells = {
        (g, s): (n, m, sd)
        for g, s, n, m, sd in zip(
            stats.cells.group_id.tolist(),
            stats.cells.stratum.tolist(),
            stats.cells.count.tolist(),
            stats.cells.mean.tolist(),
            stats.cells.std.tolist(),
            strict=True,
        )
    }
    assert cells == {(9, 1): (2, 0.5, 0.5), (9, 3): (1, 1.0, 0.0), (2, 1): (1, 4.0, 0.0)}
    assert stats.groups.group_id.tolist() == [2, 9]
    assert stats.groups.count.tolist() == [1, 3]


@pytest.mark.parametrize(
    "bad",
    [
        dict(rewards=t([1.0, 2.0]), group_ids=ids([0]), strata=ids([0, 0])),
        dict(rewards=t([[1.0]]), group_ids=ids([0]), strata=ids([0])),
        dict(rewards=ids([1]), group_ids=ids([0]), strata=ids([0])),
        dict(rewards=t([1.0]), group_ids=t([0.0]), strata=ids([0])),
        dict(rewards=t([1.0]), group_ids=ids([0]), strata=ids([0]), alpha=1.5),
    ],
)
def test_bad_input_is_rejected(bad):
    with pytest.raises(ValueError):
        stratified_advantages(**bad)


# ----------------------------------------------------------------------------- properties

batches = st.integers(min_value=1, max_value=40).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 4), min_size=n, max_size=n).map(lambda xs: [x / 4 for x in xs]),
        st.lists(st.integers(-3, 3), min_size=n, max_size=n),
        st.lists(st.integers(0, 3), min_size=n, max_size=n),
    )
)


@settings(max_examples=200, deadline=None)
@given(batches, st.floats(0.0, 1.0), st.sampled_from([0.0, 1e-6, 0.1]))
def test_matches_the_papers_loop(batch, alpha, eps):
    rewards, groups, strata = batch
    got = stratified_advantages(t(rewards), ids(groups), ids(strata), alpha=alpha, eps=eps)
    torch.testing.assert_close(got, t(reference(rewards, groups, strata, alpha, eps)))


@settings(max_examples=100, deadline=None)
@given(batches, st.floats(0.0, 1.0), st.randoms(use_true_random=False))
def test_independent_of_order_and_id_values(batch, alpha, rnd):
    rewards, groups, strata = batch
    base = stratified_advantages(t(rewards), ids(groups), ids(strata), alpha=alpha)
    perm = list(range(len(rewards)))
    rnd.shuffle(perm)
    shuffled = stratified_advantages(
        t([rewards[i] for i in perm]),
        ids([groups[i] for i in perm]),
        ids([strata[i] for i in perm]),
        alpha=alpha,
    )
    torch.testing.assert_close(shuffled, base[perm])
    relabelled = stratified_advantages(
        t(rewards),
        ids([1_000_003 * g - 17 for g in groups]),
        ids([-9 * s + 5 for s in strata]),
        alpha,
    )
    torch.testing.assert_close(relabelled, base)


@settings(max_examples=100, deadline=None)
@given(batches, st.floats(0.1, 10.0), st.floats(-5.0, 5.0))
def test_san_is_invariant_to_positive_affine_rewards(batch, a, b):
    # Proposition 2 (eps -> 0).
    rewards, groups, strata = batch
    san = stratified_advantages(t(rewards), ids(groups), ids(strata), alpha=1.0, eps=1e-12)
    moved = stratified_advantages(
        t([a * r + b for r in rewards]), ids(groups), ids(strata), alpha=1.0, eps=1e-12
    )
    torch.testing.assert_close(moved, san, atol=1e-9, rtol=1e-9)


@settings(max_examples=100, deadline=None)
@given(batches)
def test_pure_san_is_standardised_within_each_stratum(batch):
    rewards, groups, strata = batch
    eps = 1e-6
    san = stratified_advantages(t(rewards), ids(groups), ids(strata), alpha=1.0, eps=eps)
    for cell in {(g, s) for g, s in zip(groups, strata, strict=True)}:
        members = [i for i, key in enumerate(zip(groups, strata, strict=True)) if key == cell]
        values = san[members]
        spread = t([rewards[i] for i in members]).std(unbiased=False).item()
        if len(members) < 2 or spread == 0:
            continue
        assert values.mean().item() == pytest.approx(0.0, abs=1e-9)
        # Population variance sigma^2 / (sigma + eps)^2: 1 up to eps.
        assert values.var(unbiased=False).item() == pytest.approx(1.0, abs=4 * eps / spread)


@settings(max_examples=100, deadline=None)
@given(batches)
def test_theorem_1_variance_identity(batch):
    # Var[A_G] - Var[A_S] = (1/K) sum_k n_k (mean_k - mean)^2, per prompt group.
    rewards, groups, strata = batch
    stats = stratified_advantages_with_stats(t(rewards), ids(groups), ids(strata))
    for g in set(groups):
        members = [i for i, gid in enumerate(groups) if gid == g]
        a_g = stats.global_centered[members]
        a_s = stats.stratified_centered[members]
        r = t([rewards[i] for i in members])
        between = 0.0
        for k in {strata[i] for i in members}:
            cell = t([rewards[i] for i in members if strata[i] == k])
            between += len(cell) * (cell.mean().item() - r.mean().item()) ** 2
        lhs = a_g.var(unbiased=False).item() - a_s.var(unbiased=False).item()
        assert lhs == pytest.approx(between / len(members), abs=1e-12)
        assert lhs >= -1e-12


def test_constant_rewards_give_exactly_zero_in_float32():
    # sum/n rounding of 0.1 * 8 in float32 must not turn into a ~0.01 advantage through eps.
    rewards = torch.full((8,), 0.1, dtype=torch.float32)
    got = stratified_advantages(rewards, ids([0] * 8), ids([0, 0, 0, 0, 1, 1, 1, 1]), eps=1e-6)
    assert got.abs().max().item() == 0.0


@pytest.mark.parametrize(
    "layout",
    [
        "dense",  # small id ranges: ids map by subtraction, cells over all (g, s) slots
        "sparse",  # huge id values: torch.unique
        "many_cells",  # many groups x many strata: cells compacted with torch.unique
    ],
)
def test_every_id_layout_gives_the_papers_result(layout):
    gen = torch.Generator().manual_seed(1)
    n = 300
    groups = torch.randint(0, 60, (n,), generator=gen)
    strata = torch.randint(0, 4, (n,), generator=gen)
    if layout == "sparse":
        groups = groups * 10**15 - 7
        strata = strata * -(10**12)
    elif layout == "many_cells":
        strata = torch.randint(0, 200, (n,), generator=gen)
    rewards = torch.randint(0, 3, (n,), generator=gen).to(torch.float64)
    stats = stratified_advantages_with_stats(rewards, groups, strata, alpha=0.7)
    expected = reference(rewards.tolist(), groups.tolist(), strata.tolist(), 0.7, 1e-6)
    torch.testing.assert_close(stats.advantages, t(expected))
    # Statistics list exactly the occupied groups and cells.
    assert stats.groups.count.sum().item() == n and (stats.groups.count > 0).all()
    assert stats.cells.count.sum().item() == n and (stats.cells.count > 0).all()
    pairs = set(zip(groups.tolist(), strata.tolist(), strict=True))
    assert (
        set(zip(stats.cells.group_id.tolist(), stats.cells.stratum.tolist(), strict=True)) == pairs
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_equal_cells_and_groups_are_exactly_zero_in_any_dtype(dtype):
    # 0.1 has no exact binary form: n * 0.1 / n rounds unless the sums are exact (float64 rewards
    # are summed as a float32 head and a tail). With eps = 0 a residue would become +-1.
    rewards = torch.tensor([0.1] * 8 + [0.1] * 6 + [0.9, 0.5], dtype=dtype)
    groups = ids([0] * 8 + [1] * 8)
    strata = ids([0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1])
    stats = stratified_advantages_with_stats(rewards, groups, strata, alpha=0.6, eps=0.0)
    assert stats.advantages[:8].abs().max().item() == 0.0  # an all-equal group
    assert stats.san[8:14].abs().max().item() == 0.0  # an all-equal cell in a mixed group
    assert stats.stratified_centered[8:14].abs().max().item() == 0.0
    # The all-equal cell keeps its GN part (the paper's loop, in float64, leaves a residue there).
    mixed = rewards[8:].to(torch.float64)
    gn = (mixed - mixed.mean()) / mixed.std(unbiased=False)
    expected = 0.4 * gn + 0.6 * t([0.0] * 6 + [1.0, -1.0])
    torch.testing.assert_close(stats.advantages[8:], expected.to(dtype))


def random_batch(n=300, seed=3, strata_range=4):
    gen = torch.Generator().manual_seed(seed)
    groups = torch.randint(0, 60, (n,), generator=gen)
    strata = torch.randint(0, strata_range, (n,), generator=gen)
    rewards = torch.rand(n, generator=gen, dtype=torch.float64)
    return rewards, groups, strata


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("strata_range", [4, 200])  # slot cells, then occurring cells
def test_every_field_is_in_the_rewards_dtype_and_each_scale_is_taken_in_it(dtype, strata_range):
    """Each field in the rewards' dtype; SAN and GN are the deviations times 1 / (std + eps) in
    the working dtype (float32 for 16-bit rewards), bit for bit; the cell index and the groups'
    stratum -1 as the docs say."""
    rewards, groups, strata = random_batch(strata_range=strata_range)
    stats = stratified_advantages_with_stats(rewards.to(dtype), groups, strata, alpha=0.6)
    for field in ("advantages", "san", "gn", "stratified_centered", "global_centered"):
        assert getattr(stats, field).dtype == dtype, field
    for table in (stats.groups, stats.cells):
        assert table.mean.dtype == table.std.dtype == dtype
    assert stats.groups.stratum.tolist() == [-1] * len(stats.groups.group_id)
    assert stats.cells.group_id[stats.cell_index].tolist() == groups.tolist()
    assert stats.cells.stratum[stats.cell_index].tolist() == strata.tolist()
    if dtype == torch.float32:
        cell_scale = (stats.cells.std + 1e-6).reciprocal()[stats.cell_index]
        assert torch.equal(stats.san, stats.stratified_centered * cell_scale)
        group = torch.searchsorted(stats.groups.group_id, groups)
        group_scale = (stats.groups.std + 1e-6).reciprocal()[group]
        assert torch.equal(stats.gn, stats.global_centered * group_scale)


@pytest.mark.parametrize("strata_range", [4, 200])
def test_the_torch_path_gives_the_c_loops_bits(strata_range):
    rewards, groups, strata = random_batch(strata_range=strata_range)
    for dtype in (torch.float32, torch.float64):
        fused = stratified_advantages(rewards.to(dtype), groups, strata, alpha=0.7)
        with native.torch_only():
            alone = stratified_advantages(rewards.to(dtype), groups, strata, alpha=0.7)
        assert torch.equal(alone, fused)
    want = reference(rewards.tolist(), groups.tolist(), strata.tolist(), 0.7, 1e-6)
    torch.testing.assert_close(alone, t(want))


def test_a_float64_all_equal_groups_mean_is_exact_and_its_centred_rewards_exactly_0():
    rewards = t([0.1] * 7 + [0.3, 0.7])
    count, mean, std = segment_stats(rewards, ids([0] * 7 + [1, 1]), 2)
    assert mean.tolist() == [0.1, 0.5] and count.tolist() == [7, 2] and std[0] < 1e-8
    _, mean, std = segment_stats(rewards.float(), ids([0] * 7 + [1, 1]), 2)
    assert mean.dtype == std.dtype == torch.float32
    stats = stratified_advantages_with_stats(rewards, ids([0] * 7 + [1, 1]), ids([0, 1] * 4 + [0]))
    assert stats.global_centered[:7].tolist() == [0.0] * 7
    assert stats.groups.mean.tolist() == [0.1, 0.5]


def test_eps_0_and_a_spread_below_float64s_resolution_give_0_not_the_deviation_over_0():
    """1e6 and 1e6 + 2^-28: the one-pass variance rounds to 0 while the deviations do not."""
    rewards = t([1e6, 1e6 + 2.0**-28])
    stats = stratified_advantages_with_stats(rewards, ids([0, 0]), ids([0, 0]), 1.0, eps=0.0)
    assert stats.cells.std.tolist() == [0.0] and stats.stratified_centered.abs().max() > 0
    assert stats.advantages.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32])
def test_ids_of_any_integer_dtype_group_as_their_int64_values_do(dtype):
    """int8 ids spanning -128..127 are made dense by subtracting -128: in int8 that wraps."""
    lo, hi = (-128, 128) if dtype == torch.int8 else (0, 300)
    groups = torch.arange(lo, hi).repeat(2)
    strata = groups.flip(0)
    rewards = torch.arange(len(groups), dtype=torch.float64) % 3
    want = stratified_advantages(rewards, groups, strata)
    assert torch.equal(stratified_advantages(rewards, groups.to(dtype), strata.to(dtype)), want)


def test_an_empty_batchs_ids_and_statistics_are_empty():
    dense, values = _dense_ids(ids([]))
    assert dense.shape == values.shape == (0,)
    stats = stratified_advantages_with_stats(t([]), ids([]), ids([]))
    assert stats.groups.group_id.shape == stats.cells.group_id.shape == (0,)


def test_the_refusals_are_one_line_each():
    with pytest.raises(ValueError) as error:
        stratified_advantages(t([1.0]), ids([0]), ids([0]), alpha=1.5)
    assert str(error.value) == "alpha must lie in [0, 1], got 1.5"
    with pytest.raises(ValueError) as error:
        stratified_advantages(t([1.0]), ids([0]), ids([0]), eps=-0.25)
    assert str(error.value) == "eps must be >= 0, got -0.25"


def test_the_torch_path_keeps_trailing_empty_cells_and_exact_float64_means():
    """Group 1 has no stratum 1: the last slot is empty (bincount's minlength keeps it), and a
    float64 all-equal segment's mean is exact through the head and tail sums."""
    rewards, groups, strata = t([0.1] * 3 + [0.3, 0.7]), ids([0, 0, 0, 1, 1]), ids([0, 1, 1, 0, 0])
    with native.torch_only():
        got = stratified_advantages_with_stats(rewards, groups, strata, eps=0.0)
    assert got.groups.mean.tolist() == [0.1, 0.5]
    assert got.global_centered[:3].tolist() == [0.0] * 3 and got.san[:3].tolist() == [0.0] * 3
    assert torch.equal(got.advantages, stratified_advantages(rewards, groups, strata, eps=0.0))


def test_each_input_refusal_names_what_it_got():
    one, flat = t([1.0]), ids([0])
    cases = [
        (
            (one, flat, ids([[0]])),
            "rewards, group_ids and strata must be 1-D tensors, got shapes (1,), (1,), (1, 1)",
        ),
        (
            (one, flat, ids([0, 0])),
            "rewards, group_ids and strata must have equal length, got 1, 1, 2",
        ),
        ((ids([1]), flat, flat), "rewards must be a float tensor, got torch.int64"),
        ((one, flat, t([0.0])), "group_ids and strata must be integer tensors"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError) as error:
            stratified_advantages(*args)
        assert str(error.value) == message


def test_the_roots_of_the_variances_are_correctly_rounded():
    """_sqrt_ takes numpy's root on the CPU: torch's was off in the last bit on about 17% of
    these 100k float32s here (against the float64 root rounded to float32)."""
    x = torch.rand(100_000, generator=torch.Generator().manual_seed(7)) * 100
    assert torch.equal(_sqrt_(x.clone()), x.double().sqrt().float())
