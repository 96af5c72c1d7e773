"""The DeepSpeed learner on the tiny model: real DeepSpeed (one process), real HF save/load.

Device-agnostic: tensors go to the device the learner chose (CUDA where there is one). The
learners here train in float32 wherever they run: these tests compare steps that must agree to
float tolerance (bf16 on CUDA, the learner's own default there, is compared in tests/gpu/)."""

import asyncio
import math
import statistics

import numpy as np
import pytest
import torch

from actors.engine import EngineError
from buffers.group_buffer import GroupBuffer
from buffers.records import Group
from buffers.testing import synthetic_trajectory
from learner.algorithm import plan_step
from learner.batch import build_batch, response_logprobs
from learner.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from learner.estimators import ESTIMATORS
from learner.trainer import Learner, kl_to_go
from learner.weight_sync import CheckpointSync, InProcessSync
from pipeline.assets.tiny_policy import build_tiny_policy
from pipeline.config.schema import LearnerConfig
from tests.conftest import sharded_stages

TEXTS = [
    f"Question {i}: <search> Varno Telik </search> <answer> Quorvex {i} </answer>"
    for i in range(1500)
]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny", TEXTS, vocab_size=500)


def groups(
    seed: int, n: int = 2, size: int = 4, version: int = 0, tokens=lambda g, i: 24
) -> list[Group]:
    """`n` groups of `size`; `tokens(group, member)` response tokens each."""
    out = []
    for g in range(n):
        members = []
        for i in range(size):
            t = synthetic_trajectory(
                f"s{seed}g{g}",
                i,
                tokens=tokens(g, i),
                version=version,
                reward=float((i + g) % 2),
                tool_names=["search"] * (i % 3),
                seed=seed * 100 + g,
            )
            t.token_ids %= 400
            t.prompt_token_ids %= 400
            members.append(t)
        out.append(Group(f"s{seed}g{g}", tuple(members)))
    return out


def learner(policy, **overrides) -> Learner:
    options = dict(lr=5e-3, micro_batch_size=3, zero_stage=0, max_steps=50)
    options.update(overrides)
    return Learner(policy, LearnerConfig(**options), group_size=4, dtype="float32")


def weights_differ(a: Learner, b: Learner) -> bool:
    """Whether any weight of the two learners' models differs (their updates did)."""
    pairs = zip(a.model.state_dict().values(), b.model.state_dict().values(), strict=True)
    return any(not torch.equal(x, y) for x, y in pairs)


def device_of(model: Learner) -> torch.device:
    """Where the learner put its weights."""
    return next(model.model.parameters()).device


def test_loss_decreases_on_a_fixed_batch(policy):
    model = learner(policy)
    batch = groups(0)
    losses = [model.step(batch)["loss"] for _ in range(8)]
    assert losses[-1] < losses[0] - 1e-3
    assert model.version == 8


def test_mask_and_alignment_reach_the_loss(policy):
    model = learner(policy)
    trajectories = list(groups(1)[0].members)
    batch = build_batch(trajectories, torch.zeros(len(trajectories)), model.pad_id)
    device = device_of(model)
    with torch.no_grad():
        logits = model.model(
            input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device)
        ).logits
        logp, _ = response_logprobs(logits, batch)
        t = trajectories[0]
        ids = torch.tensor([list(t.prompt_token_ids) + list(t.token_ids)], device=device)
        full = torch.log_softmax(model.model(input_ids=ids).logits[0].float(), -1)
    p = len(t.prompt_token_ids)
    expected = [full[p - 1 + j, tok].item() for j, tok in enumerate(t.token_ids)]
    assert logp[0, : len(t.token_ids)].tolist() == pytest.approx(expected, abs=1e-4)
    assert batch.response_mask[0, : len(t.token_ids)].tolist() == t.loss_mask.tolist()
    assert batch.versions[0, : len(t.token_ids)].tolist() == t.token_versions.tolist()


def test_masked_tokens_do_not_move_the_step(policy):
    def first_step_loss(edit):
        model = learner(policy, importance={"type": "none"})
        batch = groups(2)
        for g in batch:
            for t in g.members:
                edit(t)
        return model.step(batch)["loss"]

    base = first_step_loss(lambda t: None)
    # A masked (observation) token's behaviour log-prob is not part of the loss...
    masked = first_step_loss(lambda t: t.behavior_logprobs.__setitem__(t.loss_mask == 0, -50.0))
    assert masked == pytest.approx(base, abs=1e-6)
    # ...a generated token's is.
    generated = first_step_loss(lambda t: t.behavior_logprobs.__setitem__(t.loss_mask == 1, -0.01))
    assert abs(generated - base) > 1e-4


