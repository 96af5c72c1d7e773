"""What every `runtime` backend declares, next to its fields: where the roles run, what this
machine refuses, how a snapshot of the weights travels to in-process engines, and where the
learner's ranks are placed. As with the engines, a runtime's implementation is imported only
when it runs; the run itself is `pipeline/runtime/<type>.py`, named in
`pipeline.runtime.run.RUNNERS`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from pipeline.config.base import Section

if TYPE_CHECKING:
    from learner.weight_sync import Publisher
    from pipeline.config.schema import StrataConfig
    from pipeline.runtime.stream import RunSummary


class RuntimeUnavailable(RuntimeError):
    """A runtime that cannot start here (no cluster, too few resources); one line, what to do."""


class RuntimeBackend(Section):
    """A `runtime` section: where the roles run."""

    one_process: ClassVar[bool] = True
    """The learner and the engine clients share one process (an NCCL broadcast from the
    learner's process and the simulated cluster need it)."""
    starts_ray: ClassVar[bool] = False
    """It starts or joins a Ray cluster (so it cannot run inside a Ray task)."""

    runs_dir: str = Field("runs", min_length=1)
    """Parent of run directories when --run-dir is not given."""
    cache_dir: str = Field("runs/cache", min_length=1)
    """Built assets reused across runs: the mini-GAIA world, its index, the warm-started policy."""
    threads: int = Field(0, ge=0, le=1024)
    """torch threads per process (0: half the cores, at least 1: generation and training share them)."""
    seed: int = Field(0, ge=0)
    """Global seed."""

    @property
    def cluster(self) -> str | None:
        """The Ray cluster it runs on: private (one it starts, whose GPUs Ray hands out from the
        first), joined (one at an address, whose GPUs the launcher cannot keep servers off), or
        None (no cluster)."""
        return None

    def check(self, config: StrataConfig) -> None:
        """Rules across sections (ValueError), checked when the config is validated."""

    def refused(self, config: StrataConfig, gpus: int) -> str | None:
        """Why this machine (with `gpus` CUDA GPUs) cannot run `config` here, in one line, or None."""
        return None

    def snapshot_publisher(self, targets: list) -> Publisher:
        """How a snapshot of the learner's weights reaches in-process engines (`targets`)."""
        raise NotImplementedError

    def rank_placement(self) -> Any:
        """Where ranks 1..N-1 of the learner run (learner.ranks.RayPlacement), or None: processes
        rank 0 starts on this machine."""
        return None

    def summary_note(self, summary: RunSummary) -> str:
        """What the run's last line adds about this runtime's restarts ("" when none apply)."""
        return ""
