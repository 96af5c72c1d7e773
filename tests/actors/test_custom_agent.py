"""`actors.agent: {type: custom}` (actors/custom_agent.py): a class of your own drives the
trajectory with ctx.generate (chat messages or token ids) and ctx.tool; the trajectory is the
engine's ids, its tool calls are those made through ctx.tool (what the stratum and the reward
see), a tool's text is cut to max_observation_tokens, a question's own tools are the only ones
it may call, and the deadline holds. The engine is the session tests' scripted fake."""

import asyncio

import pytest

from actors.agent import AgentSettings
from actors.custom_agent import CustomAgent
from actors.engine import SamplingParams
from actors.function_tools import function_tool
from actors.session_agent import AgentFailed
from pipeline.assets.datasets import Question
from pipeline.assets.tiny_policy import CHAT_TEMPLATE, train_tokenizer
from tests.actors.conftest import TEXTS
from tests.actors.test_agent_session import ScriptedEngine
from tests.actors.test_openai_agent import ANSWER, TASK, generated_spans

SEEN = []
CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "Varno Telik"}}\n</tool_call>'


def search(query: str) -> str:
    """Search the corpus.

    Args:
        query: What to search for.
    """
    return f"Doc 1(Title: {query}) born in Quorvex. " + "Filler words follow here. " * 40


def seen_reward(view, task):
    SEEN.append(view)
    return float(view.answer == task.answers[0])


SETTINGS = AgentSettings(
    max_turns=4,
    max_new_tokens_per_turn=256,
    max_response_tokens=4096,
    max_observation_tokens=16,
    reward=seen_reward,
)


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = train_tokenizer(TEXTS, 600)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


class SearchAgent:
    """The module doc's example: messages, tool calls read by the session, tools by ctx.tool."""

    async def run(self, task, ctx):
        messages = [{"role": "user", "content": task.question}]
        for _ in range(4):
            reply = await ctx.generate(messages, tools=ctx.tools)
            messages.append(reply.message)
            if not reply.tool_calls:
                return reply.text.split("<answer>")[-1].split("</answer>")[0].strip()
            for call in reply.tool_calls:
                result = await ctx.tool(call.name, call.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return None


def run(engine, agent, tasks=(TASK,), settings=SETTINGS, **options):
    tools = {"search": function_tool(search)}

    async def main():
        custom = CustomAgent(
            agent,
            engine,
            engine.tokenizer,
            tools,
            settings,
            deadline_s=options.pop("deadline_s", 30.0),
            **options,
        )
        made = await asyncio.gather(
            *(custom.run(t, f"{t.id}@pool-0:{i}", 0) for i, t in enumerate(tasks)),
            return_exceptions=True,
        )
        return made, custom

    return asyncio.run(main())


def test_a_custom_agent_trains_the_engines_ids_and_its_ctx_tool_calls(tokenizer):
    SEEN.clear()
    engine = ScriptedEngine(tokenizer, [f"<think> look </think>{CALL}<|im_end|>", ANSWER])
    (t,), agent = run(engine, SearchAgent())
    assert t.tool_names == ["search"] and t.stratum == 1 and t.reward == 1.0
    assert generated_spans(t) == [g.token_ids for g in engine.generations]
    (view,) = SEEN
    assert view.tool_calls == (("search", {"query": "Varno Telik"}),)
    assert view.observations == (search("Varno Telik"),)  # whole, as the built-in loop's
    cut = tokenizer.decode(
        tokenizer.encode(search("Varno Telik"), add_special_tokens=False)[:16],
        skip_special_tokens=False,
    )
    assert cut in t.text and search("Varno Telik") not in t.text  # the context got 16 tokens
    assert agent.stats.tools.calls["search"] == 1 and agent.stats.trajectories == 1
    assert engine.params[0] == SamplingParams(1.0, 1.0, 256)  # the run's sampling


def test_token_ids_in_a_question_own_tools_and_an_unknown_tool(tokenizer):
    class IdsAgent:
        async def run(self, task, ctx):
            assert ctx.tools == []  # the question allows no tool
            refused = await ctx.tool("search", {"query": "x"})
            assert refused == "There is no tool 'search'; the tools are: none."
            prompt = ctx.tokenizer.encode(task.question, add_special_tokens=False)
            first = await ctx.generate(prompt, ctx.sampling(max_new_tokens=8))
            nudge = ctx.tokenizer.encode(" so:", add_special_tokens=False)
            second = await ctx.generate(prompt + first.token_ids + nudge, ctx.sampling())
            assert second.version == 3 and first.text == tokenizer.decode(first.token_ids)
            return 0.5

    task = Question("q-ids", TASK.question, ("Quorvex",), "minigaia_l1", tools=())  # no tool
    engine = ScriptedEngine(tokenizer, ["Varno", ANSWER])
    (t,), agent = run(engine, IdsAgent(), tasks=[task])
    assert t.reward == 0.5 and t.finish_reason == "reward" and t.tool_names == []
    assert generated_spans(t) == [g.token_ids for g in engine.generations]
    assert engine.params[0].max_new_tokens == 8
    assert agent.stats.invalid_actions == 1 and not agent.stats.tools.calls


def test_a_generation_asks_for_at_most_max_new_tokens_per_turn(tokenizer):
    class Greedy:
        async def run(self, task, ctx):
            messages = [{"role": "user", "content": task.question}]
            reply = await ctx.generate(messages, ctx.sampling(max_new_tokens=10_000))
            return reply.content

    engine = ScriptedEngine(tokenizer, [ANSWER])
    run(engine, Greedy())
    assert engine.params[0].max_new_tokens == 256


def test_a_custom_agent_past_its_deadline_is_cancelled_and_counted(tokenizer):
    class Stuck:
        async def run(self, task, ctx):
            await ctx.generate([{"role": "user", "content": "q"}])
            await asyncio.Event().wait()

    (failed,), agent = run(ScriptedEngine(tokenizer, [ANSWER]), Stuck(), deadline_s=0.5)
    assert isinstance(failed, AgentFailed) and failed.kind == "timeout"
    assert agent.stats.failures == {"timeout": 1}


def test_a_policy_without_a_chat_template_is_refused_when_the_agent_is_made():
    tokenizer = train_tokenizer(TEXTS, 600)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="its tokenizer has none: use a chat model"):
        CustomAgent(SearchAgent(), None, tokenizer, {}, SETTINGS, deadline_s=1.0)
