"""The agent endpoint's cost: the built-in loop against an `openai`-client agent, same work.

Both paths run the same trajectories on one embedded engine (the tiny Qwen2 policy, greedy, so
both generate the very same tokens; the script checks it): `--turns` generations of at most
`--max-tokens` tokens each, a turn ended by `</tool_call>` or `</answer>`, and after each turn
that did not answer the chat_tools format's correction as a user message. The built-in path is
`actors.agent.AgentLoop` (format chat_tools, one tool offered, the model calling none); the
endpoint path is an agent written with the official `openai` client talking to
`actors.openai_endpoint.AgentEndpoint` on 127.0.0.1, one session per trajectory, its record
taken at the end as the pool does: with a client made per trajectory (`AsyncOpenAI(base_url=...,
api_key=...)`, as most agent code does), with `endpoint.client()` (one client per process, the
trajectory's key by `with_options`), and with a plain aiohttp client (the endpoint's own cost
without the `openai` library's). All run `--concurrency` trajectories at a time in the one
process and event loop, as an actor pool runs them with the embedded engine; the paths
alternate (`--repeats` each) so that drift in the machine's speed falls on all.

Printed: generated tokens/s of each path and their ratio (issue 70's target: endpoint >= 0.9 of
the built-in loop), and the endpoint's added latency per call: at concurrency 1, the client's
time for a request less the engine's time generating it (p50/p99 over every call).

    python benchmarks/agent_endpoint.py [--trajectories 64] [--concurrency 16] [--turns 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import aiohttp
import numpy as np
import torch
from openai import AsyncOpenAI

from actors.agent import AgentLoop, AgentSettings
from actors.embedded import EmbeddedEngine
from actors.formats import ANSWER_CLOSE, CHAT_CORRECTION, CHAT_INSTRUCTION
from actors.function_tools import function_tool
from actors.openai_agent import Endpoint
from actors.openai_endpoint import AgentEndpoint
from pipeline.assets.tiny_policy import build_tiny_policy

TEXTS = [
    f"Question {i}: where was Varno Telik born? <tool_call>\n"
    f'{{"name": "lookup", "arguments": {{"key": "Varno Telik {i}"}}}}\n</tool_call> '
    f"<answer> Quorvex </answer>"
    for i in range(3000)
]
STOPS = ["</tool_call>", ANSWER_CLOSE]


def lookup(key: str) -> str:
    """Look a key up in the atlas.

    key: what to look up
    """
    return f"{key}: nothing known"


class TimedEngine:
    """The engine, with the time each generation took (for the endpoint's added latency)."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.durations: list[float] = []

    @property
    def generated_tokens(self) -> int:
        return self.engine.generated_tokens

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, prompt_ids, params):
        start = time.perf_counter()
        out = await self.engine.generate(prompt_ids, params)
        self.durations.append(time.perf_counter() - start)
        return out


class Task:
    def __init__(self, i: int) -> None:
        self.id, self.question = f"q{i}", f"where was person {i} born?"
        self.ground_truth, self.data_source = ("Quorvex",), "bench"


async def builtin(engine, tokenizer, tasks, concurrency: int, turns: int, tokens: int) -> int:
    settings = AgentSettings(
        max_turns=turns - 1,
        max_new_tokens_per_turn=tokens,
        max_response_tokens=100_000,
        temperature=0.0,
        format="chat_tools",
    )
    loop = AgentLoop(engine, tokenizer, {"lookup": function_tool(lookup)}, settings)
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int, task: Task) -> int:
        async with slots:
            trajectory = await loop.run(task, task.id, i)
            return int(trajectory.loss_mask.sum())

    return sum(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))


async def endpoint_agent(
    endpoint: AgentEndpoint, tasks, concurrency: int, turns: int, tokens: int, shared=False
) -> tuple[int, list[float]]:
    schema = function_tool(lookup).schema
    slots = asyncio.Semaphore(concurrency)
    calls: list[float] = []

    async def one(task: Task) -> int:
        async with slots:
            key, session = endpoint.open_session(
                max_response_tokens=100_000, max_requests=turns, temperature=0.0
            )
            if shared:  # what `endpoint.client()` gives an openai agent: one client, its key
                client = Endpoint(endpoint.base_url, key, "strata-policy").client(max_retries=0)
            else:  # a client made for each trajectory, as most agent code does
                client = AsyncOpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0)
            content = f"{CHAT_INSTRUCTION} Question: {task.question}\n"
            messages: list = [{"role": "user", "content": content}]
            try:
                for turn in range(turns):
                    final = turn == turns - 1
                    start = time.perf_counter()
                    reply = await client.chat.completions.create(
                        model="strata-policy",
                        messages=messages,
                        tools=[schema],
                        temperature=0.0,
                        max_tokens=tokens,
                        stop=[ANSWER_CLOSE] if final else STOPS,
                    )
                    calls.append(time.perf_counter() - start)
                    message = reply.choices[0].message
                    if final or ANSWER_CLOSE in (message.content or ""):
                        break
                    messages += [message, {"role": "user", "content": CHAT_CORRECTION}]
                record = session.record()
            finally:
                endpoint.close_session(key)
                if not shared:
                    await client.close()
            return sum(record.loss_mask)

    generated = sum(await asyncio.gather(*(one(t) for t in tasks)))
    return generated, calls


