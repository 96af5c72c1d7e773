"""A simulated GPU inference cluster: servers whose timings follow a GPU model, and tools with
long-tailed latency, under the real agent loop, buffer, admission and weight publishing.

Nothing here runs a model. A server decodes its running sequences together: each decode step
advances every sequence by one token and takes `step_s + step_per_seq_s * B` at batch size B (a
memory-bound decode step: the weights are read once per step, the KV caches once per sequence),
so per-sequence speed falls and server throughput rises with B, up to `max_batch` sequences (the
rest queue). A request's new prompt tokens are prefilled first, at `prefill_per_token_s` each,
holding the server (chunked prefill is not modelled). The server is a fluid model: between two
events (a request arriving or finishing, a weight update) every running sequence moves at the
same rate, so its cost is per event, not per token.

What the policy "writes" is drawn from a seeded workload: each turn calls a tool with probability
`tool_call_p` (a geometric, long-tailed number of calls, cut at the agent's turn limit), turn
lengths are log-normal, and the text is filler words plus the real action tags, so the agent loop
parses it as it parses a model's. Tools sleep a log-uniform latency and return filler text.

Weight updates (`update_weights`): each server stops decoding for `load_s` while it loads the new
weights. With `partial_rollouts` (the default, as AReaL and the embedded engine do) generation
resumes where it was: the tokens after the update carry the new version. Without, a server first
finishes every running sequence (admitting none) and only then loads: the cost of not continuing
rollouts across an update is the idle tail of that drain.

Time is the event loop's (`loop.time()`): under `pipeline.runtime.virtual_time` a simulated hour takes as
long as the Python work it causes.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import random
from collections import deque
from dataclasses import dataclass, field

from actors.engine import Generation, SamplingParams
from actors.tools import ToolResult, string_schema


@dataclass(frozen=True)
class GpuModel:
    """One inference server's timings (defaults: an 8B model in bf16 on one H100-class GPU)."""

    step_s: float = 0.010
    """Decode step time at batch size 1 (reading 16 GB of weights at ~3 TB/s, plus overhead)."""
    step_per_seq_s: float = 0.0003
    """Added per running sequence (its KV cache read): 64 sequences -> 29 ms a step, ~2.2k tok/s."""
    prefill_per_token_s: float = 0.0001
    """Prefill time per new prompt token (~10k tokens/s)."""
    max_batch: int = 64
    """Sequences decoded together; more requests wait."""

    def step_time(self, batch: int) -> float:
        return self.step_s + self.step_per_seq_s * batch


@dataclass(frozen=True)
class Workload:
    """What the simulated policy writes and how long its tools take."""

    tool_call_p: float = 0.6
    """Chance that a turn (not the last) calls a tool: P(k calls) = (1-p) p^k, a long tail."""
    turn_tokens_median: float = 120.0
    turn_tokens_sigma: float = 0.8
    """Turn length: log-normal with this median and log-space standard deviation."""
    tool_latency_s: tuple[float, float] = (0.2, 2.0)
    """Tool call latency, log-uniform between these."""
    observation_words: int = 200
    """Words in a tool's observation (one token each with `pipeline.runtime.simulated.sim_tokenizer`)."""

    def turn_tokens(self, rng: random.Random) -> int:
        return max(
            8, round(self.turn_tokens_median * math.exp(rng.gauss(0.0, self.turn_tokens_sigma)))
        )

    def tool_latency(self, rng: random.Random) -> float:
        low, high = self.tool_latency_s
        return math.exp(rng.uniform(math.log(low), math.log(high)))


class _Request:
    __slots__ = ("done", "left", "prefill", "segments", "tokens")

    def __init__(self, tokens: int, prefill: int, loop: asyncio.AbstractEventLoop) -> None:
        self.tokens = tokens
        self.left = float(tokens)  # tokens still to decode (fluid)
        self.prefill = prefill
        self.segments: list[list[int]] = []  # [version, tokens decoded under it]
        self.done: asyncio.Future = loop.create_future()


