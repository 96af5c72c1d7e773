"""Agents of your own, run over a trajectory session: what the custom and the openai agent share.

Either agent drives one trajectory through an `actors.agent_session.TrajectorySession`, which
keeps the ids the engine generated as the truth. `SessionAgent.run` gives the pool what
`actors.agent.AgentLoop.run` gives it: a `Trajectory` (the session's last segment, its tool calls
over the whole session, the stratum from the run's stratifier, the reward), or an `EngineError`
when the trajectory is lost, so the pool counts an abort and abandons the group exactly as for
the built-in loop, and the books balance the same way. The kinds of loss are counted in
`AgentStats.failures` (`actors.agent.AGENT_FAILURES`):

    the engine failed            the session's EngineError, raised again (the pool's `aborted`)
    the agent raised             raised
    past deadline_s              timeout (the agent is cancelled; a program's processes killed)
    a program exited non-zero    exit
    a rewrite under drop         rewritten
    no answer, reward or None    invalid (also: returned without generating a token)

Running out of `max_response_tokens` (or of requests, `max_turns` + 1) is not a loss: as the
built-in loop does, the trajectory ends there, is scored (on what the agent returned; nothing if
it raised because of it) and trained, finish_reason `length`.

What the agent returns: a str is the answer, scored by `actors.reward` with the recorded tool
calls and observations; a number is the reward itself (no reward term or format bonus is
added; the overlong penalty is); None is no answer.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from actors.agent import AgentSettings, AgentStats, TaskLike, overlong_penalty
from actors.agent_session import (
    SessionBudgetExhausted,
    SessionRecord,
    SessionRewritten,
    TrajectorySession,
)
from actors.engine import EngineError
from actors.reward_view import RewardTask, RewardView
from actors.scoring import Scoring
from actors.tools import CURRENT_TRAJECTORY, Tool, TrajectoryContext
from buffers.records import Trajectory


class AgentFailed(EngineError):
    """A custom or openai agent's trajectory is lost (`kind`, one of AGENT_FAILURES): the pool
    counts an abort and abandons its group, as for an engine failure."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class SessionAgent:
    """The pool's view of an agent of your own: `run(task, prompt_id, sample_index)` and
    `stats`. Subclasses open the session (`_open`), drive the agent on it (`_drive`) and close
    it (`_close`); `_calls` says which tool calls and observations the trajectory had."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        tools: dict[str, Tool],
        settings: AgentSettings,
        *,
        deadline_s: float,
        on_rewrite: str = "segment",
        actor_id: str = "actor-0",
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):  # what every session renders with
            raise ValueError(
                "actors.agent: a custom or openai agent's messages are rendered with the "
                "policy's chat template, and its tokenizer has none: use a chat model"
            )
        self.engine, self.tokenizer, self.tools = engine, tokenizer, tools
        self.settings = settings
        self.deadline_s, self.on_rewrite = deadline_s, on_rewrite
        self.actor_id = actor_id
        self.scoring = Scoring.of(settings.reward, settings.format_weight)
        self.stats = AgentStats()

    # ------------------------------------------------------------------------ for subclasses

    def _open(self) -> tuple[str | None, TrajectorySession]:
        """A fresh session (and its key, when it has one) for one trajectory."""
        raise NotImplementedError

    async def _drive(
        self, task: TaskLike, key: str | None, session: TrajectorySession, name: str
    ) -> Any:
        """Run the agent on `task` (the trajectory `name`d PROMPT#SAMPLE) to its end; what it
        returned."""
        raise NotImplementedError

    def _close(self, key: str | None) -> None:
        """The trajectory is over: the session takes no more requests."""

    def _calls(
        self, record: SessionRecord, context: TrajectoryContext
    ) -> tuple[list[tuple[str, dict]], list[str]]:
        """The trajectory's tool calls and their observations: those the session read."""
        return record.tool_calls, record.observations

    def session_limits(self) -> dict[str, Any]:
        """The settings every session of this agent is opened with."""
        s = self.settings
        return {
            "max_response_tokens": s.max_response_tokens,
            "max_requests": s.max_turns + 1,
            "on_rewrite": self.on_rewrite,
        }

    # ---------------------------------------------------------------------------- the run

    async def run(self, task: TaskLike, prompt_id: str, sample_index: int) -> Trajectory:
        """One trajectory; raises EngineError (AgentFailed among them) when it is lost."""
        name = f"{prompt_id}#{sample_index}"
        extra = getattr(task, "extra", None) or {}
        context = TrajectoryContext(files=tuple(extra.get("attachments", ())))
        token = CURRENT_TRAJECTORY.set(context)  # ctx.tool's view of this trajectory
        key, session = self._open()
        problem: AgentFailed | None = None
        returned: Any = None
        deadline = asyncio.timeout(self.deadline_s)
        try:
            async with deadline:
                returned = await self._drive(task, key, session, name)
        except AgentFailed as exc:
            problem = exc
        except Exception as exc:  # the agent's own code: anything may fail there
            if isinstance(exc, TimeoutError) and deadline.expired():
                problem = AgentFailed(
                    "timeout",
                    f"{name}: the agent ran past actors.agent.deadline_s {self.deadline_s:g}",
                )
            else:  # a TimeoutError of its own (a socket's) too
                problem = AgentFailed(
                    "raised", f"{name}: the agent raised {type(exc).__name__}: {exc}"
                )
        finally:
            self._close(key)
            CURRENT_TRAJECTORY.reset(token)
            await context.release(self.stats.tools)
        return await self._finish(
            task, prompt_id, sample_index, session, context, returned, problem
        )

    async def _finish(
        self,
        task: TaskLike,
        prompt_id: str,
        sample_index: int,
        session: TrajectorySession,
        context: TrajectoryContext,
        returned: Any,
        problem: AgentFailed | None,
    ) -> Trajectory:
        name = f"{prompt_id}#{sample_index}"
        failure = session.failure
        if isinstance(failure, EngineError):  # the agent failed because generation did
            self.stats.finish["abort"] += 1
            raise failure
        if isinstance(failure, SessionRewritten):
            problem = AgentFailed("rewritten", f"{name}: {failure}")
        out_of_budget = isinstance(failure, SessionBudgetExhausted)
        if out_of_budget and problem is not None and problem.kind in ("raised", "exit"):
            problem, returned = None, None  # it stopped because the budget did: a `length` end
        record = session.record()
        if problem is None and not record.token_ids:
            problem = AgentFailed("invalid", f"{name}: the agent returned without generating")
        answer, reward = None, None
        if problem is None:
            if isinstance(returned, str):
                answer = returned
            elif isinstance(returned, int | float) and not isinstance(returned, bool):
                reward = float(returned)
                if not math.isfinite(reward):
                    problem = AgentFailed("invalid", f"{name}: the agent returned {reward}")
            elif returned is not None:
                problem = AgentFailed(
                    "invalid",
                    f"{name}: the agent returned a {type(returned).__name__}: an agent returns "
                    "its answer (str), a reward (float) or None",
                )
        if problem is not None:
            self.stats.failures[problem.kind] += 1
            raise problem
        return await self._trajectory(
            task, prompt_id, sample_index, record, context, answer, reward, out_of_budget
        )

    async def _trajectory(
        self,
        task: TaskLike,
        prompt_id: str,
        sample_index: int,
        record: SessionRecord,
        context: TrajectoryContext,
        answer: str | None,
        reward: float | None,
        out_of_budget: bool,
    ) -> Trajectory:
        s = self.settings
        calls, observations = self._calls(record, context)
        tool_names = [name for name, _ in calls]
        components: dict[str, float] = {}
        given = reward is not None  # the agent's own reward: no term is scored
        if reward is None:
            view = RewardView(
                answer=answer,
                response=record.generated_text,
                tool_calls=tuple(calls),
                observations=tuple(observations),
                turns=record.requests,
            )
            scored = await self.scoring(view, RewardTask.of(task))
            self.stats.reward_errors += scored.errors
            reward, components = scored.reward, scored.components
        if out_of_budget:
            finish = "length"
        else:
            finish = "answer" if answer is not None else ("reward" if given else "no_answer")
        self.stats.trajectories += 1
        self.stats.turns += record.requests
        self.stats.invalid_actions += record.invalid_tool_calls
        self.stats.rewrites += record.segments - 1
        self.stats.finish[finish] += 1
        return Trajectory(
            prompt_id=prompt_id,
            sample_index=sample_index,
            token_ids=record.token_ids,
            loss_mask=record.loss_mask,
            behavior_logprobs=record.logprobs,
            token_versions=record.versions,
            reward=reward - overlong_penalty(len(record.token_ids), s),
            reward_components=components,
            prompt_token_ids=record.prompt_ids,
            tool_names=tool_names,
            stratum=int(s.stratifier([tool_names], [f"{prompt_id}#{sample_index}"])[0]),
            segments=record.segments,
            data_source=task.data_source,
            question=task.question,
            ground_truth=list(task.ground_truth),
            finish_reason=finish,
            text=self.tokenizer.decode(record.token_ids, skip_special_tokens=False),
            actor_id=self.actor_id,
        )

    async def close(self) -> None:
        """Nothing to release here; the openai agent's runner has."""
