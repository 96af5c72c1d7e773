"""Supervised fine-tuning on demonstrations (the warm start's training), beside the RL learner.

Cross-entropy on the generated tokens of each example (observation tokens are context only),
AdamW, warm-up then cosine decay over `max_epochs` counted in steps (`learner.schedule`, shared
with the RL learner), for exactly `max_epochs`. Epochs, not seconds, decide how long it trains, so
the same data, seed and thread count give the same weights on a fast or a busy machine of one
kind (another CPU's float kernels give other weights). The optional deadline is a guard: past it
training stops with `SftTimeout` and yields no model at all, never a shorter-trained one. There is
no early stop on a loss plateau: on world v4 the same build stopped
at epoch 27 or ran all 30 depending on float rounding, and one seed's stop left its policy at loss
0.77 and held-out accuracy 0 where its full schedule reached 0.19. Sequences of similar length are batched
together; the prompt prefix every example shares runs once per step.
"""

from __future__ import annotations

import inspect
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from learner.schedule import decay, warmup


class SftTimeout(RuntimeError):
    """Training passed its deadline before its last epoch; the model is not to be used."""


@dataclass(frozen=True)
class Training:
    lr: float = 3e-3
    batch_tokens: int = 2048
    """Padded tokens per optimiser step (sequences of similar length are batched together)."""
    max_epochs: int = 60
    """World v4, held-out accuracy of the greedy policy: 0.07-0.16 after 30 epochs (loss 0.09-0.17;
    seeds and float rounding decide), 0.19-0.20 after 60 (loss 0.02-0.05): docs/results/warm_start.md."""
    warmup_steps: int = 10
    final_lr: float = 0.1
    """The learning rate decays (cosine, over `max_epochs` of steps) to this fraction of `lr`."""


@dataclass(frozen=True)
class SftExample:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]  # over response_ids: 1 generated, 0 observation

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def length_batches(
    examples: list[SftExample], batch_tokens: int, rng: random.Random
) -> list[list[int]]:
    """Indices of examples grouped by length (little padding), in a shuffled order."""
    batches, batch = [], []
    for i in sorted(range(len(examples)), key=lambda i: len(examples[i])):
        if batch and len(examples[i]) * (len(batch) + 1) > batch_tokens:
            batches.append(batch)
            batch = []
        batch.append(i)
    batches.append(batch)
    rng.shuffle(batches)
    return batches


def shared_prefix(examples: Sequence[SftExample]) -> list[int]:
    """The prompt ids every example starts with (the instruction): encoded once per step."""
    first = examples[0].prompt_ids
    n = min(len(e.prompt_ids) for e in examples) - 1  # keep one prompt token per row
    for e in examples:
        n = next((i for i in range(n) if e.prompt_ids[i] != first[i]), n)
    return first[:n]


def _tensors(batch: Sequence[SftExample], skip: int, pad: int):
    """(input ids, attention mask, labels) after the first `skip` prompt ids, right-padded:
    labels[t] is the token at t + 1 where that token was generated, else -100."""

    width = max(len(e) for e in batch) - skip
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, e in enumerate(batch):
        ids[row, : len(e) - skip] = torch.tensor((e.prompt_ids + e.response_ids)[skip:])
        attention[row, : len(e) - skip] = 1
        target = [t if m else -100 for t, m in zip(e.response_ids, e.loss_mask, strict=True)]
        start = len(e.prompt_ids) - skip - 1
        labels[row, start : start + len(target)] = torch.tensor(target)
    return ids, attention, labels


def sft_loss(model, batch: Sequence[SftExample], prefix: Sequence[int], pad: int):
    """(mean cross-entropy over the generated tokens, their count, tokens attended).

    The shared prefix runs once as a batch of one and its keys and values are repeated for the
    rows (gradients flow through them); logits are computed only where a token is predicted.
    """
    from transformers import DynamicCache

    ids, attention, labels = _tensors(batch, len(prefix), pad)
    cache, p, rows = DynamicCache(), len(prefix), len(batch)
    decoder = model.get_decoder()
    # transformers 5.24 renamed past_key_values to cache (the old name goes in 5.40)
    name = (
        "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
    )
    if p:
        decoder(input_ids=torch.tensor([list(prefix)]), **{name: cache}, use_cache=True)
        cache.batch_repeat_interleave(rows)
    hidden = decoder(
        input_ids=ids,
        attention_mask=torch.cat([torch.ones((rows, p), dtype=torch.long), attention], 1),
        position_ids=(p + torch.arange(ids.shape[1])).expand(rows, -1),
        **{name: cache if p else None},
        use_cache=bool(p),
    ).last_hidden_state
    where = labels != -100
    logits = model.get_output_embeddings()(hidden[where])
    return (
        F.cross_entropy(logits.float(), labels[where]),
        int(where.sum()),
        int(attention.sum()) + p * rows,
    )


def learning_rate(training: Training, step: int, progress: float) -> float:
    """Linear warmup, then cosine decay to `final_lr` as `progress` (share of the planned steps
    taken) goes from 0 to 1."""
    return (
        training.lr
        * warmup(step, training.warmup_steps)
        * decay("cosine", progress, training.final_lr)
    )


def train_sft(
    model,
    examples: Sequence[SftExample] | Callable[[int], Sequence[SftExample]],
    pad: int,
    training: Training,
    deadline: float | None,
    seed: int,
    progress: bool,
) -> dict:
    """AdamW on the generated tokens for `training.max_epochs` epochs.

    `examples`: the same every epoch, or a function of the epoch (from 1) giving that epoch's.
    `deadline` (time.monotonic()): a guard; passing it raises `SftTimeout` naming how far it got.
    """

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=training.lr, betas=(0.9, 0.95), weight_decay=0.0
    )
    rng = random.Random(seed)
    step, epochs, losses, planned = 0, [], [], 0
    model.train()
    for epoch in range(1, training.max_epochs + 1):
        drawn = examples(epoch) if callable(examples) else examples
        prefix = shared_prefix(drawn)
        start, total, tokens, generated = time.monotonic(), 0.0, 0, 0
        batches = length_batches(drawn, training.batch_tokens, rng)
        planned = planned or training.max_epochs * len(batches)  # the first epoch's count, fixed
        for batch in batches:
            if deadline is not None and time.monotonic() > deadline:
                raise SftTimeout(f"epoch {epoch} of {training.max_epochs}, step {step}")
            loss, n, attended = sft_loss(model, [drawn[i] for i in batch], prefix, pad)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(training, step, min(1.0, step / planned))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step, losses = step + 1, [*losses, loss.item()]
            total, generated, tokens = total + loss.item() * n, generated + n, tokens + attended
        if generated:
            seconds = time.monotonic() - start
            epochs.append(
                {
                    "epoch": epoch,
                    "loss": total / generated,
                    "tokens_per_s": tokens / seconds,
                    "seconds": seconds,
                }
            )
            if progress:
                print(
                    f"epoch {epoch}/{training.max_epochs}: loss {total / generated:.3f} on generated "
                    f"tokens, {tokens / seconds:,.0f} tokens/s, {seconds:.1f}s",
                    flush=True,
                )
    final = sum(losses[-10:]) / len(losses[-10:]) if losses else None
    return {
        "steps": step,
        "first_loss": losses[0] if losses else None,
        "final_loss": final,
        "epochs": epochs,
    }
