"""Build the system's parts from config sections: the one place config meets constructors."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from actors.agent import AgentSettings
from actors.engine import RolloutEngine
from actors.tools import PythonTool, SearchTool, Tool
from buffers.group_buffer import GroupBuffer
from buffers.spill import ParquetSpill
from buffers.strata import make_stratifier
from learner.ranks import RayPlacement, ranked_learner
from learner.trainer import Learner
from learner.weight_sync import CheckpointSync, InProcessSync, NcclSync, Publisher, RaySync
from pipeline.config.schema import (
    ActorsConfig,
    BufferConfig,
    PretrainedModel,
    RayRuntime,
    RetrievalConfig,
    StrataConfig,
    StratifierConfig,
)
from pipeline.config.schema import EmbeddedEngine as EmbeddedEngineConfig
from pipeline.config.schema import SGLangEngine as SGLangEngineConfig
from pipeline.config.schema import VLLMEngine as VLLMEngineConfig
from pipeline.runtime.stream import RuntimeUnavailable
from retrieval.client import RetrievalClient


def make_buffer(
    config: BufferConfig, run_dir: str | os.PathLike[str], groups_per_step: int = 1
) -> GroupBuffer:
    """The group buffer of a run, spilling to `run_dir/trajectories/` when `config.spill` is set.
    It is the run's one admission controller: (η + 1) * `groups_per_step` groups in flight."""
    spill = None
    if config.spill:
        spill = ParquetSpill(
            Path(run_dir) / "trajectories",
            rows_per_file=config.spill_rows_per_file,
            flush_s=config.spill_flush_s,
        )
    return GroupBuffer(
        group_size=config.group_size,
        max_staleness=config.max_staleness,
        max_groups_in_flight=config.max_groups_in_flight,
        max_resident_bytes=config.max_resident_mb * 1024 * 1024,
        group_timeout_s=config.group_timeout_s,
        spill=spill,
        groups_per_step=groups_per_step,
    )


def make_publisher(
    config: StrataConfig, targets: list, run_dir: str | os.PathLike[str], model=None, tokenizer=None
) -> Publisher:
    """The weight publisher of the run's transport: in-process engines get a snapshot (under Ray,
    through the object store); servers an HF checkpoint under run_dir/weights/ (or, with
    `weight_sync: nccl` on GPUs, a broadcast)."""
    engine = config.actors.engine
    if isinstance(engine, EmbeddedEngineConfig):
        return RaySync(targets) if config.runtime.type == "ray" else InProcessSync(targets)
    if isinstance(engine, SGLangEngineConfig) and engine.weight_sync == "nccl":
        return NcclSync(targets)
    return CheckpointSync(targets, Path(run_dir) / "weights", model, tokenizer, keep=2)


def make_learner(config: StrataConfig, policy_dir: str | os.PathLike[str]):
    """The DeepSpeed learner of `config`, starting from the HF model at `policy_dir`: rank 0 in
    this process and, with learner.num_ranks N > 1, ranks 1..N-1 as processes it starts, or
    under Ray as actors on bundles 1..N-1 of this actor's placement group (learner/ray_ranks.py;
    `close_learner` stops them)."""
    pretrained = isinstance(config.model, PretrainedModel)
    kwargs = dict(
        group_size=config.buffer.group_size,
        temperature=config.actors.temperature,
        dtype=model_dtype(config) if pretrained else None,
        gradient_checkpointing=pretrained and config.model.gradient_checkpointing,
    )
    if config.learner.num_ranks == 1:
        return Learner(policy_dir, config.learner, **kwargs)
    placement = None
    runtime = config.runtime
    if isinstance(runtime, RayRuntime):  # in the learner's actor, on bundle 0 of its group
        import ray

        placement = RayPlacement(
            ray.util.get_current_placement_group(),
            runtime.learner_num_cpus,
            runtime.learner_num_gpus,
            runtime.learner_rendezvous_host,
            runtime.learner_rendezvous_port,
        )
    return ranked_learner(
        policy_dir,
        config.learner,
        config.learner.num_ranks,
        torch.get_num_threads(),
        placement,
        **kwargs,
    )


def close_learner(learner) -> None:
    """Stop the learner's other ranks, if it has any."""
    if getattr(learner, "peers", None) is not None:
        learner.peers.close()
        learner.peers = None


def _embedded(
    config: StrataConfig, model_path: str | os.PathLike[str], urls: list[str] | None
) -> RolloutEngine:
    from actors.embedded import EmbeddedEngine

    engine = config.actors.engine
    return EmbeddedEngine.from_pretrained(
        model_path,
        device=engine.device,
        dtype=model_dtype(config),
        max_batch_size=engine.max_batch_size,
        seed=config.runtime.seed,
    )


