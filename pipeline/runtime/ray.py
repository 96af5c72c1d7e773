"""The `ray` runtime: generation, the learner and the retrieval server as Ray actors.

    runtime: {type: ray, address: null}     # null: a private cluster on 127.0.0.1

Each actor pool's generation side (an engine, its tools and the agent loop) is one Ray actor
(`GenerationWorker`, `runtime.actor_num_cpus/gpus` each, `actors.num_pools` of them, each running
up to `actors.concurrency` agent loops); the learner is another (`LearnerWorker`, ray_learner.py,
`runtime.learner_num_cpus/gpus`; with `learner.num_ranks` N it is rank 0, on bundle 0 of a
placement group of N such bundles, and ranks 1..N-1 are actors on the others, on whichever nodes
`runtime.learner_placement` puts them: learner/ray_ranks.py), and so is the retrieval server.
Pools and learner scale independently: more pools add generation, the learner is untouched.

The driver (this process) keeps what is cheap and central: the group buffer with its spill, the
pools' admission control (`ActorPool`, whose agent here is a `RemoteAgent`), the streaming loop
(`pipeline.runtime.stream.stream`, the same as the local runtime's) and the Prometheus endpoint, which
the driver fills with every role's figures. Weights travel through the object store: the
learner's snapshot is stored once and every generation actor loads it from there.

With inference servers (`actors.engine.type` vllm or sglang) each pool owns its own servers
(server j belongs to pool j mod num_pools, `pool_urls`) and the learner publishes an HF checkpoint
under run_dir/weights/ (storage every server must read) that each pool has its servers reload.
vLLM servers the launcher starts (no `actors.engine.urls`) run on the driver's machine; one that
dies is restarted and readmitted by its pool on the latest checkpoint (`ServerWatch`).

A generation actor that dies is restarted by Ray (`max_restarts=-1`); its in-flight trajectories
fail, are counted as aborted and their groups abandoned; the restarted actor catches up to the
latest published weights before it generates again.

Ray binds to 127.0.0.1 here: `_node_ip_address` plus RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 set
before ray is imported (`pipeline.runtime.ray_cluster.import_ray`; the end-to-end test reads the socket
table). Joining a multi-node cluster (`runtime.address`) needs the retrieval server
reachable from every node: set `retrieval.host` to an address the nodes can reach.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from actors.engine import EngineError
from actors.pool import ActorPool
from actors.remote import RemoteEngine
from actors.tools import ToolStats
from buffers.records import InvalidTrajectory, Trajectory
from pipeline.assets.cache import Assets
from pipeline.backends.ray import RayRuntime
from pipeline.config.schema import StrataConfig
from pipeline.evaluation.heldout import eval_settings, with_and_without_tools
from pipeline.loggers import Loggers
from pipeline.runtime.parts import (
    make_buffer,
    make_engine,
    make_publisher,
    open_acting,
    pool_urls,
    retrieval_load_options,
    start_servers,
)
from pipeline.runtime.ray_cluster import actor_gone_errors, import_ray, start_ray
from pipeline.runtime.ray_learner import LearnerWorker, learner_placement
from pipeline.runtime.ray_retrieval import RetrievalWorker, watch_retrieval
from pipeline.runtime.recovery import resume_run_dir
from pipeline.runtime.roles import Roles
from pipeline.runtime.startup import resumed
from pipeline.runtime.stream import (
    CURSOR_KEY,
    ActorStats,
    RunSummary,
    question_stream,
    stream,
)


def _threads(num_cpus: float, configured: int) -> int:
    return configured or max(1, int(num_cpus))


class GenerationWorker:
    """One actor pool's generation side: engine, tools and agent loop, built on first use inside
    the actor's event loop (so a restarted actor rebuilds itself the same way)."""

    def __init__(
        self,
        config: dict,
        policy_dir: str,
        search_url: str | None,
        name: str,
        threads: int,
        urls: list[str] | None = None,
        run_dir: str | None = None,
    ) -> None:
        """`urls`: the inference servers this pool owns (remote engines); no two pools share one,
        so each server is updated by exactly one client. `run_dir`: the run's directory (its
        logs; web_search's budget, counted there once for every pool)."""
        resumed()  # the worker imported this module with the collector paused
        self.config = StrataConfig.model_validate(config)
        self.policy_dir, self.search_url, self.name, self.urls = policy_dir, search_url, name, urls
        self.run_dir = run_dir
        torch.set_num_threads(threads)
        self.acting = self.agent = None  # built on first use (`_ready`)
        self.synced = -1  # the newest version this actor was asked to load (-1: none yet)
        self.eval_engine = None  # an embedded engine of its own for periodic evaluation
        self._building: asyncio.Lock | None = None
        self._loading: asyncio.Lock | None = None  # one weight load at a time

    async def _ready(self):
        if self.agent is None:
            self._building = self._building or asyncio.Lock()
            async with self._building:
                if self.agent is None:
                    run_dir = None if self.run_dir is None else Path(self.run_dir)
                    self.acting = await open_acting(
                        self.config,
                        self.policy_dir,
                        search_url=self.search_url,
                        urls=self.urls,
                        log_dir=None if run_dir is None else run_dir / "logs",
                        run_dir=run_dir,
                    )
                    self.agent = self.acting.agent(self.name)
        return self.agent

    async def run(self, task: Any, prompt_id: str, index: int, latest: list) -> Trajectory:
        """One trajectory. `latest` is the last publish, [version, weights] (or []): an actor
        that missed it (it was just restarted) loads it first."""
        agent = await self._ready()
        if latest and self.synced < latest[0]:
            problem = await self._load(*latest)
            if problem is not None:
                print(f"strata: {self.name} could not catch up: {problem}", flush=True)
        return await agent.run(task, prompt_id, index)

    async def update_weights(self, version: int, weights: Any) -> tuple[str | None, int]:
        """Load `weights` as `version`: a state dict (in-process engines), the path of an HF
        checkpoint (servers), or an ObjectRef of a state dict. Returns why it failed (or None)
        and the version the engine serves now; either way this version counts as tried (the
        next publish retries a failed server)."""
        problem = await self._load(version, weights)
        return problem, (await self._ready()).engine.version

    async def _load(self, version: int, weights: Any) -> str | None:
        """One load at a time; `synced` moves only once a load has been tried to its end, so a
        load cut short (a cancelled call) is tried again by the next trajectory's catch-up."""
        agent = await self._ready()
        self._loading = self._loading or asyncio.Lock()
        async with self._loading:
            if version <= self.synced:
                return None
            if not isinstance(weights, (str, dict)):
                weights = await weights  # an ObjectRef inside `latest` is not resolved by Ray
            try:
                if isinstance(weights, str):
                    await agent.engine.update_weights(version, path=weights)
                else:
                    await agent.engine.update_weights(version, state_dict=weights)
            except EngineError as exc:
                self.synced = version  # tried: the next publish retries a failed server
                return str(exc)
            self.synced = version
        return None

    async def evaluate(self, items: list, version: int, weights: Any) -> tuple[list, list]:
        """Periodic evaluation (pipeline.evaluation.heldout.PeriodicEval) of `version`: in-process engines
        get an engine of their own loaded with `weights`; servers are evaluated as they serve."""
        agent = await self._ready()
        engine = agent.engine
        if self.config.actors.engine.in_process:
            if self.eval_engine is None:
                self.eval_engine = make_engine(self.config, self.policy_dir)
            await self.eval_engine.update_weights(version, state_dict=weights)
            engine = self.eval_engine
        c = self.config
        return await with_and_without_tools(
            c,
            engine,
            agent.tokenizer,
            agent.tools,
            eval_settings(c, c.eval.samples),
            items,
            c.eval.samples,
            c.actors.concurrency,
            self.acting.search_url,
            self.acting.log_dir,
        )

    async def hold(self, url: str) -> None:
        """The server at `url` (this pool's) died and is being restarted: stop using it."""
        (await self._ready()).engine.hold(url)

    async def readmit(self, url: str) -> int:
        """The restarted server at `url` loads the last checkpoint and serves again."""
        return await (await self._ready()).engine.readmit(url)

    async def stats(self) -> tuple[int, ActorStats]:
        """(process id, figures): a new process id means Ray restarted this actor."""
        if self.agent is None:
            return os.getpid(), ActorStats(0, 0, ToolStats())
        engine = self.agent.engine
        rejoins = engine.stats()["rejoins"] if isinstance(engine, RemoteEngine) else 0
        return os.getpid(), ActorStats(
            engine.version,
            engine.generated_tokens,
            self.agent.stats.tools,
            int(rejoins),
            self.agent.stats.reward_errors,
            {server.spec.name: server.restarts for server in self.acting.mcp_servers},
            dict(self.agent.stats.failures),
            self.agent.stats.rewrites,
        )

    async def close(self) -> None:
        if self.eval_engine is not None:
            await self.eval_engine.close()
        if self.agent is not None:
            await self.acting.close()


