"""Embedded rollout engine: any local HF causal LM, generating in-process with continuous batching.

Requests from concurrent agent loops queue up; a worker thread decodes up to `max_batch_size` of
them together over one KV cache. Between any two decode steps, finished rows leave (stop string,
EOS, length) and are answered at once, and queued requests join: their prompts are prefilled
together (left-padded) and their cache is merged into the batch's, so an agent loop back from a
tool call waits one step, not for the longest trajectory of the batch. Each step samples all rows
and reads tokens and log-probs back to the host in one transfer (one device sync per step on a
GPU). New weights are applied before a forward pass, so a trajectory may hold tokens of two
versions; each token records the version of the weights whose logits it was sampled from (a
swap lands before the next forward pass, never between a forward pass and its sample).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
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
    future_done: bool = False  # answered (set in the decode thread, before the loop sees it)


class _Batch:
    """The rows decoding together: their requests, KV cache, attention mask, positions, the
    logits their next token is sampled from and the version that produced those logits."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.requests: list[_Request] = []
        self.budgets: list[int] = []
        self.produced_by: list[int] = []
        self.cache = None
        self.mask = self.positions = self.logits = self.tokens = None
        self.temperature = self.top_p = None

    @property
    def greedy(self) -> bool:
        return all(r.params.temperature <= 0 for r in self.requests)

    def finish(self, request: _Request, error: Exception | None) -> None:
        """Answer `request` on its event loop (from the decode thread)."""
        if request.future_done:
            return
        request.future_done = True
        with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody waits
            self.loop.call_soon_threadsafe(_answer, request, error)

    def select(self, keep: list[int], tokens: torch.Tensor) -> None:
        """Keep rows `keep` (indices into the rows), each to be fed its sampled token next."""
        if len(keep) < len(self.requests):
            index = torch.tensor(keep, device=tokens.device)
            self.requests = [self.requests[i] for i in keep]
            self.budgets = [self.budgets[i] for i in keep]
            self.produced_by = [self.produced_by[i] for i in keep]
            if not keep:
                self.cache = self.mask = self.positions = self.logits = self.tokens = None
                return
            self.cache.batch_select_indices(index)
            self.mask, self.positions = self.mask[index], self.positions[index]
            tokens = tokens[index]
            self.temperature, self.top_p = self.temperature[index], self.top_p[index]
            self._trim()
        self.tokens = tokens
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(keep), 1))], dim=1)
        self.positions = self.positions + 1

    def _trim(self) -> None:
        """Drop the leading cache columns no row attends to any more (the rows that needed them
        have left), once they are a quarter of the cache: the cost of a step follows its width.
        A row attends to the rightmost columns only, its prompt and the tokens fed so far (all
        but its last sampled one), so the host knows the span without asking the device."""
        span = max(len(r.prompt_ids) + len(r.result.token_ids) - 1 for r in self.requests)
        first = self.mask.shape[1] - span
        if first > 0 and first * 4 >= self.mask.shape[1]:
            self.mask = self.mask[:, first:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., first:, :], layer.values[..., first:, :]

    def join(
        self,
        requests: list[_Request],
        budgets: list[int],
        cache,
        mask: torch.Tensor,
        positions: torch.Tensor,
        logits: torch.Tensor,
        sampling: torch.Tensor,
        version: int,
    ) -> None:
        """Add prefilled rows: caches and masks are left-padded to a common width, then stacked."""
        if not self.requests:
            self.cache, self.mask, self.positions, self.logits = cache, mask, positions, logits
            self.temperature, self.top_p = sampling[:, :1], sampling[:, 1:]
        else:
            width = max(self.mask.shape[1], mask.shape[1])
            for old, new in zip(self.cache.layers, cache.layers, strict=True):
                old.keys = torch.cat([_left_pad(old.keys, width), _left_pad(new.keys, width)])
                old.values = torch.cat([_left_pad(old.values, width), _left_pad(new.values, width)])
            self.mask = torch.cat([_left_pad(self.mask, width), _left_pad(mask, width)])
            self.positions = torch.cat([self.positions, positions])
            self.logits = torch.cat([self.logits, logits])
            self.temperature = torch.cat([self.temperature, sampling[:, :1]])
            self.top_p = torch.cat([self.top_p, sampling[:, 1:]])
        self.requests += requests
        self.budgets += budgets
        self.produced_by += [version] * len(requests)


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """`tensor` widened to `width` along its sequence dimension (the last of a mask, the one
    before the head dimension of keys and values) with zeros in front."""
    dim = -1 if tensor.dim() == 2 else -2
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _answer(request: _Request, error: Exception | None) -> None:
    if request.future.done():  # cancelled by its caller meanwhile
        return
    if error is not None:
        request.future.set_exception(error)
    else:
        request.future.set_result(request.result)


