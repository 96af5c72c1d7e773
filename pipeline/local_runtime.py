"""The `local` runtime: every role in one process on one machine, streaming.

Actor pools generate continuously into the group buffer; the learner takes each complete group as
it comes, trains in a worker thread (so generation goes on meanwhile), publishes the new weights
to the engine in-process and lets the pools admit new groups under the staleness bound. The run
directory gets the Parquet spill, `metrics.jsonl` (one line per learner step), checkpoints and,
at the end, `report.md` with plots. The loop itself is `pipeline.streaming.stream`, shared with
the Ray runtime; this module builds the in-process roles.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import torch

from actors.engine import EngineError
from actors.vllm import VLLMEngine
from pipeline.assets import Assets
from pipeline.config import StrataConfig
from pipeline.streaming import (
    CURSOR_KEY,
    ActorStats,
    RunSummary,
    previous_metrics,
    stream,
    task_stream,
)

__all__ = ["RunSummary", "run_local", "set_threads"]


def set_threads(config: StrataConfig) -> int:
    """Generation and training share the cores: half each by default, so neither oversubscribes
    (two 2-thread OpenMP pools on 2 cores made small tensor ops ~100x slower here)."""
    threads = config.runtime.threads or max(1, (os.cpu_count() or 2) // 2)
    torch.set_num_threads(threads)
    return threads


class LocalRoles:
    """The learner in a worker thread of this process, publishing to the engine: in-process
    (embedded) or as an HF checkpoint the servers reload (vLLM)."""

    def __init__(self, learner, engine, agents, sync) -> None:
        self.learner, self.engine, self.agents, self.sync = learner, engine, agents, sync
        self.sync_failures = 0
        self.watch = None  # the ServerWatch of servers this run started, if any

    @property
    def version(self) -> int:
        return self.learner.version

    async def step(self, groups):
        return await asyncio.to_thread(self.learner.step, groups)

    async def publish(self) -> dict:
        start = time.perf_counter()
        version = self.learner.version
        published = True
        try:
            await self.sync.publish(self.learner.state_dict(), version)
        except EngineError as exc:  # a server keeps its weights; the next publish retries it
            published = False
            self.sync_failures += 1
            print(f"strata: weight sync to version {version} failed: {exc}", flush=True)
        report = {
            "published": published,
            "weight_sync_seconds": time.perf_counter() - start,
            "weight_sync_failures": self.sync_failures,
            "served_version": self.engine.version,  # servers: the oldest a live one serves
        }
        if self.watch is not None:
            report["server_restarts"] = self.watch.restarts
        if isinstance(self.engine, VLLMEngine):  # what the servers say, not what we believe
            try:
                served = await self.engine.served_versions()
                report["served_version_min"] = min(int(v) for v in served.values())
                report["served_version"] = min(
                    report["served_version"], report["served_version_min"]
                )
            except (EngineError, ValueError) as exc:
                print(f"strata: could not read the servers' weight versions: {exc}", flush=True)
        return report

    async def checkpoint(self, directory: Path, extra: dict) -> Path:
        from learner.checkpoint import save_checkpoint

        return await asyncio.to_thread(save_checkpoint, self.learner, directory, extra)

    async def actor_stats(self) -> dict[str, ActorStats]:
        from actors.tools import ToolStats

        tools = ToolStats()  # the pools share the one engine: their tool counts add up
        for agent in self.agents:
            for name in agent.stats.tools.calls:
                tools.calls[name] += agent.stats.tools.calls[name]
                tools.errors[name] += agent.stats.tools.errors[name]
                tools.seconds[name] += agent.stats.tools.seconds[name]
        generated = getattr(self.engine, "generated_tokens", 0)
        return {"embedded-0": ActorStats(self.engine.version, generated, tools)}


async def run_local(
    config: StrataConfig,
    assets: Assets,
    run_dir: Path,
    progress=None,
    summary: RunSummary | None = None,
    resume: bool = False,
) -> RunSummary:
    """Stream until learner.max_steps. `summary` (if given) is filled in place, so the caller
    still has it when the run is interrupted. `resume`: go on from run_dir's latest checkpoint."""
    from actors.agent import AgentLoop
    from actors.pool import ActorPool
    from learner.checkpoint import load_checkpoint
    from pipeline.components import (
        agent_settings,
        close_parts,
        make_buffer,
        make_engine,
        make_learner,
        make_tools,
    )
    from pipeline.datasets import load_world
    from retrieval.server import load_app, serve

    set_threads(config)
    summary = summary if summary is not None else RunSummary()
    runner = run_metrics = servers = watching = None
    search_url = config.retrieval.url
    if "search" in config.actors.tools and search_url is None:
        app = load_app(str(assets.index_dir))
        runner, port = await serve(app, config.retrieval.host, config.retrieval.port)
        search_url = f"http://{config.retrieval.host}:{port}"
    tools = make_tools(config.actors, config.retrieval, search_url)
    engine = None
    try:
        servers, urls = start_servers(config, assets, run_dir)
        engine = make_engine(config.actors, assets.policy_dir, seed=config.runtime.seed, urls=urls)
        learner = make_learner(config, assets.policy_dir)
        tokenizer = getattr(engine, "tokenizer", None) or learner.tokenizer
        agents = [
            AgentLoop(engine, tokenizer, tools, agent_settings(config.actors, config.learner.stratifier), actor_id=f"pool-{i}")
            for i in range(config.actors.num_pools)
        ]  # fmt: skip
        roles = LocalRoles(learner, engine, agents, make_sync(config, engine, learner, run_dir))
        if servers is not None:
            roles.watch = watch_servers(servers, engine)
            watching = asyncio.create_task(roles.watch.run())
        skip = 0
        if resume:
            extra = await asyncio.to_thread(load_checkpoint, learner, run_dir / "checkpoints")
            skip = int(extra.get(CURSOR_KEY, 0))
            summary.resumed_from = learner.version
            summary.metrics = previous_metrics(run_dir, learner.version)
            await roles.publish()  # the engine serves the resumed weights from the first token
        buffer = make_buffer(config.buffer, run_dir, config.learner.groups_per_step)
        train, _ = load_world(assets.world_dir)
        tasks = task_stream(train[: config.data.num_questions], config.data.seed, config.data.shuffle, skip)  # fmt: skip
        pools = [
            ActorPool(agent, buffer, tasks, group_size=config.buffer.group_size,
                      concurrency=config.actors.concurrency, name=agent.actor_id)
            for agent in agents
        ]  # fmt: skip
        if config.metrics.enabled:
            run_metrics = start_metrics(config, run_dir, list(tools))
        started = lambda: skip + sum(p.stats.groups_started for p in pools)  # noqa: E731
        evaluator = make_evaluator(config, assets, engine, learner, tokenizer, tools, run_dir, run_metrics)  # fmt: skip
        return await stream(config, roles, buffer, pools, run_dir, summary, progress, run_metrics,
                            started, evaluator)  # fmt: skip
    finally:
        if watching is not None:  # first: no restart while the servers are being stopped
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
        await close_parts(tools, engine, servers, runner)
        if run_metrics is not None:
            run_metrics.close()


