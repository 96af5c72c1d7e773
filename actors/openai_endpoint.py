"""Strata's OpenAI-compatible endpoint (issue 70): `/v1/chat/completions` and `/v1/models` on
127.0.0.1, served by an actor process for the agents it runs, one session per trajectory.

Each trajectory gets an API key (`strata-` + 256 random bits) naming its `TrajectorySession`
(actors/agent_session.py: the messages check, the token bookkeeping, segments); a request with
no key, an unknown key or a finished session's key is refused, so another local process cannot
write into a trajectory. Generation goes through the pool's engine (`engine.generate`), with
the same admission and staleness rules as the built-in loop.

A request's parameters either act (temperature, top_p, max_tokens / max_completion_tokens,
stop, n, tools, tool_choice, logprobs), are accepted without effect because they change nothing
generated (model: there is one policy; user, metadata, store, parallel_tool_calls, ...), or are
refused with a 400 naming them: every other parameter at any value but its default (a seed, a
penalty, a response format, streaming). A second request while one of the same session is in
flight is refused (409), not queued: one trajectory is one conversation. Errors come in
OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`:

| status | code | when |
|---|---|---|
| 400 | invalid_request | the body is no JSON object, the messages are not chat messages |
| 400 | invalid_value | an acting parameter's value is out of range or of the wrong type |
| 400 | unsupported_parameter | any other parameter not at its default (`param` names it) |
| 400 | context_length_exceeded | the session's response tokens or requests are spent |
| 400 | history_rewritten | the agent rewrote its history and the session drops rewrites |
| 404 | unknown_session / finished_session | no such key / the trajectory is over |
| 409 | session_busy | another request of the session is in flight |
| 413 | request_entity_too_large | a body over 64 MiB |
| 503 | engine_error | the engine failed or aborted; the session keeps the error |

A session that failed (engine error, budget, rewrite under drop) answers every later request
with the same error: its trajectory is lost, and `TrajectorySession.failure` says why.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

from aiohttp import web

from actors.agent_session import (
    Reply,
    SessionBudgetExhausted,
    SessionBusy,
    SessionRewritten,
    TrajectorySession,
)
from actors.engine import EngineError, RolloutEngine, SamplingParams

LOOPBACK = ("127.0.0.1", "::1", "localhost")
MAX_CHOICES = 16
NO_EFFECT = {
    "model",
    "user",
    "metadata",
    "store",
    "parallel_tool_calls",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "safety_identifier",
}
"""Taken at any value: they change nothing generated (`model`: there is one policy)."""
DEFAULTS = {
    "stream": False,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": {},
    "response_format": {"type": "text"},
    "modalities": ["text"],
    "top_logprobs": 0,
}
"""Parameters taken only at their default (or null); any other value is refused by name."""


class Refused(Exception):
    """A request answered with an error: HTTP status, OpenAI's error code, the parameter."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


@dataclass(frozen=True)
class Request:
    """A chat completion request as the session takes it."""

    messages: list
    tools: list[dict] | None
    params: SamplingParams
    n: int
    forced_prefix: str
    logprobs: bool


@dataclass
class _Entry:
    session: TrajectorySession
    temperature: float
    top_p: float
    max_tokens_default: int
    max_tokens_limit: int | None
    task: asyncio.Task | None = None  # the request in flight


def read_request(body: object, entry: _Entry) -> Request:
    """The request's messages and what its parameters make of them, or `Refused` (400) naming
    the first parameter that is malformed or would change generation in a way not supported."""
    if not isinstance(body, dict):
        raise Refused(400, "invalid_request", "the request body must be a JSON object")
    if "messages" not in body:
        raise Refused(400, "invalid_request", "messages is required", "messages")
    for key, value in body.items():
        if value is None or key in NO_EFFECT or key in _ACTING:
            continue
        if key == "stream":
            if value is not False:
                raise Refused(
                    400,
                    "unsupported_parameter",
                    "stream: streaming is not supported by Strata's endpoint; send stream false",
                    "stream",
                )
            continue
        if key in DEFAULTS and value == DEFAULTS[key]:
            continue
        raise Refused(
            400,
            "unsupported_parameter",
            f"{key}: not supported by Strata's endpoint at {json.dumps(value)[:80]} (it would "
            f"change what is generated); leave it out",
            key,
        )
    temperature = _number(body, "temperature", 0.0, 2.0, entry.temperature)
    top_p = _number(body, "top_p", 0.0, 1.0, entry.top_p)
    if top_p == 0.0:
        raise Refused(400, "invalid_value", "top_p: above 0, at most 1", "top_p")
    wanted = _count(body, "max_completion_tokens", None) or _count(body, "max_tokens", None)
    max_tokens = wanted or entry.max_tokens_default
    if entry.max_tokens_limit is not None:
        max_tokens = min(max_tokens, entry.max_tokens_limit)
    n = _count(body, "n", 1)
    if n > MAX_CHOICES:
        raise Refused(400, "invalid_value", f"n: at most {MAX_CHOICES}", "n")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list)
        or len(stop) > 4
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise Refused(400, "invalid_value", "stop: a string or a list of up to 4", "stop")
    tools = _tools(body.get("tools"))
    tools, prefix = _tool_choice(body.get("tool_choice"), tools)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise Refused(400, "invalid_value", "logprobs: true or false", "logprobs")
    params = SamplingParams(temperature, top_p, max_tokens, tuple(stop or ()))
    return Request(body["messages"], tools, params, n, prefix, bool(logprobs))


