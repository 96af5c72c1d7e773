"""One trajectory seen through the chat API (issue 70): what an agent that speaks OpenAI's chat
format sent, and the token ids the engine generated for it.

An agent sends its whole conversation with every request; the policy must be trained on the ids
the engine produced, not on a re-rendering of text. So the session keeps the ids as the truth:
the first request's messages are rendered with the policy's chat template (its tools included)
into the prompt; each reply's ids, log-probs and versions are the engine's own (loss_mask 1); a
later request is checked against the conversation so far and, when it extends it (the same
messages, then one of the replies given, then new messages: the agent's tool results, its own
text), only the new messages are rendered, as the template writes them after an assistant turn,
and appended with loss_mask 0. Earlier turns are never rendered again, so a template that
rewrites old turns (drops old `<think>` blocks) cannot change the ids already generated.

When the agent rewrote its history (summarised, dropped or edited a turn), the conversation no
longer extends the ids: `on_rewrite: segment` starts a new segment from the request's full
rendering (the trajectory trains the last segment, the one the final answer was generated in),
`drop` refuses the request (`SessionRewritten`). A reply's `<tool_call>` blocks are read with the
chat_tools format's reader (`actors.formats.read_tool_call`); tool calls and tool results count
over the whole session, so the stratum sees every call.

A session refuses a second request while one is in flight (`SessionBusy`), and once a request
failed (the engine's error, a rewrite under `drop`, the budget) every later one fails the same
way: the trajectory is lost, `failure` says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
from dataclasses import dataclass, field, replace
from typing import Literal

from actors.engine import EngineError, Generation, GenerationAborted, RolloutEngine, SamplingParams
from actors.formats import read_tool_call

CALL_OPEN = "<tool_call>"
_CALL = re.compile(r"<tool_call>((?:(?!<tool_call>).)*?)</tool_call>", re.S)  # innermost block
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
"""Message roles taken, and what the chat template sees (templates know no `developer`)."""


class SessionRewritten(Exception):
    """The request rewrote the conversation so far and the session was opened with
    on_rewrite "drop"."""


class SessionBudgetExhausted(Exception):
    """No response token left (`max_response_tokens`), or more requests than `max_requests`."""


class SessionBusy(Exception):
    """A request came while another of the same session was in flight: refused, not queued
    (one trajectory is one conversation; two at once cannot both extend it)."""


@dataclass
class ToolCall:
    id: str
    """`call_<hex>`, fresh for each call the endpoint answers with."""
    name: str
    arguments: dict


@dataclass
class Reply:
    """One generated choice."""

    text: str
    """The decoded generated text (special tokens kept), the forced prefix in front."""
    content: str | None
    """The text without the end-of-turn token, cut before a stop string, every well-formed
    `<tool_call>` block removed, stripped; None if nothing is left."""
    tool_calls: list[ToolCall]
    """Every well-formed `<tool_call>{json}</tool_call>` block, in order (read only when the
    request offered tools)."""
    generation: Generation
    """The engine's own token ids, log-probs, versions and finish reason."""
    finish_reason: str
    """`tool_calls` if there are any, else `length` if the engine said so, else `stop`."""


@dataclass
class SessionRecord:
    """What the agent did, read once it is done: the last segment as a trajectory, the rest as
    counts over the whole session."""

    prompt_ids: list[int]
    """The last segment's prompt."""
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    """The last segment's response: generated ids (mask 1, the engine's log-probs and versions);
    rendered messages and forced prefixes (mask 0, log-prob 0.0, version -1)."""
    tool_calls: list[tuple[str, dict]]
    """(name, arguments) of every tool call of every reply taken, whole session, in order."""
    observations: list[str]
    """The contents of the `tool` messages the agent sent, in order, each once."""
    generated_text: str
    """The last segment's replies' text (what a reward reads as the response)."""
    segments: int
    """1 + the rewrites the session took."""
    requests: int
    generated_tokens: int
    """Every token the engine generated for the session: all segments, all choices of n > 1."""
    invalid_tool_calls: int
    """`<tool_call>` blocks of the replies taken that were no call (bad JSON, no name, ...)."""


