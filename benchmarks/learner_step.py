"""Learner throughput (ZeRO 0 vs 2, 1 rank vs 2 on CPU, the proximal log-probs from the training
forward vs a pass of their own), weight publishing to 4 local engines vs one copy, and packed vs
padded micro-batches on a real run's trajectories.

The policy is the embedded default's tiny Qwen2 (2 layers, hidden 128) unless --hidden/--layers
say otherwise; each step trains 4 groups of 8 trajectories of 256 response tokens. Two ranks
(learner.num_ranks 2: gloo over loopback, each rank half the groups and half the threads) run in
a child process of their own, since a process holds one process group; on 2 cores expect no
speed-up: the figure is there to catch regressions in the ranks' overhead.

Packed vs padded (learner.packing) trains the trained groups of a run's spill (default: the
newest runs/local-*/trajectories, which `make run` writes) with configs/local.yaml's learner:
their real lengths, masks and tokens. It also measures the peak memory a training forward and
backward of the log-prob path adds, at Qwen3-8B's vocabulary (151,936) on a one-layer model of
hidden 64: the padded full-vocabulary float32 path against the trainer's (trained positions only,
chunked), each in a process of its own. Its last line is the packed/padded ratio.

    python benchmarks/learner_step.py [--steps 5] [--hidden 128] [--layers 2] [--spill DIR]
        [--packing-only] [--lora-only] [--head-only [--rounds 6]]

LoRA against full fine-tuning (`--lora-only` for that alone): trained tokens/s, trainable
parameters, Adam's state and the time to read the weights to publish (merged, with LoRA).

The head in chunks against the model's own logits (`--head-only`, issue 62) on the spill's
trained groups, configs/local.yaml's learner at `make run`'s threads (half the cores): trained
tokens a second of wall time (the run's `trained_tokens` over its `step_seconds`) and of the
process's CPU time, the two learners taking turns round by round in one process; the last lines
are the median ratios of the rounds. On a machine busy with other work the wall-time figures
scatter; the CPU-time ones hold.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.dataset as ds
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from actors.embedded import EmbeddedEngine
from buffers.records import Group, from_arrow
from buffers.testing import synthetic_trajectory
from learner.attention import implementation
from learner.batch import build_batch, response_logprobs
from learner.packing import response_logprobs as trained_logprobs
from learner.ranked import ranked_learner
from learner.trainer import Learner
from learner.weight_sync import InProcessSync
from pipeline.assets.tiny_policy import build_tiny_policy
from pipeline.config.loader import load_config
from pipeline.config.schema import LearnerConfig, LoraSection

TEXTS = [
    f"Question {i}: <search> Varno Telik </search> <answer> Quorvex {i} </answer>"
    for i in range(2000)
]


def batch(seed: int, vocab: int) -> list[Group]:
    out = []
    for g in range(4):
        members = []
        for i in range(8):
            t = synthetic_trajectory(
                f"b{seed}g{g}", i, tokens=256, reward=float(i % 2), seed=seed * 10 + g
            )
            t.token_ids %= vocab
            t.prompt_token_ids %= vocab
            members.append(t)
        out.append(Group(f"b{seed}g{g}", tuple(members)))
    return out


def tokens_per_second(
    path: str,
    stage: int,
    steps: int,
    vocab: int,
    ranks: int = 1,
    reuse: bool = True,
    lora: LoraSection | None = None,
    **options,
) -> float:
    """Trained tokens/s; `reuse` False (one rank only) makes the proximal pass of its own;
    `lora` (one rank only) trains adapters instead of every weight."""
    assert ranks == 1 or reuse, "the ranks' processes read their own Learner class"
    config = LearnerConfig(micro_batch_size=8, zero_stage=stage, max_steps=100, **options)
    if ranks == 1:
        learner = Learner(path, config, group_size=8, lora=lora)
        learner.reuse_forward_for_proximal = reuse
    else:
        threads = max(1, torch.get_num_threads() // ranks)
        torch.set_num_threads(threads)
        learner = ranked_learner(path, config, ranks, threads, group_size=8)
    learner.step(batch(0, vocab))  # warm-up
    tokens, elapsed = 0.0, 0.0
    for s in range(steps):
        start = time.perf_counter()
        metrics = learner.step(batch(s + 1, vocab))
        elapsed += time.perf_counter() - start
        tokens += metrics["trained_tokens"]
    if learner.peers is not None:
        learner.peers.close()
    return tokens / elapsed


def _ranks_child(path: str, steps: int, vocab: int, ranks: int, queue) -> None:
    queue.put(tokens_per_second(path, 0, steps, vocab, ranks))


def ranked_tokens_per_second(path: str, steps: int, vocab: int, ranks: int) -> float:
    context = mp.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_ranks_child, args=(path, steps, vocab, ranks, queue))
    child.start()
    result = queue.get(timeout=1800)
    child.join()
    return result


def publish_times(path: str, repeats: int) -> tuple[float, float, int]:
    """(median publish to 4 embedded engines, median plain state-dict copy, bytes)."""
    learner = Learner(path, LearnerConfig(micro_batch_size=8, max_steps=100), group_size=8)
    engines = [EmbeddedEngine.from_pretrained(path) for _ in range(4)]
    sync = InProcessSync(engines)
    state = learner.state_dict()
    size = sum(t.numel() * t.element_size() for t in state.values())

    async def publish_all() -> list[float]:
        return [
            (await sync.publish(learner.state_dict(), version)).seconds
            for version in range(1, repeats + 1)
        ]

    published = asyncio.run(publish_all())
    copies = []
    for _ in range(repeats):
        start = time.perf_counter()
        _ = {k: v.detach().clone() for k, v in state.items()}
        copies.append(time.perf_counter() - start)
    assert all(e.version == repeats for e in engines)
    return statistics.median(published), statistics.median(copies), size


def lora_vs_full(path: str, steps: int, vocab: int, repeats: int, r: int = 8) -> dict:
    """Per arm (full fine-tuning, LoRA of rank r on every linear layer): trained tokens/s
    (alternating, best of two, configs/gaia.yaml's loss: the KL term needs a reference, a copy of
    the policy or, with LoRA, the adapters off), trainable parameters, Adam's state in bytes, and
    the median time to read the weights to publish (LoRA: merged)."""
    gaia = {"importance": {"type": "tis"}, "kl_coef": 0.001}
    arms = {"full": None, "lora": LoraSection(r=r, alpha=2.0 * r)}
    found = {arm: {"tokens_per_s": 0.0} for arm in arms}
    for _ in range(2):
        for arm, lora in arms.items():
            speed = tokens_per_second(path, 0, steps, vocab, lora=lora, **gaia)
            found[arm]["tokens_per_s"] = max(found[arm]["tokens_per_s"], speed)
    for arm, lora in arms.items():
        learner = Learner(path, LearnerConfig(max_steps=100, **gaia), group_size=8, lora=lora)
        trained = sum(p.numel() for p in learner.engine.module.parameters() if p.requires_grad)
        reads = []
        for _ in range(repeats):
            start = time.perf_counter()
            learner.state_dict()
            reads.append(time.perf_counter() - start)
        found[arm] |= {
            "trainable": trained,
            "adam_bytes": 2 * 4 * trained,  # two float32 moments a trained parameter
            "reference": learner.reference is not None,
            "publish_read_s": statistics.median(reads),
        }
    return found


def report_lora(found: dict, r: int = 8) -> None:
    full, lora = found["full"], found["lora"]
    print(f"LoRA (rank {r}, every linear layer) against full fine-tuning, tis + KL:")
    for name, arm in (("full", full), (f"LoRA r={r}", lora)):
        reference = "a copy of the policy" if arm["reference"] else "the adapters off"
        print(
            f"  {name:9}: {arm['tokens_per_s']:8.0f} trained tokens/s, {arm['trainable']:>9,} "
            f"trainable parameters, Adam state {arm['adam_bytes'] / 1e6:6.2f} MB, weights to "
            f"publish read in {arm['publish_read_s'] * 1e3:6.2f} ms, reference: {reference}"
        )
    print(
        f"  LoRA / full: {lora['tokens_per_s'] / full['tokens_per_s']:.2f}x tokens/s, "
        f"{lora['trainable'] / full['trainable']:.3f}x trainable parameters and optimizer state"
    )


# ------------------------------------------------------------------ packed vs padded (issue 46)


def spill_groups(spill: Path, vocab: int) -> list[Group]:
    """The trained groups of a run's spill (`trajectories/*.parquet`), as they were: real
    prompt and response lengths, loss masks and token ids (folded into `vocab`)."""
    table = ds.dataset(sorted(spill.glob("*.parquet")), format="parquet").to_table(
        filter=pc.field("status") == "released"  # handed to the learner
    )
    members: dict[str, list] = {}
    for t in from_arrow(table):
        t.token_ids = t.token_ids % vocab  # Arrow's buffers are read-only
        t.prompt_token_ids = t.prompt_token_ids % vocab
        members.setdefault(t.prompt_id, []).append(t)
    size = max(len(m) for m in members.values())
    return [Group(p, tuple(m)) for p, m in members.items() if len(m) == size]


def newest_spill() -> Path | None:
    found = sorted(Path("runs").glob("local-*/trajectories"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def full_vocabulary(learner: Learner):
    """The learner's log-prob path before issue 46, for comparison: a padded forward over every
    position, then log-softmax of the full float32 logits (learner.batch.response_logprobs)."""

    def logprobs(model, micro):
        device = learner.engine.device
        logits = model(
            input_ids=micro.input_ids.to(device), attention_mask=micro.attention_mask.to(device)
        ).logits
        logp, entropy = response_logprobs(logits, micro, learner.temperature)
        mask = micro.response_mask.to(device)
        return logp * mask, entropy * mask, int(micro.input_ids.numel())

    return logprobs


ARMS = {
    "before": {"packing": False},  # and full_vocabulary: the learner as it was
    "padded": {"packing": False},
    "packed": {"packing": True},
}


def packed_vs_padded(path: str, groups: list[Group], steps: int, per_step: int) -> dict:
    """Tokens/s (prompt + response tokens of the trajectories trained, a second) and padding
    share of each arm, with configs/local.yaml's learner (one micro-batch of its 16 trajectories
    a step): `before` (padded, full-vocabulary log-probs: the learner before issue 46), `padded`
    (today's log-prob path on padded rows) and `packed` (the default). The arms alternate, best
    of two each."""
    learner_section = load_config("configs/local.yaml").learner
    best: dict[str, dict] = {}
    for _ in range(2):
        for arm, update in ARMS.items():
            config = learner_section.model_copy(update=update)
            learner = Learner(path, config, group_size=len(groups[0].members))
            if arm == "before":
                learner._logprobs = full_vocabulary(learner)
            learner.step(groups[:per_step])  # warm-up
            tokens = elapsed = padding = 0.0
            for s in range(1, steps + 1):
                chosen = groups[s * per_step : (s + 1) * per_step]
                start = time.perf_counter()
                metrics = learner.step(chosen)
                elapsed += time.perf_counter() - start
                tokens += sum(
                    len(t.prompt_token_ids) + len(t.token_ids) for g in chosen for t in g.members
                )
                padding += metrics["padding_share"]
            found = {"tokens_per_s": tokens / elapsed, "padding_share": padding / steps}
            if arm not in best or found["tokens_per_s"] > best[arm]["tokens_per_s"]:
                best[arm] = found
    return best


def _peak_child(packed: bool, vocab: int, hidden: int, tokens: int, rows: int, queue) -> None:
    """Peak resident memory that a training forward and backward of the log-prob path adds, in
    a process of its own: the padded full-vocabulary path (learner.batch.response_logprobs) or
    the trainer's (trained positions only, chunked float32)."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=tokens + 64,
    )
    model = Qwen2ForCausalLM(config)
    model.config._attn_implementation = implementation(packed) or "sdpa"  # as the learner has it
    trajectories = [synthetic_trajectory(f"m{i}", i, tokens=tokens, seed=i) for i in range(rows)]
    for t in trajectories:
        t.token_ids %= vocab
        t.prompt_token_ids %= vocab
    batch = build_batch(trajectories, torch.ones(rows), 0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if packed:
        logp, _, _ = trained_logprobs(model, batch, True, 1.0, torch.device("cpu"))
    else:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logp, _ = response_logprobs(logits, batch)
    (logp * batch.response_mask).sum().backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    queue.put((after - before) * 1024)  # ru_maxrss is in KiB on Linux


def peak_memory(packed: bool, vocab: int, hidden: int, tokens: int, rows: int) -> float:
    context = mp.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_peak_child, args=(packed, vocab, hidden, tokens, rows, queue))
    child.start()
    result = queue.get(timeout=1800)
    child.join()
    return result


