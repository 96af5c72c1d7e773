"""What every `actors.engine` backend declares, next to its fields: how its client is built,
what this machine refuses, how the learner's weights reach it and which servers the launcher
starts for it. The defaults here are those of an engine that serves HF checkpoints; the backends
override what differs.

Nothing at import time touches torch or a backend's package: each method imports its backend
when it is called, so `--dry-run` and the config reference stay light.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import model_validator

from pipeline.backends.runtime import RuntimeUnavailable
from pipeline.config.base import Section

if TYPE_CHECKING:
    from actors.engine import RolloutEngine
    from actors.servers import ManagedServers
    from learner.weight_sync import Publisher
    from pipeline.config.schema import StrataConfig

PathLike = str | os.PathLike[str]


class EngineBackend(Section):
    """An `actors.engine` section: a generation backend."""

    in_process: ClassVar[bool] = False
    """True: the engine generates inside the actor's process and loads weights as a state dict
    (a snapshot of the learner's; a periodic evaluation gets an engine of its own with a copy);
    False: it serves what it loaded from an HF checkpoint under run_dir/weights/."""

    def refused(self, config: StrataConfig, gpus: int) -> str | None:
        """Why this machine (with `gpus` CUDA GPUs) cannot run `config` on this engine, in one
        line, or None."""
        return None

    def build(
        self, config: StrataConfig, model_path: PathLike, urls: list[str] | None
    ) -> RolloutEngine:
        """The engine client serving the policy at `model_path`; `urls`: the servers to use
        instead of the configured ones (those the runtime started, or a pool's share)."""
        raise NotImplementedError(f"actors.engine.type {self.type} builds no engine client")

    def publisher(
        self,
        config: StrataConfig,
        targets: list,
        run_dir: PathLike,
        model: Any = None,
        tokenizer: Any = None,
    ) -> Publisher:
        """How a new version reaches `targets`: in-process engines take a snapshot over the
        runtime's transport; others an HF checkpoint under run_dir/weights/ (the two newest kept)."""
        if self.in_process:
            return config.runtime.snapshot_publisher(targets)
        from learner.weight_sync import CheckpointSync

        return CheckpointSync(targets, Path(run_dir) / "weights", model, tokenizer, keep=2)

    def servers(
        self, config: StrataConfig, policy_dir: PathLike, log_dir: PathLike | None
    ) -> ManagedServers | None:
        """The servers the launcher starts for this engine (not started yet), or None."""
        return None

    def pool_urls(self, pools: int) -> list[list[str] | None]:
        """The servers each of `pools` actor pools owns; None per pool for in-process engines."""
        return [None] * pools

    def started_gpus(self) -> int:
        """This machine's GPUs the servers the launcher starts take (Ray must not hand them out)."""
        return 0

    replaces_run: ClassVar[bool] = False
    """It runs the whole run itself instead of a runtime (the simulated cluster): see
    `pipeline.runtime.run.WHOLE_RUNS`."""


class ServerEngine(EngineBackend):
    """What the engines that generate on HTTP servers share: servers named by URL, wherever they
    run, or started by the launcher on this machine (then `STARTED_ONLY` keys act)."""

    STARTED_ONLY: ClassVar[tuple[str, ...]] = ("num_servers", "startup_timeout_s")

    @model_validator(mode="after")
    def _started_keys_only_without_urls(self) -> ServerEngine:
        fields = type(self).model_fields
        given = [
            k
            for k in self.STARTED_ONLY
            if getattr(self, k) != fields[k].get_default(call_default_factory=True)
        ]
        if self.urls and given:
            raise ValueError(
                f"{', '.join(given)} set the servers the launcher starts, but urls names running "
                "ones: drop one or the other"
            )
        return self

    def refused(self, config: StrataConfig, gpus: int) -> str | None:
        if self.urls:
            return unreachable(self.urls)
        return self.launch_refused(config, gpus)

    def launch_refused(self, config: StrataConfig, gpus: int) -> str | None:
        """Why the launcher cannot start this engine's servers here, in one line, or None."""
        return None

    def pool_urls(self, pools: int) -> list[list[str] | None]:
        """Server j belongs to pool j % pools (a server shared by two pools would be paused and
        reloaded by both); servers the launcher starts are not known yet: empty lists until they
        are. RuntimeUnavailable with fewer servers than pools."""
        count = len(self.urls) or self.num_servers
        if count < pools:
            where = "actors.engine.urls" if self.urls else "actors.engine.num_servers"
            raise RuntimeUnavailable(
                f"actors.num_pools {pools} needs at least {pools} servers, one pool each, but {where} "
                f"gives {count}: add servers or lower actors.num_pools"
            )
        return [list(self.urls[i::pools]) for i in range(pools)]


def unreachable(urls: list[str], timeout_s: float = 5.0) -> str | None:
    """One line naming the servers in `urls` whose /health does not answer, or None."""
    from concurrent.futures import ThreadPoolExecutor

    from actors.servers import healthy

    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        answers = list(pool.map(lambda url: healthy(url, timeout_s), urls))
    silent = [url for url, ok in zip(urls, answers, strict=True) if not ok]
    if not silent:
        return None
    return (
        f"actors.engine.urls: no answer from {', '.join(f'{u.rstrip(chr(47))}/health' for u in silent)} "
        f"({len(silent)} of {len(urls)} servers) within {timeout_s:g} s: start them, or fix the URLs"
    )


def server_logs(policy_dir: PathLike, log_dir: PathLike | None) -> str:
    """Where started servers write their logs: `log_dir`, else the policy directory's logs/."""
    return str(Path(log_dir) if log_dir is not None else Path(policy_dir) / "logs")
