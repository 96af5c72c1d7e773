"""The learner on 2 DeepSpeed ranks (gloo on CPU, NCCL on two GPUs) trains exactly like 1 rank on the same groups.

The one-rank reference runs in this process; the two-rank learner needs a process group of its
own, so its rank 0 runs in a spawned process (`_train_two_ranks`) which starts rank 1 itself,
as the launcher does.
"""

import multiprocessing as mp

import deepspeed
import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, BackendConfig

from buffers.records import Group
from buffers.testing import synthetic_trajectory
from learner.batch import build_batch
from learner.checkpoint import load_checkpoint, save_checkpoint
from learner.ranked import ranked_learner
from learner.ranks import init_rank_group, split_by_tokens
from learner.trainer import Learner, init_distributed
from pipeline.assets.tiny_policy import build_tiny_policy
from pipeline.config.schema import LearnerConfig, LoraSection
from tests.conftest import gpu_per_rank

TEXTS = [
    f"Question {i}: <search> Varno Telik </search> <answer> Quorvex {i} </answer>"
    for i in range(600)
]
SYSTEM = pytest.mark.system  # the rest of the matrix: make test-system
COMPARED = ("loss", "grad_norm", "trained_tokens", "reward_mean", "clip_fraction", "entropy")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny", TEXTS, vocab_size=400)


def groups(seed: int, lengths: tuple[int, ...] = (40, 12, 20)) -> list[Group]:
    """Three groups of 4 with different lengths: 2 ranks get unequal shares (one gets two groups
    and more micro-batches than the other), so empty micro-batches and the global token
    normalisation both matter."""
    out = []
    for g, tokens in enumerate(lengths):
        members = []
        for i in range(4):
            t = synthetic_trajectory(
                f"s{seed}g{g}",
                i,
                tokens=tokens + 3 * i,
                reward=float((i + g) % 2),
                tool_names=["search"] * (i % 3),
                seed=seed * 100 + g,
            )
            t.token_ids %= 300
            t.prompt_token_ids %= 300
            members.append(t)
        out.append(Group(f"s{seed}g{g}", tuple(members)))
    return out


def options(**overrides) -> dict:
    base = dict(lr=5e-3, micro_batch_size=3, zero_stage=0, max_steps=50, importance={"type": "tis"})
    base.update(overrides)
    return base


def learner_args(opts: dict) -> tuple[LearnerConfig, dict]:
    """The learner section and the Learner's keywords of `opts` (its `lora`: model.lora)."""
    opts = dict(opts)
    lora = opts.pop("lora", None)
    return LearnerConfig(**opts), {"lora": LoraSection(**lora)} if lora else {}


def _train_two_ranks(policy, opts, plan, out, queue) -> None:
    """Rank 0 of two, in a spawned process: carry out `plan` (("step", groups), ("save", dir),
    ("load", dir)), then save the step metrics and the weights to `out`."""
    try:
        torch.set_num_threads(1)
        config, kwargs = learner_args(opts)
        learner = ranked_learner(policy, config, 2, threads=1, group_size=4, **kwargs)
        try:
            metrics = []
            for op, arg in plan:
                if op == "step":
                    metrics.append(learner.step(arg))
                elif op == "save":
                    save_checkpoint(learner, arg)
                else:
                    load_checkpoint(learner, arg)
            reference = None if learner.reference is None else held_bytes(learner.reference)
            torch.save(
                {
                    "metrics": metrics,
                    "weights": learner.state_dict(),
                    "version": learner.version,
                    "reference_bytes": reference,
                },
                out,
            )
        finally:
            learner.peers.close()
        queue.put("ok")
    except BaseException as exc:  # the test prints what went wrong
        queue.put(f"{type(exc).__name__}: {exc}")


def two_ranks(policy, opts, plan, out) -> dict:
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(
        target=_train_two_ranks, args=(str(policy), opts, plan, str(out), queue)
    )
    process.start()
    process.join(timeout=300)
    assert process.exitcode == 0, f"two-rank learner exited with {process.exitcode}"
    assert (answer := queue.get(timeout=5)) == "ok", answer
    return torch.load(out, weights_only=False)


