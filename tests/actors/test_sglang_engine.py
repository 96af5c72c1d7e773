"""SGLangEngine against local stand-in SGLang servers (the real tiny model behind SGLang's JSON), a
fake server for malformed answers, and (GPU only) a real SGLang server at $STRATA_SGLANG_URL."""

import asyncio
import os
import socket
import time

import aiohttp
import pytest
import torch
from aiohttp import web

from actors.embedded import EmbeddedEngine
from actors.engine import EngineError, SamplingParams
from actors.sglang import SGLangEngine
from learner.weight_sync import NcclSync
from retrieval.server import serve
from tests.actors.sglang_standin import PausableEngine, SGLangStandIn

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def run(coro):
    return asyncio.run(coro)


async def standin(model_dir, seed=0) -> SGLangStandIn:
    engine = PausableEngine.from_pretrained(model_dir, max_batch_size=16, seed=seed)
    return await SGLangStandIn.start(engine, str(model_dir))


def prompt(tokenizer, i=0):
    return tokenizer.encode(f"Question {i}: where was Varno Telik born? <think>")


def force_tokens(engine, token_ids):
    """Make the real model emit `token_ids` first (single-row waves); everything else stays real."""
    step = {"k": 0}

    def hook(module, inputs, output):
        if step["k"] < len(token_ids):
            output.logits[:, -1, token_ids[step["k"]]] = 1e9
        step["k"] += 1
        return output

    return engine.model.register_forward_hook(hook)


def test_generation_matches_the_served_engine(tiny_policy_dir):
    async def scenario():
        async with await standin(tiny_policy_dir) as server, SGLangEngine([server.url]) as engine:
            ids = prompt(server.engine.tokenizer)
            remote = await engine.generate(ids, GREEDY)
            local = await server.engine.generate(ids, GREEDY)
            sampled = await engine.generate(ids, SamplingParams(temperature=1.0, max_new_tokens=8))
            body = server.bodies[0][1]
            return remote, local, sampled, body, server.engine.model, ids

    remote, local, sampled, body, model, ids = run(scenario())
    assert len(remote.token_ids) == len(remote.logprobs) == len(remote.versions) > 0
    assert remote.token_ids == local.token_ids and remote.finish_reason == local.finish_reason
    assert remote.logprobs == pytest.approx(local.logprobs, abs=1e-6)
    assert remote.versions == [0] * len(remote.token_ids)
    assert body["sampling_params"] == {
        "temperature": 0.0,
        "top_p": 1.0,
        "max_new_tokens": 12,
        "stop": [],
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    assert body["return_logprob"] is True and body["input_ids"] == ids
    # sampled tokens carry log_softmax(logits / T) of the policy, as a full forward computes it
    with torch.no_grad():
        logits = model(torch.tensor([ids + sampled.token_ids])).logits[0].float()
    full = torch.log_softmax(logits[len(ids) - 1 : -1], -1)
    expected = full.gather(-1, torch.tensor(sampled.token_ids).unsqueeze(-1)).squeeze(-1)
    assert sampled.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


def test_standin_answers_in_sglang_json(tiny_policy_dir):
    async def scenario():
        async with await standin(tiny_policy_dir) as server, aiohttp.ClientSession() as http:
            ids = prompt(server.engine.tokenizer)
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 5, "temperature": 0},
                "return_logprob": True,
                "return_text_in_logprobs": True,
            }
            async with http.post(f"{server.url}/generate", json=body) as response:
                answer = await response.json()
            async with http.get(f"{server.url}/get_model_info") as response:
                info = await response.json()
            return answer, info, server.engine.tokenizer, ids

    answer, info, tok, ids = run(scenario())
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 5
    assert [t for _, t, _ in meta["output_token_logprobs"]] == answer["output_ids"]
    assert [text for _, _, text in meta["output_token_logprobs"]] == [
        tok.decode([t]) for t in answer["output_ids"]
    ]
    assert (
        meta["weight_version"] == "default" == info["weight_version"]
    )  # until an update names one
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]