def head_split_vs_own(
    path: str, groups: list[Group], steps: int, rounds: int, per_step: int = 2
) -> dict[str, dict[str, list[float]]]:
    """Trained tokens a second, of wall time (`wall`: the run's `step_seconds`) and of this
    process's CPU time (`cpu`: what other work on the machine barely moves), a round (`steps`
    steps of `per_step` groups) of configs/local.yaml's learner with the head in chunks (`split`,
    learner/head.py) and with the model's own logits (`own`), both on the same groups; the order
    alternates round by round after one warm-up step each."""
    section = load_config("configs/local.yaml").learner
    learners = {arm: Learner(path, section, group_size=len(groups[0].members)) for arm in ARMS_HEAD}
    assert learners["split"].split_head, "the tiny policy's logits are its head's plain output"
    learners["own"].split_head = False
    for learner in learners.values():
        learner.step(groups[:per_step])
    found: dict[str, dict[str, list[float]]] = {arm: {"wall": [], "cpu": []} for arm in ARMS_HEAD}
    for r in range(rounds):
        for arm in ARMS_HEAD if r % 2 == 0 else ARMS_HEAD[::-1]:
            tokens = seconds = cpu = 0.0
            for s in range(steps):
                first = (per_step * (1 + r * steps + s)) % (len(groups) - per_step)
                start = time.process_time()
                metrics = learners[arm].step(groups[first : first + per_step])
                cpu += time.process_time() - start
                tokens += metrics["trained_tokens"]
                seconds += metrics["step_seconds"]
            found[arm]["wall"].append(tokens / seconds)
            found[arm]["cpu"].append(tokens / cpu)
    return found