class RemoteAgent:
    """What an `ActorPool` needs of an agent loop, running in a `GenerationWorker`. Failures come
    back as the pool expects them: a dead or failing actor is an `EngineError` (the member is
    aborted and its group abandoned), a bad record an `InvalidTrajectory`."""

    def __init__(self, handle: Any, name: str, latest: list) -> None:
        self.handle, self.actor_id, self.latest = handle, name, latest

    async def run(self, task: Any, prompt_id: str, sample_index: int) -> Trajectory:
        call = self.handle.run.remote(task, prompt_id, sample_index, list(self.latest))
        return await unwrap(call, self.actor_id)


async def unwrap(call: Any, who: str) -> Any:
    """The result of a Ray actor call, with failures as the caller's own: EngineError and
    InvalidTrajectory raised in the actor come back as themselves; anything else raised there,
    or a dead actor, as an EngineError."""
    from ray.exceptions import RayTaskError

    try:
        return await call
    except RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, (EngineError, InvalidTrajectory)):
            raise cause from None
        raise EngineError(f"{who}: {cause!r}") from None
    except actor_gone_errors() as exc:
        raise EngineError(f"{who} is gone ({type(exc).__name__}); Ray restarts it") from None


class WorkerTarget:
    """A generation actor as a weight target (`learner.weight_sync`): it loads what it is sent
    into its engine and says which version it serves. One that is dead is restarted by Ray and
    loads `latest` before it generates again, so it counts as serving the new version."""

    def __init__(self, name: str, handle: Any) -> None:
        self.name, self.handle, self.version = name, handle, 0

    async def update_weights(
        self, version: int, *, state_dict: Any = None, path: str | None = None
    ) -> None:
        from ray.exceptions import RayTaskError

        try:
            problem, served = await self.handle.update_weights.remote(version, path or state_dict)
        except actor_gone_errors():  # dead: Ray restarts it and it loads `latest` before generating
            self.version = version
            return
        except RayTaskError as exc:  # raised in the actor (a cancelled load too): a failed sync;
            # the actor loads `latest` before its next trajectory
            raise EngineError(f"{self.name}: {getattr(exc, 'cause', None) or exc!r}") from None
        self.version = served
        if problem is not None:  # its servers keep their weights; the next publish retries
            raise EngineError(f"{self.name}: {problem}")


