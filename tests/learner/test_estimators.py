"""Every estimator against a literal loop over groups, as the papers write them. The stratified
blend has its own loop reference (Algorithm 1 as the paper writes it) in test_advantages.py."""

import math
import statistics
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner import estimators
from learner.advantages import stratified_advantages
from learner.estimator_loops import loop_estimate
from learner.estimators import (
    ESTIMATORS,
    Estimator,
    estimate,
    register_estimator,
    section_params,
)


def reference(name, rewards, groups, strata, eps=1e-6):
    return loop_estimate(name, rewards, groups, eps)


def run(name, rewards, groups, strata, alpha=0.6, eps=1e-6):
    given = {"alpha": alpha, "eps": eps}
    out = estimate(
        name,
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(groups),
        torch.tensor(strata),
        **{p: given[p] for p in ESTIMATORS[name].params},
    )
    return out.advantages.tolist(), out.keep.tolist()


cases = st.integers(1, 40).flatmap(
    lambda n: st.tuples(
        st.lists(st.sampled_from([0.0, 0.0, 1.0, 0.5, 0.25, -1.0, 3.0]), min_size=n, max_size=n),
        st.lists(st.integers(0, 6), min_size=n, max_size=n),
        st.lists(st.integers(0, 3), min_size=n, max_size=n),
    )
)


LOOPED = sorted(set(ESTIMATORS) - {"stratified"})


@pytest.mark.parametrize("name", LOOPED)
@settings(max_examples=120, deadline=None)
@given(cases)
def test_each_estimator_equals_its_loop_reference(name, case):
    rewards, groups, strata = case
    got, keep = run(name, rewards, groups, strata)
    want, want_keep = reference(name, rewards, groups, strata)
    assert got == pytest.approx(want, abs=1e-9) and keep == want_keep
    # each group's members side by side, as in the learner's batches (mc_grpo skips its sort)
    order = sorted(range(len(groups)), key=lambda i: groups[i])
    got, keep = run(name, *([x[i] for i in order] for x in (rewards, groups, strata)))
    want, want_keep = reference(name, [rewards[i] for i in order], [groups[i] for i in order], [])
    assert got == pytest.approx(want, abs=1e-9) and keep == want_keep


@pytest.mark.parametrize("name", LOOPED)
def test_adversarial_groups(name):
    # all equal, a singleton, ties around the median, an even group
    rewards = [1.0, 1.0, 1.0, 5.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 2.0]
    groups = [0, 0, 0, 1, 2, 2, 2, 2, 2, 3, 3, 3]
    got, keep = run(name, rewards, groups, [0] * 12)
    want, want_keep = reference(name, rewards, groups, [0] * 12)
    assert got == pytest.approx(want, abs=1e-9) and keep == want_keep
    if name != "reinforce_pp":  # the one without a group baseline: see the test below
        assert got[:4] == [0.0] * 4  # all-equal group and singleton: no signal
    assert all(math.isfinite(a) for a in got)


def test_mc_grpo_falls_back_to_the_std_when_the_mad_is_zero():
    rewards = [0.0, 0.0, 0.0, 0.0, 1.0]  # median 0, MAD 0: more than half share the median
    got, keep = run("mc_grpo", rewards, [0] * 5, [0] * 5)
    std = statistics.pstdev(rewards)
    assert got == pytest.approx([0, 0, 0, 0, 1 / (std + 1e-6)]) and keep == [
        True,
        True,
        False,
        True,
        True,
    ]


def test_reinforce_pp_normalises_over_the_whole_step():
    """No group baseline: a singleton and a flat group are scored against the step's mean, and
    the baseline variant's scale is the step's spread, not each group's."""
    rewards, groups = [1.0, 1.0, 0.0, 0.0, 2.0], [0, 0, 1, 2, 2]
    got, _ = run("reinforce_pp", rewards, groups, [0] * 5)
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
    assert got == pytest.approx([(r - mean) / (std + 1e-6) for r in rewards])
    got, _ = run("reinforce_pp_baseline", rewards, groups, [0] * 5)
    centred = [0.0, 0.0, 0.0, -1.0, 1.0]  # flat group, singleton, then group 2 about its mean 1
    scale = statistics.pstdev(centred, mu=0.0) + 1e-6
    assert got == pytest.approx([c / scale for c in centred])
    assert got[:3] == [0.0] * 3


