from types import SimpleNamespace

import numpy as np
import pytest

from buffers.strata import (
    STRATIFIERS,
    RandomStrata,
    ToolCallCount,
    ToolSignature,
    make_stratifier,
    register_stratifier,
    section_params,
)

CALLS = [
    [],
    ["search"],
    ["search", "search"],
    ["python"],
    ["search", "python"],
    ["python", "search"],
]


def test_tool_call_count_is_the_number_of_calls():
    assert ToolCallCount()(CALLS).tolist() == [0, 1, 2, 1, 2, 2]
    assert ToolCallCount()(CALLS).dtype == np.int64


def test_tool_signature_separates_tool_types_but_not_order():
    got = ToolSignature(["search", "python"], max_calls=4)(CALLS).tolist()
    # base 5: search counts units, python counts fives.
    assert got == [0, 1, 2, 5, 6, 6]
    assert len({got[1], got[3]}) == 2  # one search vs one python call: different strata


def test_tool_signature_counts_unknown_tools_and_clamps():
    sig = ToolSignature(["search"], max_calls=2)
    got = sig([["search"] * 5, ["browse"], ["search", "browse"]])
    assert got.tolist() == [
        2,
        3,
        4,
    ]  # 5 searches clamp to 2; "browse" is the "other" digit (base 3)
    assert got.dtype == np.int64


def test_a_tool_signature_by_name_counts_search_and_python_up_to_8_calls_by_default():
    sig = make_stratifier("tool_signature")
    assert sig([["search"] * 9, ["python"], ["python"] * 2 + ["search"]]).tolist() == [8, 9, 19]


def test_random_strata_are_seeded_and_in_range():
    a = RandomStrata(3, seed=7)([[]] * 1000)
    b = RandomStrata(3, seed=7)([[]] * 1000)
    assert np.array_equal(a, b)
    assert set(a.tolist()) == {0, 1, 2}
    assert not np.array_equal(a, RandomStrata(3, seed=8)([[]] * 1000))


def test_random_strata_by_key_are_the_same_wherever_computed():
    keys = [f"p{i}#{i % 8}" for i in range(1000)]
    one_by_one = [int(RandomStrata(4, seed=1)([[]], [key])[0]) for key in keys[:50]]
    assert one_by_one == RandomStrata(4, seed=1)([[]] * 50, keys[:50]).tolist()
    assert set(RandomStrata(4, seed=1)([[]] * 1000, keys).tolist()) == {0, 1, 2, 3}


def test_make_stratifier_by_name():
    assert isinstance(make_stratifier("tool_calls"), ToolCallCount)
    assert isinstance(
        make_stratifier("tool_signature", tools=["search"], max_calls=3), ToolSignature
    )
    assert make_stratifier("random", k=5).k == 5
    with pytest.raises(ValueError, match="unknown stratifier"):
        make_stratifier("turns")


def test_a_stratifier_registers_under_its_name_with_its_parameters_and_only_once():
    @register_stratifier("halves", "cut")
    def _halves(tools, max_calls, *, cut=1):
        return lambda calls, keys=None: np.array([len(c) >= cut for c in calls], dtype=np.int64)

    try:
        assert STRATIFIERS["halves"].params == ("cut",)
        assert make_stratifier("halves", cut=2)(CALLS).tolist() == [0, 0, 1, 0, 1, 1]
        assert section_params(SimpleNamespace(type="halves", cut=3, other=0)) == {"cut": 3}
        assert section_params(SimpleNamespace(type="random", k=4, seed=9)) == {"k": 4, "seed": 9}
        with pytest.raises(ValueError, match=r"^stratifier 'halves' is registered twice$"):
            register_stratifier("halves")(_halves)
        assert STRATIFIERS["halves"].make is _halves
    finally:
        STRATIFIERS.pop("halves", None)


def test_a_stratifier_refuses_parameters_it_does_not_take():
    with pytest.raises(ValueError, match=r"^stratifier random takes k, seed, not a, cut$"):
        make_stratifier("random", cut=1, a=2)
    with pytest.raises(ValueError, match=r"^stratifier tool_calls takes no parameters, not k$"):
        make_stratifier("tool_calls", k=2)
    with pytest.raises(
        ValueError, match=r"^unknown stratifier 'turns': use tool_calls, tool_signature, random$"
    ):
        make_stratifier("turns")
    with pytest.raises(ValueError, match=r"^ToolSignature needs at least one tool name$"):
        ToolSignature([], max_calls=2)
    with pytest.raises(ValueError, match=r"^max_calls must be >= 1, got 0$"):
        ToolSignature(["search"], max_calls=0)
    assert ToolSignature(["search"], max_calls=1)([["search"] * 3]).tolist() == [1]
    with pytest.raises(ValueError, match=r"^k must be >= 1, got 0$"):
        RandomStrata(0)
    assert set(RandomStrata(1)([[]] * 20).tolist()) == {0}


KEYS = ["p0#0", "p0#1", "q7#3", "question 12#5", "x#0", "x#1"]


def test_random_strata_by_key_are_a_fixed_hash_of_the_seed_and_the_key():
    """A stratum is written to the spill and read back by replay and the books: the hash (8-byte
    BLAKE2b of "seed:key", little-endian, mod k) must give these values in every version."""
    assert RandomStrata(1000, seed=3)([[]] * 6, KEYS).tolist() == [626, 160, 553, 365, 881, 395]
    assert RandomStrata(4, seed=1)([[]] * 6, KEYS).tolist() == [2, 3, 0, 3, 0, 1]


def test_random_strata_default_to_seed_0():
    assert (
        RandomStrata(1000)([[]] * 6, KEYS).tolist()
        == RandomStrata(1000, seed=0)([[]] * 6, KEYS).tolist()
    )
    assert RandomStrata(1000)([[]] * 50).tolist() == RandomStrata(1000, seed=0)([[]] * 50).tolist()
    assert (
        RandomStrata(1000)([[]] * 6, KEYS).tolist()
        != RandomStrata(1000, seed=1)([[]] * 6, KEYS).tolist()
    )