def test_stop_string_is_kept_and_reported(tiny_policy_dir):
    async def scenario():
        async with await standin(tiny_policy_dir) as server, SGLangEngine([server.url]) as engine:
            tok = server.engine.tokenizer
            tags = [tok.convert_tokens_to_ids("<search>"), tok.convert_tokens_to_ids("</search>")]
            hook = force_tokens(server.engine, tags + tags)
            try:
                params = SamplingParams(temperature=1.0, max_new_tokens=20, stop=("</search>",))
                out = await engine.generate(prompt(tok), params)
            finally:
                hook.remove()
            return out, tags

    out, tags = run(scenario())
    assert out.finish_reason == "stop" and out.stop == "</search>"
    assert out.token_ids == tags  # ends with the stop string, untrimmed, at its first occurrence


def test_least_loaded_routing_spreads_concurrent_requests(tiny_policy_dir):
    async def scenario():
        async with (
            await standin(tiny_policy_dir) as a,
            await standin(tiny_policy_dir) as b,
            SGLangEngine([a.url, b.url]) as engine,
        ):
            ids = prompt(a.engine.tokenizer)
            outs = await asyncio.gather(*(engine.generate(ids, GREEDY) for _ in range(16)))
            return outs, a.calls.count("generate"), b.calls.count("generate"), engine.stats()

    outs, to_a, to_b, stats = run(scenario())
    assert all(len(o.token_ids) == len(o.logprobs) > 0 for o in outs)
    assert (to_a, to_b) == (8, 8)
    assert stats["requests"] == 16 and stats["in_flight"] == 0 and stats["aborts"] == 0


def test_dead_server_aborts_fast_and_later_requests_go_to_the_live_one(tiny_policy_dir):
    async def scenario():
        async with (
            await standin(tiny_policy_dir) as dying,
            await standin(tiny_policy_dir) as live,
            SGLangEngine([dying.url, live.url], timeout_s=30) as engine,
        ):
            ids = prompt(live.engine.tokenizer)
            await asyncio.gather(engine.generate(ids, GREEDY), engine.generate(ids, GREEDY))
            await dying.stop()
            started = time.monotonic()
            first = await asyncio.gather(
                *(engine.generate(ids, GREEDY) for _ in range(8)), return_exceptions=True
            )
            failed_in = time.monotonic() - started
            later = [await engine.generate(ids, GREEDY) for _ in range(4)]
            return first, failed_in, later, live.calls.count("generate"), engine.stats(), dying

    first, failed_in, later, to_live, stats, dying = run(scenario())
    errors = [r for r in first if isinstance(r, BaseException)]
    assert errors and all(isinstance(e, EngineError) for e in errors)
    assert failed_in < 5  # never waits out the 30 s timeout
    assert len(later) == 4 and to_live == 1 + (8 - len(errors)) + 4
    assert stats[f"aborts/{dying.url}"] == len(errors) and stats[f"healthy/{dying.url}"] == 0
    assert stats[f"in_flight/{dying.url}"] == 0


def test_unused_port_raises_engine_error_at_once():
    async def scenario():
        async with SGLangEngine(["http://127.0.0.1:9"], timeout_s=30) as engine:
            started = time.monotonic()
            with pytest.raises(EngineError, match=r"cannot reach http://127.0.0.1:9/generate"):
                await engine.generate([1, 2, 3], GREEDY)
            return time.monotonic() - started, engine.stats()

    elapsed, stats = run(scenario())
    assert elapsed < 5 and stats["aborts"] == 1


def test_timeout_raises_engine_error(tiny_policy_dir):
    async def scenario():
        async with await standin(tiny_policy_dir) as server:
            server.delay_s = 30
            async with SGLangEngine([server.url], timeout_s=0.5) as engine:
                started = time.monotonic()
                with pytest.raises(EngineError, match=r"no answer .* within 0.5 s"):
                    await engine.generate(prompt(server.engine.tokenizer), GREEDY)
                return time.monotonic() - started

    assert run(scenario()) < 3


def test_server_errors_abort_the_request_and_the_server_recovers(tiny_policy_dir):
    async def scenario():
        async with (
            await standin(tiny_policy_dir) as server,
            SGLangEngine([server.url], cooldown_s=0.0) as engine,
        ):
            server.fail_next = 1
            with pytest.raises(EngineError, match="HTTP 500"):
                await engine.generate(prompt(server.engine.tokenizer), GREEDY)
            return await engine.generate(prompt(server.engine.tokenizer), GREEDY)

    assert len(run(scenario()).token_ids) > 0


