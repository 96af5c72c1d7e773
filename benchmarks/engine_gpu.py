"""The embedded engine on one GPU: generated tokens/s against plain `model.generate` on the same
batch, and continuous batching against waves with agent loops of uneven turns.

    python benchmarks/engine_gpu.py [--batch 16] [--tokens 256] [--tiny] [--json FILE]

The model is Qwen2-0.5B's shape with the tiny policy's 2,000-token vocabulary (0.36B parameters,
random weights, bf16; nothing is downloaded). End tokens are disabled so every row generates
exactly `--tokens` tokens in both engines: equal work. Three figures:

1. one batch of `--batch` prompts: the embedded engine's tokens/s and `generate`'s (greedy, a
   static batch, HF's own loop), side by side;
2. `--batch` agent loops of 3 turns whose turn lengths differ (16 to `--tokens`), the next turn
   queued as soon as a loop's turn ends: continuous batching (rows join between decode steps)
   against waves (a turn waits until the running batch drained).

`--tiny` checks the script on CPU with the two-layer tiny shape. Needs a CUDA GPU otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
from gpu_figures import add_options, describe, device_for, report

from actors.embedded import EmbeddedEngine
from actors.engine import SamplingParams
from pipeline.assets.tiny_policy import build_tiny_policy

QWEN2_05B = dict(layers=24, hidden_size=896, heads=14, kv_heads=2, intermediate_size=4864)
TINY = dict(layers=2, hidden_size=128, heads=4, kv_heads=2, intermediate_size=512)
TEXTS = [
    f"Question {i}: where was Varno Telik born? <search> Varno Telik </search> "
    f"<information> Doc 1 born in Quorvex in {1900 + i % 90}. </information> <answer> Quorvex "
    "</answer>"
    for i in range(3000)
]


def engine_for(path: Path, device: str, dtype: str, batch: int, join: bool) -> EmbeddedEngine:
    engine = EmbeddedEngine.from_pretrained(
        path, device=device, dtype=dtype, max_batch_size=batch, join_running=join
    )
    engine._end_ids = set()  # every row runs to its token budget: equal work in both engines
    return engine


def one_batch(engine: EmbeddedEngine, prompts: list[list[int]], tokens: int) -> float:
    """Tokens/s of one batch through the engine (all rows start together)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens)

    async def run() -> int:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        return sum(len(o.token_ids) for o in outs)

    return tokens_per_s(engine.device.type, run)


def with_generate(model, prompts: list[list[int]], tokens: int, pad: int) -> float:
    """Tokens/s of `model.generate` on the same prompts (left-padded, greedy, exact length)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device
    )
    options = dict(
        attention_mask=mask,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=False,
        pad_token_id=pad,
    )
    with torch.inference_mode():
        model.generate(ids, **options)  # warm-up
        sync(model.device.type)
        start = time.perf_counter()
        out = model.generate(ids, **options)
        sync(model.device.type)
    return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - start)


def agent_loops(engine: EmbeddedEngine, prompts: list[list[int]], tokens: int) -> float:
    """Tokens/s of agent loops of 3 turns with uneven lengths; each turn's reply is fed back."""
    lengths = [
        16 + (tokens - 16) * ((i * 7) % len(prompts)) // max(1, len(prompts) - 1)
        for i in range(len(prompts))
    ]

    async def loop(prompt: list[int], i: int) -> int:
        context, made = list(prompt), 0
        for turn in range(3):
            n = lengths[(i + turn) % len(lengths)]
            out = await engine.generate(context, SamplingParams(temperature=0.0, max_new_tokens=n))
            made += len(out.token_ids)
            context += out.token_ids
        return made

    async def run() -> int:
        return sum(await asyncio.gather(*(loop(p, i) for i, p in enumerate(prompts))))

    return tokens_per_s(engine.device.type, run)


def tokens_per_s(device: str, run: Callable[[], Awaitable[int]]) -> float:
    """Tokens/s of `run` (which returns the tokens it made), timed after a warm-up run."""
    asyncio.run(run())
    sync(device)
    start = time.perf_counter()
    made = asyncio.run(run())
    sync(device)
    return made / (time.perf_counter() - start)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    add_options(parser)
    args = parser.parse_args()
    device = device_for("engine_gpu", "the embedded engine's tokens/s", args.tiny)
    if device is None:
        return 1
    shape, dtype = (TINY, "float32") if args.tiny else (QWEN2_05B, "bfloat16")
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_policy(
            Path(tmp) / "policy", TEXTS, vocab_size=2000, max_position=2048, **shape
        )
        continuous = engine_for(path, device, dtype, args.batch, join=True)
        waves = engine_for(path, device, dtype, args.batch, join=False)
        tokenizer = continuous.tokenizer
        prompts = [
            tokenizer.encode(f"Question {i}: where was person {i} born?") for i in range(args.batch)
        ]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        figures = {
            **describe(device),
            "parameters": sum(p.numel() for p in continuous.model.parameters()),
            "dtype": dtype,
            "batch": args.batch,
            "tokens": args.tokens,
        }
        measurements = {
            "engine_tokens_per_s": lambda: one_batch(continuous, prompts, args.tokens),
            "generate_tokens_per_s": lambda: with_generate(
                continuous.model, prompts, args.tokens, pad
            ),
            "agent_continuous_tokens_per_s": lambda: agent_loops(continuous, prompts, args.tokens),
            "agent_waves_tokens_per_s": lambda: agent_loops(waves, prompts, args.tokens),
        }
        for name, measure in measurements.items():  # each figure as it comes: a slow card
            start = time.perf_counter()  # still shows the ones it reached
            figures[name] = measure()
            took = time.perf_counter() - start
            print(f"  {name}: {figures[name]:,.0f} ({took:.0f} s)", file=sys.stderr, flush=True)
    figures["engine_vs_generate"] = (
        figures["engine_tokens_per_s"] / figures["generate_tokens_per_s"]
    )
    figures["continuous_vs_waves"] = (
        figures["agent_continuous_tokens_per_s"] / figures["agent_waves_tokens_per_s"]
    )
    print(
        f"embedded engine on {figures['device']}: {figures['parameters'] / 1e6:.0f}M parameters "
        f"({dtype}), {args.batch} rows x {args.tokens} tokens",
        file=sys.stderr,
    )
    print(
        f"  one batch: engine {figures['engine_tokens_per_s']:,.0f} tokens/s, model.generate "
        f"{figures['generate_tokens_per_s']:,.0f} tokens/s: {figures['engine_vs_generate']:.2f}x",
        file=sys.stderr,
    )
    print(
        f"  agent loops, uneven turns: continuous {figures['agent_continuous_tokens_per_s']:,.0f} "
        f"tokens/s, waves {figures['agent_waves_tokens_per_s']:,.0f}: {figures['continuous_vs_waves']:.2f}x",
        file=sys.stderr,
    )
    report(figures, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
