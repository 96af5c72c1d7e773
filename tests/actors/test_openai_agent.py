"""`actors.agent: {type: openai}` (actors/openai_agent.py): an agent function (async, or sync
in a thread of its own) or a program, pointed at the real endpoint and spoken to with the real
`openai` client; the trajectory it leaves (the engine's ids, the tool calls the endpoint read,
the answer scored), and each way a trajectory is lost: the deadline, an agent that raises, a
program that exits 1, a rewrite under drop, the engine failing; the budget ends a trajectory
and trains it, as the built-in loop does. The engine is the session tests' scripted fake."""

import asyncio
import json
import os
import sys
import textwrap
import threading
import time

import pytest
from openai import AsyncOpenAI, OpenAI

from actors.agent import AgentSettings
from actors.engine import EngineError
from actors.openai_agent import CommandRunner, Endpoint, FunctionRunner, OpenAIAgent, task_json
from actors.openai_endpoint import AgentEndpoint
from actors.session_agent import AgentFailed
from pipeline.assets.tiny_policy import CHAT_TEMPLATE, train_tokenizer
from tests.actors.conftest import TEXTS
from tests.actors.test_agent import Task
from tests.actors.test_agent_session import CALL, TOOLS, ScriptedEngine

ANSWER = "<answer> Quorvex </answer><|im_end|>"
TASK = Task("q1", "Where was Varno Telik born?", ("Quorvex",))
SETTINGS = AgentSettings(max_turns=4, max_new_tokens_per_turn=256, max_response_tokens=2048)


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = train_tokenizer(TEXTS, 600)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def run(engine, runner, *, tasks=(TASK,), settings=SETTINGS, **options):
    """Each task's trajectory (or the exception it ended in) through an OpenAIAgent on a
    started endpoint, concurrently; and the agent."""

    async def main():
        endpoint = AgentEndpoint(engine, engine.tokenizer)
        await endpoint.start()
        agent = OpenAIAgent(
            runner,
            endpoint,
            engine,
            engine.tokenizer,
            {},
            settings,
            deadline_s=options.pop("deadline_s", 30.0),
            **options,
        )
        try:
            return await asyncio.gather(
                *(agent.run(t, f"{t.id}@pool-0:{i}", 0) for i, t in enumerate(tasks)),
                return_exceptions=True,
            ), agent
        finally:
            await endpoint.close()

    return asyncio.run(main())


def generated_spans(t) -> list[list[int]]:
    """The trajectory's runs of generated (mask 1) ids."""
    spans, current = [], []
    for token, mask in zip(t.token_ids.tolist(), t.loss_mask.tolist(), strict=True):
        if mask:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


async def search_agent(task, endpoint):
    """A small search agent of its own, on the official client: it runs the search its model
    asks for and loops until an answer."""
    client = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
    messages = [{"role": "user", "content": task.question}]
    for _ in range(4):
        reply = await client.chat.completions.create(
            model=endpoint.model, messages=messages, tools=TOOLS
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or ():
            query = json.loads(call.function.arguments)["query"]
            result = f"Doc 1(Title: {query}) born in Quorvex."
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if not message.tool_calls:
            content = message.content or ""
            return content.split("<answer>")[-1].split("</answer>")[0].strip()
    return None


def test_an_agent_on_the_official_client_trains_the_engines_ids_and_its_tool_calls(tokenizer):
    engine = ScriptedEngine(tokenizer, [f"<think> look </think>{CALL}<|im_end|>", ANSWER])
    (t,), agent = run(engine, FunctionRunner(search_agent))
    assert t.tool_names == ["search"] and t.stratum == 1 and t.segments == 1
    assert t.reward == 1.0 and t.finish_reason == "answer"
    assert generated_spans(t) == [g.token_ids for g in engine.generations]
    assert t.behavior_logprobs[t.loss_mask == 1].tolist() == pytest.approx(
        [x for g in engine.generations for x in g.logprobs]
    )
    assert list(t.prompt_token_ids) + t.token_ids.tolist()[: len(generated_spans(t)[0])] == (
        engine.contexts[0] + engine.generations[0].token_ids
    )
    assert "Doc 1(Title: Varno Telik) born in Quorvex." in t.text  # the result, masked
    assert agent.stats.trajectories == 1 and agent.stats.turns == 2
    assert agent.stats.finish["answer"] == 1 and not agent.stats.failures


def test_an_agent_that_never_returns_is_cancelled_at_its_deadline_and_counted(tokenizer):
    keys = []

    async def stuck(task, endpoint):
        keys.append(endpoint)
        client = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
        await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "q"}])
        await asyncio.sleep(3600)

    engine = ScriptedEngine(tokenizer, ["A<|im_end|>"])
    start = time.monotonic()
    (failed,), agent = run(engine, FunctionRunner(stuck), deadline_s=1.0)
    assert time.monotonic() - start < 10
    assert isinstance(failed, AgentFailed) and isinstance(failed, EngineError)
    assert failed.kind == "timeout"
    assert str(failed) == "q1@pool-0:0#0: the agent ran past actors.agent.deadline_s 1"
    assert agent.stats.failures == {"timeout": 1} and agent.stats.trajectories == 0


