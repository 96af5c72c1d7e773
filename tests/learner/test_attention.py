"""Attention over packed rows (learner/attention.py): the varlen path's values and gradients equal
the per-trajectory path's, on CPU (FlexAttention with a document mask; torch's flash varlen kernel
is CUDA-only: the GPU tier compares it), and which implementation the learner picks where."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.attention import (
    FLASH,
    NAME,
    VARLEN,
    choose,
    implementation,
    segment_attention,
    segment_starts,
    varlen_attention,
)


def test_the_segments_of_a_packed_row_start_at_each_restart():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert segment_starts(positions, 9) == [0, 3, 5, 9]
    assert segment_starts(None, 7) == [0, 7]


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_varlen_attention_equals_attention_per_trajectory(kv_heads):
    torch.manual_seed(0)
    lengths = [5, 1, 9, 3]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    n = sum(lengths)
    module = torch.nn.Module()
    query = torch.randn(1, 4, n, 16, dtype=torch.float64, requires_grad=True)
    key = torch.randn(1, kv_heads, n, 16, dtype=torch.float64, requires_grad=True)
    value = torch.randn(1, kv_heads, n, 16, dtype=torch.float64, requires_grad=True)
    grads = []
    outs = []
    for attend in (segment_attention, varlen_attention):
        out, _ = attend(module, query, key, value, None, scaling=0.3, position_ids=positions)
        weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
        grads.append(torch.autograd.grad((out * weights).sum(), (query, key, value)))
        outs.append(out.detach())
    assert outs[1].shape == (1, n, 4, 16)
    torch.testing.assert_close(outs[1], outs[0])
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want)
    # attention stays inside each trajectory: changing one trajectory leaves the others alone
    changed = value.detach().clone()
    changed[:, :, 6:15] += 1.0
    again, _ = varlen_attention(module, query, key, changed, None, position_ids=positions)
    first, _ = varlen_attention(module, query, key, value.detach(), None, position_ids=positions)
    assert torch.equal(again[:, :6], first[:, :6]) and torch.equal(again[:, 15:], first[:, 15:])
    assert not torch.allclose(again[:, 6:15], first[:, 6:15])


def test_a_packed_model_with_varlen_attention_equals_one_with_segments():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = Qwen2ForCausalLM(config)
    lengths = [7, 12, 4]
    ids = torch.randint(0, 97, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    found = {}
    for name in (NAME, VARLEN):
        model.config._attn_implementation = name
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, position_ids=positions).logits
        logits.float().logsumexp(-1).sum().backward()
        found[name] = logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.testing.assert_close(found[VARLEN][0], found[NAME][0], rtol=1e-5, atol=1e-5)
    for name, grad in found[NAME][1].items():
        torch.testing.assert_close(found[VARLEN][1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "packing,cuda,flash_attn,torch_varlen,chosen",
    [
        (False, True, True, True, None),  # padded rows: the model's own attention
        (True, True, True, True, FLASH),  # flash-attn installed: its varlen kernel
        (True, True, False, True, VARLEN),  # no flash-attn: torch's own varlen kernel
        (True, True, False, False, NAME),  # a torch without it: one sdpa per trajectory
        (True, False, True, True, NAME),  # the CPU path is unchanged
        (True, False, False, True, NAME),
    ],
)
def test_which_attention_where(packing, cuda, flash_attn, torch_varlen, chosen):
    assert choose(packing, cuda, flash_attn, torch_varlen) == chosen


def test_this_machine_packs_with_the_segments_on_its_cpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert implementation(True) == NAME and implementation(False) is None
