"""How the agent and the model speak to each other (`actors.format`): the prompt, where a turn
ends, how an action is read from the generated text, and how a tool's result or a correction is
laid out as tokens after it.

- `tags`: Search-R1's format. The instruction names `<search> query </search>` (and
  `<python> code </python>`); results come back between `<information>` (`<output>`) tags; the
  answer is `<answer> ... </answer>`. The paper's factual-QA setting and the tiny policy's default.
  Every other tool is called by a tag of its name: `<lookup> word </lookup>`, the bare text, for
  a tool of one string parameter; `<add> {"a": 1, "b": 2} </add>`, a JSON object of its
  parameters, for any other. The instruction adds a line per such tool (its description and
  parameters, from its schema); its result comes back between its own tags (`<result>`).
- `chat_tools`: the format chat models were trained to call tools in. The tools' schemas go to the
  tokenizer's chat template as `tools=[...]` (OpenAI function format, each tool's own `schema`);
  the model calls one as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the result
  comes back as the chat template renders a message of the `tool` role (Qwen's: a user turn
  holding `<tool_response> ... </tool_response>`). The answer is still `<answer> ... </answer>`,
  which the reward reads. Qwen3 and other chat models start far ahead in their own format.

A format reads an action: the answer, or a tool's name and what was written for it. Whether the
call is well formed is decided here (an unknown tool, text that is no JSON object, an empty input:
an invalid action, corrected and counted by the agent loop); whether its arguments fit the tool is
the tool's own check (a bad call: an observation, counted as the tool's error).

Either way the generated ids are kept as generated (tokens in / tokens out) and what the format
adds (observations, corrections) is appended as ids with loss_mask 0. The engines only see token
ids and stop strings, so SGLang and vLLM need nothing per format. A format registers itself in
FORMATS. This module imports nothing heavy: the config schema reads it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import ClassVar

from actors.engine import Generation

SEARCH_INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every "
    "time you get new information. After reasoning, if you find you lack some knowledge, you can call "
    "a search engine by <search> query </search> and it will return the top searched results between "
    "<information> and </information>. You can search as many times as your want. If you find no "
    "further external knowledge needed, you can directly provide the answer inside <answer> and "
    "</answer>, without detailed illustrations. For example, <answer> Beijing </answer>."
)
PYTHON_INSTRUCTION = (
    " You can also run Python code by <python> code </python>; what it prints is returned between "
    "<output> and </output>."
)
BROWSE_INSTRUCTION = (
    " You can read a web page by <browse> url </browse>; its text is returned between <page> and "
    "</page>."
)
DIRECT_INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first. Then "
    "provide the answer inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>."
)
CORRECTION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> "
    "and </search>. If I want to give the final answer, I should put the answer between <answer> and "
    "</answer>. Let me try again.\n"
)
CHAT_INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every "
    "time you get new information. If you find you lack some knowledge, call one of the tools; its "
    "result comes back to you. If you find no further external knowledge needed, provide the answer "
    "inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>."
)
CHAT_CORRECTION = (
    'My previous action is invalid. To use a tool I should call it as <tool_call>{"name": ..., '
    '"arguments": {...}}</tool_call> with one of the tools given. If I want to give the final '
    "answer, I should put the answer between <answer> and </answer>. Let me try again."
)
ANSWER_CLOSE = "</answer>"

BUILTIN_TOOLS = ("search", "python", "web_search", "browse")
"""The built-in tools (pipeline/runtime/parts.py builds them); their instruction is written here,
Search-R1's own, and no plug-in tool may take their names."""
RESERVED_NAMES = ("answer", "think")
"""Tags the formats use themselves: no tool may be called so."""
TOOLS_INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every "
    "time you get new information. After reasoning, if you find you need a tool, call one of the "
    "tools below; you can call them as many times as you want. If you find no further external "
    "knowledge needed, you can directly provide the answer inside <answer> and </answer>, without "
    "detailed illustrations. For example, <answer> Beijing </answer>."
)
TOOLS_CORRECTION = (
    "\nMy previous action is invalid. If I want to use a tool, I should write its input between its "
    "tags as the instruction shows. If I want to give the final answer, I should put the answer "
    "between <answer> and </answer>. Let me try again.\n"
)
_TAG_CALL = re.compile(r"<(search|python)>(.*?)</\1>", re.S)
_DEMO_ARGUMENT = {"search": "query", "python": "code"}
"""The warm start's demos call these two tools; their parameters, to rewrite a demo's calls."""
_CLOSING_TAG = re.compile(r"</([A-Za-z][A-Za-z0-9_-]{0,63})>")