def test_the_session_is_closed_after_the_deadline_so_a_sync_agents_thread_is_refused(tokenizer):
    """A thread cannot be stopped: its requests from then on are refused (404
    finished_session)."""
    answered = []

    def slow(task, endpoint):
        time.sleep(2.0)  # past the deadline
        client = OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
        try:
            client.chat.completions.create(model="x", messages=[{"role": "user", "content": "q"}])
        except Exception as exc:
            answered.append(exc)

    async def main():
        engine = ScriptedEngine(tokenizer, [ANSWER])
        endpoint = AgentEndpoint(engine, engine.tokenizer)
        await endpoint.start()
        agent = OpenAIAgent(
            FunctionRunner(slow), endpoint, engine, tokenizer, {}, SETTINGS, deadline_s=1.0
        )
        try:
            with pytest.raises(AgentFailed) as failed:
                await agent.run(TASK, "q1@pool-0:0", 0)
            for _ in range(100):  # the endpoint still serves: the thread's request is answered
                if answered:
                    break
                await asyncio.sleep(0.05)
        finally:
            await endpoint.close()
        return failed.value

    failed = asyncio.run(main())
    assert failed.kind == "timeout"
    assert answered and getattr(answered[0], "status_code", None) == 404
    assert answered[0].code == "finished_session"


def test_a_sync_agent_that_blocks_does_not_stall_the_others(tokenizer):
    """The sync agent waits (in its thread) for the async one to have finished: were it on the
    event loop, neither would ever finish."""
    done = threading.Event()

    def patient(task, endpoint):
        assert done.wait(20), "the other trajectory never finished: the loop was stalled"
        client = OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
        reply = client.chat.completions.create(
            model=endpoint.model, messages=[{"role": "user", "content": task.question}]
        )
        return reply.choices[0].message.content.split("<answer>")[-1].split("</answer>")[0]

    async def quick(task, endpoint):
        client = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
        await client.chat.completions.create(
            model=endpoint.model, messages=[{"role": "user", "content": task.question}]
        )
        done.set()
        return "no idea"

    async def dispatch(task, endpoint):
        return await quick(task, endpoint)

    class Either:
        """Sync for q1 (a thread of its own), async for q2: two runners behind one agent."""

        def __init__(self):
            self.sync, self.coro = FunctionRunner(patient), FunctionRunner(dispatch)

        async def __call__(self, task, endpoint, name):
            return await (self.sync if task.id == "q1" else self.coro)(task, endpoint, name)

    engine = ScriptedEngine(tokenizer, [ANSWER, ANSWER])
    tasks = [TASK, Task("q2", "Q2?", ("x",))]
    (first, second), agent = run(engine, Either(), tasks=tasks)
    assert first.reward == 1.0 and second.reward == 0.0
    assert agent.stats.trajectories == 2


