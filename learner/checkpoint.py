"""Checkpoints that survive a kill mid-save, and resume that continues versions and data order.

    ROOT/step-000012/deepspeed/   DeepSpeed state: weights, optimizer, scheduler
    ROOT/step-000012/critic/      the critic's, with GAE (learner/critic.py)
    ROOT/step-000012/hf/          HF model directory (AutoModelForCausalLM / SGLang load it)
    ROOT/step-000012/adapter/     with LoRA, the adapters alone (peft's format); hf/ is merged
    ROOT/step-000012/learner.json version, model fingerprint, RNG states, caller's extra state
    ROOT/latest                   name of the newest complete checkpoint

A checkpoint is written under a temporary name and renamed into place; `latest` is replaced
atomically after that. A kill at any moment leaves the previous checkpoint intact and named.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learner.lora import save_adapter

STATE_FILE = "learner.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; one line naming the file and the problem."""


def model_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of the model's architecture config: a checkpoint of another model is refused."""
    config = model.config.to_dict()
    keys = (
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
    )
    return hashlib.sha256(
        json.dumps({k: config.get(k) for k in keys}, sort_keys=True).encode()
    ).hexdigest()


def _rng_state() -> dict[str, str]:
    def encode(obj: Any) -> str:
        return base64.b64encode(json.dumps(obj).encode()).decode()

    np_state = np.random.get_state()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": encode(random.getstate()),
        "numpy": encode([np_state[0], np_state[1].tolist(), *np_state[2:]]),
    }


def _restore_rng(state: dict[str, str]) -> None:
    torch.set_rng_state(
        torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8)
    )
    version, internal, gauss = json.loads(base64.b64decode(state["python"]))
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = json.loads(base64.b64decode(state["numpy"]))
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def save_checkpoint(
    learner: Any, root: str | os.PathLike[str], extra: dict | None = None, keep: int = 2
) -> Path:
    """Save `learner` (a learner.trainer.Learner) under ROOT/step-VERSION; returns that path."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"step-{learner.version:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        peers = getattr(learner, "peers", None)
        if peers is not None:  # every rank writes its part (ZeRO 1-2: its optimizer shard) in tmp
            peers.broadcast("save", str(tmp))
        save_rank_part(learner, tmp)
        if peers is not None:
            peers.gather("save")
        learner.model.save_pretrained(tmp / "hf", state_dict=learner.state_dict())
        learner.tokenizer.save_pretrained(tmp / "hf")
        if learner.lora is not None:  # the merged weights above; the adapters alone here
            save_adapter(learner.engine.module, learner.adapter_state_dict(), tmp / "adapter")
        state = {
            "version": learner.version,
            "model": model_fingerprint(learner.model),
            "rng": _rng_state(),
            "extra": extra or {},
        }
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException as exc:
        full = not isinstance(exc, OSError) and out_of_space(root)  # read before freeing tmp
        shutil.rmtree(tmp, ignore_errors=True)
        if full:  # torch says only "unexpected pos ..." when the disk is full
            raise OSError(
                errno.ENOSPC, f"No space left on device writing checkpoint {target}"
            ) from exc
        raise
    pointer = root / ".latest.tmp"
    try:
        pointer.write_text(target.name + "\n")
        os.replace(pointer, root / "latest")
    finally:
        pointer.unlink(missing_ok=True)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def save_rank_part(learner: Any, directory: Path) -> None:
    """This rank's DeepSpeed state under DIRECTORY/deepspeed (collective: every rank at once)."""
    learner.engine.save_checkpoint(str(directory / "deepspeed"), tag="state", save_latest=False)
    if getattr(learner, "critic", None) is not None:
        learner.critic.engine.save_checkpoint(
            str(directory / "critic"), tag="state", save_latest=False
        )


def load_rank_part(learner: Any, path: Path) -> bool:
    """This rank's DeepSpeed state (and the critic's) from checkpoint PATH; whether it loaded."""
    loaded, _ = learner.engine.load_checkpoint(str(path / "deepspeed"), tag="state")
    if getattr(learner, "critic", None) is not None:
        critic, _ = learner.critic.engine.load_checkpoint(str(path / "critic"), tag="state")
        return loaded is not None and critic is not None
    return loaded is not None


def out_of_space(path: str | os.PathLike[str], below: int = 1 << 20) -> bool:
    """Whether the file system holding `path` has less than `below` bytes left for us."""
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize < below


def latest_checkpoint(root: str | os.PathLike[str]) -> Path:
    root = Path(root)
    pointer = root / "latest"
    if not pointer.is_file():
        raise CheckpointError(f"{root}: no checkpoint to resume from (no 'latest' file)")
    path = root / pointer.read_text().strip()
    for needed in (STATE_FILE, "hf/config.json", "deepspeed/state"):
        if not (path / needed).exists():
            raise CheckpointError(f"{path}: incomplete checkpoint, {needed} is missing")
    return path


def load_checkpoint(learner: Any, root: str | os.PathLike[str]) -> dict:
    """Restore weights, optimizer, scheduler, version and RNG states; returns the saved `extra`."""
    path = latest_checkpoint(root)
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path / STATE_FILE}: unreadable ({exc})") from None
    if state.get("model") != model_fingerprint(learner.model):
        raise CheckpointError(
            f"{path}: checkpoint of another model (architecture differs from the configured one)"
        )
    critic = getattr(learner, "critic", None)
    if critic is not None and not (path / "critic" / "state").exists():
        raise CheckpointError(
            f"{path}: no critic state (saved by a run without learner.advantage.type gae): "
            "resume with the run's own advantage type"
        )
    peers = getattr(learner, "peers", None)
    if peers is not None:  # every rank loads its part at once
        peers.broadcast("load", str(root))
    loaded = load_rank_part(learner, path)
    if peers is not None:
        peers.gather("load")
    if not loaded:
        raise CheckpointError(f"{path}: DeepSpeed could not load it")
    learner.version = int(state["version"])
    _restore_rng(state["rng"])
    return state.get("extra", {})
