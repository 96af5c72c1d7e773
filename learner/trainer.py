"""The DeepSpeed learner: complete groups in, one optimiser step of Stratified GRPO out.

Per step: validate the groups (a bad one is counted and skipped, never trained), optionally drop
zero-variance groups, compute blended stratified advantages, recompute proximal log-probs when an
importance correction is configured, then `ppo_epochs` passes of micro-batches through the clipped
loss (+ KL to the initial policy when `kl_coef > 0`). Gradients accumulate over the whole step and
the loss of every micro-batch is weighted by its share of the step's tokens (or sequences), so the
step's loss is exactly the configured aggregation over all its tokens.

On CPU it runs DeepSpeed ZeRO 0-2 over gloo in one process; on GPUs ZeRO-3 with NCCL under a
launcher that sets the distributed environment.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

import torch

from buffers.records import Group
from learner.advantages import stratified_advantages_with_stats
from learner.batch import InvalidGroup, TrainBatch, build_batch, response_logprobs, validate_group
from learner.estimators import Estimate, estimate
from learner.losses import kept_by_importance, kl_penalty, policy_loss
from learner.schedule import step_schedule
from learner.telemetry import stratum_summary, theorem1_terms


def init_distributed() -> None:
    """The process group DeepSpeed trains in: the one a launcher (torchrun, deepspeed) describes
    in MASTER_ADDR / WORLD_SIZE, else a one-process group whose store is in-process (a TCPStore
    would listen on every interface for a rendezvous nobody else joins)."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "MASTER_ADDR" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend=backend, verbose=False)