def string_parameter(tool) -> str | None:
    """The parameter of a tool whose only parameter is a string, else None: its input is written
    bare in the tags format, as Search-R1's `<search> query </search>`."""
    properties = tool.schema["function"]["parameters"].get("properties") or {}
    if len(properties) != 1:
        return None
    ((name, prop),) = properties.items()
    return name if prop.get("type") == "string" else None


def parameters_text(schema: dict) -> str:
    """A tool's parameters in words, for an instruction or an observation:
    `query (string, required): What to search for; topk (integer)`."""
    parameters = schema["function"]["parameters"]
    required = set(parameters.get("required", ()))
    parts = []
    for name, prop in (parameters.get("properties") or {}).items():
        kind = ", ".join([json_type(prop)] + (["required"] if name in required else []))
        about = (prop.get("description") or "").rstrip(". ")
        parts.append(f"{name} ({kind})" + (f": {about}" if about else ""))
    return "; ".join(parts) or "none"


def json_type(prop: dict) -> str:
    """A property's type in a word or two: `string`, `integer or null`, `"a" | "b"`."""
    if "enum" in prop:
        return " | ".join(json.dumps(v) for v in prop["enum"])
    if "type" in prop:
        kinds = prop["type"] if isinstance(prop["type"], list) else [prop["type"]]
        if kinds == ["array"] and isinstance(prop.get("items"), dict):
            return f"array of {json_type(prop['items'])}"
        return " or ".join(kinds)
    for key in ("anyOf", "oneOf"):
        if key in prop:
            return " or ".join(json_type(p) for p in prop[key])
    return "any"


def tool_arguments(tool, body: str | dict) -> dict | None:
    """A call's arguments as the tool takes them (a JSON object), from what the format read: an
    object as it is; in the tags format the bare text of a one-string tool (`string_parameter`),
    else the text of a JSON object. None (an invalid action) for an empty input or text that is
    not a JSON object."""
    if isinstance(body, dict):
        return body
    parameter = string_parameter(tool)
    if parameter is not None:
        return {parameter: body} if body else None
    try:
        arguments = json.loads(body)
    except ValueError:
        return None
    return arguments if isinstance(arguments, dict) else None


def check_tool_names(tools) -> None:
    """ValueError (one line) for a tool name a format cannot speak: one the formats use
    themselves (`RESERVED_NAMES`)."""
    for name in tools:
        if name in RESERVED_NAMES:
            raise ValueError(
                f"tool name {name!r} is a tag the formats use themselves "
                f"({', '.join(RESERVED_NAMES)}): give the tool another name"
            )


def _tool_line(name: str, tool) -> str:
    """The tags format's instruction for a tool that is not built in: how to call it, what it
    takes, where its result comes back."""
    schema = getattr(tool, "schema", None)
    if schema is None:  # a name alone (a prompt's length, measured before the tools are made)
        return f" You can call {name} by <{name}> input </{name}>."
    about = schema["function"].get("description", "").rstrip(". ")
    about = f" ({about})" if about and about != name else ""
    parameter = string_parameter(tool)
    if parameter is not None:
        call = f"<{name}> {parameter} </{name}>"
    else:
        call = f"<{name}> {{...}} </{name}>, a JSON object of {parameters_text(schema)},"
    return (
        f" You can call {name}{about} by {call} and its result is returned between "
        f"{tool.open_tag} and {tool.close_tag}."
    )


def instruction(tools) -> str:
    """The task instruction of the tags format: Search-R1's, plus python and browse when
    enabled, plus a line for each other tool (`tools`: name -> tool, or names); with no built-in
    tool a neutral opening; without tools, answer directly (the no-tools baseline)."""
    if not tools:
        return DIRECT_INSTRUCTION
    items = list(tools.items()) if isinstance(tools, Mapping) else [(n, None) for n in tools]
    names = [name for name, _ in items]
    others = "".join(_tool_line(n, t) for n, t in items if n not in BUILTIN_TOOLS)
    builtin = set(names) & set(BUILTIN_TOOLS)
    base = SEARCH_INSTRUCTION if builtin or not others else TOOLS_INSTRUCTION
    return (
        base
        + (PYTHON_INSTRUCTION if "python" in names else "")
        + (BROWSE_INSTRUCTION if "browse" in names else "")
        + others
    )


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """`messages` as the prompt text: the chat template when the tokenizer has one (with the
    assistant's turn opened), else the user message's text."""
    if getattr(tokenizer, "chat_template", None):
        extra = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **extra
        )
    return messages[-1]["content"]