class RayRoles(Roles):
    """The learner and the generation actors, seen from the driver's streaming loop. Weights go
    through the object store to in-process engines, or as an HF checkpoint the learner writes
    for servers; a dead server's pool holds and readmits it; periodic evaluation runs in the
    first generation actor, on the learner's state_dict taken when the step comes due (in-process
    engines) or on what the servers serve."""

    def __init__(
        self,
        config: StrataConfig,
        learner: Any,
        workers: dict[str, Any],
        latest: list,
        publisher: Any,
        weights_dir: Path | None = None,
    ) -> None:
        """`publisher`: the run's (parts.make_publisher) over the workers' `WorkerTarget`s;
        `weights_dir`: the learner writes an HF checkpoint there for inference servers; None:
        weights go through the object store to in-process engines."""
        super().__init__(publisher)
        self.config, self.learner, self.workers, self.latest = config, learner, workers, latest
        self.weights_dir = weights_dir
        self.owners: dict[str, Any] = {}  # a started server's URL -> the pool that owns it
        self._version = 0
        self._stats: dict[str, ActorStats] = {}
        self._pids: dict[str, set[int]] = {name: set() for name in workers}

    @property
    def version(self) -> int:
        return self._version

    async def sync_version(self) -> int:
        self._version = await self.learner.version.remote()
        return self._version

    async def step(self, groups) -> dict:
        metrics = await self.learner.step.remote(groups)
        self._version = int(metrics.get("version", self._version))  # none: nothing was trained
        return metrics

    async def weights(self) -> Any:
        if self.weights_dir is not None:
            weights = await self.learner.save_weights.remote(str(self.weights_dir.resolve()))
        else:
            weights = self.learner.state_dict.remote()  # stored once; every actor reads it
        self.latest[:] = [self._version, weights]  # what a restarted actor loads first
        return weights

    async def checkpoint(self, directory: Path, extra: dict) -> Path:
        return Path(await self.learner.save.remote(str(directory.resolve()), extra))

    async def actor_stats(self) -> dict[str, ActorStats]:
        names = list(self.workers)
        replies = await asyncio.gather(
            *(self.workers[n].stats.remote() for n in names), return_exceptions=True
        )
        for name, reply in zip(names, replies, strict=True):
            if isinstance(reply, BaseException):
                continue  # restarting: its last figures stand
            pid, stats = reply
            self._pids[name].add(pid)
            self._stats[name] = stats
        return dict(self._stats)

    @property
    def restarts(self) -> int:
        return sum(max(0, len(pids) - 1) for pids in self._pids.values())

    def watch_servers(self, servers: Any):
        """Server j belongs to pool j % num_pools: that pool holds and readmits it."""
        pools = len(self.workers)
        self.owners = {
            s.url: self.workers[f"pool-{j % pools}"] for j, s in enumerate(servers.servers)
        }
        return super().watch_servers(servers)

    async def hold(self, url: str) -> None:
        await unwrap(self.owners[url].hold.remote(url), f"the pool owning {url}")

    async def readmit(self, url: str) -> int:
        return await unwrap(self.owners[url].readmit.remote(url), f"the pool owning {url}")

    def eval_weights(self) -> Any:
        if not self.config.actors.engine.in_process:
            return None
        return self.learner.state_dict.remote()  # queued before the next step

    async def evaluate(self, items: list, version: int, weights: Any) -> tuple[list, list]:
        worker = self.workers["pool-0"]
        return tuple(await unwrap(worker.evaluate.remote(items, version, weights), "pool-0"))


