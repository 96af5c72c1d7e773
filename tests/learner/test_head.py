"""The head in chunks (learner/head.py, learner/logprobs.py): the backbone and the language-model
head called apart, no [n, V] tensor at any time, and the same log-probs, entropy and gradients
as the model's own logits, packed and padded, tied and untied, with LoRA and under ZeRO 0-3
(ZeRO-3 in one gloo process on the CPU: its parameters are partitioned all the same, so its
fetch has to gather the head and the embeddings at each call)."""

import pytest
import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils import safe_get_full_grad
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from learner.batch import build_batch
from learner.head import causal_lm, parts, splits
from learner.logprobs import head_logprobs, token_logprobs
from learner.lora import with_adapters
from learner.packing import response_logprobs
from learner.trainer import Learner
from learner.weight_sync import save_hf
from pipeline.assets.tiny_policy import build_tiny_policy
from pipeline.config.schema import LearnerConfig, LoraSection
from tests.learner.test_trainer import TEXTS, uneven_groups

CPU = torch.device("cpu")


class Sizes(TorchDispatchMode):
    """The shape of every tensor an operation makes, forward and backward (`counts` picks the
    operations: all by default)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def counts(self, func, args) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counts(func, args):
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor):
                    self.shapes.append(tuple(t.shape))
        return out


def numel(shape: tuple[int, ...]) -> int:
    return int(torch.tensor(shape).prod()) if shape else 1


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_the_head_in_chunks_equals_the_full_softmax_and_its_gradients(entropy_grad, bias):
    torch.manual_seed(0)
    head = torch.nn.Linear(24, 301, bias=bias, dtype=torch.float64)
    hidden = torch.randn(37, 24, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 301, (37,))
    logp, entropy = head_logprobs(hidden, head, targets, 0.7, chunk=8, entropy_grad=entropy_grad)
    full = torch.log_softmax(head(hidden) / 0.7, -1)
    want = full.gather(-1, targets[:, None]).squeeze(-1)
    want_entropy = -(full.exp() * full).sum(-1)
    torch.testing.assert_close(logp, want.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, want_entropy.float().detach(), rtol=1e-6, atol=1e-6)
    assert entropy.requires_grad == entropy_grad
    a, b = torch.randn(37, dtype=torch.float64), torch.randn(37, dtype=torch.float64)
    inputs = [hidden, *head.parameters()]
    got_loss = (logp.double() * a).sum() + ((entropy.double() * b).sum() if entropy_grad else 0)
    want_loss = (want * a).sum() + ((want_entropy * b).sum() if entropy_grad else 0)
    got = torch.autograd.grad(got_loss, inputs)
    expected = torch.autograd.grad(want_loss, inputs)
    for g, w in zip(got, expected, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_no_vocabulary_sized_tensor_and_the_chunks_gradients_joined_once():
    """Forward and backward over 8 chunks: no tensor of n x V elements (the model's own
    logits are one), and the hidden states' gradient made whole once, not once per chunk."""
    torch.manual_seed(0)
    n, hidden_size, vocab, chunk = 64, 16, 2000, 8
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(n, hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    with Sizes() as seen:
        logp, _ = head_logprobs(hidden, head, targets, chunk=chunk)
        logp.sum().backward()
    assert max(numel(s) for s in seen.shapes) <= 2 * chunk * vocab
    assert seen.shapes.count((n, hidden_size)) <= 2  # the joined gradient (and its accumulation)
    with Sizes() as own:  # the model's logits, then chunks of them: the test can tell
        logits = head(hidden.detach())
        logp, _ = token_logprobs(logits, targets, chunk=chunk)
        logp.sum().backward()
    assert max(numel(s) for s in own.shapes) >= n * vocab


def qwen2(tied: bool, vocab: int = 211) -> Qwen2ForCausalLM:
    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return Qwen2ForCausalLM(config).eval()


def batch_of(vocab: int):
    trajectories = [t for g in uneven_groups(3) for t in g.members]
    for t in trajectories:
        t.token_ids = t.token_ids % vocab
        t.prompt_token_ids = t.prompt_token_ids % vocab
    return build_batch(trajectories, torch.zeros(len(trajectories)), 0)


def logprobs_and_grads(model, batch, packed: bool, split: bool, entropy_grad: bool):
    model.zero_grad(set_to_none=True)
    logp, entropy, _ = response_logprobs(
        model, batch, packed, 0.7, CPU, entropy_grad=entropy_grad, split=split
    )
    weights = torch.linspace(-1, 1, logp.numel()).reshape(logp.shape)
    loss = (logp * weights).sum() + (0.1 * entropy.sum() if entropy_grad else 0.0)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logp.detach(), entropy.detach(), grads


@pytest.mark.parametrize(
    "packed,tied,lora",
    [(True, True, False), (False, False, False), (True, False, True), (False, True, True)],
    ids=["packed-tied", "padded-untied", "packed-untied-lora", "padded-tied-lora"],
)
def test_split_log_probs_equal_the_models_own_logits(packed, tied, lora):
    """Log-probs, entropy (with its gradient: an entropy bonus) and every trained parameter's
    gradient, the head in chunks against the model's own logits at the trained positions."""
    model = qwen2(tied)
    if lora:  # adapters on attention and on the head itself; B = 0 would hide A's gradient
        model = with_adapters(model, LoraSection(r=4, target_modules=["q_proj", "lm_head"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    assert splits(model)
    batch = batch_of(211)
    mask = batch.response_mask > 0
    own = logprobs_and_grads(model, batch, packed, split=False, entropy_grad=True)
    split = logprobs_and_grads(model, batch, packed, split=True, entropy_grad=True)
    torch.testing.assert_close(split[0], own[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split[1], own[1], rtol=1e-5, atol=1e-5)
    assert (split[0][~mask] == 0).all() and split[0][mask].lt(0).all()
    assert set(split[2]) == set(own[2]) and (any("lora_" in n for n in own[2]) == lora)
    for name, grad in own[2].items():
        torch.testing.assert_close(split[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().max() > 0 for n, g in split[2].items() if "lm_head" in n or "embed" in n)


def test_only_a_model_whose_logits_are_its_heads_output_splits():
    """Qwen2 splits, tied or not, bare or in LoRA; Gemma 2 soft-caps its logits after the head
    (final_logit_softcapping), so it keeps its own forward."""
    assert splits(qwen2(True)) and splits(qwen2(False))
    assert splits(with_adapters(qwen2(True), LoraSection(r=2, target_modules=["v_proj"])))
    gemma = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=211,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            final_logit_softcapping=30.0,
        )
    )
    assert not splits(gemma)
    backbone, head = parts(gemma)
    assert backbone is gemma.model and head is gemma.lm_head


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny", TEXTS, vocab_size=500)


@pytest.fixture(scope="module")
def wide_policy(tmp_path_factory):
    """The tiny policy at hidden 256: its head (500 x 256) is over ZeRO-3's persistence threshold
    (1e5 elements; a smaller weight stays gathered after its first use), so under ZeRO-3 the head
    and the embeddings are fetched anew at every call, as an 8B model's are."""
    out = tmp_path_factory.mktemp("policy") / "wide"
    return build_tiny_policy(out, TEXTS, vocab_size=500, hidden_size=256)


@pytest.fixture(scope="module")
def untied_policy(wide_policy, tmp_path_factory):
    """The wide policy with a head of its own: the embeddings' weights, moved off them, so a head
    read from the embeddings (or the other way round) changes every figure."""
    model = AutoModelForCausalLM.from_pretrained(wide_policy, local_files_only=True)
    model.config.tie_word_embeddings = False
    torch.manual_seed(5)
    weight = model.get_input_embeddings().weight.detach()
    model.lm_head.weight = torch.nn.Parameter(weight + 0.05 * torch.randn_like(weight))
    tokenizer = AutoTokenizer.from_pretrained(wide_policy, local_files_only=True)
    return save_hf(tmp_path_factory.mktemp("policy") / "untied", model, tokenizer)


def recorded_gradients(model: Learner) -> list[dict[str, torch.Tensor]]:
    """Each optimiser step's gradient, as ZeRO holds it just before the step (its own
    partitions, assembled: ZeRO 1-2 keep no `.grad` on the parameters)."""
    taken: list[dict[str, torch.Tensor]] = []
    step = model.engine.step

    def recorded(*args, **kwargs):
        if model.engine.is_gradient_accumulation_boundary():
            taken.append(
                {
                    n: safe_get_full_grad(p).detach().clone()
                    for n, p in model.engine.module.named_parameters()
                    if p.requires_grad
                }
            )
        return step(*args, **kwargs)

    model.engine.step = recorded
    return taken


def gathered_calls(model: Learner, micro) -> tuple[list[tuple[str, bool]], list[tuple[str, bool]]]:
    """(module, whether its weight was whole) at each call of the head and the input embeddings
    during one forward, then one backward, of `model`'s log-probs on `micro`. Under ZeRO-3 the
    weights are partitioned (empty here) between calls, so a call sees them whole only if
    DeepSpeed's fetch gathered them for it, the head's recomputation in the backward included."""
    lm = causal_lm(model.engine)
    modules = {"embed": lm.get_input_embeddings(), "head": parts(model.engine)[1]}
    for module in modules.values():
        assert module.weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
        assert module.weight.numel() == 0 < module.weight.ds_numel
        assert not module.weight.ds_persist
    seen: list[tuple[str, bool]] = []
    hooks = [
        module.register_forward_pre_hook(
            lambda m, _args, name=name: seen.append((name, m.weight.shape == m.weight.ds_shape))
        )
        for name, module in modules.items()
    ]
    try:
        logp, _, _ = model._logprobs(model.engine, micro)
        forward = list(seen)
        model.engine.backward(logp.sum())
    finally:
        for hook in hooks:
            hook.remove()
    return forward, seen[len(forward) :]


@pytest.mark.parametrize(
    "stage,lora,tied",
    [(0, False, True), (1, True, True), (2, False, True), (3, False, True), (3, False, False)],
    ids=["z0", "z1-lora", "z2", "z3", "z3-untied"],
)
def test_a_split_learner_steps_as_the_models_own_forward_under_zero(
    request, monkeypatch, stage, lora, tied
):
    """Through DeepSpeed's engine (its forward's hooks kept): the same log-probs and entropy as
    the model's own logits, two steps of two micro-batches each with the same losses and the
    same gradient of every parameter (the head and the embeddings, tied or not, included), then
    the same weights. Under ZeRO-3 the head and the embeddings are gathered at every call."""
    # a ZeRO-3 engine replaces F.linear for the whole process ("until manually reset"): put
    # torch's back for the tests that follow in this worker
    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)
    wide = "wide_policy" if tied else "untied_policy"  # ZeRO-3: weights it partitions
    path = request.getfixturevalue("policy" if stage < 3 else wide)
    steps_as_the_models_own_forward(path, stage, lora, tied)


def steps_as_the_models_own_forward(
    path, stage: int, lora: bool = False, tied: bool = True, slack: float = 1.0
) -> None:
    """The checks of the test above for the policy at `path`, tolerances times `slack` (the GPU
    tier runs them on CUDA's kernels: tests/gpu/test_gpu_tier.py)."""
    config = LearnerConfig(lr=1e-3, zero_stage=stage, micro_batch_size=6, max_steps=10)
    section = LoraSection(r=4, target_modules=["q_proj", "lm_head"]) if lora else None
    own, split = (
        Learner(path, config, group_size=4, dtype="float32", temperature=0.7, lora=section)
        for _ in range(2)
    )
    assert own.split_head and split.split_head
    assert split.engine.zero_optimization_stage() == stage
    own.split_head = False
    micro = batch_of(500)
    with torch.no_grad():
        want, got = own._logprobs(own.engine, micro), split._logprobs(split.engine, micro)
    assert got[2] == want[2]  # the same tokens read
    torch.testing.assert_close(got[0], want[0], rtol=1e-5 * slack, atol=1e-5 * slack)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5 * slack, atol=1e-5 * slack)
    assert got[0][micro.response_mask > 0].lt(0).all()
    taken_own, taken_split = recorded_gradients(own), recorded_gradients(split)
    for seed in (40, 41):
        batch = uneven_groups(seed)
        a, b = own.step(batch), split.step(batch)
        for key in ("loss", "grad_norm", "ratio_mean", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4 * slack, abs=1e-6 * slack), key
    assert len(taken_own) == len(taken_split) == 2
    for ga, gb in zip(taken_own, taken_split, strict=True):
        assert ga.keys() == gb.keys()
        scale = max(float(g.abs().max()) for g in ga.values())
        assert scale > 0
        for name, g in ga.items():
            torch.testing.assert_close(
                gb[name], g, rtol=1e-3 * slack, atol=1e-4 * scale * slack, msg=name
            )
    if not lora:
        # tied, the head's weight is the embeddings'; untied, each has a gradient of its own
        names = ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
        assert all(name in ga for ga in taken_split for name in names)
        assert all(float(g[name].abs().max()) > 0 for g in taken_split for name in names)
    calls = []  # ZeRO-3 gathers parameters in the root module's hooks: they still run
    hook = split.engine.module.register_forward_pre_hook(lambda *_: calls.append(1))
    split._logprobs(split.engine, micro)
    hook.remove()
    assert calls == [1]
    for name, p in own.state_dict().items():
        torch.testing.assert_close(
            split.state_dict()[name], p, rtol=1e-4 * slack, atol=1e-4 * slack, msg=name
        )
    if stage == 3:  # last: its backward leaves gradients in ZeRO's partitions
        forward, backward = gathered_calls(split, micro)
        chunks = forward.count(("head", True))  # the embeddings once, the head once a chunk
        assert forward == [("embed", True)] + [("head", True)] * chunks and chunks >= 1, forward
        assert backward == [("head", True)] * chunks, backward  # each chunk's logits recomputed


def reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """log softmax(logits / T)[target] and the entropy, autograd's own full-softmax chain."""
    full = torch.log_softmax(logits / temperature, -1)
    return full.gather(-1, targets[:, None]).squeeze(-1), -(full.exp() * full).sum(-1)


def both_paths(hidden, head, targets, **kwargs):
    """(head_logprobs, token_logprobs of the head's logits), each called with `kwargs`."""
    return {
        "head": head_logprobs(hidden, head, targets, **kwargs),
        "token": token_logprobs(head(hidden), targets, **kwargs),
    }


def test_by_default_the_temperature_is_1_and_the_entropy_is_telemetry():
    torch.manual_seed(0)
    head = torch.nn.Linear(12, 97, dtype=torch.float64)
    hidden = torch.randn(21, 12, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 97, (21,))
    want, want_entropy = reference(head(hidden), targets, 1.0)
    for name, (logp, entropy) in both_paths(hidden, head, targets, chunk=8).items():
        torch.testing.assert_close(logp, want.float(), rtol=1e-6, atol=1e-6, msg=name)
        torch.testing.assert_close(entropy, want_entropy.float().detach(), msg=name)
        assert logp.requires_grad and not entropy.requires_grad, name


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_log_probs_entropy_and_gradients_at_any_temperature_equal_the_full_softmax(temperature):
    """At 1 (no division), 2 and 0.5: the values and the gradient of log-probs and entropy,
    the head in chunks and the logits in chunks."""
    torch.manual_seed(1)
    head = torch.nn.Linear(12, 97, dtype=torch.float64)
    hidden = torch.randn(21, 12, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 97, (21,))
    a, b = torch.randn(21, dtype=torch.float64), torch.randn(21, dtype=torch.float64)
    want, want_entropy = reference(head(hidden), targets, temperature)
    expected = torch.autograd.grad((want * a).sum() + (want_entropy * b).sum(), hidden)
    kwargs = {"temperature": temperature, "chunk": 8, "entropy_grad": True}
    for name, (logp, entropy) in both_paths(hidden, head, targets, **kwargs).items():
        torch.testing.assert_close(logp, want.float(), rtol=1e-6, atol=1e-6, msg=name)
        torch.testing.assert_close(entropy, want_entropy.float(), rtol=1e-6, atol=1e-6, msg=name)
        got = torch.autograd.grad((logp.double() * a).sum() + (entropy.double() * b).sum(), hidden)
        torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6, msg=name)


def test_rows_of_very_different_scale_each_get_their_own_softmax():
    """One row's logits 1000 above another's: each row's maximum is its own, so neither row's
    exponentials underflow to a log of 0 (eighths: the same values in float32)."""
    torch.manual_seed(2)
    logits = (torch.randn(6, 40, dtype=torch.float64) * 16).round() / 8
    logits[::2] += 1000.0
    logits.requires_grad_(True)
    targets = torch.randint(0, 40, (6,))
    want, want_entropy = reference(logits, targets, 0.7)
    logp, entropy = token_logprobs(logits, targets, 0.7, chunk=4)
    assert logp.isfinite().all() and entropy.isfinite().all()
    torch.testing.assert_close(logp, want.float(), rtol=1e-5, atol=1e-5)
    # H = lse - sum(p s) in float32 with s near 1430: a few of its units in the last place
    torch.testing.assert_close(entropy, want_entropy.float().detach(), rtol=0, atol=1e-3)


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("n", [0, 1])
def test_no_or_one_trained_token_gives_that_many_log_probs_attached_to_the_graph(n, entropy_grad):
    """No position: empty [0] log-probs and entropy that a loss can still backpropagate through
    (a zero gradient), the entropy attached only for a bonus; one position: its log-prob."""
    torch.manual_seed(3)
    head = torch.nn.Linear(12, 97, dtype=torch.float64)
    hidden = torch.randn(n, 12, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 97, (n,))
    want, want_entropy = reference(head(hidden), targets, 0.7)
    kwargs = {"temperature": 0.7, "entropy_grad": entropy_grad}
    for name, (logp, entropy) in both_paths(hidden, head, targets, **kwargs).items():
        assert logp.shape == entropy.shape == (n,), name
        torch.testing.assert_close(logp, want.float(), rtol=1e-6, atol=1e-6, msg=name)
        torch.testing.assert_close(entropy, want_entropy.float().detach(), msg=name)
        assert logp.requires_grad and entropy.requires_grad == entropy_grad, name
        loss = logp.sum() + (entropy.sum() if entropy_grad else 0)
        (grad,) = torch.autograd.grad(loss, hidden)
        assert grad.shape == hidden.shape and (n > 0 or grad.numel() == 0), name


def test_targets_a_chunk_short_of_the_positions_are_refused():
    torch.manual_seed(4)
    head = torch.nn.Linear(12, 97)
    hidden, targets = torch.randn(8, 12), torch.randint(0, 97, (4,))
    with pytest.raises(ValueError, match="zip"):
        head_logprobs(hidden, head, targets, chunk=4)
    with pytest.raises(ValueError, match="zip"):
        token_logprobs(head(hidden), targets, chunk=4)


def test_a_trained_head_on_frozen_hidden_states_recomputes_each_chunk_in_the_backward():
    """LoRA on the head alone: the hidden states carry no gradient, the head does; its chunks'
    logits are still recomputed in the backward (not kept whole), and its gradient is right."""
    torch.manual_seed(5)
    head = torch.nn.Linear(12, 97, dtype=torch.float64)
    hidden = torch.randn(21, 12, dtype=torch.float64)
    targets = torch.randint(0, 97, (21,))
    calls = []
    hook = head.register_forward_pre_hook(lambda *_: calls.append(1))
    logp, _ = head_logprobs(hidden, head, targets, 0.7, chunk=8)
    forward = len(calls)
    got = torch.autograd.grad(logp.sum(), list(head.parameters()))
    hook.remove()
    assert forward == 3 and len(calls) == 2 * forward  # 3 chunks, each recomputed once
    want, _ = reference(head(hidden), targets, 0.7)
    expected = torch.autograd.grad(want.sum(), list(head.parameters()))
    for g, w in zip(got, expected, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [0, 2, 21])
def test_pieces_call_the_head_that_many_times_whatever_the_positions(n):
    """ZeRO-3 over several ranks: every rank calls its head as often as the others (each call
    gathers the weight from all of them), forward and in the backward's recomputation, with as
    few positions as it has (none, fewer than the pieces, or many); the values and gradients
    are the chunked path's."""
    torch.manual_seed(6)
    head = torch.nn.Linear(12, 97, dtype=torch.float64)
    hidden = torch.randn(n, 12, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 97, (n,))
    sizes = []
    hook = head.register_forward_pre_hook(lambda _m, args: sizes.append(args[0].shape[0]))
    logp, entropy = head_logprobs(hidden, head, targets, 0.7, chunk=4, pieces=3)
    forward = list(sizes)
    got = torch.autograd.grad(logp.sum() + entropy.sum(), [hidden, *head.parameters()])
    hook.remove()
    assert forward == [len(c) for c in torch.arange(n).tensor_split(3)]  # near-equal, in order
    assert len(sizes) == 2 * 3 and sorted(sizes[3:]) == sorted(forward)  # each recomputed once
    want, want_entropy = reference(head(hidden), targets, 0.7)
    torch.testing.assert_close(logp, want.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, want_entropy.float().detach(), rtol=1e-6, atol=1e-6)
    assert not entropy.requires_grad
    expected = torch.autograd.grad(want.sum(), [hidden, *head.parameters()])
    for g, w in zip(got, expected, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


class Divisions(Sizes):
    """The shape of every division by a number (the temperature), forward and backward."""

    def counts(self, func, args) -> bool:
        by = args[1] if len(args) > 1 else None
        number = not isinstance(by, torch.Tensor) or by.dim() == 0
        return func.overloadpacket in (torch.ops.aten.div, torch.ops.aten.div_) and number


def test_at_temperature_1_no_chunk_of_logits_is_divided():
    """Dividing by 1 gives the same values: at temperature 1 no [chunk, V] buffer is spent on it,
    forward or backward; at 0.7 the logits and their gradient are divided."""
    torch.manual_seed(6)
    head = torch.nn.Linear(12, 97)
    hidden = torch.randn(16, 12, requires_grad=True)
    targets = torch.randint(0, 97, (16,))
    seen = {}
    for temperature in (1.0, 0.7):
        with Divisions() as divisions:
            logp, _ = head_logprobs(hidden, head, targets, temperature, chunk=8)
            logp.sum().backward()
        seen[temperature] = divisions.shapes.count((8, 97))
    assert seen[1.0] == 0 and seen[0.7] > 0
