"""The `local` runtime: every role in one process on one machine, streaming.

Actor pools generate continuously into the group buffer; the learner takes each complete group as
it comes, trains in a worker thread (so generation goes on meanwhile), publishes the new weights
to the engine in-process and lets the pools admit new groups under the staleness bound. The run
directory gets the Parquet spill, `metrics.jsonl` (one line per learner step), checkpoints and,
at the end, `report.md` with plots.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.assets import Assets
from pipeline.config import StrataConfig


@dataclass
class RunSummary:
    steps: int = 0
    trajectories: int = 0
    seconds: float = 0.0
    learner_busy_s: float = 0.0
    learner_idle_s: float = 0.0
    metrics: list[dict] = field(default_factory=list)
    checkpoint: Path | None = None

    @property
    def busy_fraction(self) -> float:
        return self.learner_busy_s / max(self.seconds, 1e-9)


def set_threads(config: StrataConfig) -> int:
    """Generation and training share the cores: half each by default, so neither oversubscribes
    (two 2-thread OpenMP pools on 2 cores made small tensor ops ~100x slower here)."""
    threads = config.runtime.threads or max(1, (os.cpu_count() or 2) // 2)
    torch.set_num_threads(threads)
    return threads


def task_stream(questions: list, seed: int, shuffle: bool):
    """Questions forever, reshuffled each epoch with a seeded generator."""
    rng = random.Random(seed)
    for _ in itertools.count():
        order = list(questions)
        if shuffle:
            rng.shuffle(order)
        yield from order


async def run_local(
    config: StrataConfig,
    assets: Assets,
    run_dir: Path,
    progress=None,
    summary: RunSummary | None = None,
) -> RunSummary:
    """Stream until learner.max_steps. `summary` (if given) is filled in place, so the caller
    still has it when the run is interrupted."""
    from actors.agent import AgentLoop
    from actors.pool import ActorPool
    from learner.checkpoint import save_checkpoint
    from learner.trainer import Learner
    from learner.weight_sync import InProcessSync
    from pipeline.components import agent_settings, make_buffer, make_engine, make_tools
    from pipeline.datasets import load_world
    from retrieval.server import load_app, serve

    set_threads(config)
    summary = summary if summary is not None else RunSummary()
    runner = None
    search_url = config.retrieval.url
    if "search" in config.actors.tools and search_url is None:
        app = load_app(str(assets.index_dir))
        runner, port = await serve(app, config.retrieval.host, config.retrieval.port)
        search_url = f"http://{config.retrieval.host}:{port}"
    engine = make_engine(config.actors, assets.policy_dir, seed=config.runtime.seed)
    tools = make_tools(config.actors, config.retrieval, search_url)
    learner = Learner(assets.policy_dir, config.learner, group_size=config.buffer.group_size,
                      temperature=config.actors.temperature, tools=tuple(config.actors.tools),
                      max_turns=config.actors.max_turns)  # fmt: skip
    sync = InProcessSync([engine])
    buffer = make_buffer(config.buffer, run_dir)
    train, _ = load_world(assets.world_dir)
    tasks = task_stream(train[: config.data.num_questions], config.data.seed, config.data.shuffle)
    pools = []
    for index in range(config.actors.num_pools):
        agent = AgentLoop(
            engine, engine.tokenizer, tools, agent_settings(config.actors), actor_id=f"pool-{index}"
        )
        pools.append(ActorPool(agent, buffer, tasks, group_size=config.buffer.group_size,
                               concurrency=config.actors.concurrency, max_staleness=config.buffer.max_staleness,
                               groups_per_step=config.learner.groups_per_step,
                               learner_version=lambda: learner.version, name=f"pool-{index}"))  # fmt: skip
    run_metrics = None
    if config.metrics.enabled:
        from pipeline.metrics import RunMetrics

        run_metrics = RunMetrics()
        run_metrics.declare_tools(list(tools))
        port = run_metrics.serve(config.metrics.host, config.metrics.port)
        (run_dir / "metrics_url").write_text(f"http://{config.metrics.host}:{port}/metrics\n")
        print(f"strata: metrics on http://{config.metrics.host}:{port}/metrics", flush=True)
    pool_tasks = [asyncio.create_task(pool.run()) for pool in pools]
    metrics_file = (run_dir / "metrics.jsonl").open("a")
    start = time.perf_counter()
    try:
        for _ in range(config.learner.max_steps):
            waited = time.perf_counter()
            groups = [
                await buffer.next_group(learner.version)
                for _ in range(config.learner.groups_per_step)
            ]
            busy = time.perf_counter()
            summary.learner_idle_s += busy - waited
            metrics = await asyncio.to_thread(
                learner.step, groups
            )  # actors keep generating meanwhile
            summary.learner_busy_s += time.perf_counter() - busy
            metrics["weight_sync_seconds"] = await sync.publish(
                learner.state_dict(), learner.version
            )
            for pool in pools:
                pool.notify_version()
            summary.steps += 1
            summary.trajectories += sum(g.size for g in groups)
            elapsed = time.perf_counter() - start
            stats = buffer.stats()
            metrics.update(step=summary.steps, elapsed_s=elapsed, trajectories_per_s=summary.trajectories / elapsed,
                           generated_tokens_per_s=engine.generated_tokens / elapsed,
                           buffer_ready=stats.ready_groups, buffer_open=stats.open_groups,
                           dropped_stale=stats.dropped_stale, abandoned=stats.abandoned)  # fmt: skip
            if run_metrics is not None:
                members = [t for g in groups for t in g.members]
                run_metrics.observe_step(metrics, members, busy - waited)
                run_metrics.sample(
                    stats, {"embedded-0": engine}, [p.agent.stats.tools for p in pools]
                )
            metrics_file.write(json.dumps(metrics) + "\n")
            metrics_file.flush()
            summary.metrics.append(metrics)
            if progress is not None:
                progress(metrics)
            every = config.learner.checkpoint_every
            if every and summary.steps % every == 0:
                await asyncio.to_thread(
                    save_checkpoint, learner, run_dir / "checkpoints", {"step": summary.steps}
                )
    finally:
        summary.seconds = time.perf_counter() - start
        metrics_file.close()
        for task in pool_tasks:
            task.cancel()
        await asyncio.gather(*pool_tasks, return_exceptions=True)
        await buffer.close()
        if summary.steps:
            summary.checkpoint = await asyncio.to_thread(
                save_checkpoint, learner, run_dir / "checkpoints", {"step": summary.steps}
            )
        if "search" in tools:
            await tools["search"].client.close()
        await engine.close()
        if runner is not None:
            await runner.cleanup()
        if run_metrics is not None:
            run_metrics.close()
    return summary
