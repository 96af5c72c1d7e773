"""The DeepSpeed learner: complete groups in, one optimiser step of Stratified GRPO out.

Per step: validate the groups (a bad one is counted and skipped, never trained), optionally drop
zero-variance groups, compute blended stratified advantages, then `ppo_epochs` passes of
micro-batches through the clipped loss (+ KL to the initial policy when `kl_coef > 0`). An
importance correction takes the proximal log-probs from the first pass's own forwards, or from a
forward pass of their own before it when it drops tokens or the model has dropout. Gradients
accumulate over the whole step and the loss of every micro-batch is weighted by its share of the
step's tokens (or sequences), so the step's loss is exactly the configured aggregation over all
its tokens.

With `learner.advantage.type: gae` a critic (learner/critic.py) trains beside the policy on the
same ranks: its values before the step give GAE's per-token advantages (learner/gae.py), and it
takes `ppo_epochs` passes of its clipped value loss after the policy's.

It runs DeepSpeed ZeRO 0-3: over gloo on CPU, with NCCL on GPUs (gloo still carries the ranks'
agreements, CPU tensors: learner/ranks.py `process_group_backend`). With `learner.num_ranks`
N > 1 this object is rank 0 of N (learner/ranks.py): `step` splits the groups across the ranks by
tokens and every rank trains its share in `train_rows`, with global loss normalisation.
"""

from __future__ import annotations

import os
import time
import warnings
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch

from buffers.records import Group
from learner.algorithm import CRITIC, plan_step
from learner.attention import implementation
from learner.batch import TrainBatch, build_batch
from learner.corrections import Correction
from learner.critic import Critic
from learner.deepspeed_ops import load_cpu_op
from learner.gae import explained, explained_variance, gae, outcome_rewards, whiten
from learner.head import split_logprobs, splits
from learner.logprobs import CHUNK
from learner.lora import adapter_weights, adapters_off, merged_state_dict, with_adapters
from learner.losses import kept_by_importance, kl_penalty, policy_loss
from learner.packing import plan_micro_batches, response_logprobs
from learner.ranks import (
    RankError,
    RankPeers,
    TcpRendezvous,
    init_rank_group,
    process_group_backend,
    split_by_tokens,
)
from learner.schedule import step_schedule
from learner.surrogates import surrogate_params
from learner.turn_credit import token_advantages


