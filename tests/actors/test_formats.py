"""actors.format chat_tools against a chat template of Qwen's tool-call shape (written here) and
against the tiny policy's own template; the agent loop speaking it token in, token out."""

import json

import pytest

from actors.embedded import EmbeddedEngine
from actors.engine import Generation
from actors.formats import CHAT_CORRECTION, FORMATS, read_tool_call
from actors.tools import SearchTool
from tests.actors.test_agent import Script, StubClient, Task, agent, run, segments

CHAT = FORMATS["chat_tools"]
# Qwen2.5's shape: the tools' schemas in a system turn between <tools> tags, calls as
# <tool_call> JSON, a tool message as a user turn holding <tool_response> (consecutive tool
# messages share that turn, which one call per turn never needs).
QWEN_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call one or more functions.\n\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\nFor each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(params=["qwen", "tiny"])
def chat_engine(request, long_policy_dir):
    engine = EmbeddedEngine.from_pretrained(long_policy_dir, max_batch_size=4)
    if request.param == "qwen":
        engine.tokenizer.chat_template = QWEN_TEMPLATE
    engine.template = request.param
    return engine


def stopped(at: str) -> Generation:
    return Generation(finish_reason="stop", stop=at)


@pytest.mark.parametrize(
    "text, parsed",
    [
        (
            '<tool_call>\n{"name": "search", "arguments": {"query": " Varno Telik "}}\n</tool_call>',
            ("search", {"query": " Varno Telik "}),
        ),
        (
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>',
            ("python", {"code": "print(1)"}),
        ),
        ('<tool_call>{"name": "search", "arguments": {"query": "a"}</tool_call>', None),  # bad JSON
        ('<tool_call>{"arguments": {"query": "a"}}</tool_call>', None),  # no name
        ('<tool_call>{"name": "answer", "arguments": {"query": "a"}}</tool_call>', None),
        ('<tool_call>{"name": 7, "arguments": {"query": "a"}}</tool_call>', None),
        ('<tool_call>{"name": "search", "arguments": ["a"]}</tool_call>', None),
        ('<tool_call>{"name": "search", "arguments": "[1]"}</tool_call>', None),
        ("<tool_call>[1, 2]</tool_call>", None),
        # read as calls; the agent loop refuses a tool that is not enabled, the tool arguments
        # that do not fit its schema (an observation, counted as its error)
        (
            '<tool_call>{"name": "shell", "arguments": {"cmd": "ls"}}</tool_call>',
            ("shell", {"cmd": "ls"}),
        ),
        (
            '<tool_call>{"name": "search", "arguments": {"query": 7}}</tool_call>',
            ("search", {"query": 7}),
        ),
        ('<tool_call>{"name": "now"}</tool_call>', ("now", {})),
        ('no opening {"name": "search"}</tool_call>', None),
    ],
)
def test_a_call_is_read_only_when_it_is_well_formed(text, parsed):
    assert CHAT.parse(text, stopped("</tool_call>")) == parsed


def test_the_reader_is_the_formats_and_the_endpoints_and_survives_deep_json():
    """chat_tools and the OpenAI-compatible endpoint read calls with one reader; the endpoint's
    agents name their own tools (an `answer` tool is theirs to have). JSON nested 100,000 deep
    is no call: json's RecursionError used to escape the parser and end the actor."""
    assert read_tool_call('{"name": "answer", "arguments": {}}') is None
    assert read_tool_call('{"name": "answer", "arguments": {}}', reserved=()) == ("answer", {})
    deep = "[" * 100_000
    assert read_tool_call(deep) is None
    assert CHAT.parse(f"<tool_call>{deep}</tool_call>", stopped("</tool_call>")) is None
    assert (
        CHAT.parse(
            f'<tool_call>{{"name": "a", "arguments": "{deep}"}}</tool_call>',
            stopped("</tool_call>"),
        )
        is None
    )


def test_answers_and_cut_turns():
    assert CHAT.parse("<think>x</think><answer> Quorvex </answer>", stopped("</answer>")) == (
        "answer",
        "Quorvex",
    )
    assert CHAT.parse('<tool_call>{"name": "search"', Generation(finish_reason="length")) is None
    assert CHAT.parse("<search> a </search>", stopped("</search>")) is None  # not this format's


