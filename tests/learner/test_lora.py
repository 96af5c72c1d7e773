"""LoRA (model.lora) in the DeepSpeed learner: only the adapters train, what leaves the learner
is the merged policy under the base model's names, the reference is the policy with its adapters
off, and checkpoints resume the adapters and their optimizer."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from learner.batch import build_batch, response_logprobs
from learner.checkpoint import load_checkpoint, save_checkpoint
from learner.lora import LoraError, adapted_layers, adapter_weights, save_adapter
from learner.trainer import Learner
from pipeline.assets.tiny_policy import build_tiny_policy
from pipeline.config.schema import LearnerConfig, LoraSection
from tests.conftest import sharded_stages
from tests.learner.test_trainer import TEXTS, groups

IDS = torch.tensor([[5, 17, 3, 99, 42, 7, 250, 11]])


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny", TEXTS, vocab_size=500)


LORA = LoraSection(r=4, alpha=8.0)


def lora_learner(policy, lora=LORA, **overrides) -> Learner:
    options = dict(lr=5e-3, micro_batch_size=3, zero_stage=0, max_steps=50)
    options.update(overrides)
    return Learner(policy, LearnerConfig(**options), group_size=4, dtype="float32", lora=lora)


def logits(model, ids=IDS) -> torch.Tensor:
    """On the CPU, from wherever `model` is (the learner's model is on the GPU where there is one)."""
    with torch.no_grad():
        return model(input_ids=ids.to(next(model.parameters()).device)).logits.cpu()


def on_cpu(weights: dict) -> dict:
    return {k: v.cpu() for k, v in weights.items()}


def test_only_the_adapters_train_and_the_published_weights_are_the_merged_policy(policy):
    initial = AutoModelForCausalLM.from_pretrained(policy).state_dict()
    model = lora_learner(policy)
    trained = {n for n, p in model.engine.module.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert model.state_dict().keys() == initial.keys()  # the base model's names: engines load them
    for b in (groups(1), groups(2)):
        model.step(b)
    published = on_cpu(model.state_dict())
    layers = adapted_layers(model.engine.module)
    adapted = {f"{name}.weight" for name in layers}
    assert len(adapted) == 2 * 7  # two blocks, every linear layer of each
    for key, weight in published.items():
        if key not in adapted:  # everything the adapters do not touch is the initial policy
            assert torch.equal(weight, initial[key]), key
    for name, layer in layers.items():  # the rest differs by B·A·(alpha / r), and only by that
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        delta = (b @ a).cpu() * (8.0 / 4)
        assert delta.abs().max() > 0, name  # the adapters did learn
        torch.testing.assert_close(published[f"{name}.weight"] - initial[f"{name}.weight"], delta)
    # A plain model with the published weights computes what the adapted policy computes.
    plain = AutoModelForCausalLM.from_pretrained(policy)
    plain.load_state_dict(published)
    torch.testing.assert_close(logits(plain), logits(model.engine.module), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("stage", sharded_stages())
def test_zero_stages_train_the_adapters_like_stage_0(policy, stage):
    batches = [groups(7), groups(8)]
    plain, sharded = lora_learner(policy), lora_learner(policy, zero_stage=stage)
    for b in batches:
        plain.step(b)
        sharded.step(b)
    for (name, p), q in zip(plain.state_dict().items(), sharded.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)


def test_the_reference_is_the_policy_with_its_adapters_off(policy):
    model = lora_learner(policy, kl_coef=0.05)
    assert model.reference is None  # no second copy of the policy
    initial = AutoModelForCausalLM.from_pretrained(policy)
    first = model.step(groups(3))
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # B starts at 0: policy = reference
    model.step(groups(4))
    assert model.step(groups(5))["kl"] > 0  # the adapted policy moved away from it
    with model._reference_policy() as reference:
        torch.testing.assert_close(logits(reference), logits(initial), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(logits(model.engine.module), logits(initial), atol=1e-4)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")  # peft's own
def test_a_lora_checkpoint_resumes_like_straight_training(policy, tmp_path):
    batches = [groups(30 + i) for i in range(4)]
    straight = lora_learner(policy, kl_coef=0.01)
    for b in batches:
        straight.step(b)
    first = lora_learner(policy, kl_coef=0.01)
    for b in batches[:2]:
        first.step(b)
    saved = save_checkpoint(first, tmp_path)
    resumed = lora_learner(policy, kl_coef=0.01)
    load_checkpoint(resumed, tmp_path)
    for b in batches[2:]:
        resumed.step(b)
    for (name, p), q in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)
    # hf/ is the merged policy; adapter/ the adapters alone, as peft loads them onto the base.
    from peft import PeftModel

    merged = AutoModelForCausalLM.from_pretrained(saved / "hf")
    adapters = load_file(saved / "adapter" / "adapter_model.safetensors")
    assert adapters and all("lora_" in k for k in adapters)
    onto_base = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(policy), saved / "adapter"
    )
    torch.testing.assert_close(logits(onto_base), logits(merged), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits(merged), logits(first.engine.module), atol=1e-5, rtol=1e-4)


def test_a_layer_the_policy_does_not_have_is_refused_in_one_line(policy):
    with pytest.raises(LoraError, match="no linear layer named nope; its linear layers are down"):
        lora_learner(policy, lora=LoraSection(r=4, target_modules=["q_proj", "nope"]))
    with pytest.raises(LoraError) as refused:
        lora_learner(policy, lora=LoraSection(r=4, target_modules=["nope", "q_proj", "nor"]))
    assert str(refused.value) == (
        "model.lora.target_modules: the policy has no linear layer named nope, nor; its linear "
        "layers are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"
    )


def test_adapter_dropout_takes_the_proximal_log_probs_from_an_eval_pass(policy):
    """With adapter dropout a training forward is a noisy sample, so the proximal log-probs every
    micro-batch's loss receives (a correction reads them: tis) are those of an eval pass (no
    dropout) before the update, not the training forward's own."""
    model = lora_learner(policy, lora=LoraSection(r=4, dropout=0.1), importance={"type": "tis"})
    assert model.dropout  # the proximal log-probs get a pass of their own (learner/trainer.py)
    draw = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B starts at 0, and with it the adapters' output and their dropout
        for name, p in model.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=draw).to(p))
    batch = groups(6)
    members = [t for g in batch for t in g.members]
    padded = build_batch(members, torch.zeros(len(members)), model.pad_id)
    on = next(model.model.parameters()).device
    ids, attention = padded.input_ids.to(on), padded.attention_mask.to(on)

    def logprobs(training: bool) -> torch.Tensor:
        model.model.train(training)
        with torch.no_grad():
            out = model.model(input_ids=ids, attention_mask=attention).logits
        return response_logprobs(out, padded, model.temperature)[0].cpu()

    want = logprobs(False)
    trained = padded.response_mask > 0
    assert (logprobs(True) - want)[trained].abs().max() > 1e-3  # dropout acts in training
    seen = []
    original = model._micro_step

    def recording(micro, proximal, *args, **kwargs):
        seen.append(proximal)
        return original(micro, proximal, *args, **kwargs)

    model._micro_step = recording
    assert "loss" in model.step(batch)
    plan = model._micro_batches(members)
    assert len(seen) == len(plan) and all(p is not None for p in seen)
    for rows, proximal in zip(plan, seen, strict=True):
        mask = trained[rows, : proximal.shape[1]]
        torch.testing.assert_close(
            proximal.cpu()[mask], want[rows, : proximal.shape[1]][mask], atol=1e-5, rtol=1e-5
        )


