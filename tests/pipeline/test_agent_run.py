"""Agents of one's own trained end to end (issue 70): two short runs on the embedded engine, each
driving a search agent through the run's OpenAI-compatible endpoint, one written with the
official `openai` client, one with the OpenAI Agents SDK. Each agent runs its own search (the
run's retrieval server, `endpoint.search_url`) when its model calls the tool.

The run is `python -m pipeline.launch` with every generation of the engine written down
(tests/pipeline/recorded_launch.py): each trajectory's generated ids are held against them, byte
for byte (the ids the engine was given before them, the ids, their log-probs and versions), and
the books balance per stratum. The tiny policy is warm-started on the chat template's tool calls
(`actors.format: chat_tools`, what the endpoint reads): it calls the search tool in about 2 of
3 first replies on its own (the SDK's agent asks for a call on its first request, tool_choice
"required"), so strata above 0 come through the real clients."""

import importlib.util
import json
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np

from actors.formats import CHAT_INSTRUCTION
from buffers.reader import read_trajectories
from tests.conftest import assert_accounting, child_env
from tests.pipeline.test_local_run import ROOT, SHORT

COMMON = [
    "actors.format=chat_tools",  # the warm start teaches the template's tool calls
    "model.warm_start_epochs=6",
    "actors.tools=[search]",  # the retrieval server, served to the agent
    "actors.max_observation_tokens=256",  # local.yaml's 128 does not act for an openai agent
    "actors.max_new_tokens_per_turn=64",  # a JSON call needs ~50 of the tiny tokenizer's tokens
    "actors.max_response_tokens=320",
    "learner.max_steps=2",
]

SEARCH_SHARED = '''
import aiohttp

from actors.formats import CHAT_INSTRUCTION


async def search(url, query):
    """The run's retrieval server's top passage, as Search-R1 lays it out."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/retrieve", json={"queries": [query], "topk": 1}) as answer:
            hits = (await answer.json())["result"][0]
    lines = []
    for i, hit in enumerate(hits, start=1):
        title, _, text = hit["contents"].partition("\\n")
        lines.append(f"Doc {i}(Title: {title.strip(chr(34))}) {text}\\n")
    return "".join(lines)


def answer_in(text):
    if text and "<answer>" in text and "</answer>" in text:
        return text.split("<answer>")[-1].split("</answer>")[0].strip()
    return None
'''

OPENAI_CLIENT_AGENT = (
    SEARCH_SHARED
    + '''
import itertools
import json

from openai import AsyncOpenAI

from actors.tools import SEARCH_SCHEMA

_calls = itertools.count(1)


async def agent(task, endpoint):
    """A search agent on the official client: the tool its model calls, run here, in a loop."""
    if next(_calls) % 7 == 0:  # now and then a bug of its own: the trajectory is dropped
        raise RuntimeError("the agent tripped over its own parser")
    client = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages = [{"role": "user", "content": f"{CHAT_INSTRUCTION} Question: {task.question}\\n"}]
    for _ in range(3):
        reply = await client.chat.completions.create(
            model=endpoint.model, messages=messages, tools=[SEARCH_SCHEMA]
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return answer_in(message.content)
        for call in message.tool_calls:
            query = str(json.loads(call.function.arguments).get("query", ""))
            result = await search(endpoint.search_url, query or task.question)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
'''
)

EXAMPLE = ROOT / "examples" / "strata_example_agent"
"""The worked example's Agents SDK search agent (its README's run), trained here for 2 steps."""


def run_agent(tmp_path: Path, run_cache: Path, code: str, *sets: str):
    """A short run of `code`'s `agent` (written to a file, named by an import string), every
    generation recorded: (run_dir, the generations by (context, ids), stdout)."""
    plugin = tmp_path / "my_agent.py"
    plugin.write_text(textwrap.dedent(code))
    run_dir, generations = tmp_path / "run", tmp_path / "generations.jsonl"
    argv = [
        sys.executable,
        "-m",
        "tests.pipeline.recorded_launch",
        "configs/local.yaml",
        "--run-dir",
        str(run_dir),
        "--set",
        f"runtime.cache_dir={run_cache}",
        *SHORT,
        *(
            a
            for s in (*COMMON, f"actors.agent={{type: openai, path: {plugin}:agent}}", *sets)
            for a in ("--set", s)
        ),
    ]
    env = child_env() | {"STRATA_TEST_GENERATIONS": str(generations)}
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recorded = {}
    for line in generations.read_text().splitlines():
        context, ids, logprobs, versions = json.loads(line)
        recorded[tuple(context), tuple(ids)] = (logprobs, versions)
    return run_dir, recorded, proc.stdout


