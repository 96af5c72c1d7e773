"""The agent endpoint (actors/openai_endpoint.py) spoken to by the real `openai` client (and the
OpenAI Agents SDK) on 127.0.0.1: a multi-turn tool-calling conversation, the parameters that
act, every bad input and what it gets, and the real tiny policy on the embedded engine, whose
trajectory is the engine's generated ids byte for byte."""

import asyncio
import json

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from actors.agent_session import normalise
from actors.embedded import EmbeddedEngine
from actors.engine import EngineError
from actors.openai_endpoint import AgentEndpoint
from pipeline.assets.tiny_policy import CHAT_TEMPLATE, train_tokenizer
from tests.actors.conftest import TEXTS
from tests.actors.test_agent import Script
from tests.actors.test_agent_session import CALL, QUESTION, TOOLS, ScriptedEngine
from tests.actors.test_formats import QWEN_TEMPLATE

ANSWER = "<answer> Quorvex </answer><|im_end|>"
SESSION = {"max_response_tokens": 2048, "max_requests": 8, "max_tokens_default": 256}


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = train_tokenizer(TEXTS, 600)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def served(engine, scenario, **session):
    """Run `scenario(endpoint, client, key, session)` against a started endpoint on `engine`."""

    async def main():
        endpoint = AgentEndpoint(engine, engine.tokenizer)
        await endpoint.start()
        key, trajectory = endpoint.open_session(**(SESSION | session))
        client = AsyncOpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0)
        try:
            return await scenario(endpoint, client, key, trajectory)
        finally:
            await client.close()
            await endpoint.close()

    return asyncio.run(main())


def refusal(exc_info) -> dict:
    """The error object of an `openai.APIStatusError`."""
    return exc_info.value.body if "code" in exc_info.value.body else exc_info.value.body["error"]


def test_a_tool_calling_conversation_through_the_openai_client(tokenizer):
    engine = ScriptedEngine(tokenizer, [f"<think> look </think>{CALL}<|im_end|>", ANSWER])

    async def scenario(endpoint, client, key, session):
        models = await client.models.list()
        assert [m.id for m in models.data] == ["strata-policy"]
        messages = list(QUESTION)
        first = await client.chat.completions.create(
            model="anything", messages=messages, tools=TOOLS
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "<think> look </think>"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "search"
        arguments = json.loads(call.function.arguments)
        assert arguments == {"query": "Varno Telik", "topk": 3}
        assert first.usage.prompt_tokens == len(engine.contexts[0])
        assert first.usage.completion_tokens == len(engine.generations[0].token_ids)
        # the client's own message object goes back, as most agent loops do it
        messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "Doc."}]
        second = await client.chat.completions.create(
            model="anything", messages=messages, tools=TOOLS
        )
        assert second.choices[0].message.content == "<answer> Quorvex </answer>"
        assert second.choices[0].message.tool_calls is None
        assert second.choices[0].finish_reason == "stop"
        assert second.id.startswith("chatcmpl-") and second.object == "chat.completion"
        return session.record()

    record = served(engine, scenario)
    assert record.segments == 1 and record.requests == 2
    generated = [t for t, m in zip(record.token_ids, record.loss_mask, strict=True) if m]
    assert generated == engine.generations[0].token_ids + engine.generations[1].token_ids
    assert record.tool_calls == [("search", {"query": "Varno Telik", "topk": 3})]
    assert record.observations == ["Doc."]
    assert (
        engine.contexts[1]
        == record.prompt_ids + record.token_ids[: len(engine.contexts[1]) - len(record.prompt_ids)]
    )