ARMS_HEAD = ("split", "own")


def report_head(args, spill: Path, found: dict[str, dict[str, list[float]]]) -> None:
    print(
        f"learner on {spill}'s trained groups, configs/local.yaml's learner, "
        f"{torch.get_num_threads()} threads, {args.rounds} rounds of {args.steps} steps:"
    )
    for clock, unit in (("wall", "trained tokens/s"), ("cpu", "trained tokens/CPU s")):
        for arm, name in (("split", "head in chunks    "), ("own", "model's own logits")):
            values = found[arm][clock]
            figures = ", ".join(f"{v:.0f}" for v in values)
            print(f"  {name} : median {statistics.median(values):6.0f} {unit}  ({figures})")
    for clock in ("wall", "cpu"):
        ratios = [a / b for a, b in zip(found["split"][clock], found["own"][clock], strict=True)]
        print(
            f"head in chunks / own logits, {clock} time, median of the rounds: "
            f"{statistics.median(ratios):.3f} (rounds {min(ratios):.3f} to {max(ratios):.3f})"
        )


def policy(tmp: str, args) -> Path:
    heads = max(2, args.hidden // 32)
    return build_tiny_policy(
        f"{tmp}/policy",
        TEXTS,
        layers=args.layers,
        hidden_size=args.hidden,
        heads=heads,
        kv_heads=heads // 2,
        intermediate_size=4 * args.hidden,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--spill", type=Path, help="a run's trajectories/ (default: the newest)")
    parser.add_argument(
        "--packing-only", action="store_true", help="only packed vs padded and the memory"
    )
    parser.add_argument("--lora-only", action="store_true", help="only LoRA against full")
    parser.add_argument(
        "--head-only", action="store_true", help="only the head in chunks against own logits"
    )
    parser.add_argument("--rounds", type=int, default=6, help="--head-only's rounds")
    args = parser.parse_args()
    spill = args.spill or newest_spill()
    if args.lora_only:
        with tempfile.TemporaryDirectory() as tmp:
            path = str(policy(tmp, args))
            report_lora(lora_vs_full(path, args.steps, 1900, args.repeats))
        return
    if spill is None or not any(spill.glob("*.parquet")):
        print(
            f"strata: error: no spill at {spill or 'runs/local-*/trajectories'}: run `make run` "
            "first, or pass --spill DIR (a run's trajectories/)",
            file=sys.stderr,
        )
        sys.exit(2)
    if args.head_only:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # runtime.threads 0's
        with tempfile.TemporaryDirectory() as tmp:
            path = str(policy(tmp, args))
            found = head_split_vs_own(path, spill_groups(spill, 1900), args.steps, args.rounds)
        report_head(args, spill, found)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = str(policy(tmp, args))
        vocab = 1900
        groups = spill_groups(spill, vocab)
        packing = packed_vs_padded(path, groups, args.steps, per_step=2)
        if args.packing_only:
            report_packing(args, spill, packing)
            return
        two_ranks = ranked_tokens_per_second(path, args.steps, vocab, 2)
        zero0 = tokens_per_second(path, 0, args.steps, vocab)
        zero2 = tokens_per_second(path, 2, args.steps, vocab)
        # configs/gaia.yaml's loss: proximal log-probs from the first forward or a pass of their
        # own, alternating, best of two each (a process's first runs are the slowest)
        gaia = {"importance": {"type": "tis"}, "kl_coef": 0.001}
        proximal = {False: 0.0, True: 0.0}
        for _ in range(2):
            for reuse in (False, True):
                proximal[reuse] = max(
                    proximal[reuse],
                    tokens_per_second(path, 0, args.steps, vocab, reuse=reuse, **gaia),
                )
        published, copied, size = publish_times(path, args.repeats)
        lora = lora_vs_full(path, args.steps, vocab, args.repeats)
    print(
        f"learner on CPU, Qwen2 {args.layers} layers x hidden {args.hidden}, {torch.get_num_threads()} threads"
    )
    print(f"  ZeRO 0 : {zero0:8.0f} trained tokens/s")
    print(f"  ZeRO 2 : {zero2:8.0f} trained tokens/s  ({zero2 / zero0:.2f}x of ZeRO 0)")
    print(
        f"  2 ranks, ZeRO 0 : {two_ranks:8.0f} trained tokens/s  ({two_ranks / zero0:.2f}x of 1 rank)"
    )
    print(
        f"  importance tis + KL, proximal pass of its own : {proximal[False]:8.0f} trained tokens/s"
    )
    print(
        f"  importance tis + KL, proximal from the forward: {proximal[True]:8.0f} trained tokens/s  "
        f"({proximal[True] / proximal[False]:.2f}x)"
    )
    print(
        f"  publish to 4 embedded engines : {published * 1e3:7.2f} ms  ({size / 1e6:.1f} MB state dict)"
    )
    print(f"  plain copy of the state dict  : {copied * 1e3:7.2f} ms")
    print(f"  ratio: {published / copied:.2f}x (target <= 2x)")
    report_lora(lora)
    report_packing(args, spill, packing)


def report_packing(args, spill: Path, packing: dict) -> None:
    """The memory of the log-prob path, then packed vs padded: the last line."""
    vocab, hidden, tokens, rows = 151936, 64, 1024, 2
    full, trained = (peak_memory(p, vocab, hidden, tokens, rows) for p in (False, True))
    print(
        f"log-prob path, {rows} x {tokens} response tokens at vocabulary {vocab} (hidden {hidden}),"
        " peak memory a forward + backward adds:"
    )
    print(f"  padded, full-vocabulary float32 : {full / 1e9:6.2f} GB")
    print(
        f"  trained positions, chunked      : {trained / 1e9:6.2f} GB  ({full / trained:.1f}x less)"
    )
    before, padded, packed = packing["before"], packing["padded"], packing["packed"]
    print(f"learner on {spill}'s trained groups, configs/local.yaml's learner, {args.steps} steps:")
    for name, arm in (
        ("before (padded, full vocabulary)", before),
        ("padded, trained positions      ", padded),
        ("packed, trained positions      ", packed),
    ):
        print(
            f"  {name} : {arm['tokens_per_s']:8.0f} tokens/s, padding "
            f"{arm['padding_share']:.0%} of the tokens the forward passes read"
        )
    print(
        f"packed vs before: padding {before['padding_share']:.0%} -> "
        f"{packed['padding_share']:.0%} (target <= 5%), tokens/s "
        f"{packed['tokens_per_s'] / before['tokens_per_s']:.2f}x (target >= 1.25x; packed vs "
        f"padded today {packed['tokens_per_s'] / padded['tokens_per_s']:.2f}x)"
    )


if __name__ == "__main__":
    main()
