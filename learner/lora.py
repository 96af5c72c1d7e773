"""LoRA (`model.lora`): the learner trains low-rank adapters on a frozen policy (peft), so an 8B
policy trains on one GPU.

The adapters live only in the learner. What leaves it is always a plain model's weights under
the base model's names: `merged_state_dict` adds each adapter's B·A·(alpha / r) to the frozen
weight it adapts, without touching the training model (merging in place and back would round the
frozen weights a little at every publish). The engines, the publishers and `hf/` checkpoints
therefore see the same thing as in full fine-tuning. The KL term's reference is the same model
with its adapters off (`adapters_off`): no second copy of the policy.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ADAPTER = "default"
"""The one adapter the learner trains (peft's default name)."""
ADAPTER_SEED = 0


class LoraError(ValueError):
    """model.lora names layers the policy does not have; one line saying which it has."""


def with_adapters(model: torch.nn.Module, section: Any) -> torch.nn.Module:
    """`model` (an HF causal LM) wrapped in fresh LoRA adapters of `section` (model.lora: r,
    alpha, dropout, target_modules): only the adapters train; B starts at 0, so the wrapped
    model computes exactly what `model` does until the first step. A is drawn from a fixed seed:
    every run (every rank, a resumed learner before its checkpoint loads) starts alike, and the
    caller's random state is left as it was."""
    from peft import LoraConfig, get_peft_model

    linear = sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    )
    unknown = [name for name in section.target_modules if name not in linear]
    if unknown:  # peft would skip a misspelt name silently when another one matches
        raise LoraError(
            f"model.lora.target_modules: the policy has no linear layer named {', '.join(unknown)}; "
            f"its linear layers are {', '.join(linear)}"
        )
    config = LoraConfig(
        r=section.r,
        lora_alpha=section.alpha,
        lora_dropout=section.dropout,
        target_modules=list(section.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.manual_seed(ADAPTER_SEED)
        # peft reads transformers' deprecated is_gradient_checkpointing: not ours to act on
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, config)


def adapted_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Name (as in the base model's state dict, without `.weight`) -> each LoRA-adapted layer."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of the policy `model` (a peft model) computes, under the base model's names:
    each adapted weight plus its adapter's delta, every other weight as it is (detached copies of
    the adapted ones, views of the rest)."""
    base = model.get_base_model()
    weights = {
        name.replace(".base_layer.", "."): tensor.detach()
        for name, tensor in base.state_dict().items()
        if ".lora_" not in name
    }
    for name, layer in adapted_layers(model).items():
        key = f"{name}.weight"
        weights[key] = weights[key] + layer.get_delta_weight(ADAPTER).to(weights[key].dtype)
    return weights


def adapter_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights of `model` (a peft model), as peft saves them."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


def save_adapter(model: torch.nn.Module, weights: dict, directory: Path) -> None:
    """The adapters in peft's format (adapter_config.json, adapter_model.safetensors):
    `PeftModel.from_pretrained(base, directory)` puts them back on the base model."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    model.peft_config[ADAPTER].save_pretrained(str(directory))
    save_file(
        {k: v.contiguous() for k, v in weights.items()}, directory / "adapter_model.safetensors"
    )


@contextmanager
def adapters_off(model: torch.nn.Module):
    """`model` (a peft model) computing its base model's outputs, for the reference policy."""
    with model.disable_adapter():
        yield model
