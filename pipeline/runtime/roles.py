"""The roles the streaming loop drives (`pipeline.runtime.stream.stream`): the learner's step, the
publish of its weights to the engines, checkpoints, the actors' figures, the watch over servers
the run started, and periodic evaluation. What is the same wherever they run is written here once
(the publish's bookkeeping: failures printed and counted, restarts, the version the engines
serve; the server watch; the evaluator); a runtime's subclass says only where things run:

    LocalRoles      pipeline/runtime/local.py      the learner in a worker thread of this process
    RayRoles        pipeline/runtime/ray.py        the learner and the generation side as Ray actors
    SimulatedRoles  pipeline/runtime/simulated.py  the learner as a timing model on a virtual clock
    SimulatedRoles  pipeline/runtime/fakes.py      a fake learner for loop tests and benchmarks
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actors.servers import ServerWatch
from buffers.records import Group
from learner.weight_sync import Publisher
from pipeline.config.schema import StrataConfig
from pipeline.evaluation.heldout import PeriodicEval, periodic_eval
from pipeline.runtime.stream import ActorStats


class Roles:
    """The learner side as the loop sees it, in-process or remote."""

    def __init__(self, publisher: Publisher | None = None) -> None:
        self.publisher = publisher
        self.sync_failures = 0
        self.watch: ServerWatch | None = None  # of the servers this run started, if any
        self.periodic: PeriodicEval | None = None  # made by `evaluator`

    # ------------------------------------------------------------ where things run (subclasses)

    @property
    def version(self) -> int:
        """The learner's version: the number of steps that trained something."""
        raise NotImplementedError

    async def step(self, groups: list[Group]) -> dict:
        """One learner step; the metrics' `groups` is how many were trained (0: nothing)."""
        raise NotImplementedError

    async def checkpoint(self, directory: Path, extra: dict) -> Path:
        """Save the learner's state (and `extra`) under `directory`; the checkpoint's path."""
        raise NotImplementedError

    async def actor_stats(self) -> dict[str, ActorStats]:
        """Each generation side's figures, by name."""
        raise NotImplementedError

    async def weights(self) -> Any:
        """What the publisher sends for the current version (a state dict, a reference to one,
        or the path of a checkpoint)."""
        raise NotImplementedError

    async def served_versions(self) -> dict[str, int] | None:
        """What the engines say they serve, where they can say it (None: the publisher's count
        stands)."""
        return None

    async def hold(self, url: str) -> None:
        """The started server at `url` died: stop sending it requests."""
        raise NotImplementedError

    async def readmit(self, url: str) -> int:
        """The restarted server at `url` loads the last published weights and serves again."""
        raise NotImplementedError

    def eval_weights(self) -> Any:
        """The weights a periodic evaluation of the current version runs on, taken now (None:
        the engines evaluate what they serve)."""
        return None

    async def evaluate(self, items: list, version: int, weights: Any) -> tuple[list, list]:
        """A periodic evaluation of `version` on `items`: (rows, trajectories)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- the same everywhere

    async def publish(self) -> dict:
        """Make every engine serve the learner's current version. Returns what it measured:
        `published` (every engine took it), `weight_sync_seconds`, `served_version` (the oldest
        version an engine serves now: the publisher's count, or less if an engine says so),
        `weight_sync_failures` so far, `server_restarts`, and per transport more."""
        version = self.version
        report = await self.publisher.publish(await self.weights(), version)
        for problem in report.failures:  # an engine keeps its weights; the next publish retries
            print(f"strata: weight sync to version {version} failed: {problem}", flush=True)
        self.sync_failures += len(report.failures)
        metrics = {**report.metrics(), "weight_sync_failures": self.sync_failures}
        if self.watch is not None:
            metrics["server_restarts"] = self.watch.restarts
        try:  # what the engines say they serve, not what we believe
            served = await self.served_versions()
        except RuntimeError as exc:  # an EngineError: the publisher's count stands
            print(f"strata: could not read the servers' weight versions: {exc}", flush=True)
            served = None
        if served is not None:
            lowest = min(served.values(), default=metrics["served_version"])
            metrics["served_version_min"] = lowest
            metrics["served_version"] = min(metrics["served_version"], lowest)
        return metrics

    def watch_servers(self, servers: Any) -> ServerWatch:
        """A watch that restarts the run's dead servers, holding and readmitting them here."""
        self.watch = ServerWatch(servers, self.hold, self.readmit)
        return self.watch

    def evaluator(self, config: StrataConfig, run_dir: Path, loggers: Any):
        """The run's periodic evaluation (eval.every_steps), or None."""
        self.periodic = periodic_eval(config, self.eval_weights, self.evaluate, run_dir, loggers)
        return self.periodic