async def raw_agent(
    endpoint: AgentEndpoint, tasks, concurrency: int, turns: int, tokens: int
) -> tuple[int, list[float]]:
    """The endpoint path with a plain aiohttp client posting JSON: the endpoint's own cost
    without the `openai` library's (which builds and validates typed objects a request)."""
    schema = function_tool(lookup).schema
    slots = asyncio.Semaphore(concurrency)
    calls: list[float] = []
    url = f"{endpoint.base_url}/chat/completions"

    async def one(http: aiohttp.ClientSession, task: Task) -> int:
        async with slots:
            key, session = endpoint.open_session(
                max_response_tokens=100_000, max_requests=turns, temperature=0.0
            )
            content = f"{CHAT_INSTRUCTION} Question: {task.question}\n"
            messages: list = [{"role": "user", "content": content}]
            headers = {"Authorization": f"Bearer {key}"}
            try:
                for turn in range(turns):
                    final = turn == turns - 1
                    body = {
                        "model": "strata-policy",
                        "messages": messages,
                        "tools": [schema],
                        "temperature": 0.0,
                        "max_tokens": tokens,
                        "stop": [ANSWER_CLOSE] if final else STOPS,
                    }
                    start = time.perf_counter()
                    async with http.post(url, json=body, headers=headers) as response:
                        reply = await response.json()
                    calls.append(time.perf_counter() - start)
                    message = reply["choices"][0]["message"]
                    if final or ANSWER_CLOSE in (message["content"] or ""):
                        break
                    messages += [message, {"role": "user", "content": CHAT_CORRECTION}]
                record = session.record()
            finally:
                endpoint.close_session(key)
            return sum(record.loss_mask)

    async with aiohttp.ClientSession() as http:
        generated = sum(await asyncio.gather(*(one(http, t) for t in tasks)))
    return generated, calls


async def shared_agent(endpoint, tasks, concurrency, turns, tokens):
    return await endpoint_agent(endpoint, tasks, concurrency, turns, tokens, shared=True)


PATHS = {
    "built-in loop": None,
    "endpoint, openai client": endpoint_agent,
    "endpoint, openai client from endpoint.client()": shared_agent,
    "endpoint, aiohttp client": raw_agent,
}


async def measure(path: str, args) -> None:
    engine = EmbeddedEngine.from_pretrained(path, max_batch_size=args.concurrency)
    tokenizer = engine.tokenizer
    timed = TimedEngine(engine)
    endpoint = AgentEndpoint(timed, tokenizer)
    await endpoint.start()
    tasks = [Task(i) for i in range(args.trajectories)]
    turns, tokens = args.turns, args.max_tokens
    await builtin(engine, tokenizer, tasks[:2], 2, 1, 8)  # warm-up, both paths
    await endpoint_agent(endpoint, tasks[:2], 2, 1, 8)
    rates: dict[str, list[float]] = {name: [] for name in PATHS}
    counts: dict[str, set[int]] = {name: set() for name in PATHS}
    for _ in range(args.repeats):
        for name, agent in PATHS.items():
            start = time.perf_counter()
            if agent is None:
                generated = await builtin(engine, tokenizer, tasks, args.concurrency, turns, tokens)
            else:
                generated, _ = await agent(endpoint, tasks, args.concurrency, turns, tokens)
            rates[name].append(generated / (time.perf_counter() - start))
            counts[name].add(generated)
    # the added latency: one trajectory at a time, so each call's generation is its own
    added = {}
    for name, agent in PATHS.items():
        if agent is None:
            continue
        timed.durations.clear()
        _, calls = await agent(endpoint, tasks[: args.latency_trajectories], 1, turns, tokens)
        added[name] = (np.array(calls) - np.array(timed.durations)) * 1000
    await endpoint.close()
    await engine.close()

    print(
        f"embedded engine, tiny Qwen2 (2 layers, hidden 128), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {args.trajectories} trajectories of up to {turns} "
        f"turns of {tokens} tokens, {args.concurrency} at a time, greedy; {args.repeats} "
        "alternating runs a path"
    )
    print(f"generated tokens a run: {counts}")
    if len(set().union(*counts.values())) != 1:
        print("WARNING: the paths generated different numbers of tokens: not the same work")
    base = statistics.median(rates["built-in loop"])
    print("| path | generated tokens/s (each run) | median | / built-in loop |")
    print("|---|---|---|---|")
    for name, values in rates.items():
        each = ", ".join(f"{v:,.0f}" for v in values)
        median = statistics.median(values)
        print(f"| {name} | {each} | {median:,.0f} | {median / base:.3f} |")
    print("(issue 70's target: the endpoint with the openai client >= 0.9 of the built-in loop)")
    engine_p50 = np.percentile(np.array(timed.durations) * 1000, 50)
    for name, values in added.items():
        p50, p99 = np.percentile(values, [50, 99])
        print(
            f"added latency a call, {name} (client time - engine time, concurrency 1, "
            f"{len(values)} calls): p50 {p50:.1f} ms, p99 {p99:.1f} ms"
        )
    print(f"(the engine's own time a call, p50: {engine_p50:.1f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-trajectories", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_policy(f"{tmp}/tiny", TEXTS))
        asyncio.run(measure(path, args))


if __name__ == "__main__":
    main()