def test_the_parameters_that_act(tokenizer):
    replies = [
        "Quorvex. END never",
        "A<|im_end|>",
        "B<|im_end|>",
        "C<|im_end|>",
        '{"query": "x"}}\n</tool_call><|im_end|>',
        '{"name": "search", "arguments": {}}\n</tool_call><|im_end|>',
        f"{CALL}<|im_end|>",
    ]
    engine = ScriptedEngine(tokenizer, replies)

    async def scenario(endpoint, client, key, session):
        create = client.chat.completions.create
        stopped = await create(
            model="m",
            messages=QUESTION,
            temperature=0.3,
            top_p=0.9,
            max_tokens=5000,
            stop="END",
            logprobs=True,
        )
        params = engine.params[0]
        assert (params.temperature, params.top_p, params.stop) == (0.3, 0.9, ("END",))
        assert endpoint.off_sampling == 1  # not the session's 1.0 and 1.0: said, counted
        assert params.max_new_tokens == 100  # max_tokens_limit
        assert stopped.choices[0].message.content == "Quorvex."
        assert [t.logprob for t in stopped.choices[0].logprobs.content] == (
            engine.generations[0].logprobs
        )
        again = [*QUESTION, {"role": "user", "content": "Again."}]  # a rewrite: a new segment
        three = await create(model="m", messages=again, n=3, max_completion_tokens=7)
        assert [c.message.content for c in three.choices] == ["A", "B", "C"]
        assert [c.index for c in three.choices] == [0, 1, 2]
        assert {p.max_new_tokens for p in engine.params[1:4]} == {7}
        assert engine.params[1].temperature == 0.7  # the session's default
        named = await create(
            model="m",
            messages=[*again, three.choices[1].message, {"role": "user", "content": "Call."}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "search"}},
        )
        assert named.choices[0].message.tool_calls[0].function.name == "search"
        prefix = '<tool_call>\n{"name": "search", "arguments": '
        assert tokenizer.decode(engine.contexts[4]).endswith(prefix)
        required = await create(
            model="m",
            messages=[*QUESTION, {"role": "user", "content": "x"}],
            tools=TOOLS,
            tool_choice="required",
        )
        assert tokenizer.decode(engine.contexts[5]).endswith("<|im_start|>assistant\n<tool_call>\n")
        assert "<tools>" in tokenizer.decode(engine.contexts[5])
        assert required.choices[0].message.tool_calls[0].function.arguments == "{}"
        none = await create(
            model="m",
            messages=[*QUESTION, {"role": "user", "content": "y"}],
            tools=TOOLS,
            tool_choice="none",
        )
        assert none.choices[0].message.tool_calls is None  # no tools: nothing read as a call
        assert none.choices[0].message.content == CALL
        assert "<tools>" not in tokenizer.decode(engine.contexts[6])
        return session.record()

    tokenizer.chat_template = QWEN_TEMPLATE  # one that renders the tools
    try:
        record = served(engine, scenario, temperature=0.7, max_tokens_limit=100)
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE
    assert record.segments == 4


