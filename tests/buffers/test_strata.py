import numpy as np
import pytest

from buffers.strata import RandomStrata, ToolCallCount, ToolSignature, make_stratifier

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
    got = sig([["search"] * 5, ["browse"], ["search", "browse"]]).tolist()
    assert got == [2, 3, 4]  # 5 searches clamp to 2; "browse" is the "other" digit (base 3)


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
