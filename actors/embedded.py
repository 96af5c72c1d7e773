"""Embedded rollout engine: any local HF causal LM, generating in-process with dynamic batching.

Requests from concurrent agent loops queue up; a worker thread takes up to `max_batch_size` of them
as one *wave*: one left-padded prefill, then decode steps over a shared KV cache, dropping rows
as they finish (stop string, EOS, length) so the batch shrinks instead of idling. Requests that
arrive during a wave form the next one. New weights are applied between decode steps, so a
trajectory may hold tokens of two versions; each token records the version of the weights whose
logits it was sampled from (a swap lands before the next forward pass, never between a forward
pass and its sample).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import os
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from actors.engine import EngineError, Generation, SamplingParams


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future
    cancelled: bool = False
    result: Generation = field(default_factory=Generation)


class EmbeddedEngine:
    def __init__(
        self, model, tokenizer, *, max_batch_size: int = 16, version: int = 0, seed: int = 0
    ) -> None:
        self.model = model.eval()
        # transformers 5.24 renamed past_key_values to cache (the old name goes in 5.40)
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # fmt: skip
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        self._version = version
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._queue: deque[_Request] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="strata-engine"
        )
        self._weights_lock = threading.Lock()
        self._busy = False  # a wave is decoding in the executor thread
        self._pending: tuple[int, Mapping[str, torch.Tensor], concurrent.futures.Future] | None = (
            None
        )
        self._end_ids = self._end_token_ids()
        self._max_positions = getattr(model.config, "max_position_embeddings", 1 << 30)
        self.waves = 0
        self.generated_tokens = 0

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], *, device: str = "cpu",
                        dtype: str = "float32", **kwargs: object) -> EmbeddedEngine:  # fmt: skip
        """The HF model at `path` on `device` ("cpu", "cuda") with parameters of `dtype`."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=getattr(torch, dtype)
        )
        return cls(model.to(device), tokenizer, **kwargs)

    @property
    def version(self) -> int:
        return self._version

    async def served_versions(self) -> dict[str, int]:
        return {"embedded": self._version}

    def _end_token_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids |= set(configured) if isinstance(configured, list) else {configured}
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
            ids.add(im_end)  # chat models end a turn with <|im_end|>
        return {i for i in ids if i is not None}

    # ------------------------------------------------------------------------------------ API

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if not prompt_ids:
            raise EngineError("empty prompt")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or reused from another event loop (tests do)
            self._loop, self._wakeup, self._worker = loop, asyncio.Event(), None
        request = _Request(list(prompt_ids), params, loop.create_future())
        self._queue.append(request)
        self._wakeup.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._serve())
        try:
            return await request.future
        except asyncio.CancelledError:
            request.cancelled = True  # the wave drops the row at its next step
            raise

    async def update_weights(
        self,
        version: int,
        *,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        path: str | None = None,
    ) -> None:
        """Swap in new weights at the next decode step (or at once when idle).

        A `state_dict` is adopted, not copied (see `_apply_pending`): pass a snapshot.
        """
        if state_dict is None:
            if path is None:
                raise ValueError("update_weights needs a state_dict or a path")
            state_dict = await asyncio.to_thread(_load_state_dict, path)
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._weights_lock:
            if self._pending is not None:
                self._pending[2].cancel()  # superseded before it was applied
            if self._busy:
                self._pending = (version, state_dict, done)  # the wave applies it at its next step
            else:
                self._apply(
                    (version, state_dict, done)
                )  # idle: no thread hop (the lock keeps waves out)
        await asyncio.wrap_future(done)

    async def close(self) -> None:
        if self._worker is not None and self._loop is asyncio.get_running_loop():
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        self._executor.shutdown(wait=True)

    # --------------------------------------------------------------------------------- worker

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                await asyncio.sleep(0)  # let agent loops that are ready right now join this wave
                wave = []
                while self._queue and len(wave) < self.max_batch_size:
                    request = self._queue.popleft()
                    if not request.cancelled:
                        wave.append(request)
                if not wave:
                    continue
                try:
                    await loop.run_in_executor(self._executor, self._run_wave, wave)
                except Exception as exc:  # a broken model must not hang the agent loops
                    for request in wave:
                        if not request.future.done():
                            request.future.set_exception(EngineError(f"generation failed: {exc}"))
                    continue
                for request in wave:
                    if not request.future.done():
                        request.future.set_result(request.result)

    def _apply_pending(self) -> None:
        with self._weights_lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            self._apply(pending)

    def _apply(
        self, pending: tuple[int, Mapping[str, torch.Tensor], concurrent.futures.Future]
    ) -> None:
        version, state_dict, done = pending
        try:
            tie = getattr(self.model.config, "tie_word_embeddings", False)
            tied = {"lm_head.weight"} if tie else set()
            expected = set(self.model.state_dict())
            missing, unexpected = expected - set(state_dict) - tied, set(state_dict) - expected
            if missing or unexpected:
                raise ValueError(
                    f"weights do not fit the model: missing {sorted(missing)}, "
                    f"unexpected {sorted(unexpected)}"
                )
            # assign=True adopts the tensors instead of copying them: engines in one process can
            # serve one published snapshot. The publisher must not modify it afterwards.
            self.model.load_state_dict(dict(state_dict), strict=False, assign=True)
            if tie:
                self.model.tie_weights()
            self._version = version
            done.set_result(None)
        except Exception as exc:
            done.set_exception(exc)

    def _run_wave(self, wave: list[_Request]) -> None:
        with self._weights_lock:
            self._busy = True
        try:
            self._decode_wave(wave)
        finally:
            with self._weights_lock:
                self._busy = False
            self._apply_pending()  # an update that arrived after the wave's last step

    @torch.inference_mode()
    def _decode_wave(self, wave: list[_Request]) -> None:
        from transformers import DynamicCache

        self.waves += 1
        device = self.device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        budgets = [
            max(0, min(r.params.max_new_tokens, self._max_positions - len(r.prompt_ids)))
            for r in wave
        ]
        width = max(len(r.prompt_ids) for r in wave)
        input_ids = torch.full((len(wave), width), pad, dtype=torch.long, device=device)
        mask = torch.zeros((len(wave), width), dtype=torch.long, device=device)
        for row, r in enumerate(wave):
            input_ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids, device=device)
            mask[row, width - len(r.prompt_ids) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        temperature = torch.tensor([r.params.temperature for r in wave], device=device).unsqueeze(
            -1
        )
        top_p = torch.tensor([r.params.top_p for r in wave], device=device).unsqueeze(-1)
        cache = DynamicCache()
        active = [row for row in range(len(wave)) if budgets[row] > 0]
        if not active:
            return
        produced_by = self._version  # the weights these logits come from
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            **{self._cache_kwarg: cache},
            use_cache=True,
        )
        logits = out.logits[:, -1].float()
        last_pos = positions[:, -1]
        rows = torch.arange(len(wave), device=device)  # wave row of each batch row
        while True:
            tokens, logprobs = self._sample(logits, temperature[rows], top_p[rows])
            keep = []
            for i, row in enumerate(rows.tolist()):
                request = wave[row]
                result = request.result
                token = int(tokens[i])
                result.token_ids.append(token)
                result.logprobs.append(float(logprobs[i]))
                result.versions.append(produced_by)  # never the version swapped in after
                self.generated_tokens += 1
                if request.cancelled:
                    result.finish_reason = "abort"
                elif token in self._end_ids:
                    result.finish_reason = "stop"
                elif (stop := self._stop_hit(result.token_ids, request.params.stop)) is not None:
                    result.finish_reason, result.stop = "stop", stop
                elif len(result.token_ids) >= budgets[row]:
                    result.finish_reason = "length"
                else:
                    keep.append(i)
            if not keep:
                return
            index = torch.tensor(keep, device=device)
            if len(keep) < len(rows):
                cache.batch_select_indices(index)
                mask = mask[index]
                rows = rows[index]
                tokens = tokens[index]
                last_pos = last_pos[index]
            mask = torch.cat(
                [mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=device)], dim=1
            )
            last_pos = last_pos + 1
            self._apply_pending()  # between steps: the next logits are the new version's
            produced_by = self._version
            out = self.model(
                input_ids=tokens.unsqueeze(-1),
                attention_mask=mask,
                position_ids=last_pos.unsqueeze(-1),
                **{self._cache_kwarg: cache},
                use_cache=True,
            )
            logits = out.logits[:, -1].float()

    def _sample(
        self, logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row temperature and nucleus sampling; temperature 0 is greedy. Returns tokens and
        log_softmax(logits / temperature) at them (temperature 1 for greedy rows)."""
        greedy = temperature <= 0
        scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)
        logp = torch.log_softmax(scaled, dim=-1)
        probs = logp.exp()
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keeps at least the top token
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=self._generator)
        sampled = order.gather(-1, choice).squeeze(-1)
        tokens = torch.where(greedy.squeeze(-1), logits.argmax(-1), sampled)
        return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    def _stop_hit(self, token_ids: list[int], stops: tuple[str, ...]) -> str | None:
        if not stops:
            return None
        tail = self.tokenizer.decode(token_ids[-16:], skip_special_tokens=False)
        for stop in stops:
            if stop in tail:
                return stop
        return None


def _load_state_dict(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    directory = os.fspath(path)
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(single):
        return load_file(single)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).state_dict()