def _sglang(
    config: StrataConfig, model_path: str | os.PathLike[str], urls: list[str] | None
) -> RolloutEngine:
    from actors.sglang import SGLangEngine

    engine = config.actors.engine
    return SGLangEngine(list(urls or engine.urls), timeout_s=engine.timeout_s)


def _vllm(
    config: StrataConfig, model_path: str | os.PathLike[str], urls: list[str] | None
) -> RolloutEngine:
    from actors.vllm import VLLMEngine

    engine = config.actors.engine
    return VLLMEngine(list(urls or engine.urls), timeout_s=engine.timeout_s)


ENGINES: dict[
    str, Callable[[StrataConfig, str | os.PathLike[str], list[str] | None], RolloutEngine]
] = {
    "embedded": _embedded,
    "sglang": _sglang,
    "vllm": _vllm,
}
"""`actors.engine.type` -> how the engine is built (each imports its backend only when chosen)."""


def make_engine(
    config: StrataConfig, model_path: str | os.PathLike[str], urls: list[str] | None = None
) -> RolloutEngine:
    """The generation backend `actors.engine` names, serving the policy at `model_path`.
    `urls`: the servers to use instead of `actors.engine.urls` (those the runtime started, or a
    pool's share of them)."""
    return ENGINES[config.actors.engine.type](config, model_path, urls)


def model_dtype(config: StrataConfig) -> str:
    """The policy's parameter dtype: `model.dtype` for a pretrained model; the tiny one is float32."""
    return config.model.dtype if isinstance(config.model, PretrainedModel) else "float32"


def _search_tool(config: ActorsConfig, retrieval: RetrievalConfig, search_url: str | None) -> Tool:
    if search_url is None:
        raise ValueError("the search tool is enabled but no retrieval server URL is known")
    client = RetrievalClient(search_url, topk=retrieval.topk, timeout_s=retrieval.timeout_s)
    return SearchTool(client, topk=retrieval.topk)


def _python_tool(config: ActorsConfig, retrieval: RetrievalConfig, search_url: str | None) -> Tool:
    return PythonTool(
        timeout_s=config.python_timeout_s,
        memory_mb=config.python_memory_mb,
        isolation=config.python_isolation,
    )


TOOLS: dict[str, Callable[[ActorsConfig, RetrievalConfig, str | None], Tool]] = {
    "search": _search_tool,
    "python": _python_tool,
}
"""Tool name (an `actors.tools` entry) -> how it is built from config."""


def make_tools(
    config: ActorsConfig, retrieval: RetrievalConfig, search_url: str | None
) -> dict[str, Tool]:
    """The agent's tools: search through the retrieval server at `search_url`, python in the sandbox."""
    return {name: TOOLS[name](config, retrieval, search_url) for name in config.tools}


def agent_settings(config: ActorsConfig, strata: StratifierConfig | None = None) -> AgentSettings:
    """The agent loop's settings; `strata` (learner.stratifier) picks the stratifier that
    assigns each trajectory's stratum at collection (default: the number of tool calls)."""
    strata = strata or StratifierConfig()
    stratifier = make_stratifier(
        strata.type, tools=config.tools, max_calls=config.max_turns, k=strata.k, seed=strata.seed
    )
    return AgentSettings(
        max_turns=config.max_turns,
        max_new_tokens_per_turn=config.max_new_tokens_per_turn,
        max_response_tokens=config.max_response_tokens,
        max_observation_tokens=config.max_observation_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        reward=config.reward,
        format_weight=config.format_weight,
        latent_reward=config.latent_reward,
        latent_match=config.latent_match,
        stratifier=stratifier,
    )


def pool_urls(config: StrataConfig) -> list[list[str] | None]:
    """The servers each pool owns: server j belongs to pool j % num_pools (a server shared by two
    pools would be paused and reloaded by both). None per pool for in-process engines; started
    servers are not known yet (empty lists until they are). RuntimeUnavailable with fewer servers
    than pools."""
    engine, pools = config.actors.engine, config.actors.num_pools
    if isinstance(engine, EmbeddedEngineConfig):
        return [None] * pools
    count = len(engine.urls) or (engine.num_servers if isinstance(engine, VLLMEngineConfig) else 0)
    if count < pools:
        where = "actors.engine.urls" if engine.urls else "actors.engine.num_servers"
        raise RuntimeUnavailable(
            f"actors.num_pools {pools} needs at least {pools} servers, one pool each, but {where} "
            f"gives {count}: add servers or lower actors.num_pools"
        )
    return [list(engine.urls[i::pools]) for i in range(pools)]