def test_zero_variance_groups_can_be_dropped(policy):
    model = learner(policy, drop_zero_variance_groups=True)
    flat = groups(7, n=1)
    for t in flat[0].members:
        t.reward = 1.0
    metrics = model.step(flat + groups(8, n=1))
    assert metrics["groups"] == 1 and metrics["skipped_groups"] == 1


def test_a_group_older_than_eta_never_reaches_the_learner(policy):
    model = learner(policy)

    async def scenario():
        buffer = GroupBuffer(group_size=4, max_staleness=1)
        for g in groups(9, n=1, version=0) + groups(10, n=1, version=3):
            for t in g.members:
                await buffer.put(t)
        model.version = 4  # the learner is at version 4: the version-0 group is 4 behind
        group = await buffer.next_group(model.version)
        return group, buffer.stats()

    group, stats = asyncio.run(scenario())
    assert group.policy_version == 3 and stats.dropped_stale == 4
    metrics = model.step([group])
    assert metrics["staleness_mean"] == 1.0


@pytest.mark.parametrize("stage", sharded_stages())
def test_zero_stages_train_like_stage_0(policy, stage):
    """Stage 3 (CUDA only) computes the same update with kernels of its own (flat fp32 partitions,
    another order of sums): on an H100 (2026-11-27) its weights were within 2e-5 of stage 0's
    after each of three steps, not growing, with losses and gradient norms equal to 7 digits.
    Its weights' tolerance, 1e-4, is 2% of one Adam step (lr 5e-3); a gradient lost or counted
    twice shows in the gradient norm. Stages 1 and 2 match stage 0 to 1e-5."""
    batch = groups(11)
    reference = learner(policy, zero_stage=0)
    sharded = learner(policy, zero_stage=stage)
    for _ in range(2):
        a, b = reference.step(batch), sharded.step(batch)
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    atol = 1e-4 if stage == 3 else 1e-5
    for (name, p), q in zip(
        reference.state_dict().items(), sharded.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-4, msg=name)


def uneven_groups(seed: int) -> list[Group]:
    """Three groups of four, 12 to 39 response tokens each: micro-batches of different widths."""
    return groups(seed, n=3, tokens=lambda g, i: 12 + 9 * ((i + g) % 4))


def count_proximal_passes(model: Learner) -> list[int]:
    calls = [0]
    own = model._proximal

    def counted(*args):
        calls[0] += 1
        return own(*args)

    model._proximal = counted
    return calls


@pytest.mark.parametrize(("importance", "epochs"), [("tis", 1), ("tis", 2), ("mask", 2)])
def test_proximal_log_probs_from_the_first_epoch_equal_a_pass_of_their_own(
    policy, importance, epochs
):
    """ "tis" takes the proximal log-probs from the first epoch's forward passes (the weights move
    only at the epoch's end; a second epoch reuses them): the same steps as recomputing them
    first, one pass fewer. "mask" needs them before the first micro-batch, so it still
    recomputes. 12 rows of uneven lengths in micro-batches of 5: the last is short and narrower
    than the step."""
    options = dict(
        importance={"type": importance, "cap": 1.5},
        kl_coef=0.01,
        ppo_epochs=epochs,
        micro_batch_size=5,
    )
    reused, recomputed = learner(policy, **options), learner(policy, **options)
    recomputed.reuse_forward_for_proximal = False
    passes = count_proximal_passes(reused), count_proximal_passes(recomputed)
    for seed in (30, 31):
        batch = uneven_groups(seed)
        a, b = reused.step(batch), recomputed.step(batch)
        for key in (
            "loss",
            "grad_norm",
            "importance_weight_mean",
            "truncated_fraction",
            "mask_drop_fraction",
            "ratio_mean",
            "clip_fraction",
            "kl",
            "trained_tokens",
        ):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
        assert a["importance_weight_mean"] != pytest.approx(1.0, abs=1e-3)  # not trivial weights
    assert [p[0] for p in passes] == ([0, 2] if importance == "tis" else [2, 2])
    for (name, p), q in zip(
        reused.state_dict().items(), recomputed.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)


