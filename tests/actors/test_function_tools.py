"""Plain functions as tools (actors/function_tools.py): the schema from the signature and the
docstring, calls checked against it (a bad call is an observation, counted), sync functions off
the event loop, per-trajectory state created at the first call and released however the
trajectory ends, both formats speaking a tool of several parameters through the real agent loop
on the tiny policy, and `actors.tools` entries built from config."""

import asyncio
import threading
import time
from enum import Enum
from pathlib import Path
from typing import Literal

import pytest

from actors.agent import AgentLoop, AgentSettings
from actors.embedded import EmbeddedEngine
from actors.engine import EngineError
from actors.formats import FORMATS, instruction
from actors.function_tools import function_tool
from actors.tool_schema import ToolDefinitionError, parse_docstring
from actors.tools import ToolResult, ToolStats, call_tool
from pipeline.config.loader import load_config
from tests.actors.test_agent import Script, Task, segments
from tests.actors.test_formats import QWEN_TEMPLATE


class Unit(Enum):
    celsius = "celsius"
    kelvin = "kelvin"


def convert(
    value: float,
    unit: Unit,
    places: int | None = None,
    tags: list[str] | None = None,
    mode: Literal["exact", "round"] = "round",
) -> str:
    """Convert a temperature.

    Only the two units.

    Args:
        value: The temperature
            in degrees.
        unit (Unit): Where to.
        places: Decimal places.

    Returns:
        The converted value.
    """
    kelvin = value + 273.15 if unit is Unit.kelvin else value
    return f"{round(kelvin, places or 0)}{mode[0]}{len(tags or [])}"


def test_the_schema_comes_from_the_signature_and_the_docstring():
    tool = function_tool(convert)
    function = tool.schema["function"]
    assert tool.name == function["name"] == "convert" and tool.schema["type"] == "function"
    assert function["description"] == "Convert a temperature. Only the two units."
    parameters = function["parameters"]
    assert parameters["required"] == ["value", "unit"]  # no default: required
    assert parameters["additionalProperties"] is False
    props = parameters["properties"]
    assert props["value"] == {"type": "number", "description": "The temperature in degrees."}
    assert props["unit"] == {
        "enum": ["celsius", "kelvin"],
        "type": "string",
        "description": "Where to.",
    }
    assert props["places"]["anyOf"] == [{"type": "integer"}, {"type": "null"}]
    assert props["places"]["description"] == "Decimal places."
    assert props["tags"]["anyOf"][0] == {"items": {"type": "string"}, "type": "array"}
    assert props["mode"]["enum"] == ["exact", "round"] and props["mode"]["default"] == "round"
    assert "title" not in str(parameters)


def test_sphinx_docstrings_and_one_line_refusals():
    def lookup(word: str, n: int = 1) -> str:
        """Look a word up.

        :param word: The word
            to look up.
        :param int n: How many senses.
        :returns: the senses
        """
        return word

    assert parse_docstring(lookup.__doc__) == (
        "Look a word up.",
        {"word": "The word to look up.", "n": "How many senses."},
    )

    def loose(word, *rest: str):
        return word

    def hidden(query: str, api_key: str) -> str:
        return query + api_key

    for fn, args, says in [
        (loose, None, "loose: parameter word has no type annotation"),
        (lambda x: x, None, "tool name '<lambda>' must be a letter"),
        (hidden, {"token": "k"}, "hidden has no parameter token (args)"),
        (print, None, "cannot be described by a schema"),
    ]:
        with pytest.raises(ToolDefinitionError) as refused:
            function_tool(fn, args=args)
        assert says in str(refused.value) and "\n" not in str(refused.value)
    keyed = function_tool(hidden, args={"api_key": "K"})  # fixed: not in the schema
    assert list(keyed.schema["function"]["parameters"]["properties"]) == ["query"]
    assert asyncio.run(keyed({"query": "q"})).text == "qK"


def test_arguments_are_validated_and_a_bad_call_is_an_observation_counted():
    tool, stats = function_tool(convert), ToolStats()

    async def calls():
        return [
            await call_tool(tool, {"value": 1, "unit": "kelvin", "places": 1}, stats),
            await call_tool(tool, {"value": "1", "unit": "kelvin"}, stats),  # a string
            await call_tool(tool, {"unit": "fahrenheit", "extra": 1}, stats),
            await call_tool(tool, ["not", "an", "object"], stats),
        ]

    good, *bad = asyncio.run(calls())
    assert good == ToolResult(True, "274.1r0")
    assert all(r.bad_call and not r.ok and "\n" not in r.text for r in bad)
    assert bad[0].text.startswith("Invalid call of convert: value: Input should be a valid number")
    assert "value: Field required" in bad[1].text and "extra: Extra inputs" in bad[1].text
    assert "Its parameters: value (number, required): The temperature in degrees" in bad[1].text
    assert stats.calls["convert"] == 4 and stats.errors["convert"] == 3
    assert stats.bad_calls["convert"] == 3