async def run_ray(
    config: StrataConfig,
    assets: Assets,
    run_dir: Path,
    progress=None,
    summary: RunSummary | None = None,
    resume: bool = False,
    loggers: Loggers | None = None,
) -> RunSummary:
    """Stream until learner.max_steps with every role in a Ray actor (see the module doc)."""
    runtime: RayRuntime = config.runtime  # RUNNERS["ray"]: runtime.type is ray
    ray = import_ray(runtime.node_ip)  # first: Ray decides what it listens on when imported
    summary = summary if summary is not None else RunSummary()
    pools_n = config.actors.num_pools
    ranks = config.learner.num_ranks
    urls = pool_urls(config)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    start_ray(runtime, runtime.needed(config), private_gpus=runtime.private_gpus(config, gpus))
    retrieval = retrieval_watch = servers = watching = learner = None
    workers: dict[str, Any] = {}
    try:
        servers, started = start_servers(config, assets.policy_dir, run_dir / "logs")  # main thread
        if started is not None:
            urls = [started[i::pools_n] for i in range(pools_n)]
        plain = config.model_dump(mode="json")
        policy = str(Path(assets.policy_dir).resolve())
        search_url = config.retrieval.url
        if "search" in config.actors.tools and search_url is None:
            retrieval = (
                ray.remote(RetrievalWorker)
                .options(
                    num_cpus=runtime.retrieval_num_cpus,
                    name="strata-retrieval",
                    max_restarts=-1,
                    max_task_retries=0,
                )
                .remote()
            )
            index_dir, host = str(Path(assets.index_dir).resolve()), config.retrieval.host
            options = retrieval_load_options(config.retrieval)
            port = await retrieval.start.remote(index_dir, host, config.retrieval.port, options)
            search_url = f"http://{host}:{port}"
            retrieval_watch = asyncio.create_task(
                watch_retrieval(retrieval, index_dir, host, port, summary, options=options)
            )
        placement = await learner_placement(runtime, ranks)
        learner = (
            ray.remote(LearnerWorker)
            .options(
                num_cpus=runtime.learner_num_cpus,
                num_gpus=runtime.learner_num_gpus,
                name="strata-learner",
                **placement,
            )
            .remote(plain, policy, _threads(runtime.learner_num_cpus, runtime.threads))
        )
        generation = ray.remote(GenerationWorker)
        threads = _threads(runtime.actor_num_cpus, runtime.threads)
        for i in range(pools_n):
            name = f"pool-{i}"
            workers[name] = generation.options(
                num_cpus=runtime.actor_num_cpus,
                num_gpus=runtime.actor_num_gpus,
                name=f"strata-{name}",
                max_restarts=-1,
                max_task_retries=0,
                max_concurrency=config.actors.concurrency + 8,
            ).remote(plain, policy, search_url, name, threads, urls[i], str(run_dir.resolve()))
        latest: list = []
        targets = [WorkerTarget(name, handle) for name, handle in workers.items()]
        roles = RayRoles(
            config,
            learner,
            workers,
            latest,
            make_publisher(config, targets, run_dir),
            run_dir / "weights" if urls[0] is not None else None,
        )
        if servers is not None:
            watching = asyncio.create_task(roles.watch_servers(servers).run())
        await roles.sync_version()  # waits for the learner to be built
        skip = 0
        if resume:
            extra = await learner.load.remote(str((run_dir / "checkpoints").resolve()))
            skip = int(extra.get(CURSOR_KEY, 0))
            summary.resumed_from = await roles.sync_version()
            summary.books_before, summary.metrics = resume_run_dir(
                run_dir, extra, summary.resumed_from
            )
        if roles.version:
            await roles.publish()
        buffer = make_buffer(
            config.buffer,
            run_dir,
            config.learner.groups_per_step,
            dynamic_sampling=config.learner.dynamic_sampling,
        )
        tokenizer = AutoTokenizer.from_pretrained(policy, local_files_only=True)
        tasks, summary.skipped_prompts = question_stream(config, assets.world_dir, tokenizer, skip)
        pools = [
            ActorPool(
                RemoteAgent(handle, name, latest),
                buffer,
                tasks,
                group_size=config.buffer.group_size,
                concurrency=config.actors.concurrency,
                name=name,
                first_serial=skip,
            )
            for name, handle in workers.items()
        ]
        started = lambda: skip + sum(p.stats.groups_started for p in pools)  # noqa: E731
        evaluator = roles.evaluator(config, run_dir, loggers)
        try:
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
            summary.actor_restarts = roles.restarts
    finally:
        for watch in (watching, retrieval_watch):  # first: no restart while stopping
            if watch is not None:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
        closing = [w.close.remote() for w in workers.values()]
        if learner is not None:
            closing.append(learner.close.remote())
        if retrieval is not None:
            closing.append(retrieval.stop.remote())
        await asyncio.gather(*closing, return_exceptions=True)
        if servers is not None:
            servers.stop()
        ray.shutdown()
