"""The floor of an inference server's decode step on one GPU for an 8B model: seconds per step
for a batch of B running sequences with C tokens of context each, to set beside the server model
of benchmarks/cluster_sim.py (actors.engine.step_s + step_per_seq_s x B).

It is not SGLang (which cannot travel to the lent GPU): a decode step written out in plain
PyTorch for Qwen3-8B's shape (random bfloat16 weights, a contiguous KV cache, attention by
scaled_dot_product_attention with grouped KV heads, no rotary embedding or sampling), captured in
a CUDA graph so that no Python runs per step. Its time is what moving the weights and the KV cache
through the GPU costs, about the least a server's step can take; a real server adds its
scheduler, paging and sampling.

Needs a CUDA GPU and says so otherwise; `--tiny` runs a two-layer model on whatever device there
is (without a graph on CPU), to check the script itself.

    python benchmarks/decode_gpu_cost.py [--context 2048] [--batches 1,16,32,64,128] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from gpu_figures import add_options, describe, device_for, report, timed

QWEN3_8B = dict(vocab=151936, hidden=4096, ffn=12288, layers=36, heads=32, kv_heads=8, head_dim=128)
TINY = dict(vocab=1000, hidden=128, ffn=256, layers=2, heads=4, kv_heads=2, head_dim=32)


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * weight


class Decoder:
    """Weights and a KV cache of `context` positions for `batch` sequences; `step` decodes one
    token for each, writing its keys and values at position context - 1."""

    def __init__(self, shape: dict, batch: int, context: int, device: str) -> None:
        d, h, kv, hd = shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"]
        self.shape, self.batch = shape, batch

        def w(*size):
            return torch.randn(*size, device=device, dtype=torch.bfloat16) * 0.02

        self.layers = [
            dict(
                norm1=torch.ones(d, device=device, dtype=torch.bfloat16),
                qkv=w(d, (h + 2 * kv) * hd),
                out=w(h * hd, d),
                norm2=torch.ones(d, device=device, dtype=torch.bfloat16),
                gate_up=w(d, 2 * shape["ffn"]),
                down=w(shape["ffn"], d),
                k=w(batch, kv, context, hd),
                v=w(batch, kv, context, hd),
            )
            for _ in range(shape["layers"])
        ]
        self.norm = torch.ones(d, device=device, dtype=torch.bfloat16)
        self.lm_head = w(d, shape["vocab"])
        self.x = w(batch, d)
        self.next_tokens = torch.zeros(batch, dtype=torch.int64, device=device)

    def step(self) -> None:
        s = self.shape
        h, kv, hd = s["heads"], s["kv_heads"], s["head_dim"]
        x = self.x
        for layer in self.layers:
            q, k, v = (rms(x, layer["norm1"]) @ layer["qkv"]).split([h * hd, kv * hd, kv * hd], -1)
            layer["k"][:, :, -1] = k.view(self.batch, kv, hd)
            layer["v"][:, :, -1] = v.view(self.batch, kv, hd)
            attn = F.scaled_dot_product_attention(
                q.view(self.batch, h, 1, hd), layer["k"], layer["v"], enable_gqa=True
            )
            x = x + attn.reshape(self.batch, h * hd) @ layer["out"]
            gate, up = (rms(x, layer["norm2"]) @ layer["gate_up"]).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ layer["down"]
        self.next_tokens.copy_((rms(x, self.norm) @ self.lm_head).argmax(-1))


def seconds_per_step(decoder: Decoder, device: str, steps: int) -> float:
    """Median of five timings of `steps` steps, replays of a CUDA graph on a GPU."""
    run = decoder.step
    if device == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up before capture
                decoder.step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decoder.step()
        run = graph.replay
    return timed(run, device, repeats=5, calls=steps, warmup=3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--batches", default="1,16,32,64,128")
    parser.add_argument("--steps", type=int, default=20, help="steps a timing")
    add_options(parser)
    args = parser.parse_args()
    device = device_for("decode_gpu_cost", "an 8B model's decode step", args.tiny)
    if device is None:
        return 1
    shape = TINY if args.tiny else QWEN3_8B
    figures = {**describe(device), "context": args.context, "tiny": args.tiny, "steps": {}}
    with torch.no_grad():
        for batch in (int(b) for b in args.batches.split(",")):
            decoder = Decoder(shape, batch, args.context, device)
            seconds = seconds_per_step(decoder, device, args.steps)
            figures["steps"][str(batch)] = seconds
            print(
                f"batch {batch:4d}, context {args.context}: {seconds * 1e3:7.2f} ms a step, "
                f"{batch / seconds:8.0f} tokens/s",
                flush=True,
            )
            del decoder
            if device == "cuda":
                torch.cuda.empty_cache()
    steps = figures["steps"]
    if len(steps) >= 2:  # least squares of step = a + b x batch
        xs = [int(b) for b in steps]
        ys = list(steps.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mx) ** 2 for x in xs
        )
        figures["fit"] = {"step_s": my - b * mx, "step_per_seq_s": b}
        print(f"fit: {(my - b * mx) * 1e3:.2f} ms + {b * 1e3:.3f} ms a running sequence")
    report(figures, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