@pytest.mark.parametrize(
    ("logprobs", "error"),
    [
        ([[-0.1, 5, None], [-0.2, 6, None], [-0.3, 8, None]], r"output_ids\[2\] is 7 but .* 8"),
        ([[-0.1, 5, None], [-0.2, 6, None]], "3 output_ids but 2 logprobs"),
    ],
)
def test_inconsistent_answer_raises_engine_error(logprobs, error):
    async def generate(request):
        meta = {"output_token_logprobs": logprobs, "finish_reason": {"type": "length", "length": 3}}
        return web.json_response({"output_ids": [5, 6, 7], "meta_info": meta})

    async def scenario():
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner, port = await serve(app, "127.0.0.1", 0)
        try:
            async with SGLangEngine([f"http://127.0.0.1:{port}"]) as engine:
                with pytest.raises(EngineError, match=error):
                    await engine.generate([1, 2], GREEDY)
        finally:
            await runner.cleanup()

    run(scenario())


def test_weight_versions_come_from_spans_else_the_older_of_server_and_belief():
    """Without per-token spans the server's weight_version is its version when the output was
    built: tokens sampled before an update in between are older, so the label is never fresher
    than the version served when the request left. A server that reports older weights than it
    was given ("default": never updated) was restarted: it goes out of rotation until it
    answers /health and serves the published weights again."""
    answers = [
        {
            "weight_version": "4",
            "weight_versions": [
                {"version": "3", "start": 0, "end": 2},
                {"version": "4", "start": 2, "end": 3},
            ],
        },
        {"weight_version": "4"},
        {"weight_version": "1"},
        {"weight_version": "default"},
    ]

    async def generate(request):
        meta = {
            "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]],
            "finish_reason": {"type": "stop", "matched": "</search>"},
            **answers.pop(0),
        }
        return web.json_response({"output_ids": [5, 6, 7], "meta_info": meta})

    async def health(request):
        return web.Response()

    async def model_info(request):
        return web.json_response({"weight_version": "2"})

    async def continued(request):
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def scenario():
        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/health", health)
        app.router.add_get("/get_model_info", model_info)
        app.router.add_post("/continue_generation", continued)  # a rejoining server is continued
        runner, port = await serve(app, "127.0.0.1", 0)
        try:
            async with SGLangEngine(
                [f"http://127.0.0.1:{port}"], version=2, cooldown_s=0.05, timeout_s=10
            ) as engine:
                out = [await engine.generate([1], GREEDY) for _ in range(4)]
                return out, engine.stats()
        finally:
            await runner.cleanup()

    (spans, updated_since, older, restarted), stats = run(scenario())
    assert spans.versions == [3, 3, 4]
    assert updated_since.versions == [2, 2, 2]  # the server moved to 4 after the request left
    assert older.versions == [1, 1, 1] and restarted.versions == [0, 0, 0]
    assert stats["rejoins"] == 1  # after "1"; after "default" it is down again
    assert stats["healthy/" + next(k[8:] for k in stats if k.startswith("healthy/"))] == 0
    assert spans.finish_reason == "stop" and spans.stop == "</search>"
    assert spans.logprobs == [-0.1, -0.2, -0.3]


def new_weights(model_dir, out_dir):
    model = EmbeddedEngine.from_pretrained(model_dir).model
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(out_dir)
    return out_dir


def test_update_from_disk_pauses_updates_continues_and_versions_follow(tiny_policy_dir, tmp_path):
    update_dir = new_weights(tiny_policy_dir, tmp_path / "step-1")

    async def scenario():
        async with await standin(tiny_policy_dir) as server, SGLangEngine([server.url]) as engine:
            ids = prompt(server.engine.tokenizer)
            before = await engine.generate(ids, GREEDY)
            long = SamplingParams(temperature=1.0, max_new_tokens=48)
            in_flight = [asyncio.create_task(engine.generate(ids, long)) for _ in range(4)]
            await asyncio.sleep(0.05)
            await engine.update_weights(1, path=update_dir)
            after = await engine.generate(ids, GREEDY)
            spanning = await asyncio.gather(*in_flight)
            control = [c for c in server.calls if c != "generate"]
            pause_body = dict(server.bodies)["pause_generation"]
            update_body = dict(server.bodies)["update_weights_from_disk"]
            return before, after, spanning, control, pause_body, update_body, engine.version

    before, after, spanning, control, pause_body, update_body, version = run(scenario())
    assert control == ["pause_generation", "update_weights_from_disk", "continue_generation"]
    assert pause_body == {"mode": "retract"}
    assert update_body == {"model_path": str(update_dir), "weight_version": "1"}
    assert version == 1 and set(before.versions) == {0} and set(after.versions) == {1}
    assert after.logprobs != pytest.approx(before.logprobs, abs=1e-4)  # the new weights sampled
    for out in spanning:  # requests in flight finish; their tokens say which weights made them
        assert out.versions == sorted(out.versions) and set(out.versions) <= {0, 1}