@dataclass
class _Segment:
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def observe(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def generated(self, generation: Generation) -> None:
        self.ids += generation.token_ids
        self.mask += [1] * len(generation.token_ids)
        self.logprobs += generation.logprobs
        self.versions += generation.versions

    def copy(self) -> _Segment:
        return _Segment(
            self.prompt,
            list(self.ids),
            list(self.mask),
            list(self.logprobs),
            list(self.versions),
            list(self.texts),
        )


@dataclass
class _Pending:
    """The choices of the last request, until the next one says which the agent took."""

    prefix: list[int]
    replies: list[Reply]
    invalid: list[int]


@dataclass
class _Plan:
    """What a request does to the session, decided before anything is generated."""

    context: list[int]
    taken: int | None = None
    """The pending choice the request continues from (appended at commit)."""
    delta: list[int] = field(default_factory=list)
    """The new messages' ids, appended after the taken choice."""
    rewrite: list[int] | None = None
    """A rewrite: the new segment's prompt."""
    observations: list[tuple[str | None, str]] = field(default_factory=list)


class TrajectorySession:
    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        *,
        max_response_tokens: int,
        max_requests: int,
        on_rewrite: Literal["segment", "drop"] = "segment",
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the agent endpoint renders messages with the policy's chat template, and its "
                "tokenizer has none: use a chat model (or set tokenizer.chat_template)"
            )
        if on_rewrite not in ("segment", "drop"):
            raise ValueError(f"on_rewrite {on_rewrite!r}: segment or drop")
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_response_tokens = max_response_tokens
        self.max_requests = max_requests
        self.on_rewrite = on_rewrite
        self.failure: Exception | None = None
        """The first failure (EngineError, SessionRewritten, SessionBudgetExhausted): every
        later request fails with it, and the trajectory is lost."""
        self.context_length = 0
        """The ids the last request's generation was conditioned on (its `prompt_tokens`)."""
        self.requests = 0
        self.generated_tokens = 0
        self._segment: _Segment | None = None
        self._spent = 0  # response tokens of the closed segments
        self._segments = 0
        self._history: list[dict] | None = None  # the last request's messages; None: ids only
        self._pending: _Pending | None = None
        self._final = 0  # the pending choice the trajectory ends with
        self._tool_calls: list[tuple[str, dict]] = []
        self._invalid = 0
        self._issued: set[str] = set()  # ids of the tool calls the session's replies made
        self._observations: list[str] = []
        self._answered: set[str] = set()  # tool_call_ids of tool messages counted
        self._busy = False
        self._special = set(tokenizer.all_special_ids)

    # ---------------------------------------------------------------------------------- API

    async def chat(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None,
        params: SamplingParams,
        n: int = 1,
        forced_prefix: str = "",
    ) -> list[Reply]:
        """`n` replies to `messages` (OpenAI's chat format; `tools` in OpenAI's function format,
        rendered on a first request or a rewrite, and tool calls read only when given), each
        generated after `forced_prefix` (appended with loss_mask 0). ValueError for messages
        that are not chat messages (nothing changes)."""
        self._enter()
        try:
            messages = normalise(messages)
            plan = self._plan_messages(messages, tools)
            replies = await self._generate(plan, params, n, forced_prefix, bool(tools))
            self._history = messages
            return replies
        except (EngineError, SessionRewritten, SessionBudgetExhausted) as exc:
            self.failure = exc
            raise
        finally:
            self._busy = False

    async def generate_ids(self, ids: list[int], params: SamplingParams) -> Generation:
        """One generation after `ids`, the whole context, for agents that speak token ids: when
        it extends the session's context (a reply taken, then any ids, appended with loss_mask
        0) the trajectory goes on, else it is a rewrite. No tool call is read."""
        self._enter()
        try:
            plan = self._plan_ids(list(ids))
            (reply,) = await self._generate(plan, params, 1, "", False)
            self._history = None  # the conversation is ids now: a later chat is a rewrite
            return reply.generation
        except (EngineError, SessionRewritten, SessionBudgetExhausted) as exc:
            self.failure = exc
            raise
        finally:
            self._busy = False

    def record(self) -> SessionRecord:
        """The session as a trajectory, once the agent is done: a pending reply the agent sent
        no request after is the final one (choice 0 of n > 1, or the one a request refused for
        the budget went on from)."""
        if self._segment is None:
            return SessionRecord([], [], [], [], [], [], [], "", 0, 0, 0, 0)
        segment, calls, invalid = self._segment.copy(), list(self._tool_calls), self._invalid
        if self._pending is not None:
            invalid += self._take(segment, self._pending, self._final, calls)
        return SessionRecord(
            prompt_ids=list(segment.prompt),
            token_ids=segment.ids,
            loss_mask=segment.mask,
            logprobs=segment.logprobs,
            versions=segment.versions,
            tool_calls=calls,
            observations=list(self._observations),
            generated_text="".join(segment.texts),
            segments=self._segments,
            requests=self.requests,
            generated_tokens=self.generated_tokens,
            invalid_tool_calls=invalid,
        )

    # ---------------------------------------------------------------------------- planning

    def _enter(self) -> None:
        if self._busy:
            raise SessionBusy("another request of this session is in flight: one at a time")
        if self.failure is not None:
            raise self.failure
        if self.requests >= self.max_requests:
            self.failure = SessionBudgetExhausted(
                f"this session has made its {self.max_requests} requests (max_requests)"
            )
            raise self.failure
        self._busy = True

    def _plan_messages(self, messages: list[dict], tools: list[dict] | None) -> _Plan:
        if self._segment is None:
            return _Plan([], rewrite=self._encode(self._render(messages, tools)))
        pending, history = self._pending, self._history
        if history is not None and _starts_with(messages, history):
            if len(messages) == len(history):  # the same request again: the same context
                return _Plan(self._context())
            after, new = messages[len(history)], messages[len(history) + 1 :]
            key = _message_key(after)
            for i, reply in enumerate(pending.replies if pending else ()):
                if key == _reply_key(reply):
                    delta = self._encode(self._delta(new, reply.generation))
                    observations = [
                        (m.get("tool_call_id"), m["content"]) for m in new if m["role"] == "tool"
                    ]
                    return _Plan(self._context(i) + delta, i, delta, observations=observations)
        self._refuse_rewrite()
        return _Plan(
            [],
            self._evidence(messages),
            rewrite=self._encode(self._render(messages, tools)),
            observations=[
                (m.get("tool_call_id"), m["content"])
                for m in messages
                if m["role"] == "tool"
                and m.get("tool_call_id") in self._issued | self._pending_ids()
                and m.get("tool_call_id") not in self._answered
            ],
        )

    def _plan_ids(self, ids: list[int]) -> _Plan:
        if not ids:
            raise ValueError("generate_ids: an empty context")
        if self._segment is None:
            return _Plan([], rewrite=ids)
        if ids == self._context():
            return _Plan(ids)
        for i in range(len(self._pending.replies) if self._pending else 0):
            context = self._context(i)
            if ids[: len(context)] == context:
                return _Plan(ids, i, ids[len(context) :])
        self._refuse_rewrite()
        return _Plan([], 0 if self._pending else None, rewrite=ids)

    def _refuse_rewrite(self) -> None:
        if self.on_rewrite == "drop":
            raise SessionRewritten(
                "the request's messages do not extend the conversation so far (a turn was "
                "summarised, dropped or edited) and this session drops rewritten trajectories"
            )

    def _evidence(self, messages: list[dict]) -> int | None:
        """On a rewrite, the pending choice the agent acted on: one its messages hold, or whose
        tool call a tool message answers; else choice 0 (it was answered)."""
        if self._pending is None:
            return None
        keys = [_message_key(m) for m in messages if m["role"] == "assistant"]
        answered = {m.get("tool_call_id") for m in messages if m["role"] == "tool"}
        for i, reply in enumerate(self._pending.replies):
            if _reply_key(reply) in keys or any(c.id in answered for c in reply.tool_calls):
                return i
        return 0

    def _pending_ids(self) -> set[str]:
        if self._pending is None:
            return set()
        return {call.id for reply in self._pending.replies for call in reply.tool_calls}

    def _context(self, taken: int | None = None) -> list[int]:
        """The session's ids (prompt and response), then pending choice `taken` if given."""
        segment = self._segment
        context = segment.prompt + segment.ids
        if taken is not None:
            context += self._pending.prefix + self._pending.replies[taken].generation.token_ids
        return context

    # -------------------------------------------------------------------------- generating

    async def _generate(
        self, plan: _Plan, params: SamplingParams, n: int, prefix: str, read_calls: bool
    ) -> list[Reply]:
        if n < 1:
            raise ValueError(f"n {n}: at least 1")
        prefix_ids = self._encode(prefix) if prefix else []
        spent = self._spent + len(prefix_ids)
        if self._segment is not None:
            spent += len(self._segment.ids)
            if plan.taken is not None:
                spent += len(self._pending.prefix)
                spent += len(self._pending.replies[plan.taken].generation.token_ids)
        if plan.rewrite is None:
            spent += len(plan.delta)
        room = self.max_response_tokens - spent
        if room <= 0:
            if plan.taken is not None:  # the session ends with the choice the agent went on from
                self._final = plan.taken
            raise SessionBudgetExhausted(
                f"this session's {self.max_response_tokens} response tokens are spent "
                f"({spent} generated and observed)"
            )
        context = (plan.context if plan.rewrite is None else plan.rewrite) + prefix_ids
        params = replace(params, max_new_tokens=max(1, min(params.max_new_tokens, room)))
        generations = await self._engine_generate(context, params, n)
        for generation in generations:
            self.generated_tokens += len(generation.token_ids)
        if any(g.finish_reason == "abort" for g in generations):
            raise GenerationAborted("the engine aborted the generation (a weight update?)")
        replies, invalid = [], []
        for generation in generations:
            reply, bad = self._reply(prefix, generation, read_calls)
            replies.append(reply)
            invalid.append(bad)
        self._commit(plan, _Pending(prefix_ids, replies, invalid))
        self.context_length = len(context)
        return replies

    async def _engine_generate(
        self, context: list[int], params: SamplingParams, n: int
    ) -> list[Generation]:
        if n == 1:
            return [await self.engine.generate(context, params)]
        tasks = [asyncio.ensure_future(self.engine.generate(context, params)) for _ in range(n)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:  # one failed (or we were cancelled): the others are not wanted
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def _reply(self, prefix: str, generation: Generation, read_calls: bool) -> tuple[Reply, int]:
        """The reply to a generation, and how many `<tool_call>` blocks in it were no call."""
        ids = generation.token_ids
        text = prefix + self.tokenizer.decode(ids, skip_special_tokens=False)
        visible = text
        ended = generation.finish_reason == "stop" and generation.stop is None
        if ended and ids and ids[-1] in self._special:  # the end-of-turn token it stopped at
            visible = prefix + self.tokenizer.decode(ids[:-1], skip_special_tokens=False)
        if generation.stop:  # OpenAI's stop sequences are not part of the content
            at = visible.find(generation.stop, len(prefix))
            visible = visible if at < 0 else visible[:at]
        calls, kept, start, invalid = [], [], 0, 0
        if read_calls:
            for block in _CALL.finditer(visible):
                call = read_tool_call(block[1], reserved=())
                if call is not None and _json(call[1]):
                    calls.append(ToolCall(f"call_{secrets.token_hex(12)}", *call))
                    kept.append(visible[start : block.start()])
                    start = block.end()
            invalid = visible.count(CALL_OPEN) - len(calls)
        content = ("".join(kept) + visible[start:]).strip() or None
        finish = (
            "tool_calls"
            if calls
            else ("length" if generation.finish_reason == "length" else "stop")
        )
        return Reply(text, content, calls, generation, finish), invalid

    def _commit(self, plan: _Plan, pending: _Pending) -> None:
        """The request succeeded: the choice it continued from, its new messages (or a new
        segment), and its replies, pending until the next request says which was taken."""
        if plan.taken is not None:
            self._invalid += self._take(self._segment, self._pending, plan.taken, self._tool_calls)
        if plan.rewrite is not None:
            if self._segment is not None:
                self._spent += len(self._segment.ids)
            self._segment = _Segment(plan.rewrite)
            self._segments += 1
        else:
            self._segment.observe(plan.delta)
        for call_id, content in plan.observations:
            self._observations.append(content)
            if call_id:
                self._answered.add(call_id)
        self._issued |= {call.id for reply in pending.replies for call in reply.tool_calls}
        self._pending, self._final = pending, 0
        self.requests += 1

    @staticmethod
    def _take(
        segment: _Segment, pending: _Pending, index: int, calls: list[tuple[str, dict]]
    ) -> int:
        reply = pending.replies[index]
        segment.observe(pending.prefix)
        segment.generated(reply.generation)
        segment.texts.append(reply.text)
        calls += [(call.name, call.arguments) for call in reply.tool_calls]
        return pending.invalid[index]

    # --------------------------------------------------------------------------- rendering

    def _render(self, messages: list[dict], tools: list[dict] | None) -> str:
        extra = {"tools": tools} if tools else {}
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **extra
            )
        except Exception as exc:  # the template's own refusals (raise_exception) included
            message = f"the policy's chat template cannot render these messages: {exc}"
            raise ValueError(message) from exc

    def _delta(self, new: list[dict], after: Generation) -> str:
        """What the chat template writes for `new` after an assistant turn's content (the
        turn's end included) up to the next assistant turn's opening; without the end-of-turn
        token the reply already ends with."""
        mark = f"\x00{secrets.token_hex(8)}\x00"  # unguessable: no message can hold it
        turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" + mark}]
        text = self._render(turn + new, None)
        if text.count(mark) != 1:
            raise ValueError(
                "the policy's chat template does not render an assistant turn's content as "
                "given: the session cannot tell where the new messages start"
            )
        text = text.split(mark)[1]
        if after.finish_reason == "stop" and after.stop is None and after.token_ids:
            end = self.tokenizer.decode(after.token_ids[-1:], skip_special_tokens=False)
            if end and text.startswith(end):
                text = text[len(end) :]
        return text

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def normalise(messages: object) -> list[dict]:
    """Chat messages as the session compares and renders them: content a string (None -> "",
    text parts joined), `developer` as `system`, tool calls' arguments parsed (a JSON string as
    OpenAI sends them; the template gets an object). ValueError (one line, naming the message)
    for anything else."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: a non-empty list of chat messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ValueError(f"messages[{i}]: an object whose role is one of {', '.join(ROLES)}")
        role = message["role"]
        normal = {"role": ROLES[role], "content": _text(message.get("content"), i)}
        if role == "assistant" and message.get("tool_calls"):
            normal["tool_calls"] = [_tool_call(c, i) for c in message["tool_calls"]]
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                normal[key] = message[key]
        out.append(normal)
    return out


def _text(content: object, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"messages[{i}].content: only text parts are taken, not {kind}")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ValueError(f"messages[{i}].content: a string, a list of text parts or null")


def _tool_call(call: object, i: int) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(
            f"messages[{i}].tool_calls: each a {{type: function, function: {{name, arguments}}}}"
        )
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError, RecursionError):  # else compared as written
            arguments = json.loads(arguments)
    normal = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        normal["id"] = call["id"]
    return normal


def _json(arguments: dict) -> bool:
    """Whether `arguments` is JSON as every client reads it: Python's json takes NaN and
    Infinity, which a client could neither parse nor send back equal."""
    try:
        json.dumps(arguments, allow_nan=False)
    except ValueError:
        return False
    return True


def _message_key(message: dict) -> tuple:
    """What two messages must share to be the same turn: an assistant's stripped content and
    its calls by (name, arguments), whatever JSON spelled them and whatever ids they carry."""
    if message["role"] != "assistant":
        return (message["role"], message["content"])
    calls = tuple(
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())
    )
    return ("assistant", message["content"].strip(), calls)


def _reply_key(reply: Reply) -> tuple:
    calls = tuple((call.name, call.arguments) for call in reply.tool_calls)
    return ("assistant", (reply.content or "").strip(), calls)


def _starts_with(messages: list[dict], history: list[dict]) -> bool:
    return len(messages) >= len(history) and all(
        _message_key(a) == _message_key(b) for a, b in zip(messages, history, strict=False)
    )