def test_every_bad_input_gets_its_status_and_code(tokenizer):
    engine = ScriptedEngine(tokenizer, ["A<|im_end|>", "B<|im_end|>", EngineError("down")])

    async def scenario(endpoint, client, key, session):
        url = endpoint.base_url + "/chat/completions"
        auth = {"Authorization": f"Bearer {key}"}
        async with aiohttp.ClientSession() as http:

            async def post(data, headers=auth):
                async with http.post(url, data=data, headers=headers) as response:
                    return response.status, (await response.json())["error"]

            status, error = await post("{not json")
            assert (status, error["code"], error["type"]) == (
                400,
                "invalid_request",
                "invalid_request_error",
            )
            assert (await post("[1, 2]"))[1]["code"] == "invalid_request"
            assert (await post("{}"))[1]["param"] == "messages"
            assert (await post(json.dumps({"messages": QUESTION}), {}))[1][
                "code"
            ] == "unknown_session"
            async with http.get(endpoint.base_url + "/nowhere") as response:
                assert response.status == 404 and "error" in await response.json()

        stranger = AsyncOpenAI(base_url=endpoint.base_url, api_key="strata-guess", max_retries=0)
        with pytest.raises(openai.NotFoundError) as caught:
            await stranger.chat.completions.create(model="m", messages=QUESTION)
        assert refusal(caught)["code"] == "unknown_session"
        await stranger.close()

        create = client.chat.completions.create
        for kwargs, param, code in [
            ({"seed": 7}, "seed", "unsupported_parameter"),
            ({"frequency_penalty": 0.5}, "frequency_penalty", "unsupported_parameter"),
            (
                {"response_format": {"type": "json_object"}},
                "response_format",
                "unsupported_parameter",
            ),
            ({"reasoning_effort": "high"}, "reasoning_effort", "unsupported_parameter"),
            ({"extra_body": {"top_k": 5}}, "top_k", "unsupported_parameter"),
            ({"top_logprobs": 2, "logprobs": True}, "top_logprobs", "unsupported_parameter"),
            ({"stream": True}, "stream", "unsupported_parameter"),
            ({"temperature": 5}, "temperature", "invalid_value"),
            ({"n": 0}, "n", "invalid_value"),
            ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
            ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "invalid_request"),
        ]:
            with pytest.raises(openai.BadRequestError) as caught:
                await create(**({"model": "m", "messages": QUESTION} | kwargs))
            error = refusal(caught)
            assert (error["param"], error["code"]) == (param, code), kwargs
            assert param in error["message"] or code == "invalid_request"
        assert engine.contexts == []  # nothing refused reached the engine
        # at their defaults, or without effect on what is generated: taken
        first = await create(
            model="any",
            messages=QUESTION,
            frequency_penalty=0,
            presence_penalty=0,
            seed=None,
            user="u",
            metadata={"a": "b"},
            store=False,
            parallel_tool_calls=True,
            stream=False,
            service_tier="auto",
            logit_bias={},
        )

        # two at once in one session: the second is refused, not queued
        engine.gate = asyncio.Event()
        follow = [*QUESTION, first.choices[0].message, {"role": "user", "content": "More?"}]
        running = asyncio.create_task(create(model="m", messages=follow))
        while len(engine.contexts) < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(openai.ConflictError) as caught:
            await create(model="m", messages=follow)
        assert refusal(caught)["code"] == "session_busy"
        engine.gate.set()
        second = await running

        # the engine fails: 503, remembered by the session, and so again for a retry
        follow += [second.choices[0].message, {"role": "user", "content": "And?"}]
        for _ in range(2):
            with pytest.raises(openai.InternalServerError) as caught:
                await create(model="m", messages=follow)
            assert caught.value.status_code == 503 and refusal(caught)["code"] == "engine_error"
        assert isinstance(session.failure, EngineError)

        endpoint.close_session(key)
        with pytest.raises(openai.NotFoundError) as caught:
            await create(model="m", messages=QUESTION)
        assert refusal(caught)["code"] == "finished_session"
        return dict(endpoint.errors)

    errors = served(engine, scenario)
    assert errors["session_busy"] == 1 and errors["engine_error"] == 2
    assert errors["unknown_session"] == 2 and errors["finished_session"] == 1


def test_budget_and_rewrites_under_drop_are_refused(tokenizer):
    engine = ScriptedEngine(tokenizer, ["word " * 10 + "<|im_end|>", "A<|im_end|>"])

    async def scenario(endpoint, client, key, session):
        create = client.chat.completions.create
        first = await create(model="m", messages=QUESTION)
        with pytest.raises(openai.BadRequestError) as caught:
            await create(model="m", messages=[*QUESTION, {"role": "assistant", "content": "Else."}])
        assert refusal(caught)["code"] == "history_rewritten"
        other_key, _ = endpoint.open_session(max_response_tokens=40, max_requests=8)
        small = AsyncOpenAI(base_url=endpoint.base_url, api_key=other_key, max_retries=0)
        reply = await small.chat.completions.create(model="m", messages=QUESTION)
        long = [*QUESTION, reply.choices[0].message, {"role": "user", "content": "x " * 40}]
        with pytest.raises(openai.BadRequestError) as caught:
            await small.chat.completions.create(model="m", messages=long)
        assert refusal(caught)["code"] == "context_length_exceeded"
        await small.close()
        return first

    served(engine, scenario, on_rewrite="drop")