class EmbeddedEngine:
    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_batch_size: int = 16,
        version: int = 0,
        seed: int = 0,
        join_running: bool = True,
    ) -> None:
        """`join_running`: queued requests join the running batch between decode steps
        (continuous batching); off, they wait until it has drained (for benchmarks to compare)."""
        self.model = model.eval()
        # transformers 5.24 renamed past_key_values to cache (the old name goes in 5.40)
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
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
        self.join_running = join_running
        self._busy = False  # a batch is decoding in the executor thread
        self._pending: tuple[int, Mapping[str, torch.Tensor], concurrent.futures.Future] | None = (
            None
        )
        self._end_ids = self._end_token_ids()
        self._max_positions = getattr(model.config, "max_position_embeddings", 1 << 30)
        self.waves = 0  # prefills: each admits the requests queued at that moment
        self.generated_tokens = 0

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str = "cpu",
        dtype: str = "float32",
        **kwargs: object,
    ) -> EmbeddedEngine:
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
            request.cancelled = True  # the batch drops the row at its next step
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
                self._pending = (version, state_dict, done)  # applied before the next forward
            else:
                self._apply(
                    (version, state_dict, done)
                )  # idle: no thread hop (the lock keeps the decode thread out)
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
                await asyncio.sleep(0)  # let agent loops that are ready right now join the prefill
                batch = _Batch(loop)
                try:
                    await loop.run_in_executor(self._executor, self._run, batch)
                except Exception as exc:  # a broken model must not hang the agent loops
                    for request in batch.requests:
                        batch.finish(request, EngineError(f"generation failed: {exc}"))

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

    def _run(self, batch: _Batch) -> None:
        with self._weights_lock:
            self._busy = True
        try:
            self._decode(batch)
        finally:
            with self._weights_lock:
                self._busy = False
            self._apply_pending()  # an update that arrived after the batch's last step

    def _admit(self, batch: _Batch) -> list[_Request]:
        """Requests from the queue for the batch's free rows (continuous batching: between any
        two decode steps; with `join_running` off, only into an empty batch)."""
        if batch.requests and not self.join_running:
            return []
        joining = []
        while self._queue and len(batch.requests) + len(joining) < self.max_batch_size:
            if self._queue[0].future.get_loop() is not batch.loop:
                break  # the engine moved to another event loop (tests do): that one's batch's
            request = self._queue.popleft()  # only this thread takes from the queue
            if not request.cancelled:
                joining.append(request)
        return joining

    @torch.inference_mode()
    def _decode(self, batch: _Batch) -> None:
        """Decode steps over one KV cache until no row is left and nobody waits.

        Each step samples every row at once and reads tokens and log-probs back in one
        transfer; finished rows leave (and are answered at once), queued requests join after a
        prefill of their own whose cache is merged into the batch's. Rows are left-padded: a
        row's keys sit at the right end of the cache, the mask hides the rest, and each row
        keeps its own positions.
        """
        while True:
            if joining := self._admit(batch):
                try:
                    self._prefill(batch, joining)
                except Exception as exc:  # the joining rows are in no batch yet: answer them here
                    for request in joining:
                        batch.finish(request, EngineError(f"generation failed: {exc}"))
                    raise
            if not batch.requests:
                return
            tokens, logprobs = self._sample(
                batch.logits, batch.temperature, batch.top_p, batch.greedy
            )
            values = torch.stack([tokens.double(), logprobs.double()]).tolist()  # one transfer
            keep = []
            for i, request in enumerate(batch.requests):
                result, token = request.result, int(values[0][i])
                result.token_ids.append(token)
                result.logprobs.append(values[1][i])
                result.versions.append(batch.produced_by[i])  # never a version swapped in after
                self.generated_tokens += 1
                if request.cancelled:
                    result.finish_reason = "abort"
                elif token in self._end_ids:
                    result.finish_reason = "stop"
                elif (stop := self._stop_hit(result.token_ids, request.params.stop)) is not None:
                    result.finish_reason, result.stop = "stop", stop
                elif len(result.token_ids) >= batch.budgets[i]:
                    result.finish_reason = "length"
                else:
                    keep.append(i)
                    continue
                batch.finish(request, None)
            batch.select(keep, tokens)
            if not batch.requests:
                continue  # the queue may hold requests that arrived meanwhile
            self._apply_pending()  # between steps: the next logits are the new version's
            out = self.model(
                input_ids=batch.tokens.unsqueeze(-1),
                attention_mask=batch.mask,
                position_ids=batch.positions.unsqueeze(-1),
                **{self._cache_kwarg: batch.cache},
                use_cache=True,
            )
            batch.logits = out.logits[:, -1].float()
            batch.produced_by = [self._version] * len(batch.requests)

    def _prefill(self, batch: _Batch, joining: list[_Request]) -> None:
        """Run the joining requests' prompts (left-padded) and merge them into the batch."""
        from transformers import DynamicCache

        self.waves += 1
        device = self.device
        budgets = [
            max(0, min(r.params.max_new_tokens, self._max_positions - len(r.prompt_ids)))
            for r in joining
        ]
        for request in [r for r, b in zip(joining, budgets, strict=True) if b == 0]:
            request.result.finish_reason = "length"  # no room left for a token
            batch.finish(request, None)
        joining, budgets = [r for r in joining if not r.future_done], [b for b in budgets if b]
        if not joining:
            return
        width = max(len(r.prompt_ids) for r in joining)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        rows = [[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in joining]
        input_ids = torch.tensor(rows, dtype=torch.long, device=device)
        lengths = torch.tensor([len(r.prompt_ids) for r in joining], device=device)
        mask = (torch.arange(width, device=device) >= (width - lengths).unsqueeze(-1)).long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self._apply_pending()
        cache = DynamicCache()
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            **{self._cache_kwarg: cache},
            use_cache=True,
        )
        sampling = torch.tensor(
            [[r.params.temperature, r.params.top_p] for r in joining], device=device
        )
        batch.join(
            joining,
            budgets,
            cache,
            mask,
            positions[:, -1],
            out.logits[:, -1].float(),
            sampling,
            self._version,
        )

    def _sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_p: torch.Tensor,
        all_greedy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row temperature and nucleus sampling; temperature 0 is greedy. Returns tokens and
        log_softmax(logits / temperature) at them (temperature 1 for greedy rows). `all_greedy`
        (known on the host): no row samples, so nothing is sorted or drawn."""
        if all_greedy:
            tokens = logits.argmax(-1)
            return tokens, torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(
                -1
            )
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
