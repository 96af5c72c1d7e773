"""The multi-turn tool-calling agent loop, token-in/token-out.

A trajectory is the prompt ids, then turns of generated ids (loss_mask 1, with the engine's
behaviour log-probs and versions) and tool observations appended as ids (loss_mask 0). Generated
text is decoded to find the action but never re-tokenised: the ids stay the truth. How often
decode-then-encode would have given other ids is measured (`retokenize_drift`).

Each turn ends where the format's actions end (`actors.formats`: Search-R1's `</search>`,
`</python>`, `</answer>` and each enabled tool's tag, or a chat model's `</tool_call>` and
`</answer>`; kept in the output). An answer ends the trajectory; a well-formed call of an enabled
tool gets its observation (arguments that do not fit the tool's schema: the tool's refusal, counted
as its error); anything else (no closed call, an empty, unknown or malformed action, a tool not
enabled) gets the format's corrective observation, counted. The last turn may only answer.

Every call is recorded in the trajectory's context (`actors.tools.TrajectoryContext`): its
`tool_calls` ((name, arguments)) and `observations` (the text each returned, before it is cut to
tokens), in order, what the reward sees; tools that keep per-trajectory state have it released
when the trajectory ends, however it ends.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from actors.engine import GenerationAborted, RolloutEngine, SamplingParams
from actors.formats import ANSWER_CLOSE, FORMATS, check_tool_names, tool_arguments
from actors.reward_view import RewardTask, RewardView
from actors.rewards import ANSWER_MATCHERS, extract_answer
from actors.scoring import Scoring
from actors.tools import (
    CURRENT_TRAJECTORY,
    Tool,
    ToolStats,
    TrajectoryContext,
    call_tool,
    trajectory,
)
from buffers.records import Trajectory
from buffers.strata import Stratifier, ToolCallCount


class TaskLike(Protocol):
    """What the loop needs of a question (pipeline.assets.datasets.Question satisfies it).
    Read when a question has them: `messages`, its own prompt as chat messages (instead of the
    format's instruction and the question), and `tools`, the names of the only tools it may call
    (None: every tool)."""

    id: str
    question: str
    ground_truth: tuple[str, ...]
    data_source: str


@dataclass(frozen=True)
class AgentSettings:
    max_turns: int = 4
    max_new_tokens_per_turn: int = 128
    max_response_tokens: int = 512
    max_observation_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    reward: Any = None
    """What scores a trajectory (`actors.scoring.Scoring.of`): None for the choice per data
    source (exact match; GAIA's scorer for gaia* sources), a built-in reward's name, a reward
    callable `score(view, task)`, or the weighted terms pipeline/ makes of `actors.reward`."""
    format_weight: float = 0.0
    """Weight of the format reward added to the outcome (0: none)."""
    latent_reward: float = 0.0
    """TSPO's first-occurrence latent reward beta for a wrong answer whose observations held a
    gold answer (0: off); see `AgentLoop.run`."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment over the last this many tokens of max_response_tokens
    (0: off); see `overlong_penalty`."""
    latent_match: str = "exact_match_span"
    """How a gold answer is found in an observation (a key of `rewards.ANSWER_MATCHERS`)."""
    stratifier: Stratifier = field(default_factory=ToolCallCount)
    """Assigns the stratum a trajectory is trained under, once, here (learner.stratifier)."""
    format: str = "tags"
    """How the agent and the model speak (a key of `actors.formats.FORMATS`)."""


def overlong_penalty(length: int, s: AgentSettings) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), subtracted from the reward: 0
    up to max_response_tokens - overlong_buffer tokens, then rising linearly to 1 at the budget.
    `length` counts generated and observation tokens, as the response budget does."""
    if s.overlong_buffer <= 0:
        return 0.0
    start = s.max_response_tokens - s.overlong_buffer
    return min(1.0, max(0.0, (length - start) / s.overlong_buffer))


@dataclass
class AgentStats:
    trajectories: int = 0
    turns: int = 0
    invalid_actions: int = 0
    retokenize_drift: int = 0  # trajectories whose decode->encode differs from the ids
    reward_errors: int = 0  # reward terms that raised, timed out or gave no number: scored 0
    finish: Counter = field(default_factory=Counter)
    tools: ToolStats = field(default_factory=ToolStats)
    failures: Counter = field(default_factory=Counter)
    """A custom or openai agent's dropped trajectories by kind (`AGENT_FAILURES`)."""
    rewrites: int = 0
    """Times a custom or openai agent rewrote its history (new segments) in the trajectories
    delivered."""


AGENT_FAILURES = ("raised", "timeout", "exit", "rewritten", "invalid")
"""How a custom or openai agent's trajectory can fail (actors/session_agent.py): the agent
raised, outlived actors.agent.deadline_s, its program exited with a status other than 0, it
rewrote its history under on_rewrite drop, or it returned what is no answer (or never
generated)."""


class AgentLoop:
    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        tools: dict[str, Tool],
        settings: AgentSettings,
        actor_id: str = "actor-0",
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.tools = tools
        self.format = FORMATS[settings.format]
        check_tool_names(tools)
        # the action that calls each tool, as the format names it (tags: web_search answers <search>)
        self._by_action = {self.format.call_name(n, t): t for n, t in tools.items()}
        self._stops = self.format.stops_for(self._by_action)
        self.settings = settings
        self.scoring = Scoring.of(settings.reward, settings.format_weight)
        self.actor_id = actor_id
        self.stats = AgentStats()
        self._prompts: dict[tuple, list[int]] = {}

    def prompt_ids(self, task: TaskLike) -> list[int]:
        """The question's prompt ids, rendered once for a group's members (the chat template and
        the encoding cost about a millisecond); the last 1024 questions are kept. A question's
        own messages are its prompt; its own tools are the only ones the prompt offers."""
        messages, allowed = getattr(task, "messages", None), getattr(task, "tools", None)
        key = (task.question, allowed, repr(messages))
        ids = self._prompts.get(key)
        if ids is None:
            if len(self._prompts) >= 1024:
                self._prompts.clear()
            tools = self.tools
            if allowed is not None:
                tools = {name: tool for name, tool in tools.items() if name in allowed}
            ids = self._prompts[key] = self.format.prompt_ids(
                self.tokenizer, tools, task.question, messages
            )
        return list(ids)

    async def run(self, task: TaskLike, prompt_id: str, sample_index: int) -> Trajectory:
        """One trajectory; raises EngineError if the engine fails or aborts a generation (the
        caller counts an abort and abandons the group)."""
        extra = getattr(task, "extra", None) or {}
        context = TrajectoryContext(files=tuple(extra.get("attachments", ())))
        token = CURRENT_TRAJECTORY.set(context)  # the tools' view of this trajectory
        try:
            return await self._run(task, prompt_id, sample_index)
        finally:
            CURRENT_TRAJECTORY.reset(token)
            await context.release(self.stats.tools)  # stateful tools' states, however it ended

    async def _run(self, task: TaskLike, prompt_id: str, sample_index: int) -> Trajectory:
        s = self.settings
        prompt = self.prompt_ids(task)
        # the question's own tools: a call of another is an invalid action, as a disabled tool's
        allowed, offered = getattr(task, "tools", None), None
        if allowed is not None:
            offered = {self.format.call_name(n, t) for n, t in self.tools.items() if n in allowed}
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        generated_text: list[str] = []
        tool_names: list[str] = []
        record = trajectory()  # its tool_calls and observations: what the reward sees
        first_turn = first_token = -1  # the tool call whose observation first held a gold answer
        finish = "no_answer"
        for turn in range(s.max_turns + 1):
            budget = min(s.max_new_tokens_per_turn, s.max_response_tokens - len(ids))
            if budget <= 0:
                finish = "length"
                break
            final = turn == s.max_turns
            params = SamplingParams(
                s.temperature, s.top_p, budget, (ANSWER_CLOSE,) if final else self._stops
            )
            generation = await self.engine.generate(prompt + ids, params)
            self.stats.turns += 1
            ids += generation.token_ids
            mask += [1] * len(generation.token_ids)
            logprobs += generation.logprobs
            versions += generation.versions
            text = self.tokenizer.decode(generation.token_ids, skip_special_tokens=False)
            generated_text.append(text)
            if generation.finish_reason == "abort":
                self.stats.finish["abort"] += 1
                raise GenerationAborted(
                    f"{prompt_id}#{sample_index}: the engine aborted turn {turn + 1} after "
                    f"{len(generation.token_ids)} tokens"
                )
            action = self.format.parse(text, generation)
            if action is not None and action[0] == "answer":
                finish = "answer"
                break
            if final:
                finish = "no_answer"
                break
            call = self._call(action)
            if call is not None and offered is not None and action[0] not in offered:
                call = None
            if call is not None:
                tool, arguments = call
                tool_names.append(tool.name)
                result = await call_tool(tool, arguments, self.stats.tools)
                record.tool_calls.append((tool.name, arguments))
                record.observations.append(result.text)
                observation = self.format.observation_ids(
                    self.tokenizer, tool, result.text, s.max_observation_tokens
                )
                found = ANSWER_MATCHERS[s.latent_match]
                if first_turn < 0 and found(result.text, list(task.ground_truth)):
                    first_turn, first_token = len(tool_names) - 1, len(ids)
            else:
                self.stats.invalid_actions += 1
                observation = self.format.correction_ids(self.tokenizer, self._by_action)
            room = s.max_response_tokens - len(ids)
            observation = observation[:room]
            ids += observation
            mask += [0] * len(observation)
            logprobs += [0.0] * len(observation)
            versions += [-1] * len(observation)
        response = "".join(generated_text)
        self._count(finish, ids, mask)
        view = RewardView(
            answer=extract_answer(response),
            response=response,
            tool_calls=tuple(record.tool_calls),
            observations=tuple(record.observations),
            turns=len(generated_text),
        )
        scored = await self.scoring(view, RewardTask.of(task))
        self.stats.reward_errors += scored.errors
        # TSPO (arXiv 2601.22776): a wrong answer whose search found the gold answer still earns
        # beta, credited to the turns up to that observation (the learner trains no token after
        # it), so a group of wrong answers keeps a signal for the searches that found it. An
        # outcome that failed to be scored is not known to be wrong.
        latent = 0.0
        if s.latent_reward > 0 and first_turn >= 0 and not scored.errors:
            latent = s.latent_reward if scored.outcome == 0 else 0.0
        return Trajectory(
            prompt_id=prompt_id,
            sample_index=sample_index,
            token_ids=ids,
            loss_mask=mask,
            behavior_logprobs=logprobs,
            token_versions=versions,
            reward=scored.reward + latent - overlong_penalty(len(ids), s),
            reward_components=scored.components,
            first_answer_turn=first_turn,
            first_answer_token=first_token,
            latent_reward=latent,
            prompt_token_ids=prompt,
            tool_names=tool_names,
            stratum=int(s.stratifier([tool_names], [f"{prompt_id}#{sample_index}"])[0]),
            data_source=task.data_source,
            question=task.question,
            ground_truth=list(task.ground_truth),
            finish_reason=finish,
            text=self.tokenizer.decode(ids, skip_special_tokens=False),
            actor_id=self.actor_id,
        )

    def _call(self, action: tuple[str, str | dict] | None) -> tuple[Tool, dict] | None:
        """The enabled tool an action calls and its arguments, or None: an invalid action (no
        action, an unknown or disabled tool, an empty input, text that is no JSON object)."""
        tool = self._by_action.get(action[0]) if action is not None else None
        if tool is None:
            return None
        arguments = tool_arguments(tool, action[1])
        return None if arguments is None else (tool, arguments)

    def _count(self, finish: str, ids: list[int], mask: list[int]) -> None:
        self.stats.trajectories += 1
        self.stats.finish[finish] += 1
        generated = [t for t, m in zip(ids, mask, strict=True) if m]
        text = self.tokenizer.decode(generated, skip_special_tokens=False)
        if self.tokenizer.encode(text, add_special_tokens=False) != generated:
            self.stats.retokenize_drift += 1
