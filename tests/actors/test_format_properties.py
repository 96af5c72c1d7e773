"""The chat_tools call parser (actors/formats.py) and the tools' argument checks under property
tests: any text never raises, a call is read exactly when it is well formed (a name that is a
non-empty string and not reserved, arguments that are an object, or a JSON string of one, or
absent), so a tool is never handed arguments that are not an object; and whatever object the model
writes, a tool either runs on arguments that fit its schema or refuses the call with an observation
(a bad call), never raising. The agent loop counts and corrects every turn the parser returns None
for (actors/agent.py; tests/actors/test_formats.py runs it on a malformed call)."""

import asyncio
import json
from typing import Literal

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from actors.engine import Generation
from actors.formats import ANSWER_CLOSE, FORMATS, RESERVED_NAMES
from actors.function_tools import function_tool
from actors.tools import SearchTool, check_arguments

CHAT = FORMATS["chat_tools"]
ENDINGS = st.sampled_from([*CHAT.stops, "</search>", None])
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 5)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
NAMES = st.sampled_from(["search", "python", "lookup", "answer", "think", "", "Search"]) | (
    json_values
)


@st.composite
def calls(draw):
    """A call's JSON object: a name (a tool's or not, reserved, of another type, or none) and
    arguments (an object, a JSON string of one, any other JSON value, or none)."""
    call = {}
    if draw(st.integers(0, 9)) > 0:
        call["name"] = draw(NAMES)
    if draw(st.integers(0, 9)) > 0:
        arguments = draw(st.dictionaries(st.text(max_size=5), json_values, max_size=3))
        shape = draw(st.sampled_from(["object", "string", "other"]))
        if shape == "string":
            arguments = json.dumps(arguments)
        elif shape == "other":
            arguments = draw(json_values.filter(lambda v: not isinstance(v, dict)))
        call["arguments"] = arguments
    return call


def well_formed(call) -> tuple[str, dict] | None:
    """What the parser must read from `call`, written from the format's rules alone."""
    name = call.get("name")
    if not isinstance(name, str) or not name or name in RESERVED_NAMES:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return name, arguments


def stopped(at):
    return Generation(finish_reason="stop" if at else "length", stop=at)


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=200), ENDINGS)
def test_any_text_never_raises_and_yields_an_answer_or_a_call_with_an_object(text, ending):
    parsed = CHAT.parse(text, stopped(ending))
    if parsed is not None:
        action, body = parsed
        if action == "answer":
            assert isinstance(body, str) and body == body.strip()
        else:
            assert isinstance(action, str) and action not in RESERVED_NAMES
            assert isinstance(body, dict)  # a tool is never handed anything but an object


@settings(max_examples=400, deadline=None)
@given(calls(), st.text(max_size=20), st.sampled_from(["", "\n", " "]))
def test_a_call_is_read_exactly_when_it_is_well_formed(call, before, pad):
    text = f"{before}<tool_call>{pad}{json.dumps(call)}{pad}</tool_call>"
    assume("<tool_call>" not in before and "</tool_call>" not in before)
    assert CHAT.parse(text, stopped("</tool_call>")) == well_formed(call)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60), calls())
def test_a_cut_call_or_a_turn_that_ended_in_an_answer_calls_no_tool(noise, call):
    body = json.dumps(call)
    assert CHAT.parse(f"{noise}<tool_call>{body}", stopped(None)) is None  # the length limit
    parsed = CHAT.parse(f"{noise}<tool_call>{body}</tool_call>", stopped(ANSWER_CLOSE))
    assert parsed is None or parsed[0] == "answer"


class _NoPassages:
    """The retrieval client as the search tool uses it: it finds nothing."""

    async def search(self, query: str, topk: int) -> list:
        return []


SEARCH = SearchTool(_NoPassages())


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["query", "q", ""]), json_values, max_size=3))
def test_a_built_in_tool_takes_exactly_the_arguments_its_schema_allows(arguments):
    fits = set(arguments) == {"query"} and isinstance(arguments["query"], str)  # nothing else
    assert (check_arguments(SEARCH, arguments) is None) == fits  # its schema says so
    result = asyncio.run(SEARCH(arguments))
    assert result.bad_call == (not fits)
    if not fits:
        assert not result.ok and "\n" not in result.text


def _lookup(word: str, times: int = 1, language: Literal["en", "fr"] = "en") -> str:
    """Look a word up.

    Args:
        word: The word.
        times: How often.
        language: Which dictionary.
    """
    return f"{word}:{times}:{language}"


LOOKUP = function_tool(_lookup, name="lookup")


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["word", "times", "language", "other"]),
        json_values | st.sampled_from(["en", "fr"]),
        max_size=4,
    )
)
def test_a_function_tool_runs_on_fitting_arguments_or_refuses_the_call(arguments):
    result = asyncio.run(LOOKUP(arguments))
    fits = (
        isinstance(arguments.get("word"), str)
        and set(arguments) <= {"word", "times", "language"}
        and ("times" not in arguments or type(arguments["times"]) is int)
        and arguments.get("language", "en") in ("en", "fr")
    )
    assert result.ok == fits and result.bad_call == (not fits)
    if fits:
        expected = f"{arguments['word']}:{arguments.get('times', 1)}:"
        assert result.text == expected + arguments.get("language", "en")
    else:
        assert result.text.startswith("Invalid call of lookup: ") and "\n" not in result.text