@dataclass
class ServerStats:
    busy_s: float = 0.0  # decoding or prefilling
    loading_s: float = 0.0  # loading weights
    draining_s: float = 0.0  # finishing running sequences before a load (no partial rollouts)
    generated_tokens: int = 0
    requests: int = 0


class SimulatedServer:
    """One server: a queue, a running batch, and a task that advances the batch between events."""

    def __init__(self, name: str, gpu: GpuModel, partial_rollouts: bool = True) -> None:
        self.name, self.gpu, self.partial_rollouts = name, gpu, partial_rollouts
        self.version = 0
        self.stats = ServerStats()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._wake = asyncio.Event()
        self._update: tuple[int, float, asyncio.Future] | None = None  # (version, load_s, done)
        self._task: asyncio.Task | None = None

    @property
    def load(self) -> int:
        return len(self._waiting) + len(self._running)

    def _start(self) -> None:
        """The serving task, started by the first request or update (a running loop is needed)."""
        if self._task is None:
            self._task = asyncio.create_task(self._serve(), name=f"simulated-{self.name}")

    async def decode(self, tokens: int, prefill: int) -> list[list[int]]:
        """Prefill `prefill` tokens, then decode `tokens`; returns [version, count] segments."""
        self._start()
        request = _Request(tokens, prefill, asyncio.get_running_loop())
        self._waiting.append(request)
        self.stats.requests += 1
        self._wake.set()
        return await request.done

    async def update_weights(self, version: int, load_s: float) -> None:
        """Serve `version` after loading it for `load_s` (and, without partial rollouts, after
        the running sequences have finished)."""
        self._start()
        done = asyncio.get_running_loop().create_future()
        self._update = (version, load_s, done)
        self._wake.set()
        await done

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for request in [*self._waiting, *self._running]:
            if not request.done.done():
                request.done.cancel()

    def _advance(self, seconds: float) -> None:
        """Every running sequence decodes `seconds` worth of steps at the current batch size."""
        if not self._running or seconds <= 0:
            return
        made = seconds / self.gpu.step_time(len(self._running))
        for r in self._running:
            step = min(made, r.left)
            r.left -= step
            if r.segments and r.segments[-1][0] == self.version:
                r.segments[-1][1] += step
            else:
                r.segments.append([self.version, step])
        self.stats.busy_s += seconds

    def _finish(self) -> None:
        still = []
        for r in self._running:
            if r.left <= 1e-6:
                # whole tokens per version, rounded at the boundaries so they add up exactly
                scale = r.tokens / sum(n for _, n in r.segments)
                counts, made, before = [], 0.0, 0
                for version, n in r.segments:
                    made += n
                    after = round(made * scale)
                    counts.append([version, after - before])
                    before = after
                self.stats.generated_tokens += r.tokens
                if not r.done.done():
                    r.done.set_result(counts)
            else:
                still.append(r)
        self._running = still

    async def _sleep_or_wake(self, seconds: float | None) -> None:
        self._wake.clear()
        if seconds is None:
            await self._wake.wait()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._update is not None and (self.partial_rollouts or not self._running):
                version, load_s, done = self._update
                self._update = None
                await asyncio.sleep(load_s)  # nothing decodes while the weights load
                self.stats.loading_s += load_s
                self.version = version
                done.set_result(None)
                continue
            draining = self._update is not None  # no partial rollouts: finish, admit nothing
            if not draining and self._waiting and len(self._running) < self.gpu.max_batch:
                request = self._waiting.popleft()
                prefill_s = request.prefill * self.gpu.prefill_per_token_s
                await asyncio.sleep(prefill_s)  # holds the server: running sequences wait
                self.stats.busy_s += prefill_s
                self._running.append(request)
                continue
            if not self._running:
                await self._sleep_or_wake(None)
                continue
            # decode until the first running sequence finishes or something arrives
            step = self.gpu.step_time(len(self._running))
            until = min(r.left for r in self._running) * step
            began = loop.time()
            await self._sleep_or_wake(until)
            elapsed = min(loop.time() - began, until)
            self._advance(elapsed)
            if draining:
                self.stats.draining_s += elapsed
            self._finish()