def test_the_adapters_save_into_a_new_nested_folder_and_over_an_earlier_save(policy, tmp_path):
    """save_adapter makes the folders it needs and writes over a save already there (a
    checkpoint saved again to the same place); peft loads the result onto the base model."""
    from peft import PeftModel

    learner = lora_learner(policy)
    learner.step(groups(7))
    model = learner.engine.module
    target = tmp_path / "not" / "there" / "adapter"
    save_adapter(model, on_cpu(adapter_weights(model)), target)
    save_adapter(model, on_cpu(adapter_weights(model)), target)
    onto_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(policy), target)
    torch.testing.assert_close(logits(onto_base), logits(model), atol=1e-5, rtol=1e-4)


def test_the_adapters_config_is_the_sections_for_a_causal_lm(policy, tmp_path):
    """What peft records of model.lora (and what a user's PeftModel.from_pretrained reads back):
    the section's rank, scale and layers, no bias, a causal LM's task."""
    section = LoraSection(r=2, alpha=16.0, target_modules=["k_proj", "o_proj"])
    model = lora_learner(policy, lora=section).engine.module
    save_adapter(model, on_cpu(adapter_weights(model)), tmp_path)
    found = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (found["r"], found["lora_alpha"], found["bias"]) == (2, 16.0, "none")
    assert sorted(found["target_modules"]) == ["k_proj", "o_proj"]
    assert found["task_type"] == "CAUSAL_LM"