def test_prompt_and_observation_follow_the_chat_template(chat_engine):
    tokenizer = chat_engine.tokenizer
    prompt = tokenizer.decode(CHAT.prompt_ids(tokenizer, {"search": SearchTool}, "Who?"))
    observation = tokenizer.decode(CHAT.observation_ids(tokenizer, SearchTool, "Doc 1 text", 64))
    correction = tokenizer.decode(CHAT.correction_ids(tokenizer))
    if chat_engine.template == "qwen":  # the schemas reach the template; the result its tool turn
        schemas = prompt.split("<tools>")[1].split("</tools>")[0]
        assert json.loads(schemas)["function"]["name"] == "search"
        assert observation == (
            "<|im_end|>\n<|im_start|>user\n<tool_response>\nDoc 1 text\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n"
        )
    else:  # the tiny policy's template has no tools section; its tool turn is a role of its own
        assert (
            observation
            == "<|im_end|>\n<|im_start|>tool\nDoc 1 text<|im_end|>\n<|im_start|>assistant\n"
        )
    assert prompt.endswith("Question: Who?\n<|im_end|>\n<|im_start|>assistant\n")
    assert correction.startswith("<|im_end|>\n<|im_start|>user\n") and CHAT_CORRECTION in correction
    long = CHAT.observation_ids(tokenizer, SearchTool, "word " * 500, 16)
    assert len(long) == len(CHAT.observation_ids(tokenizer, SearchTool, "", 16)) + 16


def test_the_agent_loop_speaks_chat_tools_token_in_token_out(chat_engine):
    """A malformed call is corrected and counted, a well-formed one gets the template's tool
    turn (masked out of the loss), the answer ends it; the stratum counts the valid call."""
    loop = agent(
        chat_engine,
        tools={"search": SearchTool(StubClient())},
        format="chat_tools",
        max_turns=3,
        max_new_tokens_per_turn=256,
        max_response_tokens=2048,
    )
    task = Task("q1", "Where was Varno Telik born?", ("Quorvex",))
    script = (
        '<tool_call>{"name": "search", "arguments": {"query": }}</tool_call>'  # malformed
        '<tool_call>\n{"name": "search", "arguments": {"query": "Varno Telik"}}\n</tool_call>'
        "<answer> Quorvex </answer>"
    )
    with Script(chat_engine, script):
        t = run(loop.run(task, "q1@0", 0))
    t.validate()
    assert t.finish_reason == "answer" and t.reward == 1.0
    assert t.tool_names == ["search"] and t.stratum == 1 and loop.stats.invalid_actions == 1
    assert loop.tools["search"].client.queries == ["Varno Telik"]
    runs = segments(t)
    assert [m for m, _ in runs] == [1, 0, 1, 0, 1]  # call, correction, call, result, answer
    tokenizer = chat_engine.tokenizer
    assert CHAT_CORRECTION in tokenizer.decode(runs[1][1])
    result = tokenizer.decode(runs[3][1])
    assert "Varno Telik was born in Quorvex." in result and result.endswith(
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    text = tokenizer.decode(t.token_ids)
    assert (
        '<tool_call>\n{"name": "search", "arguments": {"query": "Varno Telik"}}\n</tool_call>'
        in text
    )
    # token in / token out: what was generated is kept as generated, nothing re-tokenised
    assert [int(i) for i in runs[2][1]] == tokenizer.encode(
        '<tool_call>\n{"name": "search", "arguments": {"query": "Varno Telik"}}\n</tool_call>',
        add_special_tokens=False,
    )


def test_demos_in_tags_become_chat_tool_calls():
    assert CHAT.from_tags("<think> x </think><search> Varno Telik</search>") == (
        '<think> x </think><tool_call>\n{"name": "search", "arguments": {"query": "Varno Telik"}}'
        "\n</tool_call>"
    )
    assert CHAT.from_tags("<answer> Quorvex</answer>") == "<answer> Quorvex</answer>"
    assert FORMATS["tags"].from_tags("<search> q</search>") == "<search> q</search>"
