"""What the learner's passes cost on one GPU for an 8B model: seconds per token of a training
forward and backward (with and without gradient checkpointing) and of a forward without
gradients (the reference policy's pass for the KL term, and the proximal pass when the learner
makes one). These are the figures benchmarks/cluster_sim.py's simulated learner is calibrated to.

The model has Qwen3-8B's shape (configs/gaia.yaml's model) with random weights, built from its
config on the GPU in bfloat16: nothing is downloaded. A micro-batch is --batch sequences of --seq
tokens, configs/gaia.yaml's micro_batch_size 2 by default, trained as learner/trainer.py does:
log-softmax of float32 logits, the sampled tokens' log-probs, a loss on them, backward. Not
here: the optimiser step and ZeRO-3's communication (it shards both over the ranks), the
trainer's entropy diagnostic (one more pass over the log-softmax, without gradients), padding.

`--mix N` adds the learner's own path on a realistic length mix: N trajectories whose lengths
are drawn from a gamma distribution with the coefficient of variation of the cluster simulation's
measured workload (0.88) and mean --seq / 2, trained as learner/trainer.py does today (logits at
trained positions only, chunked float32 log-probs, gradient checkpointing on): padded to the
longest, then packed end to end (flash attention where installed, else learner/attention.py's
per-trajectory sdpa). Tokens/s, padding share and model FLOP/s (6N over real tokens) of each, and
their share of the card's bf16 peak (--peak-tflops, the H100 SXM's 989 by default).

`--grid COUNTS` (issue 62) measures only the learner's own path, with each of its switches on and
off, on length mixes of COUNTS trajectories (e.g. 8,16) at each of --means (mean response tokens,
e.g. 1024,2048; coefficient of variation 0.88, prompts of 128 tokens). One row a setting, each a
change from `packed` (the learner's default on a GPU: packed rows, the head in chunks, the
attention `learner.attention.implementation` picks, gradient checkpointing on, the whole mix in
one micro-batch):

- `padded`: one row per trajectory (the model's default attention);
- `packed_own_head`: the model's own logits at the trained positions ([n, V] in bf16) instead of
  the head in chunks;
- `packed_segments`: one sdpa per trajectory ("strata_segments") instead of the varlen kernel;
- `packed_no_checkpointing`: activations kept (may run out of memory: recorded as such);
- `packed_budget`: micro-batches of at most --budget tokens (8,192 by default;
  learner.max_tokens_per_micro_batch), a forward and backward each, timed together.

Each row: real tokens/s, model TFLOP/s on real tokens (6N) and its share of --peak-tflops, the
peak memory, and what the row ran with (attention, head, checkpointing, micro-batches).

Needs a CUDA GPU and says so otherwise; `--tiny` runs a two-layer model on whatever device there is,
to check the script itself.

    python benchmarks/learner_gpu_cost.py [--seq 4096] [--batch 2] [--repeats 5] [--mix 16]
        [--grid 8,16 --means 1024,2048 --budget 8192 --warmup 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from gpu_figures import add_options, describe, device_for, report, timed, timed_or_oom

QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
TINY = dict(
    QWEN3_8B,
    vocab_size=1000,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)


def build(shape: dict, device: str, checkpointing: bool):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**shape, attn_implementation="sdpa")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def matmul_parameters(model) -> int:
    """The parameters a token's pass multiplies by: all but the embedding (a lookup)."""
    return sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()


def token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def length_mix(count: int, mean: float, seed: int = 0) -> list[int]:
    """`count` response lengths, gamma-distributed with coefficient of variation 0.88."""
    shape = 1 / 0.88**2
    rng = torch.Generator().manual_seed(seed)
    draws = torch._standard_gamma(torch.full((count,), shape), generator=rng) * (mean / shape)
    return [max(16, int(x)) for x in draws.tolist()]


def mixed_batch(lengths: list[int], vocab: int):
    """A TrainBatch of trajectories with these response lengths (prompt 128 tokens, every
    response token trained)."""
    from buffers.testing import synthetic_trajectory
    from learner.batch import build_batch

    trajectories = []
    for i, n in enumerate(lengths):
        t = synthetic_trajectory(f"m{i}", i, tokens=n, seed=i, observation_tokens=0)
        t.token_ids %= vocab
        t.prompt_token_ids = torch.randint(0, vocab, (128,)).numpy().astype(t.token_ids.dtype)
        trajectories.append(t)
    return build_batch(trajectories, torch.ones(len(trajectories)), 0)


