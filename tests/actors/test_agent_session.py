"""The trajectory session behind the agent endpoint (actors/agent_session.py): the messages
check (a client that re-serialises tool-call arguments and sends content None still extends the
conversation), the new messages appended as the chat template writes them after an assistant
turn, rewrites (a new segment, or dropped), the budget, n > 1, the forced prefix, and exactness:
the trajectory's mask-1 ids are the engine's generated ids, byte for byte.

The engine is a scripted fake (it answers given text as token ids: the engine's boundary) except
in the last test, which runs the real tiny policy on the embedded engine."""

import asyncio
import json

import pytest

from actors.agent_session import (
    SessionBudgetExhausted,
    SessionBusy,
    SessionRewritten,
    TrajectorySession,
    normalise,
)
from actors.embedded import EmbeddedEngine
from actors.engine import EngineError, Generation, SamplingParams
from pipeline.assets.tiny_policy import CHAT_TEMPLATE, train_tokenizer
from tests.actors.conftest import TEXTS
from tests.actors.test_formats import QWEN_TEMPLATE

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the corpus.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "Varno Telik", "topk": 3}}\n</tool_call>'
QUESTION = [
    {"role": "system", "content": "Answer with tools."},
    {"role": "user", "content": "Where was Varno Telik born?"},
]
PARAMS = SamplingParams(max_new_tokens=256)


class ScriptedEngine:
    """A RolloutEngine that answers each request with the next scripted text, as the
    tokenizer's ids, cut at max_new_tokens (finish "length"), else ending at <|im_end|>
    (finish "stop") or at a stop string it holds (kept, as the engines keep it). Log-probs and
    versions are made up but distinct, so a copy from the wrong place shows."""

    def __init__(self, tokenizer, replies, version=3):
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.version = version
        self.contexts: list[list[int]] = []
        self.params: list[SamplingParams] = []
        self.generations: list[Generation] = []
        self.generated_tokens = 0
        self.gate: asyncio.Event | None = None  # set: requests wait for it

    async def served_versions(self):
        return {"scripted": self.version}

    async def generate(self, prompt_ids, params):
        self.contexts.append(list(prompt_ids))
        self.params.append(params)
        if self.gate is not None:
            await self.gate.wait()
        text = self.replies.pop(0)
        if isinstance(text, Exception):
            raise text
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        stop = next((s for s in params.stop if s in text), None)
        finish = "stop" if ids and (ids[-1] == 3 or stop) else "length"
        if len(ids) > params.max_new_tokens:
            ids, finish, stop = ids[: params.max_new_tokens], "length", None
        n = len(self.generations)
        generation = Generation(
            token_ids=ids,
            logprobs=[-0.01 * (n + 1) - 0.001 * i for i in range(len(ids))],
            versions=[self.version] * len(ids),
            finish_reason=finish,
            stop=stop if finish == "stop" else None,
        )
        self.generations.append(generation)
        self.generated_tokens += len(ids)
        return generation

    async def update_weights(self, version, *, state_dict=None, path=None):
        self.version = version

    async def close(self):
        pass


@pytest.fixture(scope="module")
def tokenizer():
    """The tests' tiny policy's tokenizer (the same texts and size as tests/actors/conftest.py),
    trained here: the session needs no model."""
    return train_tokenizer(TEXTS, 600)


@pytest.fixture(params=["tiny", "qwen"])
def template(request, tokenizer):
    tokenizer.chat_template = QWEN_TEMPLATE if request.param == "qwen" else CHAT_TEMPLATE
    yield request.param
    tokenizer.chat_template = CHAT_TEMPLATE


def session(engine, **kwargs):
    settings = {"max_response_tokens": 4096, "max_requests": 8} | kwargs
    return TrajectorySession(engine, engine.tokenizer, **settings)


def chat(s, messages, tools=TOOLS, **kwargs):
    kwargs.setdefault("params", PARAMS)
    return asyncio.run(s.chat(messages, tools=tools, **kwargs))