def prompt_ids(tokenizer, tools, question: str, messages=None) -> list[int]:
    """The tags format's prompt of `question` as ids (chat template when the tokenizer has
    one); `tools` names the enabled tools (name -> tool, or names: their instruction differs).
    `messages`: the question's own prompt as chat messages, used as they are instead."""
    if messages:
        return tokenizer.encode(render(tokenizer, list(messages)), add_special_tokens=False)
    messages = [{"role": "user", "content": f"{instruction(tools)} Question: {question}\n"}]
    return tokenizer.encode(render(tokenizer, messages), add_special_tokens=False)


def parse_action(text: str, generation: Generation) -> tuple[str, str] | None:
    """(action, its text) of a tags-format turn that ended at a closing tag, else None (an
    invalid action). The action is the tag's name, whatever it is: the agent loop knows which
    tools are enabled.

    The text is what follows the last opening tag before the closing one, so nested or
    repeated opening tags resolve to the innermost text.
    """
    if generation.finish_reason != "stop" or generation.stop is None:
        return None
    closing = _CLOSING_TAG.fullmatch(generation.stop)
    if closing is None:
        return None
    return _tagged(text, closing[1], generation.stop)


def _tagged(text: str, action: str, close: str) -> tuple[str, str] | None:
    end = text.rfind(close)
    start = text.rfind(f"<{action}>", 0, end)
    if start < 0:
        return None
    return action, text[start + len(action) + 2 : end].strip()


def read_tool_call(
    body: str, reserved: tuple[str, ...] = RESERVED_NAMES
) -> tuple[str, dict] | None:
    """(name, arguments) of the JSON written between `<tool_call>` and `</tool_call>`, else None:
    JSON that does not parse or is no object, no name, a name that is not a string, is empty or
    is `reserved`, arguments that are not an object (nor a JSON string of one) are no call
    (hostile text included). A call without arguments has `{}`. The chat_tools format and the
    OpenAI-compatible endpoint (`actors.agent_session`, whose agents name their own tools and
    reserve none) read calls with this one reader."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
        return None
    if not isinstance(call, dict):
        return None
    name = call.get("name")
    if not isinstance(name, str) or not name or name in reserved:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return name, arguments


class TagFormat:
    """Search-R1's tags (see the module doc)."""

    name: ClassVar[str] = "tags"
    closes: ClassVar[dict[str, str]] = {
        "search": "</search>",
        "python": "</python>",
        "browse": "</browse>",
        "answer": ANSWER_CLOSE,
    }
    stops: ClassVar[tuple[str, ...]] = tuple(closes.values())
    """The built-in actions' ends, enabled or not: a call to a missing tool is corrected at once."""

    def stops_for(self, actions) -> tuple[str, ...]:
        """Where a turn ends with these actions enabled: the built-in ones and each action's tag."""
        tools = [f"</{a}>" for a in actions if f"</{a}>" not in self.stops]
        return (*self.stops[:-1], *tools, ANSWER_CLOSE)

    def instruction(self, tools) -> str:
        return instruction(tools)

    def call_name(self, name: str, tool) -> str:
        """The action that calls `tool` (enabled as `name`): its tag (web_search: `search`)."""
        return getattr(tool, "call_tag", name)

    def prompt_ids(self, tokenizer, tools, question: str, messages=None) -> list[int]:
        return prompt_ids(tokenizer, tools, question, messages)

    def parse(self, text: str, generation: Generation) -> tuple[str, str] | None:
        return parse_action(text, generation)

    def observation_ids(self, tokenizer, tool, body: str, limit: int) -> list[int]:
        """`\\n\\n<tag>body</tag>\\n\\n` as ids, the body cut to `limit` tokens."""
        encode = tokenizer.encode
        return (
            encode(f"\n\n{tool.open_tag}", add_special_tokens=False)
            + encode(body, add_special_tokens=False)[:limit]
            + encode(f"{tool.close_tag}\n\n", add_special_tokens=False)
        )

    def correction_ids(self, tokenizer, actions=("search",)) -> list[int]:
        """Search-R1's correction, or, when no enabled tool answers `<search>`, one that names
        no tool."""
        known = not actions or "search" in actions
        text = CORRECTION if known else TOOLS_CORRECTION
        return tokenizer.encode(text, add_special_tokens=False)

    def call_text(self, tool: str, arguments: dict) -> str:
        """How a call of `tool` with `arguments` is written: one string bare, else JSON."""
        values = list(arguments.values())
        if len(values) == 1 and isinstance(values[0], str):
            return f"<{tool}> {values[0]}</{tool}>"
        return f"<{tool}> {json.dumps(arguments, ensure_ascii=False)}</{tool}>"

    def from_tags(self, text: str) -> str:
        """Text written in tags (the warm start's demos), in this format: as it is."""
        return text