def init_distributed() -> None:
    """The process group DeepSpeed trains in: the one a launcher (torchrun, deepspeed) describes
    in MASTER_ADDR / WORLD_SIZE, else a one-process group whose store is in-process (a TCPStore
    would listen on every interface for a rendezvous nobody else joins)."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    load_cpu_op()  # before DeepSpeed asks for it: learner/deepspeed_ops.py
    backend = process_group_backend()
    if "MASTER_ADDR" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    # ZeRO-3's every gather and reduce-scatter calls torch's old names, whose FutureWarning
    # came back every step (something resets the warning registry): nothing a user can act on.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )


def rank_metrics(ranks: list[dict[str, float]]) -> dict[str, float]:
    """Per rank: response tokens trained, seconds in its own micro-batches, and idle seconds (the
    slowest rank's work minus its own: the time it waits at the step's reductions); and the
    mean idle share of the step over the ranks."""
    slowest = max(r["seconds"] for r in ranks)
    out = {"rank_count": float(len(ranks))}
    for i, r in enumerate(ranks):
        out[f"rank/{i}/tokens"] = r["tokens"]
        out[f"rank/{i}/seconds"] = r["seconds"]
        out[f"rank/{i}/idle_seconds"] = slowest - r["seconds"]
    out["rank_idle_fraction"] = (
        sum(slowest - r["seconds"] for r in ranks) / (len(ranks) * slowest) if slowest > 0 else 0.0
    )
    return out


def kl_to_go(advantages: torch.Tensor, kl: torch.Tensor, coef: float) -> torch.Tensor:
    """REINFORCE++'s KL in the reward: [B, R] advantages, each token's own (`advantages` [B] or
    [B, R]) minus `coef` times the KL (`kl` [B, R], 0 off the trained tokens) of it and every
    later token of its row."""
    own = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1).expand_as(kl)
    return own - coef * kl.flip(-1).cumsum(-1).flip(-1)


DROPOUT_KEYS = (
    "attention_dropout",
    "hidden_dropout",
    "hidden_dropout_prob",
    "dropout",
    "attention_probs_dropout_prob",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
)
"""Model config keys of dropout probabilities, in the HF architectures that have them."""


class Learner:
    """`config` is the pipeline's `learner` config section (read by attribute, not imported)."""

    reuse_forward_for_proximal = True
    """Take the proximal log-probs from the first epoch's forward passes (see `train_rows`); False
    recomputes them in a pass of their own, for one-rank tests and benchmarks to compare against
    (ranks must agree on it: set it on the class, before the ranks start)."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        config: Any,
        *,
        group_size: int,
        temperature: float = 1.0,
        version: int = 0,
        dtype: str | None = None,
        gradient_checkpointing: bool = False,
        lora: Any = None,
        rank: tuple[int, int, str | TcpRendezvous] | None = None,
        peers: RankPeers | None = None,
        before_join: Callable[[], None] | None = None,
    ) -> None:
        """`dtype` (float32, bfloat16, float16): the parameters' dtype, None: bfloat16 on CUDA,
        else float32. `gradient_checkpointing`: recompute activations in the backward pass.
        `lora`: the model.lora section (r > 0) to train LoRA adapters instead of every weight
        (learner/lora.py), None: full fine-tuning.
        `rank`: (rank, world size, where they meet) of a learner of several ranks (learner/ranks.py);
        `peers`: on rank 0, the other ranks, told what to do at every step. `before_join`: called
        once the model is loaded, before the process group forms (the ranks report a failed load
        there instead of leaving the others waiting at the rendezvous)."""
        import deepspeed
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.config = config
        self.correction = Correction.from_section(config.importance)
        self.group_size = group_size
        self.temperature = temperature
        self.version = version
        cuda = torch.cuda.is_available()
        dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if cuda else torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        # packed rows attend inside each trajectory (learner/attention.py)
        attention = {"attn_implementation": a} if (a := implementation(config.packing)) else {}
        model = AutoModelForCausalLM.from_pretrained(
            model_path, local_files_only=True, dtype=dtype, **attention
        )
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        # the head in chunks where the model's logits are its head's plain output (learner/head.py)
        self.split_head = splits(model)
        self.lora = lora
        if lora is not None:
            model = with_adapters(model, lora)
        # With dropout a training forward is one noisy sample of the policy: the proximal
        # log-probs then need an eval-mode pass of their own (see train_rows).
        self.dropout = any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()
        ) or any(float(getattr(model.config, key, 0) or 0) > 0 for key in DROPOUT_KEYS)
        reference = None
        if config.kl_coef > 0 and lora is None:  # the initial policy, frozen (LoRA: adapters off)
            reference = AutoModelForCausalLM.from_pretrained(
                model_path, local_files_only=True, dtype=dtype, **attention
            )
            reference.requires_grad_(False).eval()
        if before_join is not None:
            before_join()
        if rank is None:
            init_distributed()
        else:
            init_rank_group(*rank)
        self.rank, self.world = (0, 1) if rank is None else rank[:2]
        self.peers = peers
        trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
        optimizer = torch.optim.AdamW(trained, lr=config.lr, weight_decay=config.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, step_schedule(config.warmup_steps, config.max_steps, config.schedule)
        )
        ds_config = {
            "train_micro_batch_size_per_gpu": config.micro_batch_size,
            "gradient_accumulation_steps": 1,  # the step boundary is set by hand, see step()
            "gradient_clipping": config.grad_clip,
            "zero_optimization": {"stage": config.zero_stage},
            "bf16": {"enabled": dtype == torch.bfloat16},
            "fp16": {"enabled": dtype == torch.float16},
            "steps_per_print": 1 << 30,
        }
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        self.critic = None  # PPO's value model (learner/critic.py), for GAE only
        if config.advantage.type == CRITIC:
            self.critic = Critic(
                model_path,
                config.advantage,
                config,
                dtype=dtype,
                attention=attention,
                ds_config=ds_config,
                gradient_checkpointing=gradient_checkpointing,
            )
        self.explained_variance = float("nan")
        self.reference = None if reference is None else self._frozen(reference, ds_config)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def _frozen(self, reference: torch.nn.Module, ds_config: dict) -> torch.nn.Module:
        """The KL's reference on the engine's device: under ZeRO-3 partitioned over the ranks as
        the policy is (a DeepSpeed engine without an optimizer, as OpenRLHF's and verl's
        reference models: at Qwen3-8B over 4 ranks 4 GB of bf16 a GPU instead of 16), its
        forwards then collectives like the policy's; else whole on every rank."""
        if self.config.zero_stage != 3:
            return reference.to(self.engine.device)
        import deepspeed

        config = {k: v for k, v in ds_config.items() if k != "gradient_clipping"}  # no training
        engine, _, _, _ = deepspeed.initialize(model=reference, config=config)
        engine.eval()
        return engine

    @property
    def model(self) -> torch.nn.Module:
        """The HF model (with LoRA, the base model its adapters sit in): its config, its
        `save_pretrained`."""
        return self.engine.module if self.lora is None else self.engine.module.get_base_model()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights for publishing (gathered under ZeRO-3), under the HF model's names; with
        LoRA, merged (the adapters' deltas added to the weights they adapt)."""
        return self._gathered(self._weights)

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """With LoRA, the adapters' weights alone, in peft's format (learner/lora.py)."""
        return self._gathered(lambda: adapter_weights(self.engine.module))

    def _gathered(self, read: Callable[[], dict]) -> dict[str, torch.Tensor]:
        """`read()` with every parameter whole on this rank: under ZeRO-3 a gather, collective
        over the ranks (the others join it as they do for `state_dict`)."""
        if self.config.zero_stage != 3:
            return read()
        import deepspeed  # GPU-only

        if self.peers is not None:
            self.peers.broadcast("state_dict")
        with deepspeed.zero.GatheredParameters(
            list(self.engine.module.parameters()), modifier_rank=None
        ):
            gathered = {k: v.clone() for k, v in read().items()}
        if self.peers is not None:
            self.peers.gather("state_dict")
        return gathered

    def _weights(self) -> dict[str, torch.Tensor]:
        if self.lora is not None:
            return merged_state_dict(self.engine.module)
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    @contextmanager
    def _reference_policy(self):
        """The KL term's reference, the initial policy: a frozen copy of it (under ZeRO-3
        partitioned, see `_frozen`), or with LoRA the policy itself with its adapters off."""
        if self.lora is None:
            yield self.reference
        else:
            with adapters_off(self.engine.module) as base:
                yield base

    # --------------------------------------------------------------------------------- the step

    def step(self, groups: list[Group]) -> dict[str, float]:
        """One optimiser step on `groups` (learner/algorithm.py plans it: which trajectories,
        their advantages, what the loss keeps); returns the step's telemetry (plain floats)."""
        start = time.perf_counter()
        plan = plan_step(groups, self.config, scorer=self.answer_logprobs)
        if not plan.groups:
            return plan.metrics
        usable, trajectories = plan.groups, plan.trajectories
        # every rank trains whole groups, dealt by tokens so the ranks' shares weigh alike
        sizes = [sum(len(t.prompt_token_ids) + len(t.token_ids) for t in g.members) for g in usable]
        shares = []
        for groups_of_rank in split_by_tokens(sizes, self.world):
            rows = torch.tensor(
                [
                    r
                    for g in groups_of_rank
                    for r in range(g * self.group_size, (g + 1) * self.group_size)
                ],
                dtype=torch.int64,
            )
            shares.append(
                (
                    [trajectories[r] for r in rows.tolist()],
                    plan.advantages[rows],
                    plan.keep[rows],
                    None if plan.early is None else plan.early[rows],
                    None if plan.per_token is None else [plan.per_token[r] for r in rows.tolist()],
                )
            )
        if self.peers is None:
            sums = self.train_rows(*shares[0])
        else:
            try:
                self.peers.send("train", shares[1:])
                sums = self.train_rows(*shares[0])
                self.peers.gather("train")
            except (RuntimeError, RankError) as exc:  # gloo's error for a peer gone is pages long
                raise self.peers.failure(f"step {self.version + 1}", exc) from exc
        metrics = {**plan.metrics, **self._telemetry(trajectories, sums, start)}
        if self.critic is not None:
            metrics["explained_variance"] = self.explained_variance
        metrics.update(rank_metrics(self.rank_stats))  # one rank too: the same series either way
        return metrics

    def train_rows(
        self,
        trajectories: list,
        advantages: torch.Tensor,
        keep: torch.Tensor,
        early: torch.Tensor | None = None,
        per_token: list[torch.Tensor] | None = None,
    ) -> Counter[str]:
        """One optimiser step on this rank's rows (every rank calls it for the same step): the
        step's token totals and micro-batch count agree over the ranks first, so each micro-batch
        loss carries its share of the whole step. `early`: turn-level credit's advantages of the
        tokens before each trajectory's finding observation (None: off). Returns the step's sums
        over all ranks."""
        batch = proximal = kept = None
        if trajectories:
            if early is not None:  # per token: before and after the finding observation
                width = max(len(t.token_ids) for t in trajectories)
                advantages = token_advantages(trajectories, advantages, early, width)
            if per_token is not None:  # step-level credit: one advantage per token
                advantages = torch.nn.utils.rnn.pad_sequence(per_token, batch_first=True)
            batch = build_batch(trajectories, advantages, self.pad_id)
            batch.response_mask[~keep] = 0  # left out of the loss (mc_grpo's pivots)
            for row, t in enumerate(trajectories):
                # TSPO: the latent reward credits the turns up to the answer's first observation
                if t.latent_reward > 0 and t.first_answer_token >= 0:
                    batch.response_mask[row, t.first_answer_token :] = 0
        plan = self._micro_batches(trajectories)
        reward_kl, kl = 0.0, None
        if self.config.kl_in_reward and (kl := self._reference_kl(batch, plan)) is not None:
            reward_kl = float(kl.sum())
            if self.critic is None:  # REINFORCE++: GAE takes it as the tokens' rewards instead
                batch.advantages = kl_to_go(batch.advantages, kl, self.config.kl_coef)
        steps = self._all_max(len(plan))  # micro-batches on the busiest rank
        if self.critic is not None:  # GAE: the advantages per token, from the critic's values
            old_values, returns = self._critic_targets(batch, trajectories, plan, steps, kl)
        # The proximal log-probs are those of the policy before this step's update. The weights
        # move only at an epoch's last micro-batch, so the first epoch's own forward passes give
        # them: no pass of their own, unless the correction drops tokens (each micro-batch's
        # weight counts the kept tokens of the whole step, so they are needed before the first)
        # or the model has dropout (a training forward is then one noisy sample of the policy).
        correction = self.correction
        reuse = (
            correction.active
            and self.reuse_forward_for_proximal
            and not (correction.drops or self.dropout)
        )
        if batch is not None and correction.active:
            if not reuse:
                proximal = self._proximal(batch, plan, steps)
            elif self.config.ppo_epochs > 1:  # filled by the first epoch for the later ones
                proximal = torch.zeros_like(batch.behavior_logprobs)
        elif correction.active and self.config.zero_stage == 3 and not reuse:
            self._proximal(None, plan, steps)  # ZeRO-3's forward gathers parameters: all join
        if batch is not None:
            # The tokens the loss is taken over (importance "mask" drops some before the loss
            # sees them): each micro-batch's share of the step is its share of these.
            kept = kept_by_importance(
                batch.response_mask, batch.behavior_logprobs, proximal, correction
            )
        local = (
            [0.0, 0.0, 0.0]
            if batch is None
            else [
                float(kept.sum()),
                float((kept.sum(-1) > 0).sum()),
                float(batch.response_mask.sum()),
            ]
        )
        tokens, sequences, response_tokens = self._all_sum(local)
        totals = {
            "tokens": max(tokens, 1.0),
            "sequences": max(sequences, 1.0),
            "response_tokens": max(response_tokens, 1.0),
        }
        sums: Counter[str] = Counter()
        work = 0.0  # seconds in this rank's own micro-batches (a reduction's wait included)
        self.engine.train()
        for epoch in range(self.config.ppo_epochs):
            for i in range(steps):
                started = time.perf_counter()
                boundary = i == steps - 1
                self.engine.set_gradient_accumulation_boundary(boundary)
                own = batch is not None and i < len(plan)
                if own:
                    rows = torch.tensor(plan[i], dtype=torch.int64)
                    part = None if proximal is None else proximal[rows]  # a copy: rows index
                    fill = reuse and epoch == 0
                    loss, stats = self._micro_step(
                        batch.select(rows), part, kept[rows], totals, fill_proximal=fill
                    )
                    if fill and part is not None:  # the first epoch's, for the later ones
                        proximal[rows] = part
                else:  # this rank has no rows left: an empty micro-batch keeps the collectives in step
                    loss, stats = self._empty_micro_step(training=True), {}
                self.engine.backward(loss * self.world)  # DeepSpeed averages over the ranks
                if boundary and self.config.zero_stage == 0:  # ZeRO 1-3 report their own norm
                    grads = [p.grad for p in self.model.parameters() if p.grad is not None]
                    sums["grad_norm"] = (
                        float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
                    )
                self.engine.step()
                work += time.perf_counter() - started if own else 0.0
                for key, value in stats.items():
                    sums[key] += value
        if self.critic is not None:
            sums.update(self._train_critic(batch, plan, steps, old_values, returns, totals))
        self.version += 1
        if self.config.kl_in_reward:  # the KL went into the advantages: reported per token
            sums["kl_sum"] += reward_kl * self.config.ppo_epochs
        self.rank_stats = [{"tokens": local[2], "seconds": work}]
        if self.world > 1:  # every rank's sums, added up (the grad norm is the same on all)
            import torch.distributed as dist

            every: list = [None] * self.world
            mine = {k: v for k, v in sums.items() if k != "grad_norm"}
            dist.all_gather_object(every, (mine, self.rank_stats[0]))
            norm = sums["grad_norm"]
            sums = Counter()
            for part, _ in every:
                sums.update(part)
            sums["grad_norm"] = norm
            self.rank_stats = [stats for _, stats in every]
        return sums

    def _micro_batches(self, trajectories: list) -> list[list[int]]:
        """This rank's micro-batches (learner/packing.py): row indices of each."""
        lengths = [len(t.prompt_token_ids) + len(t.token_ids) for t in trajectories]
        return plan_micro_batches(
            lengths, self.config.micro_batch_size, self.config.max_tokens_per_micro_batch
        )

    def _logprobs(self, model, micro: TrainBatch):
        """(log-probs, entropy, tokens read) of a micro-batch's trained tokens: [b, R] each."""
        return response_logprobs(
            model,
            micro,
            self.config.packing,
            self.temperature,
            self.engine.device,
            entropy_grad=model is self.engine and self.config.entropy_coef > 0,
            split=self.split_head,
            # under ZeRO-3 every model here is partitioned: the policy, the reference (`_frozen`)
            agree=self._head_calls if self._in_step_ranks else None,
        )

    @property
    def _in_step_ranks(self) -> bool:
        """ZeRO-3 over several ranks: every forward gathers the weights from every rank, so the
        ranks must call the same modules the same number of times, the head in chunks included."""
        return self.config.zero_stage == 3 and self.world > 1

    def _head_calls(self, tokens: int) -> int:
        """How many chunks every rank cuts its head's work into at this forward: enough for the
        rank with the most trained tokens, at most `CHUNK` positions a chunk (a collective)."""
        return max(1, -(-self._all_max(tokens) // CHUNK))

    def _all_max(self, value: int) -> int:
        """`value`'s maximum over the ranks; a CPU tensor, as `_all_sum`'s (the group's gloo)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _all_sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def _empty_micro_step(self, training: bool = False) -> torch.Tensor:
        """A zero loss through the whole model on one pad token: every parameter gets a zero
        gradient, so the rank takes part in DeepSpeed's reductions without changing them. With
        the head in chunks it takes the same path as a real micro-batch, its head called as
        many times as the other ranks call theirs (`_head_calls`); `training` (not a proximal
        pass), with the KL in the loss, the reference's forward after it too (partitioned, or
        with LoRA the engine itself)."""
        loss = self._empty_forward(self.engine)
        if training and self._reference_in_loss and self._in_step_ranks:
            with torch.no_grad(), self._reference_policy() as policy:  # as `_micro_step`'s KL
                self._empty_forward(policy)
        return loss

    @property
    def _reference_in_loss(self) -> bool:
        """Each micro-batch's loss has a KL term, its reference's forward beside the policy's."""
        return self.config.kl_coef > 0 and not self.config.kl_in_reward

    def _empty_forward(self, model) -> torch.Tensor:
        """`model` (the engine, the reference, or with LoRA the engine with its adapters off) on
        one pad token, by the path a micro-batch takes; 0 times its log-prob."""
        ids = torch.full((1, 1), self.pad_id, dtype=torch.int64, device=self.engine.device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if not self.split_head:
            return model(**inputs).logits.sum() * 0.0
        pieces = self._head_calls(1) if self._in_step_ranks else None
        logp, _ = split_logprobs(
            model, inputs, lambda h: h[0], ids[0], self.temperature, pieces=pieces
        )
        return logp.sum() * 0.0

    @torch.no_grad()
    def answer_logprobs(self, items: list) -> list[float]:
        """Per (trajectory, cut): the mean log-prob of `<answer> gold </answer>` (its first gold
        answer) right after the prompt and the trajectory's first `cut` tokens, under the weights
        before this step: IGPO's P (learner/step_credit.py). Rank 0 alone runs it, so ZeRO-3
        over several ranks is refused with igpo (pipeline/config/schema.py)."""
        model, device, out = self.model, self.engine.device, []
        training = model.training
        model.eval()
        for first in range(0, len(items), 8):
            rows, spans = [], []
            for t, cut in items[first : first + 8]:
                gold = t.ground_truth[0] if len(t.ground_truth) else ""
                answer = self.tokenizer.encode(
                    f"<answer> {gold} </answer>", add_special_tokens=False
                )
                context = [*t.prompt_token_ids.tolist(), *t.token_ids[:cut].tolist()]
                rows.append(context + answer)
                spans.append((len(context), len(answer)))
            width = max(map(len, rows))
            ids = torch.full((len(rows), width), self.pad_id, dtype=torch.int64)
            mask = torch.zeros_like(ids)
            for r, row in enumerate(rows):
                ids[r, : len(row)] = torch.tensor(row)
                mask[r, : len(row)] = 1
            # logits only at the positions that predict an answer token: [rows, kept, V]
            spans_at = [torch.arange(start - 1, start - 1 + n) for start, n in spans]
            keep = torch.unique(torch.cat(spans_at))
            logits = model(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                logits_to_keep=keep.to(device),
            ).logits
            for r, ((start, n), at) in enumerate(zip(spans, spans_at, strict=True)):
                kept = torch.searchsorted(keep, at).to(logits.device)
                logp = torch.log_softmax(logits[r, kept].float(), -1)
                wanted = ids[r, start : start + n].to(logits.device)
                out.append(float(logp.gather(-1, wanted[:, None]).mean()))
        model.train(training)
        return out

    @torch.no_grad()
    def _reference_kl(self, batch: TrainBatch | None, plan: list[list[int]]) -> torch.Tensor | None:
        """The KL in the reward (`kl_in_reward`): [B, R], each trained token's KL from the
        behaviour policy to the reference (`kl_kind`), 0 elsewhere. REINFORCE++ takes kl_coef
        times its sum over a token and the later ones off the token's advantage; GAE takes
        kl_coef times it as the token's reward. Under ZeRO-3 over several ranks the reference is
        partitioned (`_frozen`; with LoRA the engine, adapters off), so every rank joins its
        forwards: a rank with fewer micro-batches makes empty passes, one without rows (`batch`
        None) gets None."""
        if self._in_step_ranks:
            for _ in range(self._all_max(len(plan)) - len(plan)):
                with self._reference_policy() as policy:
                    self._empty_forward(policy)
        if batch is None:
            return None
        reference = torch.zeros_like(batch.behavior_logprobs)
        for indices in plan:
            rows = torch.tensor(indices, dtype=torch.int64)
            with self._reference_policy() as policy:
                logp, _, _ = self._logprobs(policy, batch.select(rows))
            reference[rows, : logp.shape[1]] = logp.float().cpu()
        mask = batch.response_mask.to(torch.float32)
        return kl_penalty(batch.behavior_logprobs, reference, self.config.kl_kind) * mask

    @torch.no_grad()
    def _critic_targets(
        self,
        batch: TrainBatch | None,
        trajectories: list,
        plan: list[list[int]],
        steps: int,
        kl: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """GAE (learner/gae.py): the critic's values before the step and the returns, [B, R]
        each on this rank's rows, and `batch.advantages` set to the whitened GAE advantages.
        Every rank calls it: the whitening and the explained variance are the step's, over all
        ranks (so is `self.explained_variance`, of the values before the step)."""
        critic = self.critic
        critic.engine.eval()
        if self.config.zero_stage == 3 and self.world > 1:  # a forward gathers from every rank
            for _ in range(steps - (0 if batch is None else len(plan))):
                critic.empty_step(self.pad_id)
        if batch is None:
            self._all_sum([0.0] * 3)
            self.explained_variance = explained(self._all_sum([0.0] * 5))
            return None, None
        values = torch.zeros_like(batch.behavior_logprobs)
        for indices in plan:
            rows = torch.tensor(indices, dtype=torch.int64)
            v, _ = critic.values(batch.select(rows), self.config.packing)
            values[rows, : v.shape[1]] = v.cpu()
        mask = batch.response_mask
        section = self.config.advantage
        rewards = torch.tensor([float(t.reward) for t in trajectories])
        penalty = None if kl is None else -self.config.kl_coef * kl
        advantages, returns = gae(
            outcome_rewards(mask, rewards, penalty), values, mask, section.gamma, section.lam
        )
        on = mask > 0
        picked = advantages[on].double()
        sums = self._all_sum([float(on.sum()), float(picked.sum()), float((picked**2).sum())])
        batch.advantages = whiten(advantages, mask, tuple(sums))
        self.explained_variance = explained(
            self._all_sum(explained_variance(returns, values, mask))
        )
        return values, returns

    def _train_critic(
        self,
        batch: TrainBatch | None,
        plan: list[list[int]],
        steps: int,
        old_values: torch.Tensor | None,
        returns: torch.Tensor | None,
        totals: dict[str, float],
    ) -> Counter[str]:
        """`ppo_epochs` passes of the critic over this rank's micro-batches, its value loss the
        token mean over the step's trained tokens; its sums for telemetry."""
        critic, sums = self.critic, Counter()
        critic.engine.train()
        for _ in range(self.config.ppo_epochs):
            for i in range(steps):
                critic.engine.set_gradient_accumulation_boundary(i == steps - 1)
                if batch is not None and i < len(plan):
                    rows = torch.tensor(plan[i], dtype=torch.int64)
                    micro = batch.select(rows)
                    width = micro.response_mask.shape[1]
                    loss, stats = critic.loss(
                        micro,
                        old_values[rows, :width],
                        returns[rows, :width],
                        self.config.packing,
                    )
                    loss = loss / totals["response_tokens"]
                    sums.update(stats)
                else:
                    loss = critic.empty_step(self.pad_id)
                critic.engine.backward(loss * self.world)  # DeepSpeed averages over the ranks
                critic.engine.step()
        return sums

    @torch.no_grad()
    def _proximal(
        self, batch: TrainBatch | None, plan: list[list[int]], steps: int
    ) -> torch.Tensor | None:
        """Log-probs of the current policy before the update (AReaL's proximal policy), over
        the step's micro-batches `plan`. Under ZeRO-3 with several ranks every rank makes `steps`
        forward passes (empty ones past its rows): each forward gathers parameters from all
        ranks."""
        self.engine.eval()
        if self.config.zero_stage == 3 and self.world > 1:
            own = 0 if batch is None else len(plan)
            for _ in range(steps - own):
                self._empty_micro_step()
        if batch is None:
            return None
        out = torch.zeros_like(batch.behavior_logprobs)
        for indices in plan:
            rows = torch.tensor(indices, dtype=torch.int64)
            logp, _, _ = self._logprobs(self.engine, batch.select(rows))
            out[rows, : logp.shape[1]] = logp.cpu()
        return out

    def _micro_step(
        self,
        micro: TrainBatch,
        proximal: torch.Tensor | None,
        kept: torch.Tensor,
        totals: dict[str, float],
        fill_proximal: bool = False,
    ):
        """One micro-batch's forward pass and loss. With `fill_proximal` its log-probs, detached,
        are the proximal ones, also written into `proximal` (these rows of the step's) when one is
        given for later epochs."""
        device = self.engine.device
        logp, entropy, read = self._logprobs(self.engine, micro)
        mask = micro.response_mask.to(device)
        width = mask.shape[1]
        if fill_proximal:
            proximal_now = logp.detach()
            if proximal is not None:  # later epochs will need them
                proximal[:, :width] = proximal_now.float().cpu()
        else:
            proximal_now = None if proximal is None else proximal[:, :width].to(device)
        loss, stats = policy_loss(
            logp,
            micro.behavior_logprobs.to(device),
            micro.advantages.to(device),
            mask,
            proximal_logprobs=proximal_now,
            clip_low=self.config.clip_low,
            clip_high=self.config.clip_high,
            dual_clip=self.config.dual_clip,
            correction=self.correction,
            ratio_level=self.config.ratio,
            agg=self.config.loss_agg,
            surrogate=self.config.surrogate.type,
            surrogate_params=surrogate_params(self.config.surrogate),
        )
        tokens = float(mask.sum())
        share = (
            float(kept.sum()) / totals["tokens"]
            if self.config.loss_agg == "token-mean"
            else (float((kept.sum(-1) > 0).sum()) / totals["sequences"])
        )
        loss = loss * share
        kl_value = 0.0
        if self.config.kl_coef > 0 and not self.config.kl_in_reward:
            with torch.no_grad(), self._reference_policy() as policy:
                ref_logp, _, _ = self._logprobs(policy, micro)
            kl = kl_penalty(logp, ref_logp, self.config.kl_kind)
            kl_mean = (kl * mask).sum() / mask.sum().clamp(min=1)
            loss = loss + self.config.kl_coef * kl_mean * (tokens / totals["response_tokens"])
            kl_value = float(kl_mean.detach())
        if self.config.entropy_coef > 0:  # a bonus: token mean over the step, like the KL term
            entropy_mean = (entropy * mask).sum() / mask.sum().clamp(min=1)
            share_of_step = tokens / totals["response_tokens"]
            loss = loss - self.config.entropy_coef * entropy_mean * share_of_step
        weighted = {
            f"{k}_sum": v * tokens
            for k, v in stats.items()
            if k not in ("tokens", "ratio_max", "importance_weight_max")
        }
        weighted.update(
            tokens=tokens,
            loss_sum=float(loss.detach()) * totals["response_tokens"],
            entropy_sum=float((entropy.detach() * mask).sum()),
            kl_sum=kl_value * tokens,
            model_tokens=float(read),
        )
        return loss, weighted

    def _telemetry(self, trajectories, sums, start) -> dict[str, float]:
        tokens = max(sums["tokens"], 1.0)
        metrics = {
            k.removesuffix("_sum"): v / tokens for k, v in sums.items() if k.endswith("_sum")
        }
        metrics["loss"] = sums["loss_sum"] / tokens
        metrics["trained_tokens"] = sums["tokens"]
        metrics["grad_norm"] = sums["grad_norm"] or float(self.engine.get_global_grad_norm() or 0.0)
        metrics["lr"] = float(self.engine.get_lr()[0])
        metrics["tool_calls_mean"] = sum(len(t.tool_names) for t in trajectories) / len(
            trajectories
        )
        metrics["response_length_mean"] = sum(len(t.token_ids) for t in trajectories) / len(
            trajectories
        )
        metrics["staleness_mean"] = sum(
            self.version - 1 - t.policy_version for t in trajectories
        ) / len(trajectories)
        generated = [t.token_versions[t.loss_mask == 1] for t in trajectories]
        count = max(sum(len(v) for v in generated), 1)  # token-weighted: long answers count more
        metrics["staleness_token_mean"] = (
            float(sum((self.version - 1 - v).sum() for v in generated)) / count
        )
        # Padding: the share of the tokens the training forward passes read that are not a
        # trajectory's (learner.packing leaves none).
        real = self.config.ppo_epochs * sum(
            len(t.prompt_token_ids) + len(t.token_ids) for t in trajectories
        )
        read = sums["model_tokens"]
        metrics["padding_share"] = max(0.0, 1 - real / read) if read else 0.0
        metrics["step_seconds"] = time.perf_counter() - start
        metrics["version"] = float(self.version)
        return metrics
