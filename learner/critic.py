"""PPO's critic: a value function V(state) trained beside the policy, for GAE (learner/gae.py).

The critic is a separate model, as in verl's and Search-R1's PPO: the policy's architecture with a
scalar head instead of the language-model head (transformers' `AutoModelForTokenClassification`,
one label), its body loaded from the policy's starting weights and its head set to 0 (V = 0
before the first step, the same in every run).
It has its own optimizer and DeepSpeed engine on the learner's own ranks and ZeRO stage, so a
learner of N ranks trains both models data-parallel over the same process group.

V(t), the value of the state before generated token t, is read at the position that predicts
token t: the same positions, packing and micro-batches as the policy's log-probs
(learner/packing.py), so values and log-probs line up token for token.

The value loss is PPO's clipped one: 0.5 * max((V - G)^2, (clip(V, V_old - c, V_old + c) - G)^2)
per trained token (c: `value_clip`; null leaves V unclipped), its token mean over the step.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from learner.batch import TrainBatch
from learner.packing import model_input
from learner.schedule import step_schedule


class Critic:
    """`advantage` is the `learner.advantage` section (type gae); `learner` the learner's."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        advantage: Any,
        learner: Any,
        *,
        dtype: torch.dtype,
        attention: dict[str, str],
        ds_config: dict[str, Any],
        gradient_checkpointing: bool,
    ) -> None:
        import deepspeed
        from transformers import AutoConfig, AutoModelForTokenClassification
        from transformers.utils import logging as hf_logging

        self.value_clip = advantage.value_clip
        was = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # "lm_head not used, score newly initialised": by design
        try:
            shape = AutoConfig.from_pretrained(model_path, local_files_only=True, num_labels=1)
            shape.classifier_dropout = 0.0  # the head's; transformers' default is 0.1
            model = AutoModelForTokenClassification.from_pretrained(
                model_path, config=shape, local_files_only=True, dtype=dtype, **attention
            )
        finally:
            hf_logging.set_verbosity(was)
        with torch.no_grad():  # V = 0 at first, whatever the random state: runs repeat
            for p in model.score.parameters():
                p.zero_()
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        lr = advantage.critic_lr if advantage.critic_lr is not None else learner.lr
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=learner.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, step_schedule(learner.warmup_steps, learner.max_steps, learner.schedule)
        )
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.module

    def values(self, micro: TrainBatch, packed: bool) -> tuple[torch.Tensor, int]:
        """V at every trained token of `micro` ([b, R] float32, 0 where `response_mask` is 0,
        on the engine's device) from one forward pass, and the tokens it read."""
        device = self.engine.device
        given = model_input(micro, packed)
        keep = given.kwargs["logits_to_keep"].to(device)
        kwargs = {k: v.to(device) for k, v in given.kwargs.items() if k != "logits_to_keep"}
        scores = self.engine(**kwargs).logits[..., 0]  # [rows, length]
        kept = scores[:, keep].reshape(-1)
        if given.select is not None:
            kept = kept[given.select.to(device)]
        full = torch.zeros(micro.response_mask.shape, dtype=torch.float32, device=device)
        where = (given.rows.to(device), given.cols.to(device))
        return full.index_put(where, kept.float()), given.tokens

    def loss(
        self,
        micro: TrainBatch,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        packed: bool,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's clipped value loss summed over its trained tokens (the caller divides
        by the step's), and its sums for telemetry."""
        device = self.engine.device
        values, _ = self.values(micro, packed)
        mask = micro.response_mask.to(device).float()
        old_values, returns = old_values.to(device), returns.to(device)
        loss = (values - returns) ** 2
        clipped = torch.zeros_like(mask)
        if self.value_clip is not None:
            bounded = old_values + (values - old_values).clamp(-self.value_clip, self.value_clip)
            loss_clipped = (bounded - returns) ** 2
            clipped = (loss_clipped > loss).float()
            loss = torch.maximum(loss, loss_clipped)
        total = 0.5 * (loss * mask).sum()
        stats = {
            "value_loss_sum": float(total.detach()),
            "value_clip_frac_sum": float((clipped * mask).sum()),
            "value_mean_sum": float((values.detach() * mask).sum()),
        }
        return total, stats

    def empty_step(self, pad_id: int) -> torch.Tensor:
        """A zero loss through the whole critic on one pad token: a rank with no rows left takes
        part in DeepSpeed's reductions without changing them."""
        ids = torch.full((1, 1), pad_id, dtype=torch.int64, device=self.engine.device)
        return self.engine(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.sum() * 0.0