class Learner:
    """`config` is the pipeline's `learner` config section (read by attribute, not imported)."""

    def __init__(self, model_path: str | os.PathLike[str], config: Any, *, group_size: int,
                 temperature: float = 1.0, version: int = 0, dtype: str | None = None,
                 gradient_checkpointing: bool = False) -> None:  # fmt: skip
        """`dtype` (float32, bfloat16, float16): the parameters' dtype, None: bfloat16 on CUDA,
        else float32. `gradient_checkpointing`: recompute activations in the backward pass."""
        import deepspeed
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.config = config
        self.group_size = group_size
        self.temperature = temperature
        self.version = version
        cuda = torch.cuda.is_available()
        dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if cuda else torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=dtype)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.reference = None
        if config.kl_coef > 0:  # the initial policy, frozen; only loaded when the KL term is on
            self.reference = AutoModelForCausalLM.from_pretrained(
                model_path, local_files_only=True, dtype=dtype
            )
            self.reference.requires_grad_(False).eval()
        init_distributed()
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, weight_decay=config.weight_decay
        )
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
        if self.reference is not None:
            self.reference.to(self.engine.device)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.counts: Counter[str] = Counter()

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.module

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights for publishing (gathered under ZeRO-3)."""
        if self.config.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(
                list(self.model.parameters()), modifier_rank=None
            ):
                return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    # --------------------------------------------------------------------------------- the step

    def step(self, groups: list[Group]) -> dict[str, float]:
        """One optimiser step on `groups`; returns the step's telemetry (plain floats)."""
        start = time.perf_counter()
        usable = []
        for group in groups:
            try:
                validate_group(group, self.group_size)
            except InvalidGroup:
                self.counts["invalid_groups"] += 1
                continue
            if self.config.drop_zero_variance_groups and len(set(group.rewards.tolist())) == 1:
                self.counts["zero_variance_groups"] += 1
                continue
            usable.append(group)
        metrics: dict[str, float] = {
            "groups": float(len(usable)),
            "skipped_groups": float(len(groups) - len(usable)),
        }
        if not usable:
            return metrics
        trajectories = [t for g in usable for t in g.members]
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float64)
        group_ids = torch.tensor([i for i, g in enumerate(usable) for _ in g.members])
        strata = torch.tensor([t.stratum for t in trajectories])  # assigned at collection
        # the stratified statistics feed the per-stratum telemetry whatever the estimator
        result = stratified_advantages_with_stats(
            rewards, group_ids, strata, self.config.alpha, self.config.eps
        )
        if self.config.advantage.type == "stratified":  # already computed: not twice
            chosen = Estimate(result.advantages, torch.ones(len(rewards), dtype=torch.bool))
        else:
            chosen = estimate(self.config.advantage.type, rewards, group_ids, strata,
                              self.config.alpha, self.config.eps)  # fmt: skip
        batch = build_batch(trajectories, chosen.advantages, self.pad_id)
        batch.response_mask[~chosen.keep] = 0  # left out of the loss (mc_grpo's pivots)
        for row, t in enumerate(trajectories):  # TSPO: the latent reward credits the turns up to
            if t.latent_reward > 0 and t.first_answer_token >= 0:  # the answer's first observation
                batch.response_mask[row, t.first_answer_token :] = 0

        proximal = self._proximal(batch) if self.config.importance != "none" else None
        # The tokens the loss is taken over (importance "mask" drops some before the loss sees
        # them): each micro-batch's share of the step is its share of these.
        kept = kept_by_importance(batch.response_mask, batch.behavior_logprobs, proximal,
                                  self.config.importance, self.config.is_cap, self.config.is_floor)  # fmt: skip
        totals = {
            "tokens": max(float(kept.sum()), 1.0),
            "sequences": max(float((kept.sum(-1) > 0).sum()), 1.0),
            "response_tokens": max(float(batch.response_mask.sum()), 1.0),
        }
        sums: Counter[str] = Counter()
        self.engine.train()
        for _ in range(self.config.ppo_epochs):
            micro = self.config.micro_batch_size
            starts = list(range(0, batch.size, micro))
            for i, first in enumerate(starts):
                rows = slice(first, first + micro)
                boundary = i == len(starts) - 1
                self.engine.set_gradient_accumulation_boundary(boundary)
                loss, stats = self._micro_step(
                    batch.select(rows),
                    None if proximal is None else proximal[rows],
                    kept[rows],
                    totals,
                )
                self.engine.backward(loss)
                if boundary and self.config.zero_stage == 0:  # ZeRO 1-3 report their own norm
                    grads = [p.grad for p in self.model.parameters() if p.grad is not None]
                    sums["grad_norm"] = (
                        float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
                    )
                self.engine.step()
                for key, value in stats.items():
                    sums[key] += value
        self.version += 1
        metrics.update(self._telemetry(result, rewards, strata, trajectories, sums, start))
        return metrics

    @torch.no_grad()
    def _proximal(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs of the current policy before the update (AReaL's proximal policy)."""
        self.engine.eval()
        width = batch.response_mask.shape[1]
        out = torch.zeros_like(batch.behavior_logprobs)
        for first in range(0, batch.size, self.config.micro_batch_size):
            rows = slice(first, first + self.config.micro_batch_size)
            micro = batch.select(rows)
            logits = self.engine(input_ids=micro.input_ids.to(self.engine.device),
                                 attention_mask=micro.attention_mask.to(self.engine.device)).logits  # fmt: skip
            logp, _ = response_logprobs(logits, micro, self.temperature)
            out[rows, : logp.shape[1]] = logp.float().cpu()[:, :width]
        return out

    def _micro_step(
        self,
        micro: TrainBatch,
        proximal: torch.Tensor | None,
        kept: torch.Tensor,
        totals: dict[str, float],
    ):
        device = self.engine.device
        logits = self.engine(
            input_ids=micro.input_ids.to(device), attention_mask=micro.attention_mask.to(device)
        ).logits
        logp, entropy = response_logprobs(logits, micro, self.temperature)
        mask = micro.response_mask.to(device)
        width = mask.shape[1]
        loss, stats = policy_loss(
            logp, micro.behavior_logprobs.to(device), micro.advantages.to(device), mask,
            proximal_logprobs=None if proximal is None else proximal[:, :width].to(device),
            clip_low=self.config.clip_low, clip_high=self.config.clip_high, dual_clip=self.config.dual_clip,
            importance=self.config.importance, is_cap=self.config.is_cap, is_floor=self.config.is_floor,
            ratio_level=self.config.ratio, agg=self.config.loss_agg,
        )  # fmt: skip
        tokens = float(mask.sum())
        share = float(kept.sum()) / totals["tokens"] if self.config.loss_agg == "token-mean" else (
            float((kept.sum(-1) > 0).sum()) / totals["sequences"]
        )  # fmt: skip
        loss = loss * share
        kl_value = 0.0
        if self.reference is not None:
            with torch.no_grad():
                ref_logits = self.reference(input_ids=micro.input_ids.to(device),
                                            attention_mask=micro.attention_mask.to(device)).logits  # fmt: skip
                ref_logp, _ = response_logprobs(ref_logits, micro, self.temperature)
            kl = kl_penalty(logp, ref_logp, self.config.kl_kind)
            kl_mean = (kl * mask).sum() / mask.sum().clamp(min=1)
            loss = loss + self.config.kl_coef * kl_mean * (tokens / totals["response_tokens"])
            kl_value = float(kl_mean.detach())
        weighted = {
            f"{k}_sum": v * tokens
            for k, v in stats.items()
            if k not in ("tokens", "ratio_max", "importance_weight_max")
        }
        weighted.update(tokens=tokens, loss_sum=float(loss.detach()) * totals["response_tokens"],
                        entropy_sum=float((entropy * mask).sum()), kl_sum=kl_value * tokens)  # fmt: skip
        return loss, weighted

    def _telemetry(self, result, rewards, strata, trajectories, sums, start) -> dict[str, float]:
        tokens = max(sums["tokens"], 1.0)
        metrics = {
            k.removesuffix("_sum"): v / tokens for k, v in sums.items() if k.endswith("_sum")
        }
        metrics["loss"] = sums["loss_sum"] / tokens
        metrics["trained_tokens"] = sums["tokens"]
        metrics["grad_norm"] = sums["grad_norm"] or float(self.engine.get_global_grad_norm() or 0.0)
        metrics["lr"] = float(self.engine.get_lr()[0])
        metrics["reward_mean"] = float(rewards.mean())
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
        metrics["adv_var_global_unnormalised"] = float(result.global_centered.var(unbiased=False))
        metrics.update(theorem1_terms(result))
        for stratum, row in stratum_summary(result, rewards, strata).items():
            metrics[f"stratum/{stratum}/count"] = row["count"]
            metrics[f"stratum/{stratum}/reward"] = row["mean_reward"]
            metrics[f"stratum/{stratum}/in_stratum_adv_var"] = row["in_stratum_adv_var"]
        metrics["step_seconds"] = time.perf_counter() - start
        metrics["version"] = float(self.version)
        return metrics