def start_servers(config: StrataConfig, assets: Assets, run_dir: Path):
    """(servers, their URLs) when the run starts its own vLLM servers, else (None, None)."""
    from pipeline.config import VLLMEngine

    engine = config.actors.engine
    if not isinstance(engine, VLLMEngine) or engine.urls:
        return None, None
    from actors.vllm_server import VLLMServers

    servers = VLLMServers(str(assets.policy_dir), engine.num_servers, engine.python, engine.max_batch_size,
                          engine.max_model_len, engine.kv_cache_gb, engine.startup_timeout_s,
                          log_dir=str(run_dir / "logs"))  # fmt: skip
    print(
        f"strata: starting {engine.num_servers} vLLM server(s) (logs in {run_dir / 'logs'})",
        flush=True,
    )
    urls = servers.start()  # from the main thread: the servers die with it (see _die_with_parent)
    return servers, urls


def make_evaluator(config: StrataConfig, assets: Assets, engine, learner, tokenizer, tools, run_dir: Path, run_metrics):  # fmt: skip
    """The run's periodic evaluation (eval.every_steps), or None. With the embedded engine it
    runs on an engine of its own holding a copy of the evaluated version's weights; with servers,
    on the run's servers (the version may move on during an evaluation: each trajectory records
    the versions that sampled it)."""
    from pipeline.config import EmbeddedEngine
    from pipeline.evaluate import eval_settings, periodic_eval, with_and_without_tools

    embedded = isinstance(config.actors.engine, EmbeddedEngine)
    settings = eval_settings(config, config.eval.samples)

    def snapshot():
        if not embedded:
            return None
        return {name: t.detach().clone() for name, t in learner.state_dict().items()}

    async def run(items, version: int, weights):
        used = engine
        if embedded:
            if not evaluator.engines:
                from actors.embedded import EmbeddedEngine as Embedded

                evaluator.engines.append(Embedded.from_pretrained(
                    assets.policy_dir, max_batch_size=config.actors.engine.max_batch_size, seed=config.runtime.seed
                ))  # fmt: skip
            used = evaluator.engines[0]
            await used.update_weights(version, state_dict=weights)
        return await with_and_without_tools(config, used, tokenizer, tools, settings, items,
                                            config.eval.samples, config.actors.concurrency)  # fmt: skip

    evaluator = periodic_eval(config, snapshot, run, run_dir, run_metrics)
    return evaluator


def watch_servers(servers, engine):
    """A ServerWatch that restarts the run's dead servers and readmits them to `engine`."""
    from actors.vllm_server import ServerWatch

    async def hold(url: str) -> None:
        engine.hold(url)

    return ServerWatch(servers, hold, engine.readmit)


def make_sync(config: StrataConfig, engine, learner, run_dir: Path):
    """In-process weights for the embedded engine; an HF checkpoint per version for servers."""
    from learner.weight_sync import CheckpointSync, InProcessSync
    from pipeline.config import EmbeddedEngine

    if isinstance(config.actors.engine, EmbeddedEngine):
        return InProcessSync([engine])
    return CheckpointSync([engine], run_dir / "weights", learner.model, learner.tokenizer, keep=2)


def start_metrics(config: StrataConfig, run_dir: Path, tools: list[str]):
    """The run's Prometheus endpoint; its URL is written to run_dir/metrics_url."""
    from pipeline.metrics import RunMetrics

    run_metrics = RunMetrics()
    run_metrics.declare_tools(tools)
    port = run_metrics.serve(config.metrics.host, config.metrics.port)
    (run_dir / "metrics_url").write_text(f"http://{config.metrics.host}:{port}/metrics\n")
    print(f"strata: metrics on http://{config.metrics.host}:{port}/metrics", flush=True)
    return run_metrics
