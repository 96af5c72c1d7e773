import asyncio

import pytest
import torch

from actors.embedded import EmbeddedEngine
from actors.engine import EngineError, SamplingParams


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def engine(tiny_policy_dir):
    return EmbeddedEngine.from_pretrained(tiny_policy_dir, max_batch_size=8, seed=1)


def steer(engine, script_ids=(), ban_ids=()):
    """Force the real model's next tokens: step k of a single-row wave emits script_ids[k]; banned
    ids never win. The model, its KV cache and the sampling code stay real."""
    state = {"step": 0}

    def hook(module, inputs, output):
        logits = output.logits
        for token in ban_ids:
            logits[..., token] = -1e9
        if state["step"] < len(script_ids):
            logits[:, -1, script_ids[state["step"]]] = 1e9
        state["step"] += 1
        return output

    return engine.model.register_forward_hook(hook)


def test_logprobs_and_lengths_match_a_full_forward(engine):
    tok = engine.tokenizer
    prompt = tok.encode("Question 3: where was Varno Telik born?")
    out = run(engine.generate(prompt, SamplingParams(max_new_tokens=24)))
    assert len(out.token_ids) == len(out.logprobs) == len(out.versions) > 0
    assert set(out.versions) == {0}
    with torch.no_grad():
        full = torch.log_softmax(
            engine.model(torch.tensor([prompt + out.token_ids])).logits[0].float(), -1
        )
    expected = [full[len(prompt) - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    assert out.logprobs == pytest.approx(expected, abs=1e-4)


def test_batched_greedy_equals_one_at_a_time(engine, tiny_policy_dir):
    tok = engine.tokenizer
    prompts = [tok.encode("x " * n + "where") for n in range(1, 9)]
    params = SamplingParams(temperature=0.0, max_new_tokens=16)

    async def batched():
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    together = run(batched())
    assert engine.waves == 1  # all eight concurrent requests went through one wave
    alone = EmbeddedEngine.from_pretrained(tiny_policy_dir, max_batch_size=1)
    for prompt, joint in zip(prompts, together, strict=True):
        single = run(alone.generate(prompt, params))
        assert single.token_ids == joint.token_ids
        assert single.logprobs == pytest.approx(joint.logprobs, abs=1e-4)


def test_stop_strings_end_the_turn_and_are_kept(engine):
    tok = engine.tokenizer
    script = tok.encode("<think> hm </think><search> Varno Telik </search> extra words")
    handle = steer(engine, script)
    try:
        out = run(
            engine.generate(
                tok.encode("Q:"), SamplingParams(max_new_tokens=40, stop=("</search>", "</answer>"))
            )
        )
    finally:
        handle.remove()
    text = tok.decode(out.token_ids)
    assert (out.finish_reason, out.stop) == ("stop", "</search>")
    assert text.endswith("</search>") and "extra" not in text


def test_eos_and_length(engine):
    tok = engine.tokenizer
    handle = steer(engine, [tok.encode("a")[0], tok.eos_token_id])
    try:
        out = run(engine.generate(tok.encode("Q:"), SamplingParams(max_new_tokens=40)))
    finally:
        handle.remove()
    assert (
        out.finish_reason == "stop"
        and out.token_ids[-1] == tok.eos_token_id
        and len(out.token_ids) == 2
    )
    handle = steer(engine, ban_ids=engine._end_ids)
    try:
        out = run(engine.generate(tok.encode("Q:"), SamplingParams(max_new_tokens=7)))
    finally:
        handle.remove()
    assert out.finish_reason == "length" and len(out.token_ids) == 7


def test_weights_change_between_decode_steps(engine):
    tok = engine.tokenizer
    handle = steer(engine, ban_ids=engine._end_ids)
    old_weights = {
        k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"
    }
    new_weights = {k: v + 0.01 * torch.randn_like(v) for k, v in engine.model.state_dict().items()}
    prompt = tok.encode("Q:")

    async def scenario():
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=300)))
        while engine.generated_tokens < 20:
            await asyncio.sleep(0.001)
        await engine.update_weights(1, state_dict=new_weights)
        assert engine.version == 1
        return await task

    try:
        out = run(scenario())
        switch = out.versions.index(1)
        assert 0 < switch < len(out.versions)
        assert out.versions == [0] * switch + [1] * (
            len(out.versions) - switch
        )  # one trajectory, two versions
        with torch.no_grad():  # the old weights, through the same ban hook
            ids = torch.tensor([prompt + out.token_ids])
            old = torch.func.functional_call(engine.model, old_weights, (ids,)).logits[0]
        old = torch.log_softmax(old.float(), -1)
        under_old = [old[len(prompt) - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    finally:
        handle.remove()
    # A token labelled with the old version came from the old weights' logits; the first token
    # labelled new did not (its label is never fresher than the weights that produced it).
    assert out.logprobs[:switch] == pytest.approx(under_old[:switch], abs=1e-4)
    assert abs(out.logprobs[switch] - under_old[switch]) > 1e-3
    served = engine.model.state_dict()
    assert (
        served["model.norm.weight"].data_ptr() == new_weights["model.norm.weight"].data_ptr()
    )  # adopted
    assert (
        engine.model.lm_head.weight.data_ptr() == served["model.embed_tokens.weight"].data_ptr()
    )  # tied


def test_weights_from_an_hf_checkpoint(engine, tmp_path):
    tok = engine.tokenizer
    engine.model.save_pretrained(tmp_path / "v5")
    run(engine.update_weights(5, path=str(tmp_path / "v5")))
    assert (
        run(engine.generate(tok.encode("Q:"), SamplingParams(max_new_tokens=3))).versions
        == [5, 5, 5][:3]
    )
    with pytest.raises(ValueError, match="do not fit the model"):
        run(engine.update_weights(6, state_dict={"nonsense.weight": torch.zeros(1)}))
    assert engine.version == 5


def test_cancelled_requests_leave_the_others_alone(engine):
    tok = engine.tokenizer
    handle = steer(engine, ban_ids=engine._end_ids)

    async def scenario():
        params = SamplingParams(max_new_tokens=60)
        doomed = asyncio.create_task(engine.generate(tok.encode("A"), params))
        survivor = asyncio.create_task(engine.generate(tok.encode("B"), params))
        while engine.generated_tokens < 10:
            await asyncio.sleep(0.001)
        doomed.cancel()
        result = await survivor
        with pytest.raises(asyncio.CancelledError):
            await doomed
        again = await engine.generate(tok.encode("C"), SamplingParams(max_new_tokens=5))
        return result, again

    try:
        result, again = run(scenario())
    finally:
        handle.remove()
    assert len(result.token_ids) == 60 and len(again.token_ids) == 5


def test_prompts_at_the_position_limit_and_empty_prompts(engine):
    limit = engine.model.config.max_position_embeddings
    out = run(engine.generate([5] * limit, SamplingParams(max_new_tokens=10)))
    assert (out.token_ids, out.finish_reason) == ([], "length")
    with pytest.raises(EngineError, match="empty prompt"):
        run(engine.generate([], SamplingParams()))


def test_the_engine_takes_the_models_dtype_from_config(tiny_policy_dir):
    """model.dtype reaches the embedded engine (built as every runtime builds it)."""
    from pipeline.config.schema import PretrainedModel, StrataConfig
    from pipeline.runtime.parts import make_engine

    config = StrataConfig(model=PretrainedModel(path=str(tiny_policy_dir), dtype="bfloat16"))
    engine = make_engine(config, tiny_policy_dir)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert engine.device.type == "cpu"
    default = make_engine(StrataConfig(), tiny_policy_dir)  # the tiny policy: float32
    assert {p.dtype for p in default.model.parameters()} == {torch.float32}


# ------------------------------------------------------------------------ continuous batching


def test_a_request_joins_a_running_batch_and_leaves_before_it(engine):
    """A turn that arrives mid-batch is prefilled and decoded beside the running row at once,
    not after the running row's 300 tokens; with join_running off it waits for them."""
    tok = engine.tokenizer
    handle = steer(engine, ban_ids=engine._end_ids)

    async def scenario():
        start = engine.generated_tokens
        long = asyncio.create_task(
            engine.generate(tok.encode("A"), SamplingParams(max_new_tokens=300))
        )
        while engine.generated_tokens < start + 10:
            await asyncio.sleep(0.001)
        short = await engine.generate(tok.encode("B"), SamplingParams(max_new_tokens=5))
        running = not long.done()
        return short, running, await long

    try:
        short, running, long = run(scenario())
        assert len(short.token_ids) == 5 and running and len(long.token_ids) == 300
        assert engine.waves == 2
        engine.join_running = False
        short, running, long = run(scenario())
        assert len(short.token_ids) == 5 and not running  # it waited for the long row
    finally:
        handle.remove()


def test_rows_that_join_and_leave_decode_as_they_would_alone(engine, tiny_policy_dir):
    """Greedy rows joining a running batch at different steps, with prompts of very different
    lengths (a long-prompt row leaving lets the cache drop its columns): the same tokens and
    log-probs as each request alone."""
    tok = engine.tokenizer
    requests = [
        (tok.encode("x " * 60 + "where"), 4),
        (tok.encode("where"), 40),
        (tok.encode("y " * 9 + "who"), 12),
        (tok.encode("z " * 30 + "what"), 25),
        (tok.encode("when"), 30),
    ]

    async def staggered():
        tasks = []
        for prompt, n in requests:
            tasks.append(
                asyncio.create_task(
                    engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=n))
                )
            )
            target = engine.generated_tokens + 3
            while engine.generated_tokens < target and not all(t.done() for t in tasks):
                await asyncio.sleep(0.0005)
        return await asyncio.gather(*tasks)

    together = run(staggered())
    assert engine.waves >= 3  # they did join at different steps
    alone = EmbeddedEngine.from_pretrained(tiny_policy_dir, max_batch_size=1)
    for (prompt, n), joint in zip(requests, together, strict=True):
        single = run(alone.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=n)))
        assert single.token_ids == joint.token_ids
        assert single.logprobs == pytest.approx(joint.logprobs, abs=1e-4)