def test_an_agent_that_raises_is_counted_and_its_trajectory_dropped(tokenizer):
    async def broken(task, endpoint):
        client = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
        await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "q"}])
        raise KeyError("no parser for this")

    engine = ScriptedEngine(tokenizer, [ANSWER])
    (failed,), agent = run(engine, FunctionRunner(broken))
    assert isinstance(failed, AgentFailed) and failed.kind == "raised"
    assert str(failed) == "q1@pool-0:0#0: the agent raised KeyError: 'no parser for this'"
    assert agent.stats.failures == {"raised": 1}


@pytest.mark.parametrize(
    ("returned", "kind"), [([1, 2], "invalid"), (float("nan"), "invalid"), (0.25, None)]
)
def test_a_returned_reward_is_the_reward_and_anything_else_is_invalid(tokenizer, returned, kind):
    async def rewarding(task, endpoint):
        client = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
        await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "q"}])
        return returned

    (result,), agent = run(ScriptedEngine(tokenizer, [ANSWER]), FunctionRunner(rewarding))
    if kind is None:
        assert result.reward == 0.25 and result.finish_reason == "reward"
        assert result.reward_components == {}
    else:
        assert isinstance(result, AgentFailed) and result.kind == kind
        assert agent.stats.failures == {kind: 1}


def test_an_agent_that_never_generates_is_invalid(tokenizer):
    async def idle(task, endpoint):
        return "Quorvex"

    (failed,), _ = run(ScriptedEngine(tokenizer, []), FunctionRunner(idle))
    assert isinstance(failed, AgentFailed) and failed.kind == "invalid"
    assert "returned without generating" in str(failed)


def test_the_engines_failure_is_the_pools_abort_whatever_the_agent_did(tokenizer):
    async def forgiving(task, endpoint):
        client = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
        try:
            await client.chat.completions.create(
                model="x", messages=[{"role": "user", "content": "q"}]
            )
        except Exception:
            return "Quorvex"  # it swallowed the 503

    engine = ScriptedEngine(tokenizer, [EngineError("the server is gone")])
    (failed,), agent = run(engine, FunctionRunner(forgiving))
    assert type(failed) is EngineError and str(failed) == "the server is gone"
    assert agent.stats.finish["abort"] == 1 and not agent.stats.failures


def test_a_rewrite_under_drop_is_counted_and_under_segment_trains_the_last_segment(tokenizer):
    async def summarising(task, endpoint):
        client = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
        first = [{"role": "user", "content": task.question}]
        await client.chat.completions.create(model="x", messages=first)
        again = [{"role": "user", "content": "In short: " + task.question}]  # history rewritten
        reply = await client.chat.completions.create(model="x", messages=again)
        return reply.choices[0].message.content.split("<answer>")[-1].split("</answer>")[0]

    engine = ScriptedEngine(tokenizer, ["A<|im_end|>", ANSWER])
    (failed,), agent = run(engine, FunctionRunner(summarising), on_rewrite="drop")
    assert isinstance(failed, AgentFailed) and failed.kind == "rewritten"
    assert agent.stats.failures == {"rewritten": 1}

    engine = ScriptedEngine(tokenizer, ["A<|im_end|>", ANSWER])
    (t,), agent = run(engine, FunctionRunner(summarising), on_rewrite="segment")
    assert t.segments == 2 and t.reward == 1.0 and agent.stats.rewrites == 1
    assert generated_spans(t) == [engine.generations[1].token_ids]  # the last segment's
    assert t.prompt_token_ids.tolist() == engine.contexts[1]


def test_running_out_of_budget_ends_the_trajectory_which_is_trained(tokenizer):
    """Like the built-in loop's `length`: the agent that raised on the 400 is not a failure."""

    async def talkative(task, endpoint):
        client = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
        messages = [{"role": "user", "content": task.question}]
        while True:
            reply = await client.chat.completions.create(model="x", messages=messages)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            messages.append({"role": "user", "content": "go on"})

    settings = AgentSettings(max_turns=1, max_new_tokens_per_turn=256, max_response_tokens=2048)
    engine = ScriptedEngine(tokenizer, ["A<|im_end|>", "B<|im_end|>", "C<|im_end|>"])
    (t,), agent = run(engine, FunctionRunner(talkative), settings=settings)
    assert t.finish_reason == "length" and t.reward == 0.0
    assert len(engine.generations) == 2  # max_turns + 1 requests
    assert generated_spans(t) == [g.token_ids for g in engine.generations]
    assert agent.stats.finish["length"] == 1 and not agent.stats.failures


