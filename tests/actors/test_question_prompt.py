"""A question's own prompt and tools (pipeline/assets/datasets.py's Question.messages and
Question.tools, from data.fields): the agent loop renders its messages instead of the format's
instruction, offers only its tools, and treats a call of another tool as an invalid action."""

import asyncio
from dataclasses import dataclass

import pytest
from transformers import AutoTokenizer

from actors.agent import AgentLoop, AgentSettings
from actors.engine import Generation
from actors.formats import DIRECT_INSTRUCTION, SEARCH_INSTRUCTION, render
from actors.tools import SearchTool
from retrieval.corpus import Passage


@dataclass(frozen=True)
class Task:
    id: str
    question: str
    ground_truth: tuple[str, ...]
    data_source: str = "q"
    messages: tuple[dict[str, str], ...] | None = None
    tools: tuple[str, ...] | None = None


class Stub:
    async def search(self, query, topk=3):
        return [(Passage("d1", "Varno Telik was born in Quorvex."), 0.9)]


class Scripted:
    """An engine that writes the given turns, each ending at its stop string."""

    generated_tokens = 0

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.prompts = tokenizer, list(turns), []

    async def generate(self, prompt_ids, params):
        self.prompts.append(list(prompt_ids))
        text, stop = self.turns.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return Generation(ids, [0.0] * len(ids), [0] * len(ids), "stop", stop)


@pytest.fixture(scope="module")
def tokenizer(tiny_policy_dir):
    return AutoTokenizer.from_pretrained(tiny_policy_dir)


def loop(tokenizer, turns=(), fmt="tags"):
    engine = Scripted(tokenizer, turns)
    tools = {"search": SearchTool(Stub())}
    return AgentLoop(engine, tokenizer, tools, AgentSettings(format=fmt)), engine


@pytest.mark.parametrize("fmt", ["tags", "chat_tools"])
def test_a_questions_own_messages_are_its_prompt(tokenizer, fmt):
    chat = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who?"})
    agent, _ = loop(tokenizer, fmt=fmt)
    own = agent.prompt_ids(Task("a", "Who?", ("x",), messages=chat))
    text = tokenizer.decode(own)
    assert "Who?" in text and "Question:" not in text and SEARCH_INSTRUCTION[:40] not in text
    if fmt == "tags":
        assert own == tokenizer.encode(render(tokenizer, list(chat)), add_special_tokens=False)
    # the same question without messages gets the format's instruction, cached apart
    assert "Question: Who?" in tokenizer.decode(agent.prompt_ids(Task("a", "Who?", ("x",))))


def test_a_questions_own_tools_are_the_only_ones_offered_and_callable(tokenizer):
    turns = [("<search> Varno Telik </search>", "</search>"), ("<answer> x </answer>", "</answer>")]
    agent, engine = loop(tokenizer, turns * 2)
    none = Task("a", "Where was Varno Telik born?", ("Quorvex",), tools=())
    cut = asyncio.run(agent.run(none, "a", 0))
    assert cut.tool_names == [] and agent.stats.invalid_actions == 1  # corrected, counted
    assert DIRECT_INSTRUCTION[:40] in tokenizer.decode(engine.prompts[0])  # no tool offered
    allowed = Task("b", "Where was Varno Telik born?", ("Quorvex",), tools=("search",))
    kept = asyncio.run(agent.run(allowed, "b", 0))
    assert kept.tool_names == ["search"] and agent.stats.invalid_actions == 1
    assert SEARCH_INSTRUCTION[:40] in tokenizer.decode(engine.prompts[2])
