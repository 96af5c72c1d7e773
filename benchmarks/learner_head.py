"""The log-prob path at a 151,936-token vocabulary on CPU (issue 62): peak memory and time of one
learner step of one micro-batch, the head in chunks against the model's own logits.

The policy is a one-layer Qwen2 of hidden 64 at Qwen3's vocabulary, untied as Qwen3-8B is: the
head is nearly all of its work, as the log-prob path is all of the memory this measures. Each
step trains one packed micro-batch of trajectories of at most 2,048 response tokens (16 prompt
tokens each), every response token trained, with the default learner (ZeRO 0, float32). Each
(arm, tokens) runs in a process of its own: a warm-up step of 256 tokens (Adam's state is made
there), then one step, timed; its peak resident memory above the resident memory just before it
(the kernel's high-water mark, reset by /proc/self/clear_refs) is what the step adds.

Arms, side by side in one run:
- `before`: the code before this issue (487d527): the model's own logits at the trained positions
  ([n, V]), then float32 log-probs a slice of 256 positions at a time (each slice's backward
  filled a zero [n, V] gradient);
- `own`: the model's own logits, cut with one split (a model whose logits are not its head's plain
  output takes this path today, learner/head.py);
- `after`: the learner's path, the backbone and the head apart, the head 256 positions at a time.

    python benchmarks/learner_head.py [--tokens 2048,4096,8192,20480,40960]
        [--arms before,own,after] [--json FILE]

`before` and `own` hold [n, V] float32 logits and their gradient, 1.24 GB each per 2,048 trained
tokens: by default they run to 4,096 and 8,192 tokens (`--most-own`, `--most-before`); `before`'s
time grows with the square of the tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

import learner.packing
from buffers.records import Group
from buffers.testing import synthetic_trajectory
from learner.logprobs import CHUNK
from learner.trainer import Learner
from pipeline.assets.tiny_policy import build_tiny_policy
from pipeline.config.schema import LearnerConfig

VOCAB = 151_936
LONGEST = 2048  # response tokens of a trajectory
ARMS = ("before", "own", "after")


# learner/logprobs.py as it was at 487d527, for the `before` arm


def _target_logprob(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    scaled = logits.float() / temperature
    return scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, -1)


def _entropy_of(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    scaled = logits.float() / temperature
    lse = torch.logsumexp(scaled, -1, keepdim=True)
    return lse.squeeze(-1) - (torch.exp(scaled - lse) * scaled).sum(-1)


@torch.no_grad()
def _entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return _entropy_of(logits, temperature).detach()


def _target_logprob_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    return _target_logprob(logits, targets, temperature), _entropy_of(logits, temperature)


def sliced_token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = CHUNK,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """learner.logprobs.token_logprobs as it was at 487d527: a slice per chunk, autograd's chain
    of float32 operations checkpointed per chunk."""
    logps, entropies = [], []
    for first in range(0, logits.shape[0], chunk):
        part, wanted = logits[first : first + chunk], targets[first : first + chunk]
        if part.requires_grad and entropy_grad:
            logp, entropy = checkpoint(
                _target_logprob_and_entropy, part, wanted, temperature, use_reentrant=False
            )
            logps.append(logp)
            entropies.append(entropy)
            continue
        if part.requires_grad:
            logps.append(
                checkpoint(_target_logprob, part, wanted, temperature, use_reentrant=False)
            )
        else:
            logps.append(_target_logprob(part, wanted, temperature))
        entropies.append(_entropy(part, temperature))
    if not logps:
        empty = logits.float().sum(-1)
        return empty, (empty if entropy_grad else empty.detach())
    return torch.cat(logps), torch.cat(entropies)


def policy(directory: Path, hidden: int) -> str:
    """A one-layer Qwen2 at Qwen3's vocabulary, untied, with the tiny policy's tokenizer (the
    learner reads only its pad token)."""
    tiny = build_tiny_policy(directory / "tokenizer", ["a b c d e"] * 8, layers=1, vocab_size=300)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=LONGEST + 64,
        tie_word_embeddings=False,
    )
    path = directory / "policy"
    Qwen2ForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(path)
    return str(path)


def groups(tokens: int, seed: int) -> list[Group]:
    """Pairs of trajectories (rewards 0 and 1) of at most LONGEST response tokens, `tokens`
    response tokens in all, every one trained."""
    rows = max(2, -(-tokens // LONGEST))
    rows += rows % 2
    sizes = [tokens // rows + (i < tokens % rows) for i in range(rows)]
    members = [
        synthetic_trajectory(
            f"p{i // 2}", i % 2, tokens=n, reward=float(i % 2), tool_names=[], seed=seed
        )
        for i, n in enumerate(sizes)
    ]
    return [Group(f"p{g}", (members[2 * g], members[2 * g + 1])) for g in range(rows // 2)]


def kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _one_step(path: str, arm: str, tokens: int, queue) -> None:
    if arm == "before":  # this process only
        learner.packing.token_logprobs = sliced_token_logprobs
    config = LearnerConfig(micro_batch_size=64, max_steps=100)
    model = Learner(path, config, group_size=2, dtype="float32")
    model.split_head = model.split_head and arm == "after"
    model.step(groups(256, seed=1))
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts here
    resident = kib("VmRSS")
    start = time.perf_counter()
    metrics = model.step(groups(tokens, seed=2))
    seconds = time.perf_counter() - start
    queue.put(
        {
            "seconds": seconds,
            "extra_gb": (kib("VmHWM") - resident) * 1024 / 1e9,
            "trained_tokens": int(metrics["trained_tokens"]),
            "split_head": model.split_head,
        }
    )


def one_step(path: str, arm: str, tokens: int) -> dict:
    context = mp.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_one_step, args=(path, arm, tokens, queue))
    child.start()
    child.join()
    if child.exitcode != 0:
        return {"failed": f"exit status {child.exitcode}"}
    return queue.get(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="2048,4096,8192,20480,40960")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--most-before", type=int, default=4096, help="tokens, at most")
    parser.add_argument("--most-own", type=int, default=8192, help="tokens, at most")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    arms = args.arms.split(",")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        print(
            f"learner_head: --arms: no arm {', '.join(unknown)}; arms: {', '.join(ARMS)}",
            file=sys.stderr,
        )
        return 2
    most = {"before": args.most_before, "own": args.most_own, "after": max(sizes)}
    figures: dict = {"vocab": VOCAB, "hidden": args.hidden, "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        path = policy(Path(tmp), args.hidden)
        for tokens in sizes:
            for arm in arms:
                if tokens > most[arm]:
                    continue
                found = one_step(path, arm, tokens)
                figures.setdefault(arm, {})[str(tokens)] = found
                print(f"{arm:6} {tokens:6} trained tokens: {found}", flush=True)
    print(f"one learner step, one packed micro-batch, vocabulary {VOCAB}, hidden {args.hidden}:")
    print("  tokens | " + " | ".join(f"{a}: s, GB added" for a in arms))
    for tokens in sizes:
        cells = []
        for arm in arms:
            f = figures.get(arm, {}).get(str(tokens))
            cells.append(
                "not run"
                if f is None
                else f.get("failed") or f"{f['seconds']:7.1f} s {f['extra_gb']:6.2f} GB"
            )
        print(f"  {tokens:6} | " + " | ".join(cells))
    after = figures.get("after", {})
    base = after.get(str(sizes[0]))
    if base and "seconds" in base:
        per = [
            f"{t}: {after[str(t)]['seconds'] / base['seconds'] * sizes[0] / t:.2f}"
            for t in sizes
            if "seconds" in after.get(str(t), {})
        ]
        print(f"  after, seconds a token against {sizes[0]} tokens': " + ", ".join(per))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
