"""On one CUDA GPU: the embedded engine against the CPU, bf16 training against fp32, the local
pipeline with the embedded engine on CUDA and ZeRO-3 (books balanced, a checkpoint that resumes),
torch's varlen attention against attention per trajectory, and the head in chunks under ZeRO-3.

Tolerances, stated once: greedy tokens of the same float32 weights on CUDA and on the CPU agree
on at least 7 of 8 prompts (a near-tie in the logits may break differently on other kernels) and
their log-probs within 1e-3 where the tokens agree; one bf16 step's loss is within 0.05 of the
fp32 step's, and the bf16 learner's log-probs after three steps are within 0.15 (mean absolute)
of the fp32 learner's; the head in chunks under ZeRO-3 meets the CPU test's tolerances times 10.
"""

import asyncio
import json
import subprocess
import sys

import pytest
import torch

from actors.embedded import EmbeddedEngine
from actors.engine import SamplingParams
from learner.attention import (
    FLASH,
    VARLEN,
    implementation,
    segment_attention,
    varlen_attention,
    varlen_attn,
)
from learner.batch import build_batch, response_logprobs
from learner.trainer import Learner
from pipeline.assets.tiny_policy import build_tiny_policy
from pipeline.config.schema import LearnerConfig
from tests.conftest import assert_accounting, child_env
from tests.gpu.conftest import MARKS
from tests.learner.test_head import steps_as_the_models_own_forward
from tests.learner.test_trainer import TEXTS, groups
from tests.pipeline.test_local_run import ROOT, SHORT

pytestmark = MARKS


def test_the_embedded_engine_on_the_gpu_matches_the_cpu_greedy(policy, device):
    gpu = EmbeddedEngine.from_pretrained(policy, device=device, max_batch_size=8)
    cpu = EmbeddedEngine.from_pretrained(policy, device="cpu", max_batch_size=8)
    assert gpu.device.type == torch.device(device).type
    prompts = [gpu.tokenizer.encode(f"Question {n}: where was Varno Telik born?") for n in range(8)]
    params = SamplingParams(temperature=0.0, max_new_tokens=32)

    async def answers(engine):
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    on_gpu, on_cpu = asyncio.run(answers(gpu)), asyncio.run(answers(cpu))
    same = [a for a, b in zip(on_gpu, on_cpu, strict=True) if a.token_ids == b.token_ids]
    assert len(same) >= 7, [(a.token_ids, b.token_ids) for a, b in zip(on_gpu, on_cpu, strict=True)]
    for a, b in zip(on_gpu, on_cpu, strict=True):
        if a.token_ids == b.token_ids:
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)


def test_bf16_training_tracks_fp32(policy, device):
    config = LearnerConfig(lr=1e-3, micro_batch_size=4, max_steps=10)
    learners = {
        dtype: Learner(policy, config, group_size=4, dtype=dtype)
        for dtype in ("float32", "bfloat16")
    }
    for model in learners.values():
        assert next(model.model.parameters()).device.type == torch.device(device).type
    batches = [groups(50 + i) for i in range(3)]
    first = {dtype: model.step(batches[0])["loss"] for dtype, model in learners.items()}
    assert first["bfloat16"] == pytest.approx(first["float32"], abs=0.05)
    for batch in batches[1:]:
        for model in learners.values():
            model.step(batch)
    members = [t for g in groups(60) for t in g.members]

    def logp(model):
        b = build_batch(members, torch.zeros(len(members)), model.pad_id)
        on = next(model.model.parameters()).device
        with torch.no_grad():
            logits = model.model(
                input_ids=b.input_ids.to(on), attention_mask=b.attention_mask.to(on)
            ).logits
            values, _ = response_logprobs(logits, b)
        mask = b.response_mask.bool()
        return values.float().cpu()[mask]

    gap = (logp(learners["bfloat16"]) - logp(learners["float32"])).abs().mean().item()
    assert gap < 0.15, gap


def launch(run_dir, cache, *extra):
    argv = [
        sys.executable,
        "-m",
        "pipeline.launch",
        "configs/local.yaml",
        "--run-dir",
        str(run_dir),
        "--set",
        f"runtime.cache_dir={cache}",
        *SHORT,
        *extra,
    ]
    return subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, env=child_env(), timeout=900
    )


def test_the_local_pipeline_on_the_gpu_with_zero3_balances_its_books_and_resumes(
    tmp_path, run_cache, device
):
    run_dir = tmp_path / "run"
    on_gpu = ["--set", f"actors.engine.device={device}", "--set", "learner.zero_stage=3"]
    done = launch(run_dir, run_cache, *on_gpu, "--set", "learner.max_steps=3")
    assert done.returncode == 0, done.stderr[-2000:]
    assert_accounting(run_dir)
    resumed = launch(run_dir, run_cache, *on_gpu, "--set", "learner.max_steps=5", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [1.0, 2.0, 3.0, 4.0, 5.0]
    books = assert_accounting(run_dir)
    assert books["total"]["trained"] == 20  # five steps of one group of 4


def test_varlen_attention_on_the_gpu_equals_attention_per_trajectory(device):
    """torch's flash varlen kernel (bf16, grouped-query heads) against one sdpa per trajectory:
    outputs and gradients within bf16's rounding. The learner packs with it (or flash-attn's)."""
    if device == "cuda":
        if varlen_attn is None:
            pytest.skip(f"torch {torch.__version__} has no varlen attention kernel")
        assert implementation(True) in (FLASH, VARLEN)
    torch.manual_seed(0)
    lengths = [700, 33, 1500, 260]
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    n = sum(lengths)
    module = torch.nn.Module()
    shapes = ((1, 8, n, 64), (1, 2, n, 64), (1, 2, n, 64))
    inputs = [
        torch.randn(s, device=device, dtype=torch.bfloat16, requires_grad=True) for s in shapes
    ]
    found = []
    for attend in (segment_attention, varlen_attention):
        out, _ = attend(module, *inputs, None, scaling=0.125, position_ids=positions)
        torch.manual_seed(1)
        weights = torch.randn(out.shape, device=device).to(out.dtype)
        found.append((out.float(), torch.autograd.grad((out * weights).sum(), inputs)))
    (want, want_grads), (got, got_grads) = found
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=5e-2, atol=5e-2)


def test_the_head_in_chunks_under_zero3_steps_as_the_models_own_forward(
    tmp_path_factory, monkeypatch
):
    """ZeRO-3 with NCCL on CUDA bypasses nothing: the backbone and the head are called through
    the engine, and their own hooks gather the embeddings and the head at every call (the chunks'
    recomputation in backward included). The CPU runs the same checks in one gloo process
    (tests/learner/test_head.py); here on CUDA's kernels, tolerances 10x. The policy is at hidden
    256 so that its head is over ZeRO-3's persistence threshold, as an 8B model's is."""
    path = build_tiny_policy(
        tmp_path_factory.mktemp("policy") / "wide", TEXTS, vocab_size=500, hidden_size=256
    )
    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)  # ZeRO-3's
    steps_as_the_models_own_forward(path, stage=3, slack=10.0)