@dataclass
class _TrajectoryState:
    context: int  # tokens of the context the server has cached for this trajectory


_TRAJECTORY: contextvars.ContextVar[_TrajectoryState | None] = contextvars.ContextVar(
    "simulated_trajectory", default=None
)


@dataclass
class SimulatedEngine:
    """The RolloutEngine over simulated servers: each request goes to the least loaded one.

    A trajectory's turns are told apart through a context variable (the agent loop runs each
    trajectory in its own task): the first call prefills the whole prompt, the next ones only
    what was appended since (the tool observation), as a server with prefix caching would."""

    servers: list[SimulatedServer]
    tokenizer: object
    workload: Workload = field(default_factory=Workload)
    seed: int = 0
    load_s: float = 0.5
    """Time a server takes to load new weights (the learner's publish waits for all)."""
    generated_tokens: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        encode = self.tokenizer.encode
        self._filler = encode(" word", add_special_tokens=False)
        self._tails = {
            "search": encode(" <search> simulated query </search>", add_special_tokens=False),
            "answer": encode(" <answer> simulated </answer>", add_special_tokens=False),
        }
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    async def served_versions(self) -> dict[str, int]:
        return {s.name: s.version for s in self.servers}

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        state = _TRAJECTORY.get()
        if state is None or state.context > len(prompt_ids):
            state = _TrajectoryState(0)
            _TRAJECTORY.set(state)
        new_tokens = len(prompt_ids) - state.context
        may_call = "</search>" in params.stop
        action = (
            "search" if may_call and self.rng.random() < self.workload.tool_call_p else "answer"
        )
        tail = self._tails[action]
        wanted = max(self.workload.turn_tokens(self.rng), len(tail) + 1)
        budget = params.max_new_tokens
        tokens = min(wanted, budget)
        server = min(self.servers, key=lambda s: s.load)
        segments = await server.decode(tokens, new_tokens)
        if wanted <= budget:
            ids = self._filler * ((tokens - len(tail)) // len(self._filler))
            ids = (ids + self._filler)[: tokens - len(tail)] + tail
            finish, stop = "stop", f"</{action}>"
        else:  # cut at the budget: no closing tag
            ids = (self._filler * tokens)[:tokens]
            finish, stop = "length", None
        versions = [v for v, n in segments for _ in range(n)]
        self.generated_tokens += len(ids)
        state.context = len(prompt_ids) + len(ids)
        return Generation(ids, [-1.0] * len(ids), versions, finish, stop)

    async def update_weights(self, version: int, *, state_dict=None, path=None) -> None:
        """Every server loads `version` (in parallel); the call returns when all serve it."""
        await asyncio.gather(*(s.update_weights(version, self.load_s) for s in self.servers))
        self._version = version

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.servers))


class SimulatedTool:
    """A tool that takes a drawn latency and returns filler text (`name` search or python), on
    the tool contract with one string parameter (its argument is not read)."""

    def __init__(self, name: str, workload: Workload, seed: int = 0) -> None:
        self.name = name
        self.schema = string_schema(name, f"A simulated {name}.", "input", "Anything.")
        self.open_tag, self.close_tag = (
            ("<information>", "</information>") if name == "search" else ("<output>", "</output>")
        )
        self.workload = workload
        self.rng = random.Random(seed)
        self._text = " ".join(["passage"] * workload.observation_words)

    async def __call__(self, arguments: dict) -> ToolResult:
        await asyncio.sleep(self.workload.tool_latency(self.rng))
        return ToolResult(True, self._text)
