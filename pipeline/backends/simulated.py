"""`actors.engine.type: simulated`: a simulated GPU cluster. Servers, tools and the learner step
follow timing models on a virtual clock while the real agent loop, buffer, admission and
publishing run on top (`pipeline/runtime/simulated.py`); the backend replaces the whole run, so
it builds no engine client and starts no servers."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, model_validator

from pipeline.backends.engine import EngineBackend

if TYPE_CHECKING:
    from pipeline.config.schema import StrataConfig


class SimulatedEngine(EngineBackend):
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

    replaces_run: ClassVar[bool] = True

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

    def refused(self, config: StrataConfig, gpus: int) -> str | None:
        if not config.runtime.one_process:
            return "actors.engine.type simulated runs on the local runtime only: use --set runtime.type=local"
        if not config.actors.agent.strata_loop:
            return (
                f"actors.engine.type simulated runs Strata's own loop on simulated text, not a "
                f"{config.actors.agent.type} agent: use --set actors.agent.type=builtin"
            )
        return None
