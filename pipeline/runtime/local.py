"""The `local` runtime: every role in one process on one machine, streaming.

Actor pools generate continuously into the group buffer; the learner takes each complete group as
it comes, trains in a worker thread (so generation goes on meanwhile), publishes the new weights
to the engine in-process and lets the pools admit new groups under the staleness bound. The run
directory gets the Parquet spill, `metrics.jsonl` (one line per learner step), checkpoints and,
at the end, `report.md` with plots. The loop itself is `pipeline.runtime.stream.stream`, shared with
the Ray runtime; this module builds the in-process roles.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from pathlib import Path

import torch

from actors.pool import ActorPool
from actors.remote import RemoteEngine
from actors.tools import ToolStats
from learner.checkpoint import load_checkpoint, save_checkpoint
from pipeline.assets.cache import Assets
from pipeline.config.schema import StrataConfig
from pipeline.evaluation.heldout import eval_settings, with_and_without_tools
from pipeline.loggers import Loggers
from pipeline.runtime.allocator import trim
from pipeline.runtime.parts import (
    Acting,
    close_learner,
    make_buffer,
    make_engine,
    make_learner,
    make_publisher,
    open_acting,
)
from pipeline.runtime.recovery import resume_run_dir
from pipeline.runtime.roles import Roles
from pipeline.runtime.stream import (
    CURSOR_KEY,
    ActorStats,
    RunSummary,
    question_stream,
    stream,
)

__all__ = ["RunSummary", "run_local", "set_threads"]


def set_threads(config: StrataConfig) -> int:
    """Generation and training share the cores: half each by default, so neither oversubscribes
    (two 2-thread OpenMP pools on 2 cores made small tensor ops ~100x slower here)."""
    threads = config.runtime.threads or max(1, (os.cpu_count() or 2) // 2)
    torch.set_num_threads(threads)
    return threads


class LocalRoles(Roles):
    """The learner in a worker thread of this process, publishing to the engine: in-process
    (embedded) or as an HF checkpoint the servers reload (vLLM, SGLang). Periodic evaluation runs
    on the run's servers, or, with an in-process engine, on an engine of its own holding a copy
    of the evaluated version's weights (the version may move on during an evaluation on servers:
    each trajectory records the versions that sampled it)."""

    def __init__(
        self, config: StrataConfig, learner, acting: Acting, agents, publisher, policy_dir
    ) -> None:
        super().__init__(publisher)
        self.config, self.learner, self.acting, self.agents = config, learner, acting, agents
        self.engine, self.policy_dir = acting.engine, policy_dir

    @property
    def version(self) -> int:
        return self.learner.version

    def _step(self, groups):
        metrics = self.learner.step(groups)
        trim()  # the step's activations go back to the system (pipeline/runtime/allocator.py)
        return metrics

    async def step(self, groups):  # a stop lets it end: pipeline/runtime/stream.py's unstoppable
        return await asyncio.to_thread(self._step, groups)

    async def weights(self):
        return self.learner.state_dict()

    async def served_versions(self) -> dict[str, int]:
        return await self.engine.served_versions()

    async def checkpoint(self, directory: Path, extra: dict) -> Path:
        return await asyncio.to_thread(save_checkpoint, self.learner, directory, extra)

    async def actor_stats(self) -> dict[str, ActorStats]:
        tools = ToolStats()  # the pools share the one engine: their tool counts add up
        failures: Counter = Counter()
        for agent in self.agents:
            tools.add(agent.stats.tools)
            failures.update(agent.stats.failures)
        rejoins = self.engine.stats()["rejoins"] if isinstance(self.engine, RemoteEngine) else 0
        return {
            "embedded-0": ActorStats(
                self.engine.version,
                self.engine.generated_tokens,
                tools,
                int(rejoins),
                sum(agent.stats.reward_errors for agent in self.agents),
                {server.spec.name: server.restarts for server in self.acting.mcp_servers},
                dict(failures),
                sum(agent.stats.rewrites for agent in self.agents),
            )
        }

    async def hold(self, url: str) -> None:
        self.engine.hold(url)

    async def readmit(self, url: str) -> int:
        return await self.engine.readmit(url)

    def eval_weights(self):
        if not self.config.actors.engine.in_process:
            return None
        return {name: t.detach().clone() for name, t in self.learner.state_dict().items()}

    async def evaluate(self, items, version: int, weights):
        used, config = self.engine, self.config
        if config.actors.engine.in_process:
            engines = self.periodic.engines  # made for evaluation only: closed with it
            if not engines:
                engines.append(make_engine(config, self.policy_dir))
            used = engines[0]
            await used.update_weights(version, state_dict=weights)
        return await with_and_without_tools(
            config,
            used,
            self.acting.tokenizer,
            self.acting.tools,
            eval_settings(config, config.eval.samples),
            items,
            config.eval.samples,
            config.actors.concurrency,
            self.acting.search_url,
            self.acting.log_dir,
        )


async def run_local(
    config: StrataConfig,
    assets: Assets,
    run_dir: Path,
    progress=None,
    summary: RunSummary | None = None,
    resume: bool = False,
    loggers: Loggers | None = None,
) -> RunSummary:
    """Stream until learner.max_steps. `summary` (if given) is filled in place, so the caller
    still has it when the run is interrupted. `resume`: go on from run_dir's latest checkpoint.
    `loggers`: where the steps' and evaluations' figures go (the caller opens and closes them)."""
    set_threads(config)
    summary = summary if summary is not None else RunSummary()
    watching = learner = None
    acting = await open_acting(
        config,
        assets.policy_dir,
        index_dir=assets.index_dir,
        log_dir=run_dir / "logs",
        run_dir=run_dir,
    )
    try:
        learner = make_learner(config, assets.policy_dir)
        agents = [acting.agent(f"pool-{i}") for i in range(config.actors.num_pools)]
        publisher = make_publisher(
            config, [acting.engine], run_dir, learner.model, learner.tokenizer
        )
        roles = LocalRoles(config, learner, acting, agents, publisher, assets.policy_dir)
        if acting.servers is not None:
            watching = asyncio.create_task(roles.watch_servers(acting.servers).run())
        skip = 0
        if resume:
            extra = await asyncio.to_thread(load_checkpoint, learner, run_dir / "checkpoints")
            skip = int(extra.get(CURSOR_KEY, 0))
            summary.resumed_from = learner.version
            summary.books_before, summary.metrics = resume_run_dir(run_dir, extra, learner.version)
            await roles.publish()  # the engine serves the resumed weights from the first token
        buffer = make_buffer(
            config.buffer,
            run_dir,
            config.learner.groups_per_step,
            dynamic_sampling=config.learner.dynamic_sampling,
        )
        tasks, summary.skipped_prompts = question_stream(
            config, assets.world_dir, acting.tokenizer, skip
        )
        pools = [
            ActorPool(
                agent,
                buffer,
                tasks,
                group_size=config.buffer.group_size,
                concurrency=config.actors.concurrency,
                name=agent.actor_id,
                first_serial=skip,
            )
            for agent in agents
        ]
        started = lambda: skip + sum(p.stats.groups_started for p in pools)  # noqa: E731
        evaluator = roles.evaluator(config, run_dir, loggers)
        return await stream(
            config,
            roles,
            buffer,
            pools,
            run_dir,
            summary,
            progress,
            loggers,
            started,
            evaluator,
        )
    finally:
        if watching is not None:  # first: no restart while the servers are being stopped
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
        await acting.close()
        if learner is not None:
            close_learner(learner)