def packed_vs_padded(shape: dict, device: str, args, figures: dict) -> None:
    from learner.attention import implementation
    from learner.packing import response_logprobs

    lengths = length_mix(args.mix, args.seq / 2)
    batch = mixed_batch(lengths, shape["vocab_size"])
    real = int(batch.attention_mask.sum())
    for packed in (False, True):
        model = build(shape, device, checkpointing=True)
        model.config._attn_implementation = implementation(packed) or "sdpa"
        model.train()
        matmul = matmul_parameters(model)
        read = [0]

        def train(model=model, packed=packed, read=read):
            logp, _, read[0] = response_logprobs(model, batch, packed, 1.0, torch.device(device))
            (-(logp.sum()) / real).backward()
            model.zero_grad(set_to_none=True)

        key = "mix_packed" if packed else "mix_padded"
        what = f"{len(lengths)} trajectories, {real} real tokens"
        seconds = timed_or_oom(train, device, args.repeats, figures, key, what)
        if seconds is not None:
            tflops = 6 * matmul * real / seconds / 1e12
            figures[key] = {
                "tokens_per_s": real / seconds,
                "padding_share": 1 - real / read[0],
                "tflops_6n_real": tflops,
                "peak_share": tflops / args.peak_tflops,
            }
            print(
                f"{key}: {len(lengths)} trajectories, {real} real tokens, {real / seconds:.0f} "
                f"tokens/s, padding {1 - real / read[0]:.0%}, {tflops:.0f} TFLOP/s on real tokens "
                f"({tflops / args.peak_tflops:.0%} of {args.peak_tflops:g})",
                flush=True,
            )
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    if all(isinstance(figures.get(k), dict) for k in ("mix_packed", "mix_padded")):
        ratio = figures["mix_packed"]["tokens_per_s"] / figures["mix_padded"]["tokens_per_s"]
        figures["mix_packed_over_padded"] = ratio
        print(f"packed vs padded on the mix: {ratio:.2f}x tokens/s", flush=True)


SWITCHES = {
    "padded": {"packed": False},
    "packed": {},
    "packed_own_head": {"split": False},
    "packed_segments": {"attention": "strata_segments"},
    "packed_no_checkpointing": {"checkpointing": False},
    "packed_budget": {"budget": True},
}
"""Each grid row's change from the packed default (the budget row's budget: --budget)."""