def test_groups_are_dealt_whole_by_tokens():
    assert split_by_tokens([40, 12, 20], 2) == [[0], [1, 2]]
    assert split_by_tokens([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]
    assert split_by_tokens([7], 3) == [[0], [], []]
    shares = split_by_tokens(list(range(1, 30)), 4)
    assert sorted(i for s in shares for i in s) == list(range(29))
    loads = [sum(range(1, 30)[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= 29


@pytest.mark.parametrize(
    ("cuda", "nccl", "served"),
    [
        (True, True, {"cpu": "gloo", "cuda": "nccl"}),
        (True, False, {"cpu": "gloo", "cuda": "gloo"}),
        (False, False, {"cpu": "gloo", "cuda": "gloo"}),
    ],
    ids=["cuda-nccl", "cuda-without-nccl", "cpu"],
)
@pytest.mark.parametrize("entry", ["ranks", "one-process"])
def test_the_process_group_serves_the_cpu_tensors_of_the_learners_own_collectives(
    tmp_path, monkeypatch, entry, cuda, nccl, served
):
    """Issue 68: on a CUDA machine the learner's group was plain "nccl", which serves CUDA
    tensors only, while the learner's own collectives take CPU ones (`_all_max`: the head's
    chunk count and the micro-step count; `_all_sum`: the step's totals; `all_gather_object`:
    its sums, on the group's CPU device when it has one), so configs/gaia.yaml's four ranks
    stopped at their first forward. NCCL cannot start on this machine: torch sees a GPU and
    NCCL here only by monkeypatching, the group's creation is recorded rather than made, and
    torch's own parser says which backend the chosen string gives each device. Both entry
    points (the ranks' `init_rank_group`, one process's `init_distributed`) choose alike."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    for module in ("learner.ranks", "learner.trainer"):  # DeepSpeed's CPU op: not the choice
        monkeypatch.setattr(f"{module}.load_cpu_op", lambda: "")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    made = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: made.append(backend))
    monkeypatch.setattr(
        deepspeed, "init_distributed", lambda dist_backend, **kw: made.append(dist_backend)
    )
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GLOO_SOCKET_IFNAME"):  # both set some
        monkeypatch.setenv(name, "1" if name == "WORLD_SIZE" else "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    if entry == "ranks":
        init_rank_group(0, 1, str(tmp_path / "store"))
    else:
        init_distributed()
    assert len(made) == 2 and made[0] == made[1], made  # torch's group and DeepSpeed's, alike
    assert BackendConfig(Backend(made[0])).get_device_backend_map() == served, made[0]


@gpu_per_rank(2)
@pytest.mark.parametrize(
    "overrides",
    [  # each stage once, the defaults at 2; a case is a spawned pair of ranks (~20 s on 2 cores,
        # most of it the two processes' imports): make test runs one, make test-system the rest
        pytest.param(dict(zero_stage=2), marks=SYSTEM, id="zero2-and-resume"),
        pytest.param(
            dict(
                zero_stage=0,
                loss_agg="seq-mean-token-mean",
                importance={"type": "none"},
                lora={"r": 4, "alpha": 8.0},
            ),
            marks=SYSTEM,
            id="zero0-seq-mean-lora",
        ),
        pytest.param(
            dict(zero_stage=1, max_tokens_per_micro_batch=90, advantage={"type": "gae"}),
            id="zero1-token-budget-gae",
        ),
    ],
)
def test_two_ranks_train_like_one(policy, tmp_path, overrides):
    """Loss, gradient norm and weights after two steps; under ZeRO 2 the two-rank checkpoint
    (each rank's optimizer shard) resumes on two ranks and a third step matches too. Packed
    micro-batches (the default) throughout; with a token budget the ranks make different
    numbers of micro-batches (tests/learner/test_packing.py holds packed to padded), there
    with GAE's critic beside the policy on the same ranks; with LoRA the ranks train the
    adapters and publish the same merged weights."""
    opts = options(**overrides)
    batches = [groups(1), groups(2), groups(3)]
    config, kwargs = learner_args(opts)
    one = Learner(policy, config, group_size=4, **kwargs)
    reference = [one.step(b) for b in batches[:2]]
    weights = {k: v.clone() for k, v in one.state_dict().items()}
    root = str(tmp_path / "checkpoints")
    result = two_ranks(
        policy,
        opts,
        [("step", batches[0]), ("step", batches[1]), ("save", root)],
        tmp_path / "two.pt",
    )
    for step, (a, b) in enumerate(zip(reference, result["metrics"], strict=True)):
        for key in (*COMPARED, "value_loss", "explained_variance"):
            if key in a:  # the critic's with gae: its GAE whitened and explained over both ranks
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (step, key)
        assert b["rank_count"] == 2.0 and b["rank/0/tokens"] > 0 and b["rank/1/tokens"] > 0
    assert_same(result["weights"], weights)
    start = Learner(policy, config, group_size=4, **kwargs).state_dict()
    assert max(float((weights[k] - start[k]).abs().max()) for k in weights) > 1e-3  # they trained
    if opts["zero_stage"] != 2:
        return
    shards = sorted(
        p.name for p in (tmp_path / "checkpoints" / "step-000002" / "deepspeed" / "state").iterdir()
    )
    assert shards == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    resumed = two_ranks(
        policy, opts, [("load", root), ("step", batches[2])], tmp_path / "resumed.pt"
    )
    third = one.step(batches[2])
    assert resumed["version"] == 3
    assert resumed["metrics"][0]["loss"] == pytest.approx(third["loss"], rel=1e-4, abs=1e-6)
    assert_same(resumed["weights"], one.state_dict())


@pytest.fixture(scope="module")
def wide_policy(tmp_path_factory):
    """The tiny policy at hidden 256: its embeddings and MLP weights are over ZeRO-3's
    persistence threshold (1e5 elements), so ZeRO-3 partitions them and every forward gathers."""
    out = tmp_path_factory.mktemp("policy") / "wide"
    return build_tiny_policy(out, TEXTS, vocab_size=400, hidden_size=256)


@gpu_per_rank(2)
@pytest.mark.parametrize(
    "overrides",
    [  # make test runs the partitioned reference (issue 68); make test-system the others
        pytest.param(
            dict(importance={"type": "mask", "cap": 2.0}), marks=SYSTEM, id="mask-and-resume"
        ),
        pytest.param(
            dict(lora={"r": 4, "alpha": 8.0}, kl_coef=0.1), marks=SYSTEM, id="lora-kl-in-loss"
        ),
        pytest.param(
            dict(lora={"r": 4, "alpha": 8.0}, kl_coef=0.1, kl_in_reward=True),
            marks=SYSTEM,
            id="lora-kl-in-reward",
        ),
        pytest.param(dict(kl_coef=0.1), id="reference-kl-in-loss"),
        pytest.param(
            dict(kl_coef=0.1, kl_in_reward=True, kl_kind="k1"),
            marks=SYSTEM,
            id="reference-kl-in-reward",
        ),
    ],
)
def test_two_zero3_ranks_train_like_one_with_uneven_shares_and_resume(
    wide_policy, tmp_path, monkeypatch, overrides
):
    """ZeRO-3 over two ranks (configs/gaia.yaml trains over four): each forward gathers the
    parameters from every rank, so a rank with fewer micro-batches, or with no group at all,
    makes empty passes to keep in step with the other (`_empty_micro_step`), its proximal
    pass included (importance "mask" drops tokens, so the proximal log-probs are a pass of
    their own), and the head in chunks is called as often on every rank (`_head_calls`).
    Losses, gradient norms and weights equal one rank's over three steps (a token budget gives
    the ranks unequal numbers of micro-batches; the third step's one group leaves rank 1 none),
    and the two ranks' ZeRO-3 checkpoint resumes on two ranks for a fourth. With LoRA the KL's
    reference is the engine with its adapters off: its forwards too are made on every rank (in
    the loss, and in the reward before the step). Without LoRA the reference, a frozen copy of
    the initial policy, is partitioned as the policy is (issue 68: it was whole on every rank,
    16 GB a GPU at Qwen3-8B in bf16): each rank holds half of every weight over ZeRO-3's
    persistence threshold, and its forwards are made on every rank as LoRA's are."""
    # the one-rank ZeRO-3 engine here replaces F.linear for the whole process: put torch's back
    # for the tests that follow in this worker
    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)
    policy = wide_policy
    opts = options(zero_stage=3, max_tokens_per_micro_batch=90, **overrides)
    # the second step's long group goes to rank 0, whose micro-batches then train over 256
    # tokens each (two head chunks) while rank 1's train a few dozen (one chunk, unless agreed)
    batches = [groups(1), groups(2, lengths=(300, 12, 20)), groups(3)[:1], groups(4)]
    config, kwargs = learner_args(opts)
    one = Learner(policy, config, group_size=4, **kwargs)
    reference = [one.step(b) for b in batches[:3]]
    weights = {k: v.clone() for k, v in one.state_dict().items()}
    root = str(tmp_path / "checkpoints")
    plan = [("step", b) for b in batches[:3]]
    result = two_ranks(policy, opts, [*plan, ("save", root)], tmp_path / "two.pt")
    for step, (a, b) in enumerate(zip(reference, result["metrics"], strict=True)):
        for key in (*COMPARED, "kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (step, key)
    shares = [(m["rank/0/tokens"] > 0, m["rank/1/tokens"] > 0) for m in result["metrics"]]
    assert shares == [(True, True), (True, True), (True, False)]
    # After three steps a few weights of 100k differ by up to 7e-5 (1.4% of an Adam step of
    # lr 5e-3): Adam divides a near-zero gradient by its own size, so the order of ZeRO-3's
    # sums shows there; the losses and gradient norms above agree to 1e-4.
    assert_same(result["weights"], weights, atol=1e-4)
    if "lora" not in overrides and "kl_coef" in overrides:
        # the weights ZeRO-3 partitions (those over its persistence threshold): all of each on
        # one rank, half of each on either of two
        whole = {n: p for n, p in initial_model(policy).named_parameters() if p.numel() > 100_000}
        size = sum(p.numel() * p.element_size() for p in whole.values())
        half = sum(-(-p.numel() // 2) * p.element_size() for p in whole.values())
        assert sum(held_bytes(one.reference)[n] for n in whole) == size
        held = sum(result["reference_bytes"][n] for n in whole)
        assert held == half, (
            f"rank 0 of 2 holds {held} bytes of the reference's {size} in weights ZeRO-3 "
            f"partitions, not its half ({half})"
        )
        # and the partitioned reference is the initial policy: its log-probs are the HF model's
        members = [t for g in batches[0] for t in g.members]
        batch = build_batch(members, torch.zeros(len(members)), one.pad_id)
        with torch.no_grad():
            partitioned, _, _ = one._logprobs(one.reference, batch)
            plain, _, _ = one._logprobs(initial_model(policy), batch)
        torch.testing.assert_close(partitioned, plain, atol=1e-5, rtol=1e-5)
    if "kl_coef" in overrides:  # the ZeRO-3 resume once, "mask"s (LoRA: tests/pipeline/)
        return
    state = tmp_path / "checkpoints" / "step-000003" / "deepspeed" / "state"
    assert len(list(state.glob("*optim_states.pt"))) == 2  # each rank's partition
    resumed = two_ranks(
        policy, opts, [("load", root), ("step", batches[3])], tmp_path / "resumed.pt"
    )
    fourth = one.step(batches[3])
    assert resumed["version"] == 4
    assert resumed["metrics"][0]["loss"] == pytest.approx(fourth["loss"], rel=1e-4, abs=1e-6)
    assert_same(resumed["weights"], one.state_dict(), atol=1e-4)


def assert_same(weights: dict, reference: dict, atol: float = 1e-5) -> None:
    assert weights.keys() == reference.keys()
    for name, p in reference.items():  # one Adam step moves a weight by about lr = 5e-3
        torch.testing.assert_close(
            weights[name], p, atol=atol, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


def initial_model(policy) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(policy, local_files_only=True, dtype=torch.float32)


def held_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Per parameter of `model` (an HF model, or a DeepSpeed engine around one): the bytes this
    rank holds of it, its tensor and under ZeRO-3 its partition (`ds_tensor`)."""
    module = getattr(model, "module", model)
    return {
        name: sum(
            t.numel() * t.element_size()
            for t in (p.data, getattr(p, "ds_tensor", None))
            if t is not None
        )
        for name, p in module.named_parameters()
    }