# ------------------------------------------------------------------------------------ programs

PROGRAM = """
import json, os, sys
from openai import OpenAI

task = json.load(sys.stdin)
print("reading", task["id"], file=sys.stderr)
client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"])
reply = client.chat.completions.create(
    model=os.environ["STRATA_MODEL"], messages=[{"role": "user", "content": task["question"]}]
)
content = reply.choices[0].message.content
if task["id"] == "q-fails":
    sys.exit("giving up on " + task["id"])
if task["id"] == "q-hangs":
    open(os.environ["PID_FILE"], "w").write(str(os.getpid()))
    import time; time.sleep(3600)
print(content.split("<answer>")[-1].split("</answer>")[0])
"""


def test_a_program_gets_the_task_on_stdin_and_the_endpoint_in_its_environment(tokenizer, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent(PROGRAM))
    log = tmp_path / "logs" / "agent-pool-0.log"
    engine = ScriptedEngine(tokenizer, [ANSWER])
    (t,), _ = run(engine, CommandRunner(["python", str(script)], log))
    assert t.reward == 1.0 and t.finish_reason == "answer"
    assert log.read_text() == "--- q1@pool-0:0#0: exit status 0\nreading q1\n"
    assert task_json(TASK) == {
        "id": "q1",
        "question": "Where was Varno Telik born?",
        "data_source": "minigaia_l1",
        "level": None,
        "messages": None,
        "tools": None,
        "extra": {},
    }  # the answers stay with the reward


def test_a_program_that_exits_1_is_counted_with_its_last_stderr_line(tokenizer, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent(PROGRAM))
    log = tmp_path / "agent.log"
    engine = ScriptedEngine(tokenizer, [ANSWER])
    task = Task("q-fails", "Q?", ("x",))
    (failed,), agent = run(engine, CommandRunner([sys.executable, str(script)], log), tasks=[task])
    assert isinstance(failed, AgentFailed) and failed.kind == "exit"
    assert str(failed) == (
        f"q-fails@pool-0:0#0: {sys.executable} exited with status 1: giving up on q-fails"
    )
    assert agent.stats.failures == {"exit": 1}
    assert "--- q-fails@pool-0:0#0: exit status 1\nreading q-fails\ngiving up on q-fails\n" in (
        log.read_text()
    )


def test_a_program_past_its_deadline_is_killed_with_its_process_group(
    tokenizer, tmp_path, monkeypatch
):
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent(PROGRAM))
    monkeypatch.setenv("PID_FILE", str(tmp_path / "pid"))
    engine = ScriptedEngine(tokenizer, [ANSWER])
    task = Task("q-hangs", "Q?", ("x",))
    runner = CommandRunner(["python", str(script)], tmp_path / "agent.log")
    (failed,), _ = run(engine, runner, tasks=[task], deadline_s=3.0)
    assert isinstance(failed, AgentFailed) and failed.kind == "timeout"
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert (
        "--- q-hangs@pool-0:0#0: killed (deadline or stop)" in (tmp_path / "agent.log").read_text()
    )


def test_endpoint_client_shares_one_client_with_each_trajectorys_key():
    """`endpoint.client()`: the process's one client for the endpoint (its connections shared),
    with this trajectory's key, without paying for a new client per trajectory."""

    async def main():
        first = Endpoint("http://127.0.0.1:9/v1", "strata-a", "m").client(max_retries=0)
        second = Endpoint("http://127.0.0.1:9/v1", "strata-b", "m").client()
        assert (first.api_key, second.api_key) == ("strata-a", "strata-b")
        assert str(first.base_url) == "http://127.0.0.1:9/v1/"
        assert first.max_retries == 0
        assert first._client is second._client  # one connection pool

    asyncio.run(main())