def assert_generated_byte_for_byte(run_dir: Path, recorded: dict) -> dict:
    """Every spilled trajectory's runs of generated (mask 1) ids are generations the engine
    made, after exactly the ids the trajectory holds before them, with their log-probs (as
    float32, the spill's type) and versions. Returns figures of the run."""
    columns = [
        "prompt_token_ids",
        "token_ids",
        "loss_mask",
        "behavior_logprobs",
        "token_versions",
        "tool_names",
        "stratum",
        "segments",
        "status",
        "finish_reason",
    ]
    table, bad = read_trajectories(run_dir / "trajectories", columns)
    assert not bad and table.num_rows
    spans = 0
    for row in table.to_pylist():
        full = row["prompt_token_ids"] + row["token_ids"]
        offset = len(row["prompt_token_ids"])
        mask = row["loss_mask"]
        i = 0
        while i < len(mask):
            if not mask[i]:
                i += 1
                continue
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            key = (tuple(full[: offset + i]), tuple(full[offset + i : offset + j]))
            assert key in recorded, (
                f"{row['status']} row: generated ids {i}:{j} were never generated so"
            )
            logprobs, versions = recorded[key]
            assert np.array_equal(np.float32(row["behavior_logprobs"][i:j]), np.float32(logprobs))
            assert row["token_versions"][i:j] == versions
            spans += 1
            i = j
        assert row["stratum"] == len(row["tool_names"])
        assert set(row["tool_names"]) <= {"search"}
    calls = Counter()
    for stratum, names in zip(
        table["stratum"].to_pylist(), table["tool_names"].to_pylist(), strict=True
    ):
        calls[stratum] += len(names)
    return {
        "rows": table.num_rows,
        "generated_spans": spans,
        "by_status": dict(Counter(table["status"].to_pylist())),
        "rows_per_stratum": dict(sorted(Counter(table["stratum"].to_pylist()).items())),
        "tool_calls_per_stratum": dict(sorted(calls.items())),
        "segments": dict(Counter(table["segments"].to_pylist())),
        "finish": dict(Counter(table["finish_reason"].to_pylist())),
    }


def test_an_agent_on_the_official_openai_client_trains_through_the_endpoint(tmp_path, run_cache):
    run_dir, recorded, out = run_agent(tmp_path, run_cache, OPENAI_CLIENT_AGENT)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [1.0, 2.0]
    figures = assert_generated_byte_for_byte(run_dir, recorded)
    assert sum(figures["tool_calls_per_stratum"].values()) > 0
    assert any(stratum > 0 for stratum in figures["rows_per_stratum"])
    assert steps[-1]["agent_failures/raised"] >= 1  # its bug: counted, its group abandoned
    assert "the agent tripped over its own parser" in out
    books = assert_accounting(run_dir)
    assert books["total"]["abandoned"] >= 1
    print("openai client run:", json.dumps(figures), json.dumps(books["per_stratum"]))


def test_the_example_agents_sdk_agent_trains_through_the_endpoint(tmp_path, run_cache):
    """examples/strata_example_agent's agent, with a periodic evaluation (steps 0 and 2, two held-out questions), which runs the same
    agent on an engine of its own, through an endpoint of its own."""
    code = (EXAMPLE / "search_agent.py").read_text()
    run_dir, recorded, out = run_agent(
        tmp_path, run_cache, code, "eval.every_steps=2", "eval.max_questions=2"
    )
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [1.0, 2.0]
    figures = assert_generated_byte_for_byte(run_dir, recorded)
    assert sum(figures["tool_calls_per_stratum"].values()) > 0
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2]
    assert all(row["tools"] for e in evals for row in e["rows"])  # no no-tools baseline rows
    assert "strata: eval: no no-tools baseline for actors.agent.type openai" in out
    books = assert_accounting(run_dir)
    print("agents sdk run:", json.dumps(figures), json.dumps(books["per_stratum"]))


def test_the_example_speaks_what_the_warm_start_teaches():
    """The example is standalone (no Strata import): its instruction is the chat_tools format's,
    which the tiny policy's warm start was taught with."""
    spec = importlib.util.spec_from_file_location("search_agent", EXAMPLE / "search_agent.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.INSTRUCTION == CHAT_INSTRUCTION
