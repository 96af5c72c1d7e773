"""The chat_tools call parser (actors/formats.py) under property tests: any text never raises, a
call is read exactly when it is well formed (a known tool, arguments that are an object, or a
JSON string of one, holding its input as a non-empty string), so a tool is never called with
arguments that are not an object. The agent loop counts and corrects every turn the parser
returns None for (actors/agent.py; tests/actors/test_formats.py runs it on a malformed call)."""

import json

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from actors.engine import Generation
from actors.formats import ANSWER_CLOSE, ARGUMENT, FORMATS

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
NAMES = st.sampled_from([*ARGUMENT, "answer", "shell", "", "Search"])


@st.composite
def calls(draw):
    """A call's JSON object and its text: a tool name (known or not, or none), its arguments
    (an object, a JSON string of one, or any other JSON value), its input of any type."""
    call = {}
    if draw(st.integers(0, 9)) > 0:
        call["name"] = draw(NAMES)
    if draw(st.integers(0, 9)) > 0:
        name = call.get("name")
        key = ARGUMENT.get(name, "query") if draw(st.booleans()) else draw(st.text(max_size=5))
        value = draw(st.text(max_size=12) | json_values)
        arguments = {
            key: value,
            **draw(st.dictionaries(st.text(max_size=4), json_values, max_size=2)),
        }
        arguments[key] = value
        shape = draw(st.sampled_from(["object", "string", "other"]))
        if shape == "string":
            arguments = json.dumps(arguments)
        elif shape == "other":
            arguments = draw(json_values.filter(lambda v: not isinstance(v, dict)))
        call["arguments"] = arguments
    return call


def well_formed(call) -> tuple[str, str] | None:
    """What the parser must read from `call`, written from the format's rules alone."""
    name = call.get("name")
    if name not in ARGUMENT:
        return None
    arguments = call.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    value = arguments.get(ARGUMENT[name])
    if not isinstance(value, str) or not value.strip():
        return None
    return name, value.strip()


def stopped(at):
    return Generation(finish_reason="stop" if at else "length", stop=at)


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=200), ENDINGS)
def test_any_text_never_raises_and_yields_a_known_action_or_none(text, ending):
    parsed = CHAT.parse(text, stopped(ending))
    if parsed is not None:
        action, argument = parsed
        assert action in ARGUMENT or action == "answer"
        assert isinstance(argument, str) and argument == argument.strip()
        if action != "answer":
            assert argument  # a tool is never called on nothing


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
