"""Publishing the learner's weights to the actors, with a version number that bounds staleness.

`InProcessSync` hands one snapshot to engines living in this process (the embedded default): the
snapshot is the only copy, engines adopt its tensors. `CheckpointSync` writes an HF checkpoint
to a directory the servers can read and has each engine load it (SGLang's
/update_weights_from_disk, vLLM's reload). Engines are anything with
`update_weights(version, *, state_dict=None, path=None)` (the actors' RolloutEngine); the learner
never imports the actor side.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch


class VersionedEngine(Protocol):
    async def update_weights(self, version: int, *, state_dict: Mapping[str, Any] | None = None,
                             path: str | None = None) -> None: ...  # fmt: skip


class WeightSync(Protocol):
    async def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> float:
        """Make every engine serve `version`; returns the seconds it took."""
        ...


def _check_version(last: int | None, version: int) -> None:
    if last is not None and version <= last:
        raise ValueError(f"weight versions must increase: {version} after {last}")


class InProcessSync:
    def __init__(self, engines: Sequence[VersionedEngine]) -> None:
        self.engines = list(engines)
        self.last_version: int | None = None
        self.seconds: list[float] = []

    async def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> float:
        _check_version(self.last_version, version)
        start = time.perf_counter()
        # One copy, detached from the learner's live parameters, shared by every engine.
        snapshot = {name: tensor.detach().clone() for name, tensor in state_dict.items()}
        await asyncio.gather(
            *(e.update_weights(version, state_dict=snapshot) for e in self.engines)
        )
        self.last_version = version
        self.seconds.append(time.perf_counter() - start)
        return self.seconds[-1]


class CheckpointSync:
    """HF checkpoint per version under `directory` (the last `keep` are kept), loaded by path."""

    def __init__(self, engines: Sequence[VersionedEngine], directory: str | os.PathLike[str], model: Any,
                 tokenizer: Any = None, keep: int = 2) -> None:  # fmt: skip
        self.engines = list(engines)
        self.directory = Path(directory)
        self.model = model  # anything with save_pretrained(dir, state_dict=...)
        self.tokenizer = tokenizer
        self.keep = keep
        self.last_version: int | None = None
        self.seconds: list[float] = []

    async def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> float:
        _check_version(self.last_version, version)
        start = time.perf_counter()
        path = await asyncio.to_thread(
            write_checkpoint, self.directory, version, dict(state_dict), self.model, self.tokenizer
        )
        await asyncio.gather(*(e.update_weights(version, path=str(path)) for e in self.engines))
        self.last_version = version
        prune_checkpoints(self.directory, self.keep)
        self.seconds.append(time.perf_counter() - start)
        return self.seconds[-1]


def write_checkpoint(directory: str | os.PathLike[str], version: int,
                     state_dict: Mapping[str, torch.Tensor], model: Any, tokenizer: Any = None) -> Path:  # fmt: skip
    """`directory/vNNNNNN`, an HF checkpoint of `state_dict` (saved by `model.save_pretrained`)."""
    return save_hf(Path(directory) / f"v{version:06d}", model, tokenizer, state_dict)


def save_hf(target: str | os.PathLike[str], model: Any, tokenizer: Any = None,
            state_dict: Mapping[str, torch.Tensor] | None = None) -> Path:  # fmt: skip
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


class RaySync:
    """Engines inside Ray actors: the snapshot goes into the object store once (`ray.put`) and each
    actor's `update_weights(version, state_dict)` receives it from there (zero-copy on one node)."""

    def __init__(self, actors: Sequence[Any]) -> None:
        self.actors = list(actors)
        self.last_version: int | None = None
        self.seconds: list[float] = []

    async def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> float:
        import ray

        _check_version(self.last_version, version)
        start = time.perf_counter()
        ref = ray.put({name: tensor.detach().cpu() for name, tensor in state_dict.items()})
        await asyncio.gather(*(actor.update_weights.remote(version, ref) for actor in self.actors))
        self.last_version = version
        self.seconds.append(time.perf_counter() - start)
        return self.seconds[-1]
