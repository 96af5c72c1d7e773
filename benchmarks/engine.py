"""Embedded engine: 16 concurrent agent loops batched continuously, in waves, and one at a time.

Each loop runs 3 turns: generate up to 48 tokens, append a 24-token observation, generate again.
Sampling is greedy so every run produces the very same tokens (batched greedy decoding equals
one-at-a-time decoding; tests check it) and the ratios compare equal work. Continuous batching
(the engine's default) lets a loop's next turn join the running batch between decode steps;
waves (`join_running=False`) make it wait until the batch has drained.

    python benchmarks/engine.py [--loops 16] [--turns 3]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import torch

from actors.embedded import EmbeddedEngine
from actors.engine import SamplingParams
from pipeline.assets.tiny_policy import build_tiny_policy

TEXTS = [
    f"Question {i}: where was Varno Telik born? <search> Varno Telik </search> <information> Doc 1(Title: "
    f"Varno Telik) born in Quorvex in {1900 + i % 90}. </information> <answer> Quorvex </answer>"
    for i in range(3000)
]


async def agent_loops(
    engine: EmbeddedEngine, prompts: list[list[int]], turns: int, observation: list[int]
) -> int:
    async def loop(prompt: list[int]) -> int:
        context, generated = list(prompt), 0
        for _ in range(turns):
            out = await engine.generate(context, SamplingParams(temperature=0.0, max_new_tokens=48))
            generated += len(out.token_ids)
            context += out.token_ids + observation
        return generated

    return sum(await asyncio.gather(*(loop(p) for p in prompts)))


def run(path: str, batch: int, prompts, turns, observation, join: bool = True) -> tuple[float, int]:
    async def main():
        engine = EmbeddedEngine.from_pretrained(path, max_batch_size=batch, join_running=join)
        await agent_loops(engine, prompts[:2], 1, observation)  # warm-up
        start = time.perf_counter()
        tokens = await agent_loops(engine, prompts, turns, observation)
        elapsed = time.perf_counter() - start
        await engine.close()
        return tokens / elapsed, tokens

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_policy(f"{tmp}/tiny", TEXTS))
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        prompts = [
            tokenizer.encode(f"Question {i}: where was person {i} born?") for i in range(args.loops)
        ]
        observation = tokenizer.encode(
            " <information> Doc 1(Title: X) some retrieved text here. </information> "
        )
        batched, tokens_b = run(path, args.loops, prompts, args.turns, observation)
        waves, tokens_w = run(path, args.loops, prompts, args.turns, observation, join=False)
        single, tokens_s = run(path, 1, prompts, args.turns, observation)
    assert tokens_b == tokens_s == tokens_w, (tokens_b, tokens_s, tokens_w)
    print(
        f"embedded engine, tiny Qwen2 (2 layers, hidden 128), torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"  {args.loops} agent loops x {args.turns} turns, greedy, {tokens_b} generated tokens in each run"
    )
    print(f"  continuous batching : {batched:8.0f} tokens/s")
    print(f"  waves               : {waves:8.0f} tokens/s (continuous: {batched / waves:.2f}x)")
    print(f"  one at a time       : {single:8.0f} tokens/s")
    print(f"  speed-up            : {batched / single:8.1f}x (target >= 4x)")


if __name__ == "__main__":
    main()
