"""Packed micro-batches and token budgets (learner/packing.py) train exactly as padded ones, and
the chunked log-probs (learner/logprobs.py) equal the full-vocabulary reference."""

import pytest
import torch

from learner.batch import build_batch, response_logprobs
from learner.corrections import CORRECTIONS
from learner.estimators import ESTIMATORS
from learner.logprobs import token_logprobs
from learner.packing import model_input, plan_micro_batches
from learner.packing import response_logprobs as packed_logprobs
from learner.trainer import Learner
from pipeline.assets.tiny_policy import build_tiny_policy
from pipeline.config.schema import LearnerConfig
from tests.learner.test_trainer import TEXTS, groups, uneven_groups


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny", TEXTS, vocab_size=500)


def test_micro_batches_by_count_keep_step_order():
    assert plan_micro_batches([5, 9, 3, 7, 2], 2, None) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("budget", [10, 25, 60])
def test_micro_batches_by_tokens_hold_every_row_once_within_the_budget(budget):
    lengths = [12, 40, 7, 7, 22, 3, 15, 30, 9]
    plan = plan_micro_batches(lengths, 4, budget)
    assert sorted(i for rows in plan for i in rows) == list(range(len(lengths)))
    for rows in plan:
        assert len(rows) <= 4 and rows == sorted(rows)
        assert sum(lengths[i] for i in rows) <= budget or len(rows) == 1  # too long: alone
    assert len(plan) < len(lengths) or budget < 12  # rows do share micro-batches


def test_micro_batches_by_tokens_fill_the_longest_rows_first():
    """First fit, longest first: two 7s and two 3s under a budget of 10 make two micro-batches;
    filled in index order (or shortest first) the 3s would share one and each 7 take its own."""
    assert plan_micro_batches([3, 3, 7, 7], 4, 10) == [[0, 2], [1, 3]]
    assert plan_micro_batches([5, 5, 5], 4, 10) == [[0, 1], [2]]  # an exact fit shares
    assert plan_micro_batches([1] * 5, 2, 100) == [[0, 1], [2, 3], [4]]  # at most max_rows


def test_chunked_log_probs_and_their_gradient_equal_the_full_softmax():
    torch.manual_seed(0)
    logits = torch.randn(37, 301, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 301, (37,))
    logp, entropy = token_logprobs(logits, targets, temperature=0.7, chunk=8)
    full = torch.log_softmax(logits / 0.7, -1)
    expected = full.gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(logp, expected.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1).float().detach())
    weights = torch.randn(37, dtype=torch.float64)
    (grad,) = torch.autograd.grad((logp.double() * weights).sum(), logits)
    (want,) = torch.autograd.grad((expected * weights).sum(), logits)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)
    assert not entropy.requires_grad