def grid_row(model, batch, lengths: list[int], device: str, args, change: dict) -> dict:
    """One setting of the learner's path on one mix (see the module doc): its figures, or "out
    of memory"."""
    from learner.attention import implementation
    from learner.head import splits
    from learner.packing import plan_micro_batches, response_logprobs

    packed = change.get("packed", True)
    split = change.get("split", True) and splits(model)
    attention = change.get("attention") or implementation(packed) or "sdpa"
    checkpointing = change.get("checkpointing", True)
    model.config._attn_implementation = attention
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    model.train()
    matmul = matmul_parameters(model)
    real = int(batch.attention_mask.sum())
    budget = args.budget if change.get("budget") else None
    plan = plan_micro_batches([n + 128 for n in lengths], len(lengths), budget)
    read = [0]

    def train():
        read[0] = 0
        for rows in plan:
            micro = batch.select(torch.tensor(rows, dtype=torch.int64))
            logp, _, tokens = response_logprobs(
                model, micro, packed, 1.0, torch.device(device), split=split
            )
            (-(logp.sum()) / real).backward()
            read[0] += tokens
        model.zero_grad(set_to_none=True)

    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    holder: dict = {}
    what = f"{len(lengths)} trajectories, {real} real tokens"
    seconds = timed_or_oom(train, device, args.repeats, holder, "row", what, args.warmup)
    row = {
        "attention": attention,
        "head": "chunks" if split else "own logits",
        "checkpointing": checkpointing,
        "micro_batches": len(plan),
        "budget": budget,
        "real_tokens": real,
    }
    if seconds is None:
        return row | {"result": "out of memory"}
    tflops = 6 * matmul * real / seconds / 1e12
    row |= {
        "tokens_per_s": real / seconds,
        "padding_share": 1 - real / read[0],
        "tflops_6n_real": tflops,
        "peak_share": tflops / args.peak_tflops,
    }
    if device == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def grid(shape: dict, device: str, args, figures: dict) -> None:
    """Every SWITCHES row on every mix of --grid counts x --means, one model for all; --json
    rewritten after each row."""
    model = build(shape, device, checkpointing=True)
    rows = figures.setdefault("grid", {})
    for count in [int(c) for c in args.grid.split(",")]:
        for mean in [int(m) for m in args.means.split(",")]:
            lengths = length_mix(count, mean)
            batch = mixed_batch(lengths, shape["vocab_size"])
            mix = f"{count}x{mean}"
            rows[mix] = {"lengths": lengths}
            for name, change in SWITCHES.items():
                row = grid_row(model, batch, lengths, device, args, change)
                rows[mix][name] = row
                figure = (
                    row.get("result")
                    or f"{row['tokens_per_s']:.0f} tokens/s, {row['tflops_6n_real']:.0f} TFLOP/s "
                    f"on real tokens ({row['peak_share']:.0%} of {args.peak_tflops:g}), padding "
                    f"{row['padding_share']:.0%}"
                    + (f", peak {row['peak_gib']:.1f} GiB" if "peak_gib" in row else "")
                )
                print(
                    f"{mix} {name}: {figure} [{row['attention']}, head {row['head']}, "
                    f"checkpointing {'on' if row['checkpointing'] else 'off'}, "
                    f"{row['micro_batches']} micro-batches]",
                    flush=True,
                )
                if args.json:  # row by row: a run stopped at its time limit keeps its rows
                    Path(args.json).write_text(json.dumps(figures, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mix", type=int, default=0, help="also packed vs padded on N lengths")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the card's bf16 peak")
    parser.add_argument(
        "--grid", help="only the learner's path, each switch on and off, on mixes of these counts"
    )
    parser.add_argument("--means", default="1024,2048", help="--grid's mean response tokens")
    parser.add_argument("--budget", type=int, default=8192, help="tokens a micro-batch, its row")
    parser.add_argument("--warmup", type=int, default=2, help="--grid's untimed calls a row")
    add_options(parser)
    args = parser.parse_args()
    device = device_for("learner_gpu_cost", "an 8B model's training passes", args.tiny)
    if device is None:
        return 1
    shape = TINY if args.tiny else QWEN3_8B
    if args.grid:
        figures = {**describe(device), "tiny": args.tiny, "peak_tflops": args.peak_tflops}
        grid(shape, device, args, figures)
        report(figures, args.json)
        return 0
    tokens = args.batch * args.seq
    ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), device=device)
    figures = {**describe(device), "seq": args.seq, "batch": args.batch, "tiny": args.tiny}
    for checkpointing in (True, False):
        model = build(shape, device, checkpointing)
        model.train()
        params = sum(p.numel() for p in model.parameters())
        matmul = matmul_parameters(model)

        def train(model=model):
            loss = -token_logprobs(model, ids).mean()
            loss.backward()
            model.zero_grad(set_to_none=True)

        def forward(model=model):
            with torch.no_grad():
                token_logprobs(model, ids)

        key = "train_checkpointed" if checkpointing else "train"
        what = f"{args.batch} x {args.seq} tokens"
        seconds = timed_or_oom(train, device, args.repeats, figures, key, what)
        if seconds is not None:
            figures[key] = {
                "s_per_token": seconds / tokens,
                "tflops_6n": 6 * matmul * tokens / seconds / 1e12,
            }
            print(
                f"{key}: {seconds:.3f} s a micro-batch, {seconds / tokens:.3e} s a token, "
                f"{6 * matmul * tokens / seconds / 1e12:.0f} TFLOP/s (6N)",
                flush=True,
            )
        if checkpointing:
            model.eval()
            seconds = timed(forward, device, args.repeats)
            figures["forward"] = {
                "s_per_token": seconds / tokens,
                "tflops_2n": 2 * matmul * tokens / seconds / 1e12,
            }
            print(
                f"forward (no grad): {seconds:.3f} s a micro-batch, {seconds / tokens:.3e} s a "
                f"token, {2 * matmul * tokens / seconds / 1e12:.0f} TFLOP/s (2N)",
                flush=True,
            )
        figures["parameters"] = params  # the same for both builds
        if device == "cuda" and isinstance(figures[key], dict):  # not for a run out of memory
            figures[f"{key}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.mix:
        packed_vs_padded(shape, device, args, figures)
    report(figures, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
