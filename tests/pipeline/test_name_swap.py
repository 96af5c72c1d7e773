"""Renaming a demo's entities: consistent across its text, within each pool, afresh per epoch."""

import re

import pytest

from pipeline.assets.name_swap import NameSwap
from pipeline.assets.world import build_world

PARTS = {"first_name": ["Ada", "Bel", "Cor", "Dun"], "surname": ["Voss", "Kell", "Marr"]}
DEMO = {
    "id": "q1",
    "question": "Where was Ada Voss born?",
    "response": "<search> Ada Voss birthplace</search><information>Ada Voss was born in X. Bel "
    "Kell taught Ada.</information><answer>X</answer> Adam Vossberg",
    "answer": "Bel Kell",
}


def test_a_demo_is_renamed_consistently_within_each_pool():
    out = NameSwap(PARTS, seed=1)(DEMO, epoch=1)
    first = re.match(r"Where was (\w+) (\w+) born\?", out["question"]).groups()
    assert first[0] in PARTS["first_name"] and first[1] in PARTS["surname"]
    assert out["response"].count(f"{first[0]} {first[1]}") == 2  # the query and the passage
    other = re.search(r"X\. (\w+) (\w+) taught (\w+)\.", out["response"]).groups()
    assert other[2] == first[0]  # the same word, renamed the same way everywhere
    assert (other[0], other[1]) != first and other[0] != first[0]  # injective: names stay apart
    assert out["answer"] == f"{other[0]} {other[1]}"
    assert out["response"].endswith("Adam Vossberg")  # whole words only
    assert out["id"] == "q1" and DEMO["question"] == "Where was Ada Voss born?"  # not mutated


def test_the_same_epoch_renames_the_same_way_and_another_epoch_differently():
    swap = NameSwap(PARTS, seed=1)
    assert swap(DEMO, 3) == swap(DEMO, 3)
    assert len({swap(DEMO, e)["question"] for e in range(1, 20)}) > 3


def test_world_demos_stay_answerable_after_renaming():
    """A renamed demo that was right still finds its answer in the passages it searched (L1, L2)."""
    world = build_world(3, "small")
    swap = NameSwap(world.name_parts, seed=0)
    renamed = 0
    for demo in world.demos:
        out = swap(demo, 1)
        renamed += out["question"] != demo["question"]
        searched_all = demo["strategy"] == ("one_search" if demo["level"] == 1 else "two_searches")
        if demo["correct"] and searched_all and demo["level"] < 3:
            seen = "".join(re.findall(r"<information>(.*?)</information>", out["response"], re.S))
            assert f" {out['answer']}" in seen, out
    assert renamed > 0.9 * len(world.demos)


def test_an_empty_set_of_pools_is_refused():
    with pytest.raises(ValueError, match="at least one pool"):
        NameSwap({"first_name": []})