def test_a_model_with_dropout_recomputes_the_proximal_log_probs(policy, tmp_path):
    """A training forward with dropout is one noisy sample of the policy: not the proximal one."""
    import json
    import shutil

    noisy = tmp_path / "noisy"
    shutil.copytree(policy, noisy)
    config = json.loads((noisy / "config.json").read_text())
    config["attention_dropout"] = 0.1
    (noisy / "config.json").write_text(json.dumps(config))
    model = learner(noisy, importance={"type": "tis"})
    passes = count_proximal_passes(model)
    model.step(groups(32))
    assert model.dropout and passes == [1]
    assert not learner(policy, importance={"type": "tis"}).dropout


def test_checkpoint_resume_equals_straight_training(policy, tmp_path):
    batches = [groups(20 + i) for i in range(4)]
    straight = learner(policy, importance={"type": "tis"}, kl_coef=0.01)
    for b in batches:
        straight.step(b)

    first = learner(policy, importance={"type": "tis"}, kl_coef=0.01)
    for b in batches[:2]:
        first.step(b)
    saved = save_checkpoint(first, tmp_path, extra={"data_cursor": 2})
    resumed = learner(policy, importance={"type": "tis"}, kl_coef=0.01)
    extra = load_checkpoint(resumed, tmp_path)
    assert extra == {"data_cursor": 2} and resumed.version == 2
    for b in batches[extra["data_cursor"] :]:
        resumed.step(b)
    assert resumed.version == straight.version == 4
    for (name, p), q in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)

    # The HF directory loads as an ordinary model with the saved weights.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(saved / "hf")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        trained = first.model(ids.to(device_of(first))).logits.cpu()
        torch.testing.assert_close(hf(ids).logits, trained, atol=1e-5, rtol=1e-4)