def test_closing_a_session_cancels_its_request_in_flight(tokenizer):
    engine = ScriptedEngine(tokenizer, ["A<|im_end|>"])

    async def scenario(endpoint, client, key, session):
        engine.gate = asyncio.Event()
        running = asyncio.create_task(client.chat.completions.create(model="m", messages=QUESTION))
        while not engine.contexts:
            await asyncio.sleep(0.01)
        endpoint.close_session(key)
        with pytest.raises(openai.APIConnectionError):
            await running
        return session

    assert served(engine, scenario).requests == 0


def test_the_agents_sdk_extends_its_session(tokenizer):
    """The OpenAI Agents SDK converts the reply into items and back: its second request still
    extends the session (one segment), with the call and its result recorded."""
    import agents

    agents.set_tracing_disabled(True)
    engine = ScriptedEngine(
        tokenizer,
        [
            '<think> look it up </think><tool_call>\n{"name": "lookup", "arguments": {"word": "Telik"}}\n</tool_call><|im_end|>',
            ANSWER,
        ],
    )

    @agents.function_tool
    def lookup(word: str) -> str:
        """Look a word up."""
        return f"{word}: born in Quorvex"

    async def scenario(endpoint, client, key, session):
        model = agents.OpenAIChatCompletionsModel(model="strata-policy", openai_client=client)
        agent = agents.Agent(name="searcher", instructions="Answer.", tools=[lookup], model=model)
        result = await agents.Runner.run(agent, "Where was Varno Telik born?")
        assert "Quorvex" in result.final_output
        return session.record()

    record = served(engine, scenario)
    assert (record.segments, record.requests) == (1, 2)
    assert record.tool_calls == [("lookup", {"word": "Telik"})]
    assert record.observations == ["Telik: born in Quorvex"]


def test_the_sync_client_and_the_embedded_engine_byte_for_byte(tiny_policy_dir):
    """The real tiny policy on the embedded engine, steered to call a tool on its first turn
    and free on its second, through the synchronous `openai` client (in a worker thread): the
    trajectory's trained ids and log-probs are exactly the engine's."""
    engine = EmbeddedEngine.from_pretrained(tiny_policy_dir, max_batch_size=4, seed=3)
    produced = []
    generate = engine.generate

    async def recording(ids, params):
        produced.append(await generate(ids, params))
        return produced[-1]

    engine.generate = recording

    def agent(base_url, key):
        client = OpenAI(base_url=base_url, api_key=key, max_retries=0)
        messages = list(QUESTION)
        first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        (call,) = first.choices[0].message.tool_calls
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "Varno Telik: born in Quorvex."},
        ]
        second = client.chat.completions.create(model="m", messages=messages, max_tokens=12)
        client.close()
        return call.function.name, second.choices[0].finish_reason

    async def scenario(endpoint, client, key, session):
        with Script(engine, f"{CALL}<|im_end|>"):
            return await asyncio.to_thread(agent, endpoint.base_url, key), session.record()

    (name, finish), record = served(engine, scenario)
    assert name == "search" and finish in ("stop", "length")
    assert record.segments == 1 and len(produced) == 2
    generated = [t for t, m in zip(record.token_ids, record.loss_mask, strict=True) if m]
    assert generated == produced[0].token_ids + produced[1].token_ids
    trained = [lp for lp, m in zip(record.logprobs, record.loss_mask, strict=True) if m]
    assert trained == produced[0].logprobs + produced[1].logprobs
    prompt = engine.tokenizer.apply_chat_template(
        normalise(QUESTION), tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert engine.tokenizer.decode(record.prompt_ids) == prompt