def test_a_sync_tool_runs_off_the_loop_and_an_async_one_on_it():
    seen = {}

    def blocking(seconds: float) -> str:
        seen["sync"] = threading.current_thread() is threading.main_thread()
        time.sleep(seconds)
        return "done"

    async def awaiting(x: int) -> dict:
        seen["async"] = threading.current_thread() is threading.main_thread()
        return {"x": x}

    async def scenario():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        result = await function_tool(blocking)({"seconds": 0.5})
        ticker.cancel()
        return result, ticks, await function_tool(awaiting)({"x": 3})

    result, ticks, structured = asyncio.run(scenario())
    assert result.text == "done" and ticks >= 10  # the loop went on while the tool slept
    assert seen == {"sync": False, "async": True} and structured.text == '{"x": 3}'


class Scratch:
    """A scratch file per trajectory."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)
        self.created: list[Path] = []
        self.released: list[Path] = []

    def create(self) -> Path:
        path = self.root / f"scratch-{len(self.created)}"
        path.write_text("")
        self.created.append(path)
        return path

    async def release(self, path: Path) -> None:
        self.released.append(path)
        path.unlink()

    def __call__(self, path: Path, text: str) -> str:
        """Append a line to the trajectory's scratch file; returns the file.

        Args:
            text: The line.
        """
        with path.open("a") as f:
            f.write(text + "\n")
        return path.read_text()


@pytest.fixture
def engine(tiny_policy_dir):
    return EmbeddedEngine.from_pretrained(tiny_policy_dir, max_batch_size=4)


def test_per_trajectory_state_is_created_once_and_released_however_it_ends(engine, tmp_path):
    scratch = Scratch(str(tmp_path))
    tool = function_tool(scratch, name="note")
    loop = AgentLoop(engine, engine.tokenizer, {"note": tool}, AgentSettings(max_turns=3))
    script = "<note> a </note><note> b </note><answer> x </answer>"
    with Script(engine, script):
        t = asyncio.run(loop.run(Task("q", "?", ("x",)), "q@0", 0))
    observations = [engine.tokenizer.decode(ids) for m, ids in segments(t) if m == 0]
    assert observations[1] == "\n\n<result>a\nb\n</result>\n\n"  # one state, both calls
    assert len(scratch.created) == 1 and scratch.released == scratch.created
    assert not scratch.created[0].exists()

    class Failing:  # the engine fails after the first call: the trajectory raises
        def __init__(self):
            self.calls, self.tokenizer = 0, engine.tokenizer

        async def generate(self, prompt_ids, params):
            self.calls += 1
            if self.calls > 1:
                raise EngineError("the server is gone")
            return await engine.generate(prompt_ids, params)

    loop = AgentLoop(Failing(), engine.tokenizer, {"note": tool}, AgentSettings(max_turns=3))
    with Script(engine, "<note> c </note>"), pytest.raises(EngineError):
        asyncio.run(loop.run(Task("q", "?", ("x",)), "q@1", 0))
    assert len(scratch.created) == 2 and scratch.released == scratch.created


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


def test_the_tags_format_calls_a_tool_of_several_parameters_with_a_json_object(engine):
    tools = {"add": function_tool(add), "shout": function_tool(shout)}
    settings = AgentSettings(max_turns=5, max_response_tokens=640, max_observation_tokens=48)
    loop = AgentLoop(engine, engine.tokenizer, tools, settings)
    text = instruction(tools)
    assert (
        "You can call add (Add two integers) by <add> {...} </add>, a JSON object of a (integer, "
        "required): The first; b (integer, required): The second, and its result is returned "
        "between <result> and </result>." in text
    )
    assert "You can call shout (Upper-case a text) by <shout> text </shout>" in text  # bare
    assert text.startswith("Answer the given question.") and "<search>" not in text
    script = (
        '<add> {"a": 2, "b": 40} </add>'  # a JSON object
        '<add> {"a": "2"} </add>'  # a bad call: its observation says why
        "<add> two and two </add>"  # no JSON object: an invalid action
        "<shout> hi </shout>"  # one string parameter: the bare text
        "<answer> 42 </answer>"
    )
    with Script(engine, script):
        t = asyncio.run(loop.run(Task("q", "2 + 40?", ("42",)), "q@0", 0))
    observations = [engine.tokenizer.decode(ids) for m, ids in segments(t) if m == 0]
    assert observations[0] == "\n\n<result>42</result>\n\n"
    assert observations[1].startswith("\n\n<result>Invalid call of add: a: Input should be")
    assert "My previous action is invalid" in observations[2]
    assert observations[3] == "\n\n<result>HI</result>\n\n"
    assert t.tool_names == ["add", "add", "shout"] and t.stratum == 3 and t.reward == 1.0
    assert loop.stats.invalid_actions == 1 and loop.stats.tools.bad_calls == {"add": 1}
    assert loop.stats.tools.errors == {"add": 1}


def test_chat_tools_gives_the_function_schema_to_the_template_and_reads_its_call(
    long_policy_dir,
):
    engine = EmbeddedEngine.from_pretrained(long_policy_dir, max_batch_size=4)
    engine.tokenizer.chat_template = QWEN_TEMPLATE  # Qwen's shape: schemas in the prompt
    settings = AgentSettings(
        format="chat_tools", max_turns=2, max_new_tokens_per_turn=256, max_response_tokens=2048
    )
    loop = AgentLoop(engine, engine.tokenizer, {"add": function_tool(add)}, settings)
    prompt = engine.tokenizer.decode(loop.prompt_ids(Task("q", "2 + 40?", ("42",))))
    assert '"name": "add"' in prompt and '"description": "The first."' in prompt
    script = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call><answer> 42 </answer>'
    with Script(engine, script):
        t = asyncio.run(loop.run(Task("q", "2 + 40?", ("42",)), "q@0", 0))
    observations = [engine.tokenizer.decode(ids) for m, ids in segments(t) if m == 0]
    assert "<tool_response>\n42\n</tool_response>" in observations[0]
    assert t.tool_names == ["add"] and t.reward == 1.0
    assert FORMATS["chat_tools"].parse(script[: script.index("<answer>")], _stopped()) == (
        "add",
        {"a": 2, "b": 40},
    )


def _stopped():
    from actors.engine import Generation

    return Generation(finish_reason="stop", stop="</tool_call>")


PLUGIN = '''
def lookup(word: str, times: int = 1, sep: str = " ") -> str:
    """Repeat a word.

    Args:
        word: The word.
        times: How often.
    """
    return sep.join([word] * times)


class Counter:
    """Counts calls per trajectory."""

    def __init__(self, start: int = 0):
        self.start = start

    def create(self):
        return [self.start]

    def release(self, state):
        pass

    def __call__(self, state, step: int = 1) -> str:
        state[0] += step
        return str(state[0])
'''


def test_actors_tools_entries_become_tools(tmp_path, monkeypatch):
    from pipeline.backends.runtime import RuntimeUnavailable
    from pipeline.runtime.parts import make_tools

    (tmp_path / "myplugin.py").write_text(PLUGIN)
    monkeypatch.chdir(tmp_path)
    config = load_config(
        Path(__file__).parents[2] / "configs/local.yaml",
        [
            "actors.tools=[python, myplugin.py:lookup, "
            "{fn: 'myplugin.py:lookup', name: dashes, args: {sep: '-'}}, "
            "{fn: 'myplugin.py:Counter', name: counter, args: {start: 10}}]"
        ],
    )
    assert config.actors.tool_names == ["python", "lookup", "dashes", "counter"]
    tools = make_tools(config.actors, config.retrieval, None)
    assert list(tools) == config.actors.tool_names
    schema = tools["dashes"].schema["function"]["parameters"]
    assert list(schema["properties"]) == ["word", "times"]  # args are not the model's to set
    assert asyncio.run(tools["dashes"]({"word": "a", "times": 3})).text == "a-a-a"
    assert asyncio.run(tools["counter"]({"step": 2})).text == "12"
    bad = load_config(
        Path(__file__).parents[2] / "configs/local.yaml",
        ["actors.tools=[{fn: 'myplugin.py:Counter', args: {begin: 1}}]"],
    )
    with pytest.raises(RuntimeUnavailable) as refused:
        make_tools(bad.actors, bad.retrieval, None)
    assert str(refused.value).startswith("actors.tools[0]: myplugin.py:Counter: Counter(begin=1)")
    assert "\n" not in str(refused.value)