def test_resume_refuses_broken_or_foreign_checkpoints(policy, tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        load_checkpoint(learner(policy), tmp_path)
    model = learner(policy)
    model.step(groups(30))
    path = save_checkpoint(model, tmp_path)
    (path / "hf" / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint, hf/config\.json is missing"):
        load_checkpoint(learner(policy), tmp_path)
    save_checkpoint(model, tmp_path / "other")
    other = build_tiny_policy(
        tmp_path / "wider", TEXTS, vocab_size=500, hidden_size=64, heads=2, kv_heads=1
    )
    with pytest.raises(CheckpointError, match="checkpoint of another model"):
        load_checkpoint(
            Learner(other, LearnerConfig(micro_batch_size=3), group_size=4), tmp_path / "other"
        )


class RecordingEngine:
    def __init__(self, fail=False):
        self.updates, self.version, self.fail = [], 0, fail

    async def update_weights(self, version, *, state_dict=None, path=None):
        if self.fail:
            raise EngineError("127.0.0.1:30000 refused the checkpoint")
        self.updates.append((version, state_dict, path))
        self.version = version


def test_weight_sync_snapshots_once_and_versions_increase(policy, tmp_path):
    model = learner(policy)
    engines = [RecordingEngine() for _ in range(4)]
    sync = InProcessSync(engines)
    model.step(groups(40))
    report = asyncio.run(sync.publish(model.state_dict(), model.version))
    assert report.seconds > 0 and report.published and report.served_version == 1
    assert {e.updates[0][0] for e in engines} == {1}
    shared = engines[0].updates[0][1]
    assert all(e.updates[0][1] is shared for e in engines)  # one snapshot for all
    before = shared["model.norm.weight"].clone()
    model.step(groups(41))  # training on does not touch what the engines serve
    torch.testing.assert_close(shared["model.norm.weight"], before)
    with pytest.raises(ValueError, match="must increase"):
        asyncio.run(sync.publish(model.state_dict(), 1))

    disk = CheckpointSync(engines[:1], tmp_path / "weights", model.model, model.tokenizer, keep=2)
    for version in (2, 3, 4):
        asyncio.run(disk.publish(model.state_dict(), version))
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000003", "v000004"]
    assert engines[0].updates[-1][2].endswith("v000004")

    # A target that fails keeps its version; the report says so and nothing is raised.
    broken = CheckpointSync(
        [engines[0], RecordingEngine(fail=True)], tmp_path / "weights", model.model
    )
    report = asyncio.run(broken.publish(model.state_dict(), 5))
    assert not report.published and report.served_version == 0
    assert report.failures == ["127.0.0.1:30000 refused the checkpoint"]


def test_a_step_makes_rewarded_responses_more_likely(policy):
    """The direction of the update, not only its size: after one step the rewarded members of
    each group gain log-probability relative to the unrewarded ones (a sign error in the
    advantages or the surrogate would reverse this while the loss still went down)."""
    model = learner(policy, lr=1e-3)
    batch = groups(3)
    members = [t for g in batch for t in g.members]
    rewards = torch.tensor([t.reward for t in members])

    def logp() -> torch.Tensor:
        b = build_batch(members, torch.zeros(len(members)), model.pad_id)
        device = device_of(model)
        with torch.no_grad():
            logits = model.model(
                input_ids=b.input_ids.to(device), attention_mask=b.attention_mask.to(device)
            ).logits
            values, _ = response_logprobs(logits, b)
        return (values.cpu() * b.response_mask).sum(-1)

    before = logp()
    model.step(batch)
    gain = logp() - before
    assert gain[rewards == 1].mean() > gain[rewards == 0].mean() + 0.1


def step_gradient(policy, batch, **options) -> torch.Tensor:
    """The gradient one step accumulates over its micro-batches (the optimiser step is skipped)."""
    model = learner(policy, **options)
    model.engine.step = lambda: None  # keep what the micro-batches accumulated
    model.step(batch)
    return torch.cat(
        [p.grad.flatten().cpu() for p in model.model.parameters() if p.grad is not None]
    )


def test_importance_mask_weights_micro_batches_by_the_tokens_it_keeps(policy):
    """With importance "mask" dropping most tokens of one group only, a step split into
    micro-batches has the gradient of the same step in one piece: each micro-batch counts by
    the tokens the loss keeps, not by those it had before the mask."""
    batch = groups(7)
    for t in batch[0].members:  # behaviour log-probs far below the policy's: weight above the cap
        generated = t.loss_mask == 1
        t.behavior_logprobs[generated] = -30.0
        t.behavior_logprobs[np.flatnonzero(generated)[:2]] = -1.0  # a few tokens stay
    options = dict(importance={"type": "mask", "cap": 2.0}, drop_zero_variance_groups=False)
    whole = step_gradient(policy, batch, micro_batch_size=8, **options)
    split = step_gradient(policy, batch, micro_batch_size=4, **options)  # one micro-batch per group
    assert whole.norm() > 0
    torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-6)


def test_model_dtype_and_gradient_checkpointing_act(policy):
    """model.dtype and model.gradient_checkpointing reach the learner (bfloat16 trains on CPU)."""
    from pipeline.config.schema import BufferConfig, PretrainedModel, StrataConfig
    from pipeline.runtime.parts import make_learner

    config = StrataConfig(
        model=PretrainedModel(path=str(policy), dtype="bfloat16"),
        learner=LearnerConfig(micro_batch_size=3, lr=5e-3),
        buffer=BufferConfig(group_size=4),
    )
    bf16 = make_learner(config, policy)  # as both runtimes build it
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    before = {k: v.clone() for k, v in bf16.state_dict().items()}
    assert math.isfinite(bf16.step(groups(0))["loss"]) and bf16.version == 1
    after = bf16.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before)  # every tensor trained

    def gradient(**options):
        model = Learner(
            policy,
            LearnerConfig(micro_batch_size=3, lr=5e-3),
            group_size=4,
            dtype="float32",
            **options,
        )
        model.engine.step = lambda: None
        model.step(groups(3))
        return model, torch.cat(
            [p.grad.flatten().cpu() for p in model.model.parameters() if p.grad is not None]
        )

    checkpointed, with_checkpoints = gradient(gradient_checkpointing=True)
    assert checkpointed.model.is_gradient_checkpointing
    torch.testing.assert_close(with_checkpoints, gradient()[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(set(ESTIMATORS) - {"stratified"}))
def test_every_estimator_trains(policy, name):
    """learner.advantage.type picks the estimator; mc_grpo's pivots (odd groups) carry no tokens."""
    model = learner(policy, advantage={"type": name})
    batch = groups(9, size=4)
    if name == "mc_grpo":
        model.group_size = 3  # odd groups: one pivot each
        batch = [Group(g.prompt_id, g.members[:3]) for g in batch]
    metrics = model.step(batch)
    assert math.isfinite(metrics["loss"]) and model.version == 1
    generated = sum(int(t.loss_mask.sum()) for g in batch for t in g.members)
    pivots = {"mc_grpo": 2}.get(name, 0)
    assert metrics["trained_tokens"] <= generated
    if pivots:  # the trained tokens exclude exactly the pivots' generated tokens
        from learner.estimators import estimate

        members = [t for g in batch for t in g.members]
        keep = estimate(
            "mc_grpo",
            torch.tensor([t.reward for t in members], dtype=torch.float64),
            torch.tensor([i // 3 for i in range(len(members))]),
            torch.tensor([t.stratum for t in members]),
        ).keep
        assert int((~keep).sum()) == pivots
        kept_tokens = sum(
            int(t.loss_mask.sum()) for t, k in zip(members, keep.tolist(), strict=True) if k
        )
        assert metrics["trained_tokens"] == kept_tokens


@pytest.mark.parametrize(
    "options",
    [
        {"importance": {"type": "icepop"}},
        {"importance": {"type": "seq_mask", "floor": 0.2}},
        {"ratio": "sequence", "loss_agg": "seq-mean-token-mean"},
    ],
)
def test_every_correction_trains(policy, options):
    model = learner(policy, **options)
    metrics = model.step(groups(11))
    assert math.isfinite(metrics["loss"]) and model.version == 1 and metrics["trained_tokens"] > 0


def test_token_weighted_staleness_counts_each_generated_token(policy):
    model = learner(policy)
    model.step(groups(12))  # now at version 1: the next step trains tokens of versions 0 and 1
    batch = groups(13)
    old = new = 0
    for g in batch:
        for t in g.members:
            generated = np.flatnonzero(t.loss_mask == 1)
            t.token_versions[generated[: len(generated) // 3]] = (
                1  # a third sampled after an update
            )
            new += len(generated) // 3
            old += len(generated) - len(generated) // 3
            t._policy_version = None  # recomputed from the token versions
    metrics = model.step(batch)
    assert metrics["staleness_mean"] == 1.0  # a trajectory is as old as its oldest token
    assert metrics["staleness_token_mean"] == pytest.approx(old / (old + new))


def test_turn_credit_gives_the_finding_turns_their_own_advantage(policy):
    """learner.turn_credit: the tokens before the finding observation train with the early
    advantage, the rest with the outcome's; every generated token trains (nothing is cut)."""
    from learner.turn_credit import token_advantages

    batch = groups(15)
    t = batch[0].members[1]
    cut = int(np.flatnonzero(t.loss_mask == 0)[0])
    t.first_answer_turn, t.first_answer_token = 0, cut
    t.validate()
    rows = [m for g in batch for m in g.members]
    late, early = torch.zeros(len(rows)), torch.zeros(len(rows))
    early[1] = 2.0
    per_token = token_advantages(rows, late, early, 40)
    assert per_token[1, :cut].eq(2.0).all() and per_token[1, cut:].eq(0).all()
    assert per_token[[0, *range(2, len(rows))]].eq(0).all()
    credited = learner(policy, turn_credit=0.5)
    metrics = credited.step(batch)
    generated = sum(int(m.loss_mask.sum()) for m in rows)
    assert metrics["trained_tokens"] == generated and metrics["found_answer_share"] == 0.125
    plain = learner(policy)
    plain.step(batch)
    assert weights_differ(credited, plain)  # the credit changed the update


def test_a_latent_reward_trains_only_the_turns_up_to_the_first_answer(policy):
    """TSPO credit: a trajectory rewarded for having found the answer trains no token after the
    observation that held it; the others train all their generated tokens."""
    model = learner(policy)
    batch = groups(14)
    t = batch[0].members[1]
    cut = int(np.flatnonzero(t.loss_mask == 0)[0])  # its first observation
    t.first_answer_turn, t.first_answer_token, t.latent_reward = 0, cut, 0.3
    t.validate()
    metrics = model.step(batch)
    generated = sum(int(m.loss_mask.sum()) for g in batch for m in g.members)
    after = int(t.loss_mask[cut:].sum())
    assert after > 0 and metrics["trained_tokens"] == generated - after


def test_kl_in_reward_takes_each_tokens_kl_to_go_from_its_advantage(policy):
    """REINFORCE++: A_t = A - kl_coef * sum over t' >= t of (log pi_behav - log pi_ref)(t'),
    over the trained tokens of the row, as a loop; the loss then carries no KL term."""
    model = learner(
        policy, kl_coef=0.5, kl_kind="k1", kl_in_reward=True, advantage={"type": "grpo"}
    )
    batch = groups(7)
    members = [t for g in batch for t in g.members]
    plan = plan_step(batch, model.config)
    padded = build_batch(members, plan.advantages, model.pad_id)
    kl = model._reference_kl(padded, model._micro_batches(members))
    got, total = kl_to_go(plan.advantages, kl, 0.5), float(kl.sum())
    on = device_of(model)
    with torch.no_grad():
        logits = model.reference(
            input_ids=padded.input_ids.to(on), attention_mask=padded.attention_mask.to(on)
        ).logits
        reference, _ = response_logprobs(logits, padded)
    reference = reference.float().cpu()
    mask = padded.response_mask
    everything = 0.0
    for i in range(len(members)):
        trained = [j for j in range(mask.shape[1]) if mask[i, j]]
        for j in trained:
            to_go = sum(
                float(padded.behavior_logprobs[i, k] - reference[i, k]) for k in trained if k >= j
            )
            assert float(got[i, j]) == pytest.approx(
                float(plan.advantages[i]) - 0.5 * to_go, abs=1e-4
            )
        everything += sum(float(padded.behavior_logprobs[i, k] - reference[i, k]) for k in trained)
    assert total == pytest.approx(everything, abs=1e-3)
    metrics = model.step(batch)
    assert math.isfinite(metrics["loss"]) and metrics["kl"] == pytest.approx(
        everything / metrics["trained_tokens"], rel=1e-3, abs=1e-4
    )
    with pytest.raises(ValueError, match=r"set learner\.kl_coef > 0"):
        LearnerConfig(kl_in_reward=True)


def test_step_credit_reaches_the_tokens_it_credits(policy):
    """learner.step_credit gigpo: each token trains with its plan's per-token advantage (the
    loss of a step equals the policy loss on those advantages), and the update differs from the
    episode advantage's alone."""
    batch = groups(16)
    credited = learner(policy, advantage={"type": "grpo"}, step_credit={"type": "gigpo"})
    plan = plan_step(batch, credited.config)
    rows = [m for g in batch for m in g.members]
    assert plan.per_token is not None and len(plan.per_token) == len(rows)
    assert any(not torch.allclose(p, p[0].expand_as(p)) for p in plan.per_token)
    metrics = credited.step(batch)
    assert math.isfinite(metrics["loss"])
    plain = learner(policy, advantage={"type": "grpo"})
    plain.step(batch)
    assert weights_differ(credited, plain)


def test_igpo_scores_the_gold_answer_with_the_policy_and_trains(policy):
    """answer_logprobs is the teacher-forced mean log-prob of `<answer> gold </answer>` after
    the prompt and the trajectory's first `cut` tokens; a step with igpo trains."""
    model = learner(policy, advantage={"type": "grpo"}, step_credit={"type": "igpo"})
    batch = groups(17)
    t = batch[0].members[0]
    cuts = (5, 11)  # rows of two widths: the logits kept are the union of their answers'
    got = model.answer_logprobs([(t, cut) for cut in cuts])
    answer = model.tokenizer.encode(
        f"<answer> {t.ground_truth[0]} </answer>", add_special_tokens=False
    )
    on = device_of(model)
    for cut, score in zip(cuts, got, strict=True):
        ids = [*t.prompt_token_ids.tolist(), *t.token_ids[:cut].tolist(), *answer]
        with torch.no_grad():
            logp = torch.log_softmax(
                model.model(input_ids=torch.tensor([ids], device=on)).logits[0].float(), -1
            )
        start = len(ids) - len(answer)
        want = statistics.fmean(float(logp[start - 1 + j, tok]) for j, tok in enumerate(answer))
        assert score == pytest.approx(want, abs=1e-4)
    metrics = model.step(batch)
    assert math.isfinite(metrics["loss"]) and "step_advantage_abs_mean" in metrics


def test_gigpo_and_igpo_as_advantage_types_are_grpo_plus_their_step_credit(policy):
    """learner.advantage.type gigpo is the paper's composition: the plan equals GRPO's episode
    advantage with learner.step_credit gigpo added, token for token."""
    batch = groups(18)
    as_type = plan_step(batch, LearnerConfig(advantage={"type": "gigpo", "omega": 0.5}))
    composed = plan_step(
        batch,
        LearnerConfig(advantage={"type": "grpo"}, step_credit={"type": "gigpo", "omega": 0.5}),
    )
    assert torch.equal(as_type.advantages, composed.advantages)
    for a, b in zip(as_type.per_token, composed.per_token, strict=True):
        assert torch.equal(a, b)
    model = learner(policy, advantage={"type": "igpo"})
    assert math.isfinite(model.step(batch)["loss"])


def padded_values(critic, batch) -> torch.Tensor:
    """V of every response token of a padded batch from a plain forward of the critic's model,
    read at the position before the token (the reference the learner's packed path is held to)."""
    on = next(critic.model.parameters()).device
    with torch.no_grad():
        scores = critic.model(
            input_ids=batch.input_ids.to(on), attention_mask=batch.attention_mask.to(on)
        ).logits[..., 0]
    r = batch.response_mask.shape[1]
    at = batch.response_start.to(on)[:, None] - 1 + torch.arange(r, device=on)
    values = scores.gather(1, at.clamp(max=scores.shape[1] - 1)).float().cpu()
    return values * (batch.response_mask > 0)


def test_gae_trains_a_critic_and_the_policy_on_its_advantages(policy):
    """The critic reads V at the position before each trained token (packed = a padded plain
    forward); the step's advantages are GAE of those values, whitened over the step's tokens;
    both models move; value loss and explained variance are reported."""
    from learner.gae import gae, outcome_rewards

    model = learner(policy, advantage={"type": "gae", "lam": 0.9}, ppo_epochs=2)
    batch = groups(19)
    members = [t for g in batch for t in g.members]
    padded = build_batch(members, torch.zeros(len(members)), model.pad_id)
    want = padded_values(model.critic, padded)
    got, _ = model.critic.values(padded.select(torch.arange(len(members))), True)
    torch.testing.assert_close(got.cpu(), want[:, : got.shape[1]], atol=1e-5, rtol=1e-4)
    # the advantages the loss sees: whitened GAE of those values
    seen = []
    original = model._micro_step

    def recording(micro, *args, **kwargs):
        seen.append(micro.advantages.clone())
        return original(micro, *args, **kwargs)

    model._micro_step = recording
    critic_before = [p.detach().clone() for p in model.critic.model.parameters()]
    policy_before = [p.detach().clone() for p in model.model.parameters()]
    metrics = model.step(batch)
    rewards = torch.tensor([t.reward for t in members])
    mask = padded.response_mask
    advantages, _ = gae(outcome_rewards(mask, rewards), want, mask, 1.0, 0.9)
    on = advantages[mask > 0]
    whitened = (advantages - on.mean()) / (on.var(unbiased=False) + 1e-8).sqrt()
    plan = model._micro_batches(members)
    for rows, micro_advantages in zip(plan, seen, strict=False):  # the first epoch's
        width = micro_advantages.shape[1]
        expected = whitened[rows, :width] * (mask[rows, :width] > 0)
        torch.testing.assert_close(micro_advantages, expected, atol=1e-4, rtol=1e-4)
    assert len(seen) == 2 * len(plan)
    for key in ("value_loss", "value_mean", "value_clip_frac", "explained_variance", "loss"):
        assert math.isfinite(metrics[key]), key
    assert metrics["value_loss"] > 0 and metrics["explained_variance"] <= 1
    moved = lambda before, model: any(  # noqa: E731
        not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True)
    )
    assert moved(critic_before, model.critic.model) and moved(policy_before, model.model)


def test_gae_checkpoints_resume_the_critic_too(policy, tmp_path):
    """Two steps, save, resume, a third: the policy and the critic equal three straight steps;
    a checkpoint without a critic is refused by a learner with one."""
    batches = [groups(50 + i) for i in range(3)]
    straight = learner(policy, advantage={"type": "gae"})
    for b in batches:
        straight.step(b)
    first = learner(policy, advantage={"type": "gae"})
    for b in batches[:2]:
        first.step(b)
    save_checkpoint(first, tmp_path / "gae")
    resumed = learner(policy, advantage={"type": "gae"})
    load_checkpoint(resumed, tmp_path / "gae")
    resumed.step(batches[2])
    for a, b in (
        (straight.model, resumed.model),
        (straight.critic.model, resumed.critic.model),
    ):
        for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)
    plain = learner(policy)
    plain.step(batches[0])
    save_checkpoint(plain, tmp_path / "plain")
    with pytest.raises(CheckpointError, match="no critic state"):
        load_checkpoint(learner(policy, advantage={"type": "gae"}), tmp_path / "plain")
