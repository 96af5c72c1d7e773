"""The acting parts, built one way everywhere: retrieval server -> tools -> inference servers ->
engine -> tokenizer, then agent loops over them.

The local runtime, the Ray runtime's generation actors, `pipeline.evaluate` and the warm start's
format check all call `open_acting`; they differ only in what they hand it: a search URL of a
retrieval server that runs elsewhere (Ray), server URLs a runtime started and split between
pools, or nothing, in which case what is missing is started here, in this process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from actors.agent import AgentLoop, AgentSettings
from actors.engine import RolloutEngine
from actors.servers import ManagedServers
from actors.tools import Tool
from pipeline.config.schema import SGLangEngine, StrataConfig, VLLMEngine
from pipeline.runtime.parts import agent_settings, make_engine, make_tools, model_dtype
from retrieval.server import load_app, serve


@dataclass
class Acting:
    """What generates trajectories, and what `close` stops, users first."""

    config: StrataConfig
    engine: RolloutEngine
    tokenizer: Any
    tools: dict[str, Tool]
    servers: Any = None
    """The inference servers started here (actors.servers.ManagedServers), if any."""
    retrieval: Any = None
    """The retrieval server's aiohttp runner, when it was started here."""

    def agent(
        self, actor_id: str, settings: AgentSettings | None = None, tools: dict | None = None
    ) -> AgentLoop:
        """An agent loop on these parts: the config's settings and tools unless given."""
        settings = settings or agent_settings(self.config.actors, self.config.learner.stratifier)
        return AgentLoop(
            self.engine,
            self.tokenizer,
            self.tools if tools is None else tools,
            settings,
            actor_id=actor_id,
        )

    async def close(self) -> None:
        if "search" in self.tools:
            await self.tools["search"].client.close()
        await self.engine.close()
        if self.servers is not None:
            self.servers.stop()
        if self.retrieval is not None:
            await self.retrieval.cleanup()


async def open_acting(
    config: StrataConfig,
    policy_dir: str | os.PathLike[str],
    *,
    index_dir: str | os.PathLike[str] | None = None,
    search_url: str | None = None,
    urls: list[str] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
) -> Acting:
    """The acting parts of `config`, serving the policy at `policy_dir`.

    `search_url`: a retrieval server running elsewhere; else `retrieval.url`; else one is started
    here on `index_dir`. `urls`: the inference servers to use (a pool's share of those the
    runtime started); else `actors.engine.urls`; else, for vLLM and SGLang, servers are started
    here on `policy_dir` (logs in `log_dir`) and stopped by `close`."""
    retrieval = servers = None
    tools: dict[str, Tool] = {}
    try:
        search_url = search_url or config.retrieval.url
        if "search" in config.actors.tools and search_url is None:
            if index_dir is None:
                raise ValueError("the search tool is enabled but there is no index to serve")
            retrieval, port = await serve(
                load_app(str(index_dir)), config.retrieval.host, config.retrieval.port
            )
            search_url = f"http://{config.retrieval.host}:{port}"
        tools = make_tools(config.actors, config.retrieval, search_url)
        if urls is None:
            servers, urls = start_servers(config, policy_dir, log_dir)
        engine = make_engine(config, policy_dir, urls=urls)
    except BaseException:
        await Acting(config, _NoEngine(), None, tools, servers, retrieval).close()
        raise
    tokenizer = engine.tokenizer  # servers hold none: the policy directory's own
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(policy_dir), local_files_only=True)
    return Acting(config, engine, tokenizer, tools, servers, retrieval)


def start_servers(
    config: StrataConfig, policy_dir: str | os.PathLike[str], log_dir: str | os.PathLike[str] | None
):
    """(servers, their URLs) when `config` generates on vLLM or SGLang servers given by no URL:
    started here (call from the main thread: they die with it), else (None, None)."""
    servers = managed_servers(config, policy_dir, log_dir)
    if servers is None:
        return None, None
    print(
        f"strata: starting {servers.count} {servers.label} server(s) (logs in {servers.log_dir})",
        flush=True,
    )
    return servers, servers.start()


def managed_servers(
    config: StrataConfig, policy_dir: str | os.PathLike[str], log_dir: str | os.PathLike[str] | None
) -> ManagedServers | None:
    """The servers the launcher starts for `config` (not started yet), or None when it names
    running ones or generates in-process."""
    engine = config.actors.engine
    if not isinstance(engine, VLLMEngine | SGLangEngine) or engine.urls:
        return None
    logs = str(Path(log_dir) if log_dir is not None else Path(policy_dir) / "logs")
    if isinstance(engine, VLLMEngine):
        from actors.vllm_server import VLLMServers

        return VLLMServers(
            str(policy_dir),
            engine.num_servers,
            engine.startup_timeout_s,
            logs,
            python=engine.python,
            max_num_seqs=engine.max_batch_size,
            max_model_len=engine.max_model_len,
            kv_cache_gb=engine.kv_cache_gb,
            dtype=model_dtype(config),
        )
    import torch

    from actors.sglang_server import SGLangServers, gpu_sets

    sets = gpu_sets(engine.num_servers, engine.tp_size, engine.gpus, torch.cuda.device_count())
    return SGLangServers(
        str(policy_dir),
        engine.num_servers,
        engine.startup_timeout_s,
        logs,
        gpu_sets=sets,
        tp_size=engine.tp_size,
        mem_fraction_static=engine.mem_fraction_static,
        python=engine.python,
        dtype=model_dtype(config),
        seed=config.runtime.seed,
        extra_args=list(engine.extra_args),
    )


class _NoEngine:
    """Stands in for an engine that was never made, so a failed `open_acting` closes the rest."""

    async def close(self) -> None:
        return None
