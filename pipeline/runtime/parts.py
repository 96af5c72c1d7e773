"""The system's parts built from config: the one place config meets constructors.

The buffer, the learner and the weight publisher for the learner's side; for the acting side,
`open_acting` builds every part one way everywhere (retrieval server -> tools -> inference
servers -> engine -> tokenizer) for the local runtime, the Ray runtime's generation actors,
`pipeline.evaluate` and the warm start's format check. They differ only in what they hand it: a
search URL of a retrieval server that runs elsewhere (Ray), server URLs a runtime started and
split between pools, or nothing, in which case what is missing is started here, in this process.
What differs between engines and runtimes is asked of the chosen backend (`pipeline.backends`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from actors.agent import AgentLoop, AgentSettings
from actors.browse import BrowseTool
from actors.custom_agent import CustomAgent
from actors.engine import RolloutEngine
from actors.function_tools import ToolDefinitionError, function_tool
from actors.mcp_tools import McpError, McpServer, McpServerSpec, open_mcp_tools
from actors.openai_agent import CommandRunner, FunctionRunner, OpenAIAgent
from actors.openai_endpoint import AgentEndpoint
from actors.scoring import RemoteReward, Term
from actors.servers import ManagedServers
from actors.tools import PythonTool, SearchTool, Tool
from actors.web_search import PROVIDERS, DiskCache, WebSearchTool, WebStats
from buffers.group_buffer import GroupBuffer, rewards_differ
from buffers.spill import ParquetSpill
from buffers.strata import make_stratifier, section_params
from learner.ranked import ranked_learner
from learner.trainer import Learner
from learner.weight_sync import Publisher
from pipeline.backends.runtime import RuntimeUnavailable
from pipeline.config.algorithm import StratifierConfig, ToolCallsStrata
from pipeline.config.schema import (
    ActorsConfig,
    BufferConfig,
    PretrainedModel,
    RemoteRewardSpec,
    RetrievalConfig,
    RewardSpec,
    StrataConfig,
    ToolSpec,
    reward_term_name,
)
from pipeline.plugins import register_builtins, resolve
from pipeline.runtime.startup import uncollected
from retrieval.client import RetrievalClient
from retrieval.gpu import GpuOptions
from retrieval.kinds import IndexSpec
from retrieval.server import load_app, serve


def make_buffer(
    config: BufferConfig,
    run_dir: str | os.PathLike[str],
    groups_per_step: int = 1,
    dynamic_sampling: bool = False,
) -> GroupBuffer:
    """The group buffer of a run, spilling to `run_dir/trajectories/` when `config.spill` is set.
    It is the run's one admission controller: (η + 1) * `groups_per_step` groups in flight, more
    with `dynamic_sampling` (learner.dynamic_sampling: flat groups filtered, the step refilled)."""
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
        usable=rewards_differ if dynamic_sampling else None,
    )


def make_publisher(
    config: StrataConfig, targets: list, run_dir: str | os.PathLike[str], model=None, tokenizer=None
) -> Publisher:
    """The weight publisher of the run's transport, as the engine declares it: in-process engines
    get a snapshot (under Ray, through the object store); servers an HF checkpoint under
    run_dir/weights/ (or, with `weight_sync: nccl` on GPUs, a broadcast)."""
    return config.actors.engine.publisher(config, targets, run_dir, model, tokenizer)


def make_learner(config: StrataConfig, policy_dir: str | os.PathLike[str]):
    """The DeepSpeed learner of `config`, starting from the HF model at `policy_dir`: rank 0 in
    this process and, with learner.num_ranks N > 1, ranks 1..N-1 as processes it starts, or
    under Ray as actors on bundles 1..N-1 of this actor's placement group (learner/ray_ranks.py;
    `close_learner` stops them). DeepSpeed and the model's code import here, the collector
    paused (pipeline/runtime/startup.py)."""
    with uncollected():
        return _make_learner(config, policy_dir)


def _make_learner(config: StrataConfig, policy_dir: str | os.PathLike[str]):
    pretrained = isinstance(config.model, PretrainedModel)
    kwargs = dict(
        group_size=config.buffer.group_size,
        temperature=config.actors.temperature,
        dtype=config.model.param_dtype if pretrained else None,
        gradient_checkpointing=pretrained and config.model.gradient_checkpointing,
        lora=config.model.lora if config.model.lora.enabled else None,
    )
    if config.learner.num_ranks == 1:
        return Learner(policy_dir, config.learner, **kwargs)
    placement = config.runtime.rank_placement()  # None: processes started here
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


def make_engine(
    config: StrataConfig, model_path: str | os.PathLike[str], urls: list[str] | None = None
) -> RolloutEngine:
    """The generation backend `actors.engine` names, serving the policy at `model_path`.
    `urls`: the servers to use instead of `actors.engine.urls` (those the runtime started, or a
    pool's share of them). An in-process engine's model code imports here, the collector paused
    (pipeline/runtime/startup.py)."""
    with uncollected():
        return config.actors.engine.build(config, model_path, urls)


def _search_tool(
    config: ActorsConfig, retrieval: RetrievalConfig, search_url: str | None, run_dir: Path | None
) -> Tool:
    if search_url is None:
        raise ValueError("the search tool is enabled but no retrieval server URL is known")
    client = RetrievalClient(search_url, topk=retrieval.topk, timeout_s=retrieval.timeout_s)
    return SearchTool(client, topk=retrieval.topk)


def _python_tool(
    config: ActorsConfig, retrieval: RetrievalConfig, search_url: str | None, run_dir: Path | None
) -> Tool:
    return PythonTool(
        timeout_s=config.python_timeout_s,
        memory_mb=config.python_memory_mb,
        isolation=config.python_isolation,
    )


WEB_STATS = WebStats()
"""What this process's web tools did (both tools count here): printed when the acting parts close."""


def _web_search_tool(
    config: ActorsConfig, retrieval: RetrievalConfig, search_url: str | None, run_dir: Path | None
) -> Tool:
    web = config.web
    return WebSearchTool(
        PROVIDERS[web.provider](web.url, web.num_results),
        DiskCache(web.cache_dir),
        web.api_key_env,
        max_calls_per_run=web.max_calls_per_run,
        max_calls_per_trajectory=web.max_calls_per_trajectory,
        requests_per_second=web.requests_per_second,
        retries=web.retries,
        timeout_s=web.timeout_s,
        stats=WEB_STATS,
        run_dir=run_dir,  # the run's budget: one count for all its processes and resumes
    )


def _browse_tool(
    config: ActorsConfig, retrieval: RetrievalConfig, search_url: str | None, run_dir: Path | None
) -> Tool:
    web = config.web
    return BrowseTool(
        max_bytes=web.browse_max_bytes,
        max_chars=web.browse_max_chars,
        max_calls_per_trajectory=web.max_calls_per_trajectory,
        timeout_s=web.timeout_s,
        allow_hosts=tuple(web.allow_hosts),
        stats=WEB_STATS,
    )


TOOLS: dict[str, Callable[[ActorsConfig, RetrievalConfig, str | None, Path | None], Tool]] = {
    "search": _search_tool,
    "python": _python_tool,
    "web_search": _web_search_tool,
    "browse": _browse_tool,
}
"""Built-in tool name (an `actors.tools` entry) -> how it is built from config; every other entry
is a plug-in (`plugin_tool`)."""
register_builtins("tools", TOOLS)


def retrieval_load_options(retrieval: RetrievalConfig) -> dict:
    """How the server Strata starts loads its index: search-time settings and GPU placement."""
    return {
        "search": IndexSpec(nprobe=retrieval.nprobe, ef_search=retrieval.ef_search),
        "gpu": GpuOptions(mode=retrieval.gpu, fp16=retrieval.gpu_fp16),
    }


def make_tools(
    config: ActorsConfig,
    retrieval: RetrievalConfig,
    search_url: str | None,
    run_dir: Path | None = None,
) -> dict[str, Tool]:
    """The agent's tools of `actors.tools`, by name: the built-ins (search through the retrieval
    server at `search_url`, python in the sandbox, the web tools) and plug-ins. The MCP servers'
    tools join them in `open_acting`, where the servers start. `run_dir`: the run's directory,
    where web_search counts the run's budget (none: this process counts its own)."""
    tools: dict[str, Tool] = {}
    for i, entry in enumerate(config.tools):
        if isinstance(entry, str) and entry in TOOLS:
            tool = TOOLS[entry](config, retrieval, search_url, run_dir)
        else:
            tool = plugin_tool(entry, f"actors.tools[{i}]")
        tools[tool.name] = tool
    return tools


def plugin_tool(entry: str | ToolSpec, where: str) -> Tool:
    """The tool a plug-in entry names (pipeline.plugins finds the object, actors.function_tools
    makes it a tool, named as the config says); RuntimeUnavailable (one line) when it cannot be."""
    spec = entry if isinstance(entry, ToolSpec) else ToolSpec(fn=entry)
    try:
        return function_tool(resolve("tools", spec.fn, where), spec.tool_name, spec.args)
    except ToolDefinitionError as exc:
        raise RuntimeUnavailable(f"{where}: {spec.fn}: {exc}") from None


async def open_mcp_servers(
    config: ActorsConfig, tools: dict[str, Tool], log_dir: str | os.PathLike[str] | None
) -> list[McpServer]:
    """Start `actors.mcp_servers` (stdio ones as this process's children, their stderr in
    `log_dir/mcp-<name>.log`) and add their tools to `tools`; RuntimeUnavailable (one line) when
    one cannot start or its tools clash with others. The servers are returned to be stopped."""
    if not config.mcp_servers:
        return []
    specs = [
        McpServerSpec(s.name, s.command, s.url, s.tools, s.timeout_s, dict(s.env), s.allow_remote)
        for s in config.mcp_servers
    ]
    try:
        servers, found = await open_mcp_tools(specs, log_dir)
    except McpError as exc:
        raise RuntimeUnavailable(f"actors.mcp_servers: {exc}") from None
    clash = sorted(set(found) & set(tools))
    if clash:
        await asyncio.gather(*(server.close() for server in servers))
        raise RuntimeUnavailable(
            f"actors.mcp_servers: tool {clash[0]!r} of server "
            f"{found[clash[0]].server.spec.name} has the name of an actors.tools entry: rename "
            "the server or the tool"
        )
    tools.update(found)
    return servers


def reward_terms(config: ActorsConfig) -> tuple[Term, ...]:
    """`actors.reward` as the terms the agent loop sums (actors/scoring.py): each reward
    resolved (pipeline/plugins.py), a class made with its args, a function given its args;
    RuntimeUnavailable (one line) when a class cannot be made."""
    many = isinstance(config.reward, list)
    terms = []
    for i, entry in enumerate(config.reward if many else [config.reward]):
        where = f"actors.reward[{i}]" if many else "actors.reward"
        name = reward_term_name(entry)
        if isinstance(entry, RemoteRewardSpec):
            remote = RemoteReward(entry.url, entry.timeout_s, entry.retries)
            terms.append(Term(name, remote, entry.weight, timeout_s=None))  # timed per request
            continue
        spec = RewardSpec(fn=entry) if isinstance(entry, str) else entry
        found = resolve("rewards", spec.fn, where)
        if inspect.isclass(found):
            try:
                found = found(**spec.args)
            except Exception as exc:  # the plug-in's own constructor
                raise RuntimeUnavailable(
                    f"{where}: {spec.fn}(**{spec.args}) failed: {exc}"
                ) from None
        elif spec.args:
            found = functools.partial(found, **spec.args)
        terms.append(Term(name, found, spec.weight, spec.timeout_s))
    return tuple(terms)


def agent_settings(config: ActorsConfig, strata: StratifierConfig | None = None) -> AgentSettings:
    """The agent loop's settings; `strata` (learner.stratifier) picks the stratifier that
    assigns each trajectory's stratum at collection (default: the number of tool calls)."""
    strata = strata or ToolCallsStrata()
    stratifier = make_stratifier(
        strata.type, tools=config.tool_names, max_calls=config.max_turns, **section_params(strata)
    )
    return AgentSettings(
        max_turns=config.max_turns,
        max_new_tokens_per_turn=config.max_new_tokens_per_turn,
        max_response_tokens=config.max_response_tokens,
        max_observation_tokens=config.max_observation_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        reward=reward_terms(config),
        format_weight=config.format_weight,
        latent_reward=config.latent_reward,
        overlong_buffer=config.overlong_buffer,
        latent_match=config.latent_match,
        stratifier=stratifier,
        format=config.format,
    )


def pool_urls(config: StrataConfig) -> list[list[str] | None]:
    """The servers each pool owns: server j belongs to pool j % num_pools (a server shared by two
    pools would be paused and reloaded by both). None per pool for in-process engines; started
    servers are not known yet (empty lists until they are). RuntimeUnavailable with fewer servers
    than pools."""
    return config.actors.engine.pool_urls(config.actors.num_pools)


# ------------------------------------------------------------------------------------ the agent


ENDPOINT_MODEL = "strata-policy"
"""The model name the OpenAI-compatible endpoint answers with (it takes any: one policy)."""


@dataclass(frozen=True)
class AgentParts:
    """What an agent is built on: one actor process's acting parts, or an evaluation's."""

    config: StrataConfig
    engine: RolloutEngine
    tokenizer: Any
    tools: dict[str, Tool]
    settings: AgentSettings
    actor_id: str
    endpoint: Any = None
    """The OpenAI-compatible endpoint on `engine` (actors/openai_endpoint.py), when the agent
    type needs one."""
    search_url: str | None = None
    """The retrieval server's URL, when one serves this process."""
    log_dir: Path | None = None


def _builtin_agent(parts: AgentParts) -> AgentLoop:
    return AgentLoop(
        parts.engine, parts.tokenizer, parts.tools, parts.settings, actor_id=parts.actor_id
    )


def _custom_agent(parts: AgentParts) -> CustomAgent:
    spec = parts.config.actors.agent
    found = resolve("agents", spec.path, "actors.agent.path")
    try:
        made = found()
    except Exception as exc:  # the plug-in's own constructor
        raise RuntimeUnavailable(f"actors.agent.path: {spec.path}() failed: {exc}") from None
    return CustomAgent(
        made,
        parts.engine,
        parts.tokenizer,
        parts.tools,
        parts.settings,
        deadline_s=spec.deadline_s,
        on_rewrite=spec.on_rewrite,
        actor_id=parts.actor_id,
    )


def _openai_agent(parts: AgentParts) -> OpenAIAgent:
    spec = parts.config.actors.agent
    if spec.command is not None:
        log = None if parts.log_dir is None else Path(parts.log_dir) / f"agent-{parts.actor_id}.log"
        runner: FunctionRunner | CommandRunner = CommandRunner(spec.command, log)
    else:
        runner = FunctionRunner(resolve("agents", spec.path, "actors.agent.path"))
    served = "search" in parts.config.actors.tool_names
    return OpenAIAgent(
        runner,
        parts.endpoint,
        parts.engine,
        parts.tokenizer,
        parts.tools,
        parts.settings,
        deadline_s=spec.deadline_s,
        on_rewrite=spec.on_rewrite,
        actor_id=parts.actor_id,
        search_url=parts.search_url if served else None,
    )


@dataclass(frozen=True)
class AgentType:
    """How an `actors.agent.type` is built (its config section: pipeline/config/schema.py)."""

    build: Callable[[AgentParts], Any]
    """The agent on these parts: what the pool runs (`run(task, prompt_id, sample_index)`,
    `stats`, `engine`, `tokenizer`, `tools`)."""
    endpoint: bool = False
    """It needs the OpenAI-compatible endpoint: each actor process serves one, on its engine."""
    no_tools_baseline: bool = True
    """Its held-out evaluation can run again with every tool disabled (an openai agent runs
    tools of its own: it cannot)."""


AGENT_TYPES: dict[str, AgentType] = {
    "builtin": AgentType(_builtin_agent),
    "custom": AgentType(_custom_agent),
    "openai": AgentType(_openai_agent, endpoint=True, no_tools_baseline=False),
}
"""`actors.agent.type` -> how it is built."""


def make_agent(parts: AgentParts) -> Any:
    """The agent `parts.config` names, on `parts`; RuntimeUnavailable (one line) when its
    plug-in cannot be had or the policy cannot speak chat."""
    try:
        return AGENT_TYPES[parts.config.actors.agent.type].build(parts)
    except ValueError as exc:  # a PluginError (an entry point uninstalled since the config was
        raise RuntimeUnavailable(str(exc)) from None  # read), a policy without a chat template


async def start_endpoint(config: StrataConfig, engine: RolloutEngine, tokenizer: Any):
    """The OpenAI-compatible endpoint on `engine` (127.0.0.1, a free port), started, when the
    configured agent type needs one; else None. The caller closes it."""
    if not AGENT_TYPES[config.actors.agent.type].endpoint:
        return None
    endpoint = AgentEndpoint(engine, tokenizer, model_name=ENDPOINT_MODEL)
    await endpoint.start()
    return endpoint


@contextlib.asynccontextmanager
async def agent_endpoint(
    config: StrataConfig, engine: RolloutEngine, tokenizer: Any
) -> AsyncIterator[Any]:
    """`start_endpoint` for the length of a `with` (an evaluation on an engine of its own)."""
    endpoint = await start_endpoint(config, engine, tokenizer)
    try:
        yield endpoint
    finally:
        if endpoint is not None:
            await endpoint.close()


# ------------------------------------------------------------------------------ the acting parts


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
    mcp_servers: list = field(default_factory=list)
    """The MCP servers started (or reached) here (actors.mcp_tools.McpServer)."""
    endpoint: Any = None
    """The OpenAI-compatible endpoint served here on `engine`, when the agent type needs one."""
    search_url: str | None = None
    """The retrieval server's URL (started here or elsewhere), if any."""
    log_dir: Path | None = None

    def agent(
        self, actor_id: str, settings: AgentSettings | None = None, tools: dict | None = None
    ) -> Any:
        """The configured agent (`actors.agent`) on these parts: the config's settings and
        tools unless given."""
        settings = settings or agent_settings(self.config.actors, self.config.learner.stratifier)
        return make_agent(
            AgentParts(
                self.config,
                self.engine,
                self.tokenizer,
                self.tools if tools is None else tools,
                settings,
                actor_id,
                self.endpoint,
                self.search_url,
                self.log_dir,
            )
        )

    async def close(self) -> None:
        if self.endpoint is not None:  # the agents' sessions end before their engine does
            await self.endpoint.close()
        for name, tool in self.tools.items():  # connections, clients, a plug-in's own close
            close = getattr(tool, "close", None)
            if close is None:
                continue
            try:
                await close()
            except Exception as exc:  # one tool's failure must not keep the others open
                print(f"strata: closing tool {name}: {type(exc).__name__}: {exc}", flush=True)
        if {"web_search", "browse"} & set(self.tools):
            print(f"strata: web tools: {WEB_STATS.summary()}", flush=True)
        for server in self.mcp_servers:
            await server.close()
            if server.restarts:
                print(f"strata: mcp server {server.spec.name}: {server.restarts} restart(s)")
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
    run_dir: str | os.PathLike[str] | None = None,
) -> Acting:
    """The acting parts of `config`, serving the policy at `policy_dir`.

    `search_url`: a retrieval server running elsewhere; else `retrieval.url`; else one is started
    here on `index_dir`. `urls`: the inference servers to use (a pool's share of those the
    runtime started); else `actors.engine.urls`; else, for vLLM and SGLang, servers are started
    here on `policy_dir` (logs in `log_dir`) and stopped by `close`. `run_dir`: the training
    run's directory (web_search's run budget); none for an evaluation."""
    retrieval = servers = None
    tools: dict[str, Tool] = {}
    mcp: list[McpServer] = []
    try:
        search_url = search_url or config.retrieval.url
        if "search" in config.actors.tools and search_url is None:
            if index_dir is None:
                raise ValueError("the search tool is enabled but there is no index to serve")
            retrieval, port = await serve(
                load_app(str(index_dir), **retrieval_load_options(config.retrieval)),
                config.retrieval.host,
                config.retrieval.port,
            )
            search_url = f"http://{config.retrieval.host}:{port}"
        tools = make_tools(
            config.actors, config.retrieval, search_url, None if run_dir is None else Path(run_dir)
        )
        mcp = await open_mcp_servers(config.actors, tools, log_dir)
        if urls is None:
            servers, urls = start_servers(config, policy_dir, log_dir)
        engine = make_engine(config, policy_dir, urls=urls)
    except BaseException:
        await Acting(config, _NoEngine(), None, tools, servers, retrieval, mcp).close()
        raise
    tokenizer = engine.tokenizer  # servers hold none: the policy directory's own
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(policy_dir), local_files_only=True)
    acting = Acting(config, engine, tokenizer, tools, servers, retrieval, mcp)
    acting.search_url = search_url
    acting.log_dir = None if log_dir is None else Path(log_dir)
    try:
        acting.endpoint = await start_endpoint(config, engine, tokenizer)
    except BaseException:
        await acting.close()
        raise
    return acting


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
    return config.actors.engine.servers(config, policy_dir, log_dir)


class _NoEngine:
    """Stands in for an engine that was never made, so a failed `open_acting` closes the rest."""

    async def close(self) -> None:
        return None