def test_stratified_is_the_blend_and_keeps_everything():
    rewards, groups, strata = [1.0, 0.0, 1.0, 1.0], [0, 0, 0, 0], [0, 1, 1, 2]
    got, keep = run("stratified", rewards, groups, strata, alpha=0.8)
    want = stratified_advantages(
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(groups),
        torch.tensor(strata),
        0.8,
        1e-6,
    )
    assert got == want.tolist() and all(keep)


def test_unknown_estimators_and_parameters_are_refused_in_one_line():
    """Rewards are checked where they enter (the buffer refuses a non-finite one, see
    tests/buffers); what the estimators refuse is a name or a parameter they do not have."""
    zeros = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        estimate("ppo", torch.zeros(2), zeros, zeros)
    with pytest.raises(ValueError, match="estimator grpo takes eps, not alpha") as error:
        estimate("grpo", torch.zeros(2), zeros, zeros, alpha=0.5)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="estimator rloo takes no parameters, not eps"):
        estimate("rloo", torch.zeros(2), zeros, zeros, eps=1e-6)


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
GROUP_BASELINED = ["dr_grpo", "grpo", "mc_grpo", "reinforce_pp_baseline", "rloo"]
flat_cases = st.tuples(
    st.floats(-1e3, 1e3, allow_nan=False, width=16),
    st.integers(1, 24).flatmap(lambda n: st.lists(st.integers(0, 5), min_size=n, max_size=n)),
    st.sampled_from(DTYPES),
)


def all_params(name):
    return {p: {"alpha": 0.6, "eps": 1e-6}[p] for p in ESTIMATORS[name].params}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@settings(max_examples=60, deadline=None)
@given(flat_cases)
def test_a_flat_step_gets_exactly_zero_in_every_float_dtype(name, case):
    """Seven rewards of 0.7 in float32 once gave reinforce_pp 0.0563 each (the step mean taken
    in float32): every estimator gives a step of equal rewards exactly 0, in any dtype."""
    value, groups, dtype = case
    rewards = torch.full((len(groups),), value, dtype=dtype)
    out = estimate(
        name, rewards, torch.tensor(groups), torch.tensor(groups) % 2, **all_params(name)
    )
    assert out.advantages.dtype == dtype
    assert out.advantages.tolist() == [0.0] * len(groups)


@pytest.mark.parametrize("name", GROUP_BASELINED)
@settings(max_examples=60, deadline=None)
@given(flat_cases, st.lists(st.floats(-10, 10, width=16), min_size=2, max_size=6))
def test_a_flat_group_gets_exactly_zero_beside_others_in_every_float_dtype(name, case, other):
    value, groups, dtype = case
    rewards = torch.tensor([value] * len(groups) + other, dtype=dtype)
    ids = torch.tensor([0] * len(groups) + [1] * len(other))
    out = estimate(name, rewards, ids, torch.zeros_like(ids), **all_params(name))
    assert out.advantages[: len(groups)].tolist() == [0.0] * len(groups)
    if dtype != torch.float16:  # float16 stops at 65504: 1 / (a tiny MAD + eps) may not fit
        assert torch.isfinite(out.advantages).all()


def test_seven_rewards_of_0_7_in_float32_get_zero_under_reinforce_pp():
    rewards = torch.full((7,), 0.7, dtype=torch.float32)
    ids = torch.arange(7)
    assert estimate("reinforce_pp", rewards, ids, ids).advantages.tolist() == [0.0] * 7


def test_an_estimator_registers_once_under_its_name_with_its_parameters(monkeypatch):
    monkeypatch.setattr(estimators, "ESTIMATORS", dict(ESTIMATORS))

    def probe(rewards, group_ids, strata, *, k):
        return None

    register_estimator("probe", probe, "k")
    assert estimators.ESTIMATORS["probe"] == Estimator(probe, ("k",))
    with pytest.raises(ValueError, match="estimator 'grpo' is registered twice"):
        register_estimator("grpo", probe)
    assert estimators.ESTIMATORS["grpo"] == ESTIMATORS["grpo"]