def test_failed_update_reports_the_server_message_and_resumes_generation(tiny_policy_dir):
    async def scenario():
        async with await standin(tiny_policy_dir) as server, SGLangEngine([server.url]) as engine:
            with pytest.raises(EngineError, match="Failed to update weights"):
                await engine.update_weights(1, path="/nonexistent/checkpoint")
            out = await engine.generate(prompt(server.engine.tokenizer), GREEDY)
            return server.calls, server.paused, engine.version, out

    calls, paused, version, out = run(scenario())
    assert calls[:3] == ["pause_generation", "update_weights_from_disk", "continue_generation"]
    assert not paused and version == 0 and set(out.versions) == {0}


def test_dead_server_does_not_hold_back_the_update_of_the_others(tiny_policy_dir, tmp_path):
    update_dir = new_weights(tiny_policy_dir, tmp_path / "step-1")

    async def scenario():
        async with (
            await standin(tiny_policy_dir) as live,
            SGLangEngine(["http://127.0.0.1:9", live.url]) as engine,
        ):
            with pytest.raises(EngineError, match=r"127.0.0.1:9: pause failed: cannot reach"):
                await engine.update_weights(1, path=update_dir)
            out = await engine.generate(prompt(live.engine.tokenizer), GREEDY)
            return live.calls, engine.version, out

    calls, version, out = run(scenario())
    assert calls == [
        "pause_generation",
        "update_weights_from_disk",
        "continue_generation",
        "generate",
    ]
    assert version == 1 and set(out.versions) == {1}  # the dead server is out of rotation


def test_update_fails_when_continue_fails_even_after_a_successful_update(tiny_policy_dir, tmp_path):
    update_dir = new_weights(tiny_policy_dir, tmp_path / "step-1")

    async def scenario():
        async with await standin(tiny_policy_dir) as server, SGLangEngine([server.url]) as engine:
            original = server._continue_generation

            async def broken(body):
                return web.json_response({"error": "boom"}, status=500)

            server._continue_generation = broken
            with pytest.raises(
                EngineError, match="serves version 1 but generation could not be resumed"
            ):
                await engine.update_weights(1, path=update_dir)
            server._continue_generation = original
            return engine.stats(), server.url

    stats, url = run(scenario())
    assert stats["version"] == 1 and stats[f"healthy/{url}"] == 0  # out of rotation for now


