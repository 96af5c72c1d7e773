"""The policy called apart at its language-model head, so that no [n, V] tensor is ever whole.

A transformers causal LM computes `lm_head(decoder(...).last_hidden_state)` and, at Qwen3's
151,936-token vocabulary, the logits of 40k trained positions are 12 GB in bf16 before anything
else sees them. Here the decoder (the backbone) runs alone, the hidden states at the positions
that predict a trained token are picked out ([n, H]), and `learner.logprobs.head_logprobs` takes
them through the head a chunk at a time, recomputing each chunk's logits in the backward pass.

**Through DeepSpeed.** The engine's forward does more than call its module: it resets ZeRO's
per-step gradient-hook state and registers the hooks that open the backward pass on the
forward's outputs (and under ZeRO-3 its root module's hooks gather parameters). So the split
forward is not called beside the engine but through it: for one call the engine's module (the
HF model, or the peft model around it with LoRA) has its `forward` replaced by the split one,
and the engine is called as usual. The backbone and the head are called as modules, so ZeRO-3's
per-module hooks fetch the embeddings (inside the backbone) and the head's weight (tied to the
embeddings or not) at each call. ZeRO 0-3 are tested on CPU (tests/learner/test_head.py: ZeRO-3
in one gloo process, which partitions the weights all the same), ZeRO-3 again with NCCL in the
GPU tier: each chunk's head call, and its recomputation in backward, gathers the head's weight
anew, which the GPU figure (benchmarks/learner_gpu_cost.py) has to show is affordable. Over
several ZeRO-3 ranks every rank must make the same gathers, so the ranks agree before each
forward on how many chunks they cut the head's work into (learner/trainer.py `_head_calls`:
enough for the rank with the most trained tokens, some chunks empty on the others), and a rank
without rows runs its empty micro-batch through this same path; without that the ranks
deadlocked or aborted at their first uneven micro-batch (tests/learner/test_ranks.py, two gloo
ranks on CPU).

**Which models.** Only a model whose own logits are exactly its head's output on its backbone's
last hidden states (Qwen2/3, Llama, Mistral...), checked once on a few tokens when the learner
loads it (`splits`): object identity of the logits and bitwise equality of the head's input, so
a model that scales or soft-caps its logits after the head (Gemma 2, Cohere, Granite) or its
hidden states before it keeps its own forward, with `token_logprobs` on its logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from learner.logprobs import head_logprobs


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside `model`: itself, or the one a DeepSpeed engine
    (`.module`) and a peft model (`get_base_model()`) wrap."""
    root = getattr(model, "module", model)
    return root.get_base_model() if hasattr(root, "get_base_model") else root


def parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(backbone, head) of `model` (see `causal_lm`): the decoder returning the last hidden
    states, and the output embeddings (with LoRA on them, the adapted layer)."""
    lm = causal_lm(model)
    return lm.get_decoder(), lm.get_output_embeddings()


@torch.no_grad()
def splits(model: torch.nn.Module) -> bool:
    """Whether `model`'s own logits are its head's output on its backbone's last hidden states,
    untouched: one forward of a few tokens in eval mode, the head's input compared bit for bit
    with the backbone's output and the logits returned checked to be the head's output tensor."""
    lm = causal_lm(model)
    backbone, head = lm.get_decoder(), lm.get_output_embeddings()
    if backbone is None or head is None:
        return False
    seen: dict[str, torch.Tensor] = {}

    def backbone_out(_module, _args, output) -> None:
        seen["hidden"] = output.last_hidden_state

    def head_io(_module, args, output) -> None:
        seen["input"], seen["output"] = args[0], output

    device = next(lm.parameters()).device
    ids = torch.arange(1, 9, device=device)[None] % lm.config.get_text_config().vocab_size
    hooks = [backbone.register_forward_hook(backbone_out), head.register_forward_hook(head_io)]
    training = lm.training
    lm.eval()
    try:
        logits = lm(input_ids=ids, use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
        lm.train(training)
    return (
        logits is seen.get("output")
        and "hidden" in seen
        and torch.equal(seen["input"], seen["hidden"])
    )


def split_logprobs(
    model: torch.nn.Module,
    kwargs: dict[str, torch.Tensor],
    positions: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    temperature: float,
    entropy_grad: bool = False,
    pieces: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) [n] of `targets` from one forward of `model` (an HF causal LM, a peft
    model or a DeepSpeed engine around either) on `kwargs` (input ids and position ids or
    attention mask): `positions` picks the hidden states predicting the targets, [n, H] in the
    targets' order, out of the backbone's [rows, length, H]. `pieces`: how many head calls
    (`head_logprobs`; the same on every rank under ZeRO-3)."""

    def forward(**inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        backbone, head = parts(model)
        hidden = backbone(**inputs, use_cache=False).last_hidden_state
        return head_logprobs(
            positions(hidden), head, targets, temperature, entropy_grad=entropy_grad, pieces=pieces
        )

    with forward_replaced(getattr(model, "module", model), forward):
        return model(**kwargs)


@contextmanager
def forward_replaced(module: torch.nn.Module, forward: Callable) -> Iterator[None]:
    """`module.forward` is `forward` inside: calling `module` (or the engine around it) still
    runs every hook on the module and around it."""
    own = module.__dict__.get("forward")  # one set on the instance already (accelerate's hooks)
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own
