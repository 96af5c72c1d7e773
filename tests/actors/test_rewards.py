import random
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.rewards import (
    exact_match,
    extract_answer,
    f1,
    format_reward,
    gaia_score,
    normalize_answer,
    reward_for,
    score,
)


def test_normalize_answer_drops_case_punctuation_articles_and_extra_space():
    assert normalize_answer("  The Quick, Brown\tFox!  ") == "quick brown fox"
    assert normalize_answer("Atlanta and a theatre") == "atlanta and theatre"  # whole words only
    assert normalize_answer("Eiffel-Tower") == "eiffeltower"  # SQuAD deletes, not spaces


@pytest.mark.parametrize(
    ("prediction", "golden", "expected"),
    [
        ("The Eiffel Tower.", ["eiffel tower"], 1.0),
        ("an apple", "Apple", 1.0),
        ("  New\tYork \n", ["Boston", "new york"], 1.0),
        ("New York City", ["new york"], 0.0),
        ("anything", [], 0.0),
    ],
)
def test_exact_match(prediction, golden, expected):
    assert exact_match(prediction, golden) == expected


def test_f1_by_hand():
    # tokens: [cat, sat, on, mat] vs [cat, on, hat]: 2 shared, P = 1/2, R = 2/3, F1 = 4/7
    assert f1("The cat sat on the mat", ["a cat on a hat"]) == pytest.approx(4 / 7)
    assert f1("cat cat", "cat") == pytest.approx(2 / 3)  # P = 1/2, R = 1
    assert f1("cat", ["dog", "the cat"]) == 1.0  # best golden answer
    assert f1("", ["the"]) == 1.0 and f1("", ["cat"]) == 0.0 and f1("cat", [""]) == 0.0
    assert f1("cat", []) == 0.0


@pytest.mark.parametrize(
    ("prediction", "truth", "expected"),
    [
        ("$1,234.50", "1234.5", True),
        ("12%", "12", True),
        (" 12 ", "12", True),
        ("abc", "12", False),
        ("twelve", "12", False),
        ("a, b; c", "A,b,c", True),
        ("1; 2.0, $3", "1,2,3", True),
        ("a, b", "a,b,c", False),
        ("St. Louis, Paris", "st louis, paris", False),  # list items keep their punctuation
        ("New-York City!", "new york city", True),
        ("Paris", "London", False),
        ("1,234", "1,234", True),  # a comma makes the truth a list, as in the official scorer
        ("1234", "1,234", False),
    ],
)
def test_gaia_score(prediction, truth, expected):
    assert gaia_score(prediction, truth) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>a</answer> then <answer> b </answer>", "b"),
        ("<answer>a</answer> <answer>b", "a"),
        ("<think>x</think><answer>b", None),
        ("<answer><answer>x</answer></answer>", "x"),
        ("<answer>a</answer></answer>", "a"),
        ("no tags at all", None),
        ("x</answer><answer>", None),
        ("\x00\xff<answer>\ud800ok\x1b</answer>\x00", "\ud800ok\x1b"),
        ("<answer></answer>", ""),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "<answer>" * 2**17,
        "</answer>" * 2**17,
        "<answer>" * 2**17 + "x</answer>",
        "<think>x</think>" * 2**16 + "<answer>x</answer>",
        "".join(
            random.Random(0).choices(
                ["<answer>", "</answer>", "<think>", "x\x00\xff", "/"], k=2**17
            )
        ),
    ],
)
def test_extract_answer_is_fast_on_a_megabyte(text):
    start = time.perf_counter()
    extract_answer(text)
    format_reward(text)
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    "text",
    [
        "<answer>37</answer>",
        "<think>plan</think>\n<search>who</search>\n<think>so</think><answer>37</answer>\n ",
        "Let me compute. <python>print(1998 - 1961)</python><answer>37</answer>",
    ],
)
def test_format_reward_accepts_well_formed_text(text):
    assert format_reward(text) == 1.0


@pytest.mark.parametrize(
    "text",
    [
        "37",  # no answer
        "<answer>3</answer><answer>37</answer>",  # two answers
        "<answer>37</answer> and then more",  # text after the answer
        "<answer>37</answer><think>x</think>",
        "<think><search>q</search></think><answer>37</answer>",  # nested
        "<think>plan<answer>37</answer>",  # unclosed
        "</think><answer>37</answer>",  # stray close
        "<think>x</search><answer>37</answer>",  # mismatched close
        "<answer>37",
    ],
)
def test_format_reward_rejects_malformed_text(text):
    assert format_reward(text) == 0.0


def test_reward_for_dispatches_by_source_and_kind():
    assert reward_for("nq") is exact_match and reward_for("minigaia_l3") is exact_match
    assert reward_for("nq", "f1") is f1
    for scorer in (reward_for("gaia_l1"), reward_for("GAIA"), reward_for("nq", "gaia")):
        assert scorer("$1,234.50", ["1234.5", "other"]) == 1.0
        assert scorer("1234.5", ["other", "1234.5"]) == 0.0  # the first golden answer only
        assert scorer("x", []) == 0.0
    assert (
        reward_for("gaia_l1", "exact_match")("12%", ["12"]) == 1.0
    )  # GAIA truths need GAIA's scorer
    with pytest.raises(
        ValueError, match="unknown reward kind 'bleu': expected one of exact_match, f1, gaia"
    ):
        reward_for("nq", "bleu")


def test_score():
    good = "<think>capital</think><answer>Paris</answer>"
    assert score(good, ["paris"], "nq") == 1.0
    assert score(good, ["paris"], "nq", format_weight=0.1) == pytest.approx(1.1)
    assert score(good + " trailing", ["paris"], "nq", format_weight=0.1) == 1.0
    assert score("Paris", ["paris"], "nq", format_weight=0.1) == 0.0  # no answer at all
    assert score("<answer>Paris France</answer>", ["paris"], "nq", "f1") == pytest.approx(2 / 3)
    assert score("<answer>$1,234.50</answer>", ["1234.5"], "gaia_l2") == 1.0


ASCII = st.text(st.characters(codec="ascii", categories=["L", "N", "P", "S"]), max_size=12)


@given(st.lists(ASCII, min_size=1, max_size=6), st.data())
def test_em_ignores_case_and_whitespace_changes(words, data):
    golden = " ".join(words)
    spaces = st.text(" \t\n\r", min_size=1, max_size=3)
    changed = "".join(data.draw(spaces) + w for w in words) + data.draw(spaces)
    changed = "".join(c.upper() if data.draw(st.booleans()) else c.lower() for c in changed)
    assert exact_match(changed, [golden]) == 1.0


@given(st.text(), st.lists(st.text(), max_size=3))
def test_f1_is_between_0_and_1(prediction, golden):
    assert 0.0 <= f1(prediction, golden) <= 1.0


@given(st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False)))
def test_gaia_numbers_match_themselves_in_any_money_format(x):
    assert gaia_score(str(x), str(x)) and gaia_score(f"${x:,}", str(x))


@given(st.text(), st.text())
def test_extract_answer_finds_a_final_answer_behind_any_noise(noise, answer):
    if "answer>" in noise + answer:
        return
    assert extract_answer(f"{noise}<answer>{answer}</answer>") == answer.strip()