def test_update_with_a_state_dict_says_sglang_takes_weights_from_disk_or_nccl(tiny_policy_dir):
    async def scenario():
        async with await standin(tiny_policy_dir) as server, SGLangEngine([server.url]) as engine:
            weights = {"lm_head.weight": torch.zeros(2, 2)}
            with pytest.raises(EngineError, match=r"path=.*update_weights_distributed"):
                await engine.update_weights(1, state_dict=weights)
            return server.calls

    assert run(scenario()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_distributed_update_without_gpu_says_what_it_needs():
    async def scenario():
        async with SGLangEngine(["http://127.0.0.1:9"]) as engine:
            with pytest.raises(EngineError, match=r"needs torch.distributed with nccl and a CUDA"):
                await engine.update_weights_distributed(
                    1, {"w": torch.zeros(2)}, master_address="127.0.0.1", master_port=29500
                )
            # the same through the run's publisher (weight_sync: nccl): reported, not raised
            report = await NcclSync([engine]).publish({"w": torch.zeros(2)}, 1)
            assert not report.published and report.served_version == 0
            assert "needs torch.distributed with nccl and a CUDA GPU" in report.failures[0]

    run(scenario())


def test_weight_sync_nccl_is_refused_under_ray_in_one_line(monkeypatch):
    """The rule itself, as on an 8-GPU machine with sglang (without CUDA the launcher-started
    servers are refused first)."""
    from pipeline.config.loader import load_config
    from pipeline.runtime.preflight import unavailable

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # a GPU machine's: gaia.yaml's roles ask for 6
    monkeypatch.setattr("actors.sglang_server.sglang_installed", lambda python: True)
    ray = load_config("configs/gaia.yaml", ["actors.engine.weight_sync=nccl"])
    problem = unavailable(ray)
    assert problem is not None and "\n" not in problem and "runtime.type local" in problem
    local = load_config(
        "configs/gaia.yaml", ["actors.engine.weight_sync=nccl", "runtime.type=local"]
    )
    assert unavailable(local) is None  # reachable from config in the local runtime
    assert unavailable(load_config("configs/gaia.yaml")) is None  # disk under Ray


def test_nccl_updates_go_in_buckets_and_the_last_one_sets_the_version():
    from actors.remote_nccl import bucket_body as _bucket_body
    from actors.remote_nccl import buckets as _buckets

    tensors = [("a", torch.zeros(256)), ("b", torch.zeros(256)), ("c", torch.zeros(1024))]
    buckets = _buckets(tensors, limit=2048)  # float32: 1 KiB, 1 KiB, 4 KiB
    assert [[name for name, _ in b] for b in buckets] == [["a", "b"], ["c"]]
    first, last = _bucket_body(buckets[0], "g", 3, False), _bucket_body(buckets[1], "g", 3, True)
    assert first == {
        "names": ["a", "b"],
        "dtypes": ["float32", "float32"],
        "shapes": [[256], [256]],
        "group_name": "g",
        "flush_cache": False,
    }
    assert last["weight_version"] == "3" and last["flush_cache"] and last["shapes"] == [[1024]]


# ------------------------------------------------------------------ a real SGLang server (GPU)

REAL_URL = os.environ.get("STRATA_SGLANG_URL")
REAL_MODEL = os.environ.get("STRATA_SGLANG_MODEL")  # the HF checkpoint the server was started on
needs_server = pytest.mark.skipif(
    not REAL_URL, reason="set STRATA_SGLANG_URL to a running SGLang server"
)


@pytest.mark.gpu
@needs_server
def test_real_server_generates_and_updates_from_disk():
    from transformers import AutoTokenizer

    async def scenario():
        async with SGLangEngine([REAL_URL], timeout_s=120) as engine:
            ids = [1, 2, 3, 4]
            if REAL_MODEL:
                ids = AutoTokenizer.from_pretrained(REAL_MODEL).encode("The capital of France is")
            out = await engine.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=16))
            stopped = await engine.generate(
                ids, SamplingParams(temperature=1.0, max_new_tokens=64, stop=(" ",))
            )
            updated = None
            if REAL_MODEL:
                await engine.update_weights(7, path=REAL_MODEL)
                updated = await engine.generate(ids, SamplingParams(max_new_tokens=8))
            return out, stopped, updated

    out, stopped, updated = run(scenario())
    assert len(out.token_ids) == len(out.logprobs) == len(out.versions) > 0
    assert all(lp <= 0 for lp in out.logprobs) and out.finish_reason in ("stop", "length")
    if stopped.finish_reason == "stop" and stopped.stop is not None:
        assert stopped.stop == " "
    if updated is not None:
        assert set(updated.versions) == {7}


@pytest.mark.gpu
@needs_server
@pytest.mark.skipif(not REAL_MODEL, reason="set STRATA_SGLANG_MODEL to the server's checkpoint")
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU the server does not use"
)
def test_real_server_takes_weights_over_nccl():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(REAL_MODEL, dtype=torch.bfloat16).cuda()
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]

    async def scenario():
        async with SGLangEngine([REAL_URL], timeout_s=120) as engine:
            await engine.update_weights_distributed(
                9, dict(model.named_parameters()), master_address="127.0.0.1", master_port=port
            )
            return engine.version, await engine.generate(
                [1, 2, 3], SamplingParams(max_new_tokens=8)
            )

    version, out = run(scenario())
    assert version == 9 and set(out.versions) == {9}
