"""Publishing the learner's weights to the actors, one publisher per transport, for both runtimes.

    InProcessSync    a snapshot of the state dict, adopted by engines in this process (embedded)
    RaySync          the state dict in Ray's object store, loaded by each generation actor
    CheckpointSync   an HF checkpoint directory every target can read (inference servers reload it)
    NcclSync         GPU only: a broadcast from the learner's process to the servers' GPUs

A target is anything with a `version` and `update_weights(version, *, state_dict=None,
path=None)`: an actors' RolloutEngine, or a runtime's handle on a process that owns engines (the
learner never imports the actor side). A target that fails raises (`EngineError` from the
engines); it keeps its weights and the next publish retries it. Every `publish` returns what it
measured (`PublishReport`). Versions only ever increase.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch


class WeightTarget(Protocol):
    @property
    def version(self) -> int:
        """The version it serves now."""
        ...

    async def update_weights(
        self, version: int, *, state_dict: Mapping[str, Any] | None = None, path: str | None = None
    ) -> None: ...


@dataclass
class PublishReport:
    published: bool
    """Every target took the new version."""
    seconds: float
    served_version: int
    """The oldest version a target serves now (what an admitted group may be sampled with)."""
    failures: list[str] = field(default_factory=list)
    """Why each target that failed did, this publish."""

    def metrics(self) -> dict[str, float | bool]:
        return {
            "published": self.published,
            "weight_sync_seconds": self.seconds,
            "served_version": self.served_version,
        }


class Publisher:
    """What every transport shares: increasing versions, one delivery to all targets at once,
    failures collected (never raised past the caller: a server that failed keeps serving)."""

    def __init__(self, targets: Sequence[WeightTarget]) -> None:
        self.targets = list(targets)
        self.last_version: int | None = None

    def _check(self, version: int) -> float:
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(f"weight versions must increase: {version} after {self.last_version}")
        return time.perf_counter()

    async def _deliver(
        self, version: int, start: float, load: Callable[[WeightTarget], Awaitable[None]]
    ) -> PublishReport:
        outcomes = await asyncio.gather(*(load(t) for t in self.targets), return_exceptions=True)
        failures = []
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, RuntimeError):  # EngineError is one; a bug is not
                    raise outcome
                failures.append(str(outcome))
        self.last_version = version
        served = min((t.version for t in self.targets), default=version)
        return PublishReport(not failures, time.perf_counter() - start, served, failures)


class InProcessSync(Publisher):
    async def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PublishReport:
        start = self._check(version)
        # One copy, detached from the learner's live parameters, shared by every engine.
        snapshot = {name: tensor.detach().clone() for name, tensor in state_dict.items()}
        return await self._deliver(
            version, start, lambda t: t.update_weights(version, state_dict=snapshot)
        )


class CheckpointSync(Publisher):
    """HF checkpoint per version under `directory` (the last `keep` are kept), loaded by path.
    `publish` takes the state dict (written here, with `model`'s save_pretrained) or the path of
    a checkpoint another process wrote (the Ray learner: `write_checkpoint`)."""

    def __init__(
        self,
        targets: Sequence[WeightTarget],
        directory: str | os.PathLike[str],
        model: Any = None,
        tokenizer: Any = None,
        keep: int = 2,
    ) -> None:
        super().__init__(targets)
        self.directory = Path(directory)
        self.model = model  # anything with save_pretrained(dir, state_dict=...)
        self.tokenizer = tokenizer
        self.keep = keep

    async def publish(
        self, weights: Mapping[str, torch.Tensor] | str, version: int
    ) -> PublishReport:
        start = self._check(version)
        if isinstance(weights, str):
            path = weights
        else:
            written = await asyncio.to_thread(
                write_checkpoint, self.directory, version, dict(weights), self.model, self.tokenizer
            )
            path = str(written)
        report = await self._deliver(version, start, lambda t: t.update_weights(version, path=path))
        prune_checkpoints(self.directory, self.keep)
        return report


class RaySync(Publisher):
    """Targets inside Ray actors: the snapshot goes into the object store once and each target
    loads it from there (zero-copy on one node). `publish` takes the state dict (put here) or an
    ObjectRef of it (put by the learner's actor, so the driver never holds the weights)."""

    async def publish(self, weights: Any, version: int) -> PublishReport:
        import ray

        start = self._check(version)
        if not isinstance(weights, ray.ObjectRef):
            weights = ray.put({name: tensor.detach().cpu() for name, tensor in weights.items()})
        return await self._deliver(
            version, start, lambda t: t.update_weights(version, state_dict=weights)
        )


class NcclSync(Publisher):
    """GPU only: this process (the learner's, rank 0) broadcasts every tensor to the servers'
    GPUs; each target is a server engine with `update_weights_distributed` (SGLang, vLLM), which
    forms the NCCL group at master_address:master_port on first use. Without CUDA every target
    fails with one line saying so."""

    def __init__(
        self, targets: Sequence[Any], master_address: str = "127.0.0.1", master_port: int = 0
    ) -> None:
        super().__init__(targets)
        self.master_address, self.master_port = master_address, master_port or _free_port()

    async def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PublishReport:
        start = self._check(version)
        return await self._deliver(
            version,
            start,
            lambda t: t.update_weights_distributed(
                version,
                state_dict,
                master_address=self.master_address,
                master_port=self.master_port,
            ),
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_checkpoint(
    directory: str | os.PathLike[str],
    version: int,
    state_dict: Mapping[str, torch.Tensor],
    model: Any,
    tokenizer: Any = None,
) -> Path:
    """`directory/vNNNNNN`, an HF checkpoint of `state_dict` (saved by `model.save_pretrained`)."""
    return save_hf(Path(directory) / f"v{version:06d}", model, tokenizer, state_dict)


def save_hf(
    target: str | os.PathLike[str],
    model: Any,
    tokenizer: Any = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """`model` (with `state_dict`'s weights if given) and `tokenizer` as an HF directory at
    `target`, made whole under a temporary name first: a reader never sees a half-written one,
    and one left by an interrupted run is replaced."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        if state_dict is None:
            model.save_pretrained(tmp)
        else:
            model.save_pretrained(tmp, state_dict=dict(state_dict))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def prune_checkpoints(directory: str | os.PathLike[str], keep: int) -> None:
    """Delete all but the `keep` newest `vNNNNNN` checkpoints in `directory`."""
    versions = sorted(p for p in Path(directory).glob("v*") if p.is_dir())
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