def as_sent(reply, reserialise=True):
    """The assistant message a client sends back: arguments re-serialised (other spacing and
    key order), content None when there was only a call, ids as the client keeps them."""
    calls = [
        {
            "id": call.id,
            "type": "function",
            "function": {
                "name": call.name,
                "arguments": json.dumps(dict(reversed(call.arguments.items())), indent=1)
                if reserialise
                else json.dumps(call.arguments),
            },
        }
        for call in reply.tool_calls
    ]
    message = {"role": "assistant", "content": reply.content}
    if calls:
        message["tool_calls"] = calls
    return message


def tool_result(reply, text):
    return {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": text}


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_tool_calling_conversation_is_the_engines_ids_and_the_templates_deltas(
    tokenizer, template
):
    engine = ScriptedEngine(
        tokenizer, [f"<think> search </think>{CALL}<|im_end|>", "It is Quorvex.<|im_end|>"]
    )
    s = session(engine)
    (first,) = chat(s, QUESTION)
    prompt = encode(
        tokenizer,
        tokenizer.apply_chat_template(
            QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=False
        ),
    )
    assert engine.contexts[0] == prompt
    assert first.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in first.tool_calls] == [
        ("search", {"query": "Varno Telik", "topk": 3})
    ]
    assert first.content == "<think> search </think>"
    assert first.tool_calls[0].id.startswith("call_") and len(first.tool_calls[0].id) == 29

    # the client re-serialises the arguments, sends content None-or-text and ids of its own
    sent = as_sent(first)
    sent["tool_calls"][0]["id"] = "call_client_side"
    messages = [
        *QUESTION,
        sent,
        {"role": "tool", "tool_call_id": "call_client_side", "content": "Born in Quorvex."},
    ]
    (second,) = chat(s, messages)
    delta = tokenizer.decode(engine.contexts[1][len(prompt) + len(first.generation.token_ids) :])
    if template == "qwen":
        assert delta == (
            "\n<|im_start|>user\n<tool_response>\nBorn in Quorvex.\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )
    else:  # the reply's own <|im_end|> ends its turn: not appended twice
        assert delta == "\n<|im_start|>tool\nBorn in Quorvex.<|im_end|>\n<|im_start|>assistant\n"
    assert engine.contexts[1][: len(prompt)] == prompt
    assert second.content == "It is Quorvex." and second.finish_reason == "stop"
    assert second.tool_calls == []

    record = s.record()
    assert record.prompt_ids == prompt
    assert record.token_ids == engine.contexts[1][len(prompt) :] + second.generation.token_ids
    generated = [t for t, m in zip(record.token_ids, record.loss_mask, strict=True) if m]
    assert generated == engine.generations[0].token_ids + engine.generations[1].token_ids
    assert [lp for lp, m in zip(record.logprobs, record.loss_mask, strict=True) if m] == (
        engine.generations[0].logprobs + engine.generations[1].logprobs
    )
    assert {v for v, m in zip(record.versions, record.loss_mask, strict=True) if not m} == {-1}
    assert {v for v, m in zip(record.versions, record.loss_mask, strict=True) if m} == {3}
    assert record.tool_calls == [("search", {"query": "Varno Telik", "topk": 3})]
    assert record.observations == ["Born in Quorvex."]
    assert (record.segments, record.requests, record.invalid_tool_calls) == (1, 2, 0)
    assert record.generated_tokens == len(generated)
    assert record.generated_text == first.text + second.text


def test_content_none_parts_and_developer_are_normalised():
    assert normalise(
        [
            {
                "role": "developer",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ]
    ) == [{"role": "system", "content": "ab"}, {"role": "assistant", "content": ""}]
    for bad, says in [
        ([], "non-empty list"),
        ([{"role": "robot", "content": "x"}], "role is one of"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "image_url"),
        ([{"role": "user", "content": 7}], "a string, a list of text parts"),
        ([{"role": "assistant", "content": "", "tool_calls": [{"x": 1}]}], "tool_calls"),
    ]:
        with pytest.raises(ValueError, match=says):
            normalise(bad)


def test_old_turns_are_never_rendered_again(tokenizer):
    """A template that drops old <think> blocks would re-render the first reply differently;
    the session keeps the ids generated."""
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{{ m.content.split('</think>')[-1] if m.role == 'assistant' else m.content }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    try:
        engine = ScriptedEngine(
            tokenizer, ["<think> hm </think> Quorvex?<|im_end|>", "Yes.<|im_end|>"]
        )
        s = session(engine)
        (first,) = chat(s, QUESTION)
        chat(s, [*QUESTION, as_sent(first), {"role": "user", "content": "Sure?"}])
        assert engine.contexts[1][: len(engine.contexts[0])] == engine.contexts[0]
        after = engine.contexts[1][len(engine.contexts[0]) :]
        assert after[: len(first.generation.token_ids)] == first.generation.token_ids
        assert tokenizer.decode(after).startswith(
            "<think> hm </think> Quorvex?<|im_end|>\n<|im_start|>user\nSure?"
        )
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE


def test_a_reply_cut_at_the_length_limit_gets_its_turn_closed(tokenizer):
    engine = ScriptedEngine(tokenizer, ["words " * 40, "ok<|im_end|>"])
    s = session(engine)
    (first,) = chat(s, QUESTION, params=SamplingParams(max_new_tokens=8))
    assert first.finish_reason == "length" and len(first.generation.token_ids) == 8
    chat(s, [*QUESTION, as_sent(first), {"role": "user", "content": "Go on."}])
    delta = engine.contexts[1][len(engine.contexts[0]) + 8 :]
    assert (
        tokenizer.decode(delta)
        == "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_rewritten_history_starts_a_segment_and_counts_over_the_session(tokenizer):
    engine = ScriptedEngine(
        tokenizer, [f"{CALL}<|im_end|>", f"{CALL}<|im_end|>", "Quorvex.<|im_end|>"]
    )
    s = session(engine)
    (first,) = chat(s, QUESTION)
    turn = [*QUESTION, as_sent(first), tool_result(first, "Doc one.")]
    (second,) = chat(s, turn)
    # the agent summarises: its first call and result become one user line, then the new result
    summary = [
        *QUESTION,
        {"role": "user", "content": "Notes: Doc one."},
        as_sent(second),
        tool_result(second, "Doc two."),
    ]
    (third,) = chat(s, summary)
    prompt = encode(
        tokenizer,
        tokenizer.apply_chat_template(
            normalise(summary), tools=TOOLS, add_generation_prompt=True, tokenize=False
        ),
    )
    assert engine.contexts[2] == prompt
    record = s.record()
    assert record.segments == 2
    assert record.prompt_ids == prompt and record.token_ids == third.generation.token_ids
    assert record.loss_mask == [1] * len(third.generation.token_ids)
    assert record.tool_calls == [("search", {"query": "Varno Telik", "topk": 3})] * 2
    assert record.observations == ["Doc one.", "Doc two."]  # each once
    assert record.generated_text == third.text


def test_a_rewrite_under_drop_fails_the_session(tokenizer):
    engine = ScriptedEngine(tokenizer, ["A.<|im_end|>", "B.<|im_end|>"])
    s = session(engine, on_rewrite="drop")
    (first,) = chat(s, QUESTION)
    edited = {"role": "assistant", "content": "Something else."}
    with pytest.raises(SessionRewritten, match="do not extend"):
        chat(s, [*QUESTION, edited, {"role": "user", "content": "?"}])
    assert isinstance(s.failure, SessionRewritten)
    with pytest.raises(SessionRewritten):  # even a request that extends it: the trajectory is lost
        chat(s, [*QUESTION, as_sent(first), {"role": "user", "content": "?"}])
    assert len(engine.contexts) == 1 and s.record().requests == 1


def test_the_budget_clips_max_tokens_and_then_refuses(tokenizer):
    engine = ScriptedEngine(tokenizer, ["word " * 10 + "<|im_end|>", "x" * 10, "y<|im_end|>"])
    s = session(engine, max_response_tokens=80)
    (first,) = chat(s, QUESTION, params=SamplingParams(max_new_tokens=1000))
    assert engine.params[0].max_new_tokens == 80
    spent = len(first.generation.token_ids)
    follow = [*QUESTION, as_sent(first), {"role": "user", "content": "More."}]
    (second,) = chat(s, follow, params=SamplingParams(max_new_tokens=1000))
    delta = len(engine.contexts[1]) - len(engine.contexts[0]) - spent
    assert engine.params[1].max_new_tokens == 80 - spent - delta
    with pytest.raises(SessionBudgetExhausted, match="80 response tokens"):
        chat(s, [*follow, as_sent(second), {"role": "user", "content": "x " * 50}])
    assert isinstance(s.failure, SessionBudgetExhausted) and len(engine.contexts) == 2


def test_a_request_refused_for_the_budget_still_says_which_choice_the_agent_took(tokenizer):
    engine = ScriptedEngine(tokenizer, ["A.<|im_end|>", "B.<|im_end|>"])
    s = session(engine, max_response_tokens=30)
    choices = chat(s, QUESTION, n=2)
    with pytest.raises(SessionBudgetExhausted):
        chat(s, [*QUESTION, as_sent(choices[1]), {"role": "user", "content": "x " * 40}])
    assert s.record().token_ids == choices[1].generation.token_ids


def test_max_requests(tokenizer):
    engine = ScriptedEngine(tokenizer, ["A<|im_end|>"] * 3)
    s = session(engine, max_requests=2)
    chat(s, QUESTION)
    chat(s, QUESTION)  # the same request again: generated from the same context
    assert engine.contexts[0] == engine.contexts[1]
    with pytest.raises(SessionBudgetExhausted, match="2 requests"):
        chat(s, QUESTION)


def test_n_choices_from_one_context_and_the_one_the_agent_took(tokenizer):
    replies = ["A.<|im_end|>", "B.<|im_end|>", "C.<|im_end|>", "D.<|im_end|>"]
    engine = ScriptedEngine(tokenizer, replies)
    s = session(engine)
    choices = chat(s, QUESTION, n=3)
    assert [c.content for c in choices] == ["A.", "B.", "C."]
    assert engine.contexts[0] == engine.contexts[1] == engine.contexts[2]
    assert s.record().token_ids == choices[0].generation.token_ids  # none taken yet: choice 0
    chat(s, [*QUESTION, as_sent(choices[2]), {"role": "user", "content": "Why?"}])
    assert engine.contexts[3][len(engine.contexts[0]) :][:3] == choices[2].generation.token_ids[:3]
    record = s.record()
    assert (
        record.token_ids[: len(choices[2].generation.token_ids)] == choices[2].generation.token_ids
    )
    assert record.generated_text == "C.<|im_end|>D.<|im_end|>"
    assert record.generated_tokens == sum(len(g.token_ids) for g in engine.generations)


def test_a_forced_prefix_is_masked_and_starts_the_reply(tokenizer):
    engine = ScriptedEngine(
        tokenizer, ['"search", "arguments": {"query": "x"}}\n</tool_call><|im_end|>']
    )
    s = session(engine)
    prefix = '<tool_call>\n{"name": '
    (reply,) = chat(s, QUESTION, forced_prefix=prefix)
    assert engine.contexts[0][-len(encode(tokenizer, prefix)) :] == encode(tokenizer, prefix)
    assert reply.text.startswith(prefix) and reply.tool_calls[0].arguments == {"query": "x"}
    record = s.record()
    n = len(encode(tokenizer, prefix))
    assert record.loss_mask[:n] == [0] * n and record.loss_mask[n:] == [1] * (
        len(record.loss_mask) - n
    )


def test_calls_that_do_not_parse_stay_in_the_content_and_are_counted(tokenizer):
    bad = '<tool_call>{"name": "search", "arguments": [1]}</tool_call>'
    nan = '<tool_call>{"name": "search", "arguments": {"k": NaN}}</tool_call>'
    engine = ScriptedEngine(
        tokenizer, [f'{bad} and {CALL}{nan} then <tool_call>{{"name<|im_end|>', "ok<|im_end|>"]
    )
    s = session(engine)
    (reply,) = chat(s, QUESTION)
    assert len(reply.tool_calls) == 1
    assert reply.content == f'{bad} and {nan} then <tool_call>{{"name'
    assert s.record().invalid_tool_calls == 3  # NaN: JSON to Python alone, to no client
    (plain,) = chat(s, QUESTION, tools=None)  # no tools offered: nothing is read as a call
    assert plain.tool_calls == [] and plain.content == "ok"


def test_a_stop_string_stays_in_the_ids_and_leaves_the_content(tokenizer):
    engine = ScriptedEngine(tokenizer, ["Quorvex. END more"])
    s = session(engine)
    (reply,) = chat(s, QUESTION, params=SamplingParams(stop=("END",)))
    assert reply.content == "Quorvex." and "END" in reply.text


def test_one_request_at_a_time_and_engine_errors_are_remembered(tokenizer):
    engine = ScriptedEngine(tokenizer, ["A<|im_end|>", EngineError("server down")])
    s = session(engine)

    async def two_at_once():
        engine.gate = asyncio.Event()
        first = asyncio.create_task(s.chat(QUESTION, tools=None, params=PARAMS))
        await asyncio.sleep(0)
        with pytest.raises(SessionBusy):
            await s.chat(QUESTION, tools=None, params=PARAMS)
        engine.gate.set()
        return await first

    (reply,) = asyncio.run(two_at_once())
    assert reply.content == "A" and len(engine.contexts) == 1
    with pytest.raises(EngineError, match="server down"):
        chat(s, [*QUESTION, as_sent(reply), {"role": "user", "content": "?"}])
    assert isinstance(s.failure, EngineError)
    with pytest.raises(EngineError, match="server down"):
        chat(s, QUESTION)
    assert len(engine.contexts) == 2 and s.record().requests == 1


def test_token_level_requests_extend_or_rewrite(tokenizer):
    engine = ScriptedEngine(tokenizer, ["A<|im_end|>", "B<|im_end|>", "C<|im_end|>"])
    s = session(engine)
    prompt = encode(tokenizer, "Q: where?")
    first = asyncio.run(s.generate_ids(prompt, PARAMS))
    observation = encode(tokenizer, "<information> x </information>")
    asyncio.run(s.generate_ids(prompt + first.token_ids + observation, PARAMS))
    record = s.record()
    assert record.prompt_ids == prompt
    assert record.loss_mask == [1] * len(first.token_ids) + [0] * len(observation) + [1] * 2
    asyncio.run(s.generate_ids(encode(tokenizer, "Q: elsewhere?"), PARAMS))
    assert s.record().segments == 2
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(s.generate_ids([], PARAMS))


def test_the_embedded_engine_trajectory_is_its_generated_ids_byte_for_byte(tiny_policy_dir):
    """The real tiny policy: what the session trains is exactly what the engine generated."""
    engine = EmbeddedEngine.from_pretrained(tiny_policy_dir, max_batch_size=4, seed=2)
    produced: list[Generation] = []
    generate = engine.generate

    async def recording(ids, params):
        out = await generate(ids, params)
        produced.append(out)
        return out

    engine.generate = recording
    s = session(engine, max_response_tokens=200)
    params = SamplingParams(max_new_tokens=16)

    async def conversation():
        messages, taken = list(QUESTION), []
        for turn in range(3):
            replies = await s.chat(messages, tools=TOOLS, params=params, n=2 if turn == 1 else 1)
            taken.append(replies[-1].generation)  # turn 2 takes its second choice
            messages += [as_sent(replies[-1]), {"role": "user", "content": f"And {turn}?"}]
        return taken

    taken = asyncio.run(conversation())
    assert len(produced) == 4 and all(any(g is p for p in produced) for g in taken)
    record = s.record()
    generated = [t for t, m in zip(record.token_ids, record.loss_mask, strict=True) if m]
    assert generated == [t for g in taken for t in g.token_ids]
    assert [lp for lp, m in zip(record.logprobs, record.loss_mask, strict=True) if m] == [
        lp for g in taken for lp in g.logprobs
    ]
    assert record.segments == 1 and record.requests == 3
    assert record.generated_tokens == sum(len(g.token_ids) for g in produced)
