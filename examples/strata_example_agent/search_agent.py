"""A search agent written with the OpenAI Agents SDK, trained by Strata unchanged.

Strata calls `agent(task, endpoint)` once per trajectory (actors.agent: {type: openai}). The agent
is ordinary Agents SDK code: an `Agent` with a function tool, run by `Runner`; the only Strata
thing about it is where its model lives (`endpoint.base_url` and `endpoint.api_key`: this
trajectory's session of the actor process's endpoint, on 127.0.0.1). Its tool searches the
run's own retrieval server (`endpoint.search_url`, served because the config's actors.tools is
[search]); it returns the final answer, which Strata scores with actors.reward.
"""

import aiohttp
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from openai import AsyncOpenAI

set_tracing_disabled(True)  # the SDK would send its traces to OpenAI: nothing leaves this machine

INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every "
    "time you get new information. If you find you lack some knowledge, call one of the tools; its "
    "result comes back to you. If you find no further external knowledge needed, provide the answer "
    "inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>."
)
"""The instruction the tiny policy's warm start was taught with (actors/formats.py's
CHAT_INSTRUCTION); a model that follows instructions needs none of it."""


async def retrieve(url: str, query: str, topk: int = 1) -> str:
    """The top passages for `query` from Strata's retrieval server, laid out as Search-R1 does."""
    body = {"queries": [query], "topk": topk}
    async with aiohttp.ClientSession() as http, http.post(f"{url}/retrieve", json=body) as answer:
        answer.raise_for_status()
        hits = (await answer.json())["result"][0]
    lines = []
    for i, hit in enumerate(hits, start=1):
        title, _, text = hit["contents"].partition("\n")
        lines.append(f"Doc {i}(Title: {title.strip(chr(34))}) {text}\n")
    return "".join(lines)


def answer_in(text: str | None) -> str | None:
    """The text between the last <answer> and </answer>, or None."""
    if text and "<answer>" in text and "</answer>" in text:
        return text.split("<answer>")[-1].split("</answer>")[0].strip()
    return None


async def agent(task, endpoint) -> str | None:
    """One trajectory: the SDK's Runner loops model -> tool -> model until the model answers."""

    @function_tool(name_override="search")  # the tool's name the warm start taught
    async def search(query: str) -> str:
        """Search the knowledge base; returns the top passages for the query.

        Args:
            query: What to search for.
        """
        return await retrieve(endpoint.search_url, query or task.question)

    # any client pointed at the endpoint works; `endpoint.client()` is the same client without
    # the ~50 ms of CPU that making one costs (docs/plugins.md)
    client = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    searcher = Agent(
        name="searcher",
        tools=[search],
        model=OpenAIChatCompletionsModel(model=endpoint.model, openai_client=client),
        # the first turn must call a tool (the tiny policy answers too early otherwise); the
        # SDK resets it to auto after a tool call, so later turns may answer
        model_settings=ModelSettings(tool_choice="required"),
    )
    try:
        result = await Runner.run(
            searcher, f"{INSTRUCTION} Question: {task.question}\n", max_turns=10
        )
    except (ModelBehaviorError, MaxTurnsExceeded):  # a call of a tool it lacks, no end: no answer
        return None  # (raising would drop the trajectory; this one is trained, at reward 0)
    return answer_in(str(result.final_output))