class ChatToolsFormat:
    """Tool calls in the chat template's own format (see the module doc)."""

    name: ClassVar[str] = "chat_tools"
    call_open: ClassVar[str] = "<tool_call>"
    call_close: ClassVar[str] = "</tool_call>"
    stops: ClassVar[tuple[str, ...]] = (call_close, ANSWER_CLOSE)
    _MARK = "\x00STRATA-BODY\x00"

    def __init__(self) -> None:
        self._layouts: dict[tuple[str | None, str], tuple[str, str]] = {}

    def stops_for(self, actions) -> tuple[str, ...]:
        return self.stops

    def instruction(self, tools) -> str:
        return CHAT_INSTRUCTION if tools else DIRECT_INSTRUCTION

    def call_name(self, name: str, tool) -> str:
        """The action that calls `tool` (enabled as `name`): the schema's name, `name`."""
        return name

    def prompt_ids(self, tokenizer, tools: Mapping, question: str, messages=None) -> list[int]:
        """The prompt with every tool's schema (`tools`: name -> tool) through the template;
        `messages`, the question's own chat messages, in place of the instruction and question."""
        if not tools:  # the no-tools baseline: answer directly, no schemas
            return prompt_ids(tokenizer, (), question, messages)
        messages = list(messages or ()) or [
            {"role": "user", "content": f"{CHAT_INSTRUCTION} Question: {question}\n"}
        ]
        schemas = [tool.schema for tool in tools.values()]
        return tokenizer.encode(render(tokenizer, messages, schemas), add_special_tokens=False)

    def parse(self, text: str, generation: Generation) -> tuple[str, str | dict] | None:
        """(tool name, its arguments) of a well-formed call, ("answer", text) of an answer, else
        None: no closed call, JSON that does not parse, no name, a name that is not a string or
        is reserved ("answer"), arguments that are not an object (nor a JSON string of one) are
        all invalid actions (hostile text included). A call without arguments has `{}`. Whether
        the name is an enabled tool is the agent loop's business, whether the arguments fit it
        the tool's."""
        if generation.finish_reason != "stop" or generation.stop not in self.stops:
            return None
        if generation.stop == ANSWER_CLOSE:
            return _tagged(text, "answer", ANSWER_CLOSE)
        end = text.rfind(self.call_close)
        start = text.rfind(self.call_open, 0, end)
        if start < 0:
            return None
        return read_tool_call(text[start + len(self.call_open) : end])

    def observation_ids(self, tokenizer, tool, body: str, limit: int) -> list[int]:
        """The chat template's rendering of a `tool` message holding `body` (cut to `limit`
        tokens), from the end of the assistant's turn to the opening of its next one."""
        before, after = self._layout(tokenizer, "tool")
        encode = tokenizer.encode
        return (
            encode(before, add_special_tokens=False)
            + encode(body, add_special_tokens=False)[:limit]
            + encode(after, add_special_tokens=False)
        )

    def correction_ids(self, tokenizer, actions=()) -> list[int]:
        before, after = self._layout(tokenizer, "user")
        return tokenizer.encode(before + CHAT_CORRECTION + after, add_special_tokens=False)

    def call_text(self, tool: str, arguments: dict) -> str:
        call = json.dumps({"name": tool, "arguments": arguments}, ensure_ascii=False)
        return f"{self.call_open}\n{call}\n{self.call_close}"

    def from_tags(self, text: str) -> str:
        """Text written in tags (the warm start's demos) with each tool call rewritten as a chat
        tool call (reasoning, observations and answers are left as they are)."""
        return _TAG_CALL.sub(
            lambda m: self.call_text(m[1], {_DEMO_ARGUMENT[m[1]]: m[2].strip()}), text
        )

    def _layout(self, tokenizer, role: str) -> tuple[str, str]:
        """What the chat template writes around a `role` message that follows an assistant turn
        (the turn's end included), up to the next assistant turn's opening: (before, after) the
        message's content. Rendered once per chat template and role."""
        key = (getattr(tokenizer, "chat_template", None), role)  # the layout is the template's
        if key not in self._layouts:
            messages = [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a" + self._MARK},
                {"role": role, "content": self._MARK},
            ]
            text = render(tokenizer, messages)
            if text.count(self._MARK) != 2:
                raise ValueError(
                    f"actors.format chat_tools: the tokenizer's chat template does not render a "
                    f"{role} message after an assistant turn with its content as given"
                )
            _, between, after = text.split(self._MARK)
            self._layouts[key] = (between, after)
        return self._layouts[key]


FORMATS = {f.name: f for f in (TagFormat(), ChatToolsFormat())}
"""`actors.format` -> the format the agent loop speaks."""