_ACTING = {
    "messages",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "n",
    "tools",
    "tool_choice",
    "logprobs",
}


def _number(body: dict, key: str, low: float, high: float, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise Refused(400, "invalid_value", f"{key}: a number", key)
    if not low <= value <= high:
        raise Refused(400, "invalid_value", f"{key}: between {low:g} and {high:g}", key)
    return float(value)


def _count(body: dict, key: str, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Refused(400, "invalid_value", f"{key}: a whole number, at least 1", key)
    return value


def _tools(tools: object) -> list[dict] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise Refused(
            400,
            "invalid_value",
            "tools: a list of {type: function, function: {name, description, parameters}}",
            "tools",
        )
    return tools


def _tool_choice(choice: object, tools: list[dict] | None) -> tuple[list[dict] | None, str]:
    """The tools the request renders and reads, and the forced prefix: `none` offers none,
    `required` opens a call, a named function opens a call of it."""
    if choice is None or choice == "auto":
        return tools, ""
    if choice == "none":
        return None, ""
    if tools is None:
        raise Refused(400, "invalid_value", "tool_choice: only with tools", "tool_choice")
    if choice == "required":
        return tools, "<tool_call>\n"
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
    if name not in {t["function"]["name"] for t in tools}:
        raise Refused(
            400,
            "invalid_value",
            "tool_choice: none, auto, required or {type: function, function: {name}} naming "
            "one of the tools",
            "tool_choice",
        )
    return tools, f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": '


class AgentEndpoint:
    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        *,
        model_name: str = "strata-policy",
        host: str = "127.0.0.1",
        finished_kept: int = 65536,
    ) -> None:
        if host not in LOOPBACK:
            raise ValueError(
                f"the agent endpoint listens on loopback only ({', '.join(LOOPBACK)}), not {host!r}"
            )
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.host = host
        self.base_url = ""
        self.errors: Counter[str] = Counter()
        """Error answers by code (unknown_session, session_busy, ...)."""
        self.off_sampling = 0
        """Requests that sampled at another temperature or top_p than the session's defaults
        (actors.temperature and top_p, which the learner scores tokens at): their tokens'
        behaviour log-probs are the engine's at the request's own, so their trajectories are
        off-policy by that much. Said in one line, the first time."""
        self._sessions: dict[str, _Entry] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()  # the last `finished_kept` keys
        self._finished_kept = finished_kept
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Listen on an ephemeral port of `host`; `base_url` says where."""
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._shape])
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        # a client that hangs up (an agent killed) cancels its request, and its generation
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        port = self._runner.addresses[0][1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.base_url = f"http://{host}:{port}/v1"

    def open_session(
        self,
        *,
        max_response_tokens: int,
        max_requests: int,
        on_rewrite: str = "segment",
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens_default: int = 512,
        max_tokens_limit: int | None = None,
    ) -> tuple[str, TrajectorySession]:
        """A new trajectory's key and session. `temperature`, `top_p` and `max_tokens_default`
        are what a request that gives none gets; `max_tokens_limit` caps a request's own."""
        session = TrajectorySession(
            self.engine,
            self.tokenizer,
            max_response_tokens=max_response_tokens,
            max_requests=max_requests,
            on_rewrite=on_rewrite,
        )
        key = "strata-" + secrets.token_urlsafe(32)
        self._sessions[key] = _Entry(
            session, temperature, top_p, max_tokens_default, max_tokens_limit
        )
        return key, session

    def close_session(self, key: str) -> None:
        """The trajectory is over: later requests with `key` get 404 finished_session, and a
        request still in flight is cancelled (its generation dropped)."""
        entry = self._sessions.pop(key, None)
        if entry is None:
            return
        if entry.task is not None:
            entry.task.cancel()
        self._finished[key] = None
        while len(self._finished) > self._finished_kept:
            self._finished.popitem(last=False)

    async def close(self) -> None:
        for key in list(self._sessions):
            self.close_session(key)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ----------------------------------------------------------------------------- handlers

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "strata"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.Response:
        key = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        entry = self._sessions.get(key)
        if entry is None:
            if key in self._finished:
                raise Refused(404, "finished_session", "this session's trajectory is over")
            raise Refused(
                404,
                "unknown_session",
                "no session has this API key: use the key Strata gave the agent for its "
                "trajectory (Authorization: Bearer <key>)",
            )
        try:
            body = json.loads(await request.read())
        except (ValueError, RecursionError) as exc:
            raise Refused(400, "invalid_request", f"the body is not JSON: {exc}") from exc
        call = read_request(body, entry)
        self._check_sampling(call.params, entry)
        mine = entry.task is None  # else the session refuses this one: it is busy
        if mine:
            entry.task = asyncio.current_task()
        try:
            replies = await entry.session.chat(
                call.messages,
                tools=call.tools,
                params=call.params,
                n=call.n,
                forced_prefix=call.forced_prefix,
            )
        except SessionBusy as exc:
            raise Refused(409, "session_busy", str(exc)) from exc
        except SessionBudgetExhausted as exc:
            raise Refused(400, "context_length_exceeded", str(exc)) from exc
        except SessionRewritten as exc:
            raise Refused(400, "history_rewritten", str(exc), "messages") from exc
        except EngineError as exc:
            raise Refused(503, "engine_error", f"generation failed: {exc}") from exc
        except ValueError as exc:
            raise Refused(400, "invalid_request", str(exc), "messages") from exc
        finally:
            if mine:
                entry.task = None
        return web.json_response(self._answer(entry.session, replies, call.logprobs))

    def _check_sampling(self, params: SamplingParams, entry: _Entry) -> None:
        if (params.temperature, params.top_p) == (entry.temperature, entry.top_p):
            return
        self.off_sampling += 1
        if self.off_sampling == 1:
            print(
                f"strata: agent endpoint: a request samples at temperature {params.temperature}, "
                f"top_p {params.top_p}; the learner scores tokens at actors.temperature "
                f"{entry.temperature}, top_p {entry.top_p}, so these trajectories are off-policy "
                "(their behaviour log-probs are the engine's at the request's settings): set "
                "actors.temperature and top_p to what the agent asks, or leave them out of its "
                "requests",
                flush=True,
            )

    def _answer(self, session: TrajectorySession, replies: list[Reply], logprobs: bool) -> dict:
        choices = []
        for index, reply in enumerate(replies):
            message: dict = {"role": "assistant", "content": reply.content}
            if reply.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {
                            "name": call.name,
                            "arguments": json.dumps(call.arguments, ensure_ascii=False),
                        },
                    }
                    for call in reply.tool_calls
                ]
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "finish_reason": reply.finish_reason,
                    "logprobs": self._logprobs(reply) if logprobs else None,
                }
            )
        completion = sum(len(reply.generation.token_ids) for reply in replies)
        return {
            "id": "chatcmpl-" + secrets.token_hex(12),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": session.context_length,
                "completion_tokens": completion,
                "total_tokens": session.context_length + completion,
            },
        }

    def _logprobs(self, reply: Reply) -> dict:
        content = []
        for token, logprob in zip(
            reply.generation.token_ids, reply.generation.logprobs, strict=True
        ):
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            content.append(
                {
                    "token": text,
                    "logprob": logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [],
                }
            )
        return {"content": content}

    @web.middleware
    async def _shape(self, request: web.Request, handler) -> web.StreamResponse:
        """Every error in OpenAI's shape, counted by code."""
        try:
            return await handler(request)
        except Refused as exc:
            return self._error(exc.status, exc.code, str(exc), exc.param)
        except web.HTTPException as exc:  # no such path, method, a body over the size limit
            code = exc.reason.lower().replace(" ", "_")
            return self._error(exc.status, code, f"{request.method} {request.path}: {exc.reason}")
        except Exception as exc:  # a bug of ours: still an answer the client can read
            return self._error(500, "internal_error", f"{type(exc).__name__}: {exc}")

    def _error(self, status: int, code: str, message: str, param: str | None = None):
        self.errors[code] += 1
        kind = "server_error" if status >= 500 else "invalid_request_error"
        error = {"message": message, "type": kind, "param": param, "code": code}
        return web.json_response({"error": error}, status=status)
