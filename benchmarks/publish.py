"""Weight publishing at a realistic size: a Qwen2.5-0.5B-shaped policy (random weights, float32),
to 4 in-process embedded engines and through an HF checkpoint on disk, in one run.

- plain copy: `tensor.clone()` of every entry of the state dict, the least any publish must do
  (the learner keeps training its own tensors, so the engines need a copy);
- in-process publish (`InProcessSync`, what the local runtime uses): one snapshot shared by every
  engine, adopted without a further copy;
- checkpoint publish (`CheckpointSync`, what servers in other processes load): `save_pretrained`
  of the state dict, then every engine loads it back; its write is set beside a plain write of the
  same number of bytes to the same disk (no fsync in either).

    python benchmarks/publish.py [--repeats 5] [--engines 4] [--layers 24]

Needs about 12 GB of memory and 4 GB of disk at the default size. The last line states the
in-process publish against the plain copy (target <= 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.embedded import EmbeddedEngine
from learner.weight_sync import CheckpointSync, InProcessSync


def qwen25_05b(layers: int):
    """Qwen2.5-0.5B's shape (hidden 896, 14 heads, 2 KV heads, MLP 4864, vocab 151,936, tied
    embeddings), built from config with random weights: nothing is downloaded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151_936,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to_empty(device="cpu")  # memory without the slow random init, then fill it
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    model.tie_weights()
    return model


def tokenizer():
    """A two-token tokenizer: engines want one, publishing never uses it."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|endoftext|>": 1}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        unk_token="<unk>",
        eos_token="<|endoftext|>",
    )


def engine_model(model):
    """An engine's own model of the same shape (uninitialised: the first publish fills it)."""
    with torch.device("meta"):
        twin = type(model)(model.config)
    return twin.to_empty(device="cpu")


def median_of(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def plain_write_seconds(directory: str, size: int, repeats: int) -> float:
    """Median seconds to write `size` random bytes to a new file in `directory` (no fsync)."""
    blob = os.urandom(1 << 20) * max(1, size >> 20)
    path = os.path.join(directory, "plain.bin")

    def write() -> None:
        with open(path, "wb") as f:
            f.write(blob)
        os.remove(path)

    return median_of(repeats, write)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument(
        "--dir", default=None, help="where the checkpoints go (default: a temp dir)"
    )
    args = parser.parse_args()

    model = qwen25_05b(args.layers)
    state = model.state_dict()
    unique = {t.untyped_storage().data_ptr(): t for t in state.values()}  # tied: counted once
    size = sum(t.numel() * t.element_size() for t in unique.values())
    params = sum(p.numel() for p in model.parameters())

    engines = [EmbeddedEngine(engine_model(model), tokenizer()) for _ in range(args.engines)]
    in_process = InProcessSync(engines)

    async def publish_all(sync, weights, first: int) -> list[float]:
        return [
            (await sync.publish(weights, v)).seconds for v in range(first, first + args.repeats)
        ]

    async def interleaved() -> tuple[list[float], list[float]]:
        # copy and publish in turns: a fresh 2 GB allocation's page faults vary run to run
        copies, publishes = [], []
        for version in range(1, args.repeats + 1):
            start = time.perf_counter()
            copy = {k: v.detach().clone() for k, v in state.items()}
            copies.append(time.perf_counter() - start)
            del copy
            publishes.append((await in_process.publish(state, version)).seconds)
        return copies, publishes

    copies, inproc = asyncio.run(interleaved())
    copy_s = statistics.median(copies)
    assert all(e.version == args.repeats for e in engines)
    if not all(torch.equal(e.model.state_dict()[k], v) for e in engines for k, v in state.items()):
        raise SystemExit("in-process publish: an engine does not hold the published weights")

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        write_s = plain_write_seconds(tmp, size, args.repeats)
        checkpoint = CheckpointSync(engines, os.path.join(tmp, "published"), model=model, keep=1)
        start = args.repeats + 1
        on_disk = asyncio.run(publish_all(checkpoint, state, start))
        saves = iter(range(args.repeats))

        def save() -> None:  # a new directory each time: transformers skips a shard already there
            target = os.path.join(tmp, f"save-{next(saves)}")
            model.save_pretrained(target, state_dict=dict(state))  # it empties the dict it is given
            shutil.rmtree(target)

        save_s = median_of(args.repeats, save)
    assert all(e.version == 2 * args.repeats for e in engines)

    mb = size / 1e6
    print(
        f"weight publishing, Qwen2.5-0.5B shape ({args.layers} layers, {params / 1e6:.0f}M parameters, "
        f"{mb:,.0f} MB float32), {args.engines} embedded engines, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; median of {args.repeats}"
    )
    print(
        f"  plain copy of the state dict     : {copy_s * 1e3:8.0f} ms  ({mb / copy_s / 1e3:.1f} GB/s)"
    )
    print(
        f"  in-process publish ({args.engines} engines)    : {statistics.median(inproc) * 1e3:8.0f} ms  "
        f"(every engine checked to hold the published weights)"
    )
    print(
        f"  checkpoint publish (save + {args.engines} loads) : {statistics.median(on_disk) * 1e3:8.0f} ms"
    )
    print(
        f"    of which save_pretrained       : {save_s * 1e3:8.0f} ms  ({mb / save_s / 1e3:.2f} GB/s)"
    )
    print(
        f"    plain write of as many bytes   : {write_s * 1e3:8.0f} ms  ({mb / write_s / 1e3:.2f} GB/s; "
        f"save is {save_s / write_s:.2f}x)"
    )
    ratio = statistics.median(inproc) / copy_s
    print(f"in-process publish vs plain copy at 0.5B: {ratio:.2f}x (target <= 2x)")


if __name__ == "__main__":
    main()
