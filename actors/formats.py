"""How the agent and the model speak to each other (`actors.format`): the prompt, where a turn
ends, how an action is read from the generated text, and how a tool's result or a correction is
laid out as tokens after it.

- `tags`: Search-R1's format. The instruction names `<search> query </search>` (and
  `<python> code </python>`); results come back between `<information>` (`<output>`) tags; the
  answer is `<answer> ... </answer>`. The paper's factual-QA setting and the tiny policy's default.
- `chat_tools`: the format chat models were trained to call tools in. The tools' schemas go to the
  tokenizer's chat template as `tools=[...]` (OpenAI function format); the model calls one as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the result comes back as the chat
  template renders a message of the `tool` role (Qwen's: a user turn holding
  `<tool_response> ... </tool_response>`). The answer is still `<answer> ... </answer>`, which
  the reward reads. Qwen3 and other chat models start far ahead in their own format.

Either way the generated ids are kept as generated (tokens in / tokens out) and what the format
adds (observations, corrections) is appended as ids with loss_mask 0. The engines only see token
ids and stop strings, so SGLang and vLLM need nothing per format. A format registers itself in
FORMATS.
"""

from __future__ import annotations

import json
import re
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

TOOL_SCHEMAS = {
    "search": {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the knowledge base; returns the top passages for the query.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "What to search for."}},
                "required": ["query"],
            },
        },
    },
    "web_search": {
        "type": "function",
        "function": {
            "name": "web_search",
            "description": "Search the web (Google); returns the top results' titles, snippets "
            "and URLs.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "What to search for."}},
                "required": ["query"],
            },
        },
    },
    "browse": {
        "type": "function",
        "function": {
            "name": "browse",
            "description": "Read a web page; returns its text, cut to a budget.",
            "parameters": {
                "type": "object",
                "properties": {"url": {"type": "string", "description": "The page's URL."}},
                "required": ["url"],
            },
        },
    },
    "python": {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code in a sandbox; returns what it prints.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The program to run."}},
                "required": ["code"],
            },
        },
    },
}
"""Each tool's schema in OpenAI's function format, as chat templates take them (`tools=`)."""
_TAG_CALL = re.compile(r"<(search|python)>(.*?)</\1>", re.S)
ARGUMENT = {
    name: schema["function"]["parameters"]["required"][0] for name, schema in TOOL_SCHEMAS.items()
}
"""The argument that carries a tool's input (the query, the code)."""


def instruction(tools) -> str:
    """The task instruction of the tags format: Search-R1's, plus python when enabled; without
    tools, answer directly (the evaluation's no-tools baseline)."""
    if not tools:
        return DIRECT_INSTRUCTION
    return (
        SEARCH_INSTRUCTION
        + (PYTHON_INSTRUCTION if "python" in tools else "")
        + (BROWSE_INSTRUCTION if "browse" in tools else "")
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
    one); `tools` is anything naming the enabled tools (their instruction differs).
    `messages`: the question's own prompt as chat messages, used as they are instead."""
    if messages:
        return tokenizer.encode(render(tokenizer, list(messages)), add_special_tokens=False)
    messages = [{"role": "user", "content": f"{instruction(tools)} Question: {question}\n"}]
    return tokenizer.encode(render(tokenizer, messages), add_special_tokens=False)


def parse_action(text: str, generation: Generation) -> tuple[str, str] | None:
    """(action, argument) of a tags-format turn that ended at a closing tag, else None (an
    invalid action).

    The argument is what follows the last opening tag before the closing one, so nested or
    repeated opening tags resolve to the innermost text.
    """
    if generation.finish_reason != "stop" or generation.stop is None:
        return None
    action = next((a for a, close in TagFormat.closes.items() if close == generation.stop), None)
    if action is None:
        return None
    return _tagged(text, action, generation.stop)


def _tagged(text: str, action: str, close: str) -> tuple[str, str] | None:
    end = text.rfind(close)
    start = text.rfind(f"<{action}>", 0, end)
    if start < 0:
        return None
    return action, text[start + len(action) + 2 : end].strip()


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
    """Every action's end, enabled or not: a call to a missing tool is corrected at once."""

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

    def correction_ids(self, tokenizer) -> list[int]:
        return tokenizer.encode(CORRECTION, add_special_tokens=False)

    def call_text(self, tool: str, argument: str) -> str:
        """How a call of `tool` on `argument` is written."""
        return f"<{tool}> {argument}</{tool}>"

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

    def instruction(self, tools) -> str:
        return CHAT_INSTRUCTION if tools else DIRECT_INSTRUCTION

    def call_name(self, name: str, tool) -> str:
        """The action that calls `tool` (enabled as `name`): the schema's name, `name`."""
        return name

    def prompt_ids(self, tokenizer, tools, question: str, messages=None) -> list[int]:
        """The prompt with the tools' schemas through the template; `messages`, the question's
        own chat messages, in place of the instruction and question."""
        if not tools:  # the no-tools baseline: answer directly, no schemas
            return prompt_ids(tokenizer, (), question, messages)
        messages = list(messages or ()) or [
            {"role": "user", "content": f"{CHAT_INSTRUCTION} Question: {question}\n"}
        ]
        schemas = [TOOL_SCHEMAS[name] for name in tools]
        return tokenizer.encode(render(tokenizer, messages, schemas), add_special_tokens=False)

    def parse(self, text: str, generation: Generation) -> tuple[str, str] | None:
        """(tool, its input) of a well-formed call of a known tool, ("answer", text) of an
        answer, else None: no closed call, JSON that does not parse, no name, arguments that are
        not an object, a missing or empty input, are all invalid actions (hostile text included)."""
        if generation.finish_reason != "stop" or generation.stop not in self.stops:
            return None
        if generation.stop == ANSWER_CLOSE:
            return _tagged(text, "answer", ANSWER_CLOSE)
        end = text.rfind(self.call_close)
        start = text.rfind(self.call_open, 0, end)
        if start < 0:
            return None
        try:
            call = json.loads(text[start + len(self.call_open) : end])
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in ARGUMENT:
            return None
        arguments = call.get("arguments")
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        value = arguments.get(ARGUMENT[call["name"]]) if isinstance(arguments, dict) else None
        if not isinstance(value, str) or not value.strip():
            return None
        return call["name"], value.strip()

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

    def correction_ids(self, tokenizer) -> list[int]:
        before, after = self._layout(tokenizer, "user")
        return tokenizer.encode(before + CHAT_CORRECTION + after, add_special_tokens=False)

    def call_text(self, tool: str, argument: str) -> str:
        arguments = json.dumps({ARGUMENT[tool]: argument}, ensure_ascii=False)
        return (
            f'{self.call_open}\n{{"name": "{tool}", "arguments": {arguments}}}\n{self.call_close}'
        )

    def from_tags(self, text: str) -> str:
        """Text written in tags (the warm start's demos) with each tool call rewritten as a chat
        tool call (reasoning, observations and answers are left as they are)."""
        return _TAG_CALL.sub(lambda m: self.call_text(m[1], m[2].strip()), text)

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
