"""`actors.agent: {type: custom, path: "module:Class"}`: an agent class of your own.

The class is made once per actor pool, with no arguments; its `async run(task, ctx)` drives one
trajectory and returns the final answer (a str, scored by `actors.reward`), a reward (a float)
or None:

    class SearchAgent:
        async def run(self, task, ctx):
            messages = [{"role": "user", "content": task.question}]
            for _ in range(4):
                reply = await ctx.generate(messages, tools=ctx.tools)
                messages.append(reply.message)
                if not reply.tool_calls:
                    return reply.text
                for call in reply.tool_calls:
                    result = await ctx.tool(call.name, call.arguments)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})

`ctx.generate(messages, sampling)` renders chat messages with the policy's chat template (the
`tools` schemas given rendered too, and `<tool_call>` blocks read as chat_tools reads them);
`ctx.generate(token_ids, sampling)` takes the whole context as ids. Either way the trajectory is
the session's (actors/agent_session.py): the engine's own ids, log-probs and versions, what the
agent added since masked; a context that does not extend the one so far is a rewrite
(`actors.agent.on_rewrite`). `ctx.tool(name, arguments)` calls a tool of `actors.tools` (or an
MCP server's) as the built-in loop does (counted in the tool figures, a stateful tool's state
kept for the trajectory) and returns its text cut to `actors.max_observation_tokens` tokens; the
calls made through it are the trajectory's tool calls (its stratum) and what the reward sees.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from actors.agent import AgentSettings, TaskLike
from actors.agent_session import SessionRecord, ToolCall, TrajectorySession
from actors.engine import SamplingParams
from actors.formats import string_parameter
from actors.session_agent import SessionAgent
from actors.tools import Tool, TrajectoryContext, call_tool, trajectory


@dataclass
class Generated:
    """One generation: its text and the engine's own ids, log-probs and versions."""

    text: str
    """The decoded generated text (special tokens kept)."""
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    """The policy version that generated each token."""
    finish_reason: str
    """`tool_calls`, `length` or `stop` (from messages); the engine's own (from ids)."""
    content: str | None = None
    """From messages: the text without its end-of-turn token and tool calls, stripped."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """From messages with tools: the calls read from the text (each with id, name, arguments)."""

    @property
    def version(self) -> int:
        """The newest policy version among its tokens (-1: none generated)."""
        return max(self.versions, default=-1)

    @property
    def message(self) -> dict:
        """The reply as an assistant message to send back (content and tool calls)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in self.tool_calls
            ]
        return message


class AgentContext:
    """What `run(task, ctx)` gets: generation on this trajectory's session and the tools."""

    def __init__(
        self,
        session: TrajectorySession,
        agent: CustomAgent,
        task: TaskLike,
    ) -> None:
        self._session, self._agent = session, agent
        allowed = getattr(task, "tools", None)  # the question's own tools, when it names them
        self._tools = {
            name: tool for name, tool in agent.tools.items() if allowed is None or name in allowed
        }
        self.tokenizer = agent.tokenizer
        """The policy's tokenizer (its chat template renders the messages)."""

    @property
    def tools(self) -> list[dict]:
        """The schemas (OpenAI's function format) of the tools this trajectory may call."""
        return [tool.schema for tool in self._tools.values()]

    def sampling(self, **changes: Any) -> SamplingParams:
        """The run's sampling (actors.temperature, top_p, max_new_tokens_per_turn), changed."""
        return dataclasses.replace(self._agent.default_sampling, **changes)

    async def generate(
        self,
        prompt: list[dict] | list[int],
        sampling: SamplingParams | None = None,
        *,
        tools: list[dict] | None = None,
    ) -> Generated:
        """One generation after `prompt`: chat messages (rendered with `tools`, whose calls are
        then read) or the whole context as token ids. `sampling`: the run's when None; its
        max_new_tokens at most actors.max_new_tokens_per_turn (the budget may cut it further).
        Raises when the session is spent (max_response_tokens, max_turns + 1 generations) or
        lost (the engine failed, a rewrite under on_rewrite drop)."""
        params = sampling or self._agent.default_sampling
        ceiling = self._agent.default_sampling.max_new_tokens  # actors.max_new_tokens_per_turn
        if params.max_new_tokens > ceiling:
            params = dataclasses.replace(params, max_new_tokens=ceiling)
        if prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            made = await self._session.generate_ids(list(prompt), params)
            text = self.tokenizer.decode(made.token_ids, skip_special_tokens=False)
            return Generated(text, made.token_ids, made.logprobs, made.versions, made.finish_reason)
        (reply,) = await self._session.chat(list(prompt), tools=tools, params=params)
        made = reply.generation
        return Generated(
            reply.text,
            made.token_ids,
            made.logprobs,
            made.versions,
            reply.finish_reason,
            reply.content,
            reply.tool_calls,
        )

    async def tool(self, name: str, arguments: dict | str) -> str:
        """Call tool `name` with `arguments` (a dict; a bare string for a one-string tool) and
        return its text, cut to actors.max_observation_tokens tokens. A tool this trajectory may
        not call answers so, counted as an invalid action."""
        agent = self._agent
        tool = self._tools.get(name)
        if tool is None:
            agent.stats.invalid_actions += 1
            known = ", ".join(self._tools) or "none"
            return f"There is no tool {name!r}; the tools are: {known}."
        if isinstance(arguments, str):  # a one-string tool's argument
            arguments = {string_parameter(tool) or "input": arguments}
        result = await call_tool(tool, arguments, agent.stats.tools)
        record = trajectory()
        record.tool_calls.append((tool.name, arguments))
        record.observations.append(result.text)
        ids = self.tokenizer.encode(result.text, add_special_tokens=False)
        limit = agent.settings.max_observation_tokens
        if len(ids) <= limit:
            return result.text
        return self.tokenizer.decode(ids[:limit], skip_special_tokens=False)


class CustomAgent(SessionAgent):
    """Runs an instance of the configured class once per trajectory (see the module doc)."""

    def __init__(
        self,
        agent: Any,
        engine: Any,
        tokenizer: Any,
        tools: dict[str, Tool],
        settings: AgentSettings,
        *,
        deadline_s: float,
        on_rewrite: str = "segment",
        actor_id: str = "actor-0",
    ) -> None:
        super().__init__(
            engine,
            tokenizer,
            tools,
            settings,
            deadline_s=deadline_s,
            on_rewrite=on_rewrite,
            actor_id=actor_id,
        )
        self.agent = agent
        self.default_sampling = SamplingParams(
            settings.temperature, settings.top_p, settings.max_new_tokens_per_turn
        )

    def _open(self) -> tuple[str | None, TrajectorySession]:
        return None, TrajectorySession(self.engine, self.tokenizer, **self.session_limits())

    async def _drive(
        self, task: TaskLike, key: str | None, session: TrajectorySession, name: str
    ) -> Any:
        return await self.agent.run(task, AgentContext(session, self, task))

    def _calls(
        self, record: SessionRecord, context: TrajectoryContext
    ) -> tuple[list[tuple[str, dict]], list[str]]:
        """The calls made through ctx.tool: the agent reads the model's actions its own way."""
        return context.tool_calls, context.observations