SPREAD = (
    torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0, 1.0, 0.25], dtype=torch.float64),
    torch.tensor([0, 0, 0, 1, 1, 1, 1]),
    torch.tensor([0, 0, 1, 0, 1, 1, 0]),
)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_an_estimator_called_without_parameters_takes_its_sections_defaults(name):
    """alpha 0.6 and eps 1e-6, the config sections' defaults (tests/pipeline/test_config.py
    checks the signatures against the sections; this, that the functions act on them)."""
    fn = ESTIMATORS[name].fn
    bare, given = fn(*SPREAD), fn(*SPREAD, **all_params(name))
    assert bare.advantages.tolist() == given.advantages.tolist()
    assert bare.keep.tolist() == given.keep.tolist()


def test_stratified_takes_its_eps():
    got = estimate("stratified", *SPREAD, alpha=0.6, eps=0.5).advantages
    assert got.tolist() == stratified_advantages(*SPREAD, 0.6, 0.5).tolist()
    assert got.tolist() != stratified_advantages(*SPREAD, 0.6, 1e-6).tolist()


@pytest.mark.parametrize(
    "name", sorted(set(LOOPED) & {n for n in ESTIMATORS if "eps" in ESTIMATORS[n].params})
)
def test_eps_0_gives_a_flat_group_and_a_singleton_0_not_nan(name):
    """With eps 0 a flat group's deviation over its spread is 0 / 0: the estimators give 0, as
    their loops do (0.5 and 1.0 square exactly, so the flat group's std is exactly 0)."""
    rewards = [0.5, 0.5, 0.5, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 3.0]
    groups = [0, 0, 0, 1, 2, 2, 2, 2, 3, 3, 3]  # flat, singleton, MAD 0 with a spread, a spread
    got, keep = run(name, rewards, groups, [0] * len(rewards), eps=0.0)
    want, want_keep = reference(name, rewards, groups, [], eps=0.0)
    assert all(math.isfinite(a) for a in got)
    assert got == pytest.approx(want, abs=1e-12) and keep == want_keep
    if name != "reinforce_pp":
        assert got[:4] == [0.0] * 4


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_an_empty_step_gets_empty_advantages(name):
    none = torch.zeros(0, dtype=torch.int64)
    out = estimate(name, torch.zeros(0, dtype=torch.float32), none, none, **all_params(name))
    assert out.advantages.shape == out.keep.shape == (0,)
    assert out.advantages.dtype == torch.float32 and out.keep.dtype == torch.bool


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
def test_eps_0_gives_a_flat_step_0_not_nan(name):
    got, _ = run(name, [0.5] * 4, [0, 0, 1, 2], [0] * 4, eps=0.0)
    assert got == [0.0] * 4


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32])
def test_group_ids_of_any_integer_dtype_group_as_their_int64_values_do(dtype):
    """int8 ids spanning -128..127 are made dense by subtracting -128: in int8 that wraps."""
    lo, hi = (-128, 128) if dtype == torch.int8 else (0, 256 if dtype == torch.uint8 else 300)
    ids = torch.arange(lo, hi).repeat(2)
    rewards = torch.arange(len(ids), dtype=torch.float64) % 3
    for name in sorted(ESTIMATORS):
        want = estimate(name, rewards, ids, ids % 2, **all_params(name))
        got = estimate(name, rewards, ids.to(dtype), (ids % 2).to(dtype), **all_params(name))
        assert got.advantages.tolist() == want.advantages.tolist(), name
        assert got.keep.tolist() == want.keep.tolist(), name


def test_the_refusals_name_every_choice_and_every_unknown_parameter():
    zeros = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError) as error:
        estimate("ppo", torch.zeros(2), zeros, zeros)
    assert str(error.value) == (f"unknown advantage estimator 'ppo': use {', '.join(ESTIMATORS)}")
    with pytest.raises(ValueError) as error:
        estimate("stratified", torch.zeros(2), zeros, zeros, gamma=1, beta=2)
    assert str(error.value) == "estimator stratified takes alpha, eps, not beta, gamma"
    for name in ("grpo", "stratified"):
        with pytest.raises(ValueError) as error:
            estimate(name, torch.zeros(2), zeros, zeros, **{**all_params(name), "eps": -0.5})
        assert str(error.value) == "eps must be >= 0, got -0.5"


def test_section_params_reads_the_estimators_keys_from_its_section():
    section = SimpleNamespace(type="stratified", alpha=0.25, eps=0.125, other=1)
    assert section_params("stratified", section) == {"alpha": 0.25, "eps": 0.125}
    assert section_params("rloo", section) == {}