@pytest.mark.parametrize("packed", [True, False])
def test_log_probs_at_trained_positions_equal_the_padded_full_reference(policy, packed):
    """Packed (one row, position ids restarting) or padded, logits only where a token trains:
    the same log-probs as the full forward of the padded batch, 0 where the mask is 0, at the
    sampling temperature (0.7) as at 1."""
    model = Learner(policy, LearnerConfig(), group_size=4, dtype="float32").model.eval()
    trajectories = [t for g in uneven_groups(3) for t in g.members]
    batch = build_batch(trajectories, torch.zeros(len(trajectories)), 0)
    on = next(model.parameters()).device  # the device the learner chose
    with torch.no_grad():
        full = model(
            input_ids=batch.input_ids.to(on), attention_mask=batch.attention_mask.to(on)
        ).logits
        for temperature in (1.0, 0.7):
            want, want_entropy = response_logprobs(full, batch, temperature)
            got, entropy, read = packed_logprobs(model, batch, packed, temperature, on)
            got, entropy = got.cpu(), entropy.cpu()
            want, want_entropy = want.cpu(), want_entropy.cpu()
            mask = batch.response_mask > 0
            torch.testing.assert_close(got[mask], want[mask], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(entropy[mask], want_entropy[mask], rtol=1e-4, atol=1e-4)
            assert (got[~mask] == 0).all()
    real = int(batch.attention_mask.sum())
    assert read == (real if packed else batch.input_ids.numel()) and read > 0
    given = model_input(batch, packed)
    assert given.targets.numel() == int(mask.sum())
    # outside no_grad: the log-probs carry a gradient, the entropy one only when asked for it,
    # with the head in chunks too
    logp, entropy, _ = packed_logprobs(model, batch, packed, 1.0, on)
    assert logp.requires_grad and not entropy.requires_grad
    for split in (False, True):
        _, entropy, _ = packed_logprobs(
            model, batch, packed, 1.0, on, entropy_grad=True, split=split
        )
        assert entropy.requires_grad


def test_the_agreed_number_of_head_calls_is_asked_with_the_trained_tokens_and_kept(policy):
    """ZeRO-3 over several ranks (learner/trainer.py `_head_calls`): `agree` is given this
    micro-batch's trained tokens and its answer is how many times the head is called; the
    values are those of the head in its usual chunks."""
    model = Learner(policy, LearnerConfig(), group_size=4, dtype="float32").model.eval()
    trajectories = [t for g in uneven_groups(3) for t in g.members]
    batch = build_batch(trajectories, torch.zeros(len(trajectories)), 0)
    on = next(model.parameters()).device
    asked, calls = [], []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        want, _, _ = packed_logprobs(model, batch, True, 0.7, on, split=True)
        calls.clear()
        got, _, _ = packed_logprobs(
            model, batch, True, 0.7, on, split=True, agree=lambda n: asked.append(n) or 5
        )
    hook.remove()
    assert asked == [int(batch.response_mask.sum())] and len(calls) == 5
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# Every estimator, correction and aggregation mode at least once (a case each, not the product).
CASES = [
    {"advantage": {"type": "grpo"}, "importance": {"type": "none"}},
    {
        "advantage": {"type": "stratified", "alpha": 0.6},
        "loss_agg": "seq-mean-token-sum",
        "kl_coef": 0.05,
    },
    {"advantage": {"type": "rloo"}, "importance": {"type": "mask", "cap": 1.5}, "ppo_epochs": 2},
    {
        "advantage": {"type": "dr_grpo"},
        "importance": {"type": "icepop", "cap": 1.5},
        "loss_agg": "seq-mean-token-mean",
    },
    {
        "advantage": {"type": "mc_grpo"},
        "importance": {"type": "seq_mask", "cap": 1.5},
        "loss_agg": "seq-mean-token-mean",
    },
    {"ratio": "sequence", "loss_agg": "seq-mean-token-mean", "importance": {"type": "none"}},
    {"advantage": {"type": "reinforce_pp"}, "importance": {"type": "none"}},
    {
        "advantage": {"type": "reinforce_pp_baseline"},
        "surrogate": {"type": "cispo"},
        "dual_clip": None,
        "entropy_coef": 0.01,
    },
    {"advantage": {"type": "grpo"}, "step_credit": {"type": "gigpo", "omega": 0.5}},
    {"advantage": {"type": "gae"}, "kl_coef": 0.05, "kl_in_reward": True, "ppo_epochs": 2},
]
# Clip-Cov and KL-Cov choose tokens within the micro-batch the loss sees (learner/surrogates.py),
# so they match only where the micro-batches do: a case of their own below, and in the rest
# of the suite as any other surrogate.
assert {c.get("advantage", {}).get("type") for c in CASES} >= set(ESTIMATORS)
assert {c.get("importance", {}).get("type", "tis") for c in CASES} >= set(CORRECTIONS)


def recording_gradients(model: Learner) -> list[dict[str, torch.Tensor]]:
    """The summed gradient of every optimiser step, taken just before DeepSpeed applies it:
    Adam turns a gradient of ~1e-9 into a full step of either sign, so weights cannot be
    compared where the order of float additions differs; the gradients can."""
    taken: list[dict[str, torch.Tensor]] = []
    step = model.engine.step

    def recorded(*args, **kwargs):
        if model.engine.is_gradient_accumulation_boundary():
            taken.append(
                {
                    n: p.grad.detach().clone()
                    for n, p in model.model.named_parameters()
                    if p.grad is not None
                }
            )
        return step(*args, **kwargs)

    model.engine.step = recorded
    return taken


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_a_packed_step_with_a_token_budget_equals_the_padded_step(policy, case):
    """Every estimator, correction and aggregation: the padded step (micro-batches of 5 rows)
    against packed rows under a token budget (other micro-batches altogether): the same loss,
    statistics and gradient, to float tolerance, over two steps; no padding when packed."""
    base = dict(lr=5e-3, zero_stage=0, max_steps=50, micro_batch_size=5)
    padded = Learner(
        policy, LearnerConfig(**base, **case, packing=False), group_size=4, dtype="float32"
    )
    packed = Learner(
        policy,
        LearnerConfig(**base, **case, max_tokens_per_micro_batch=120),
        group_size=4,
        dtype="float32",
    )
    grads_a, grads_b = recording_gradients(padded), recording_gradients(packed)
    for seed in (40, 41):
        batch = uneven_groups(seed)
        a, b = padded.step(batch), packed.step(batch)
        for key in (
            *("loss", "grad_norm", "ratio_mean", "clip_fraction", "entropy", "kl"),
            *("value_loss", "value_mean", "explained_variance"),  # the critic's (gae)
        ):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        assert a["trained_tokens"] == b["trained_tokens"]
        assert b["padding_share"] == 0.0 < a["padding_share"]
    assert len(grads_a) == len(grads_b) == 2 * padded.config.ppo_epochs
    for ga, gb in zip(grads_a, grads_b, strict=True):
        scale = max(float(g.abs().max()) for g in ga.values())
        for name, g in ga.items():
            torch.testing.assert_close(gb[name], g, rtol=1e-3, atol=1e-4 * scale, msg=name)


def test_kl_cov_packed_equals_padded_on_the_same_micro_batches(policy):
    case = {"surrogate": {"type": "kl_cov", "share": 0.05}, "dual_clip": None}
    base = dict(lr=5e-3, zero_stage=0, max_steps=50, micro_batch_size=5, **case)
    padded = Learner(policy, LearnerConfig(**base, packing=False), group_size=4, dtype="float32")
    packed = Learner(policy, LearnerConfig(**base), group_size=4, dtype="float32")
    batch = uneven_groups(40)
    a, b = padded.step(batch), packed.step(batch)
    for key in ("loss", "grad_norm", "cov_selected_fraction"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert a["cov_selected_fraction"] > 0


def test_a_micro_batch_with_no_trained_token_still_steps(policy):
    """Every token of a micro-batch masked (here: every trajectory's loss mask zero): the
    backward pass still runs, and nothing moves."""
    model = Learner(policy, LearnerConfig(lr=5e-3, micro_batch_size=8), group_size=4)
    batch = groups(7)
    for g in batch:
        for t in g.members:
            t.loss_mask[:] = 0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = model.step(batch)
    assert metrics["trained_tokens"] == 0
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p, before[name], msg=name)
