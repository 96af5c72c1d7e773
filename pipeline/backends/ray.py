"""`runtime.type: ray`: generation, the learner and the retrieval server as Ray actors on a
private cluster bound to 127.0.0.1 or a joined one (`pipeline/runtime/ray.py`); weights reach
in-process engines through Ray's object store, and learner ranks sit on a placement group."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from pipeline.backends.runtime import RuntimeBackend

if TYPE_CHECKING:
    from learner.weight_sync import Publisher
    from pipeline.config.schema import StrataConfig
    from pipeline.runtime.stream import RunSummary


class RayRuntime(RuntimeBackend):
    """Actor pools, learner and retrieval server as Ray actors, scaled independently."""

    one_process: ClassVar[bool] = False
    starts_ray: ClassVar[bool] = True

    type: Literal["ray"] = "ray"
    """Run under Ray."""
    address: str | None = None
    """Join this cluster (e.g. 127.0.0.1:6379); null: start a private local one."""
    node_ip: str = "127.0.0.1"
    """Address Ray binds to when it starts a local cluster."""
    actor_num_cpus: float = Field(1.0, ge=0)
    """CPUs reserved per actor pool."""
    actor_num_gpus: float = Field(0.0, ge=0)
    """GPUs reserved per actor pool."""
    learner_num_cpus: float = Field(1.0, ge=0)
    """CPUs reserved for the learner (per rank with learner.num_ranks > 1)."""
    learner_num_gpus: float = Field(0.0, ge=0)
    """GPUs reserved for the learner (per rank with learner.num_ranks > 1)."""
    learner_placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """With learner.num_ranks > 1: the strategy of the placement group whose bundle r (learner_num_cpus
    and learner_num_gpus) holds rank r: PACK fills as few nodes as it can, STRICT_SPREAD puts
    every rank on a node of its own."""
    learner_rendezvous_host: str | None = None
    """With learner.num_ranks > 1: the address rank 0 serves the ranks' rendezvous on (a TCPStore
    bound to it alone); null: rank 0's node address as Ray knows it (127.0.0.1 on a private
    cluster). Ranks on other machines must reach it; set GLOO_SOCKET_IFNAME or
    NCCL_SOCKET_IFNAME for the interface their traffic takes."""
    learner_rendezvous_port: int = Field(0, ge=0, le=65535)
    """With learner.num_ranks > 1: the rendezvous port (0: any free one)."""
    retrieval_num_cpus: float = Field(0.0, ge=0)
    """CPUs reserved for the retrieval server (0: it shares them; it mostly waits on requests)."""

    @property
    def cluster(self) -> str | None:
        return "joined" if self.address else "private"

    def check(self, config: StrataConfig) -> None:
        if config.learner.num_ranks > 1:
            return
        for key in ("learner_placement", "learner_rendezvous_host", "learner_rendezvous_port"):
            if getattr(self, key) != type(self).model_fields[key].default:
                raise ValueError(
                    f"runtime.{key} places the learner's ranks: it acts with learner.num_ranks > 1 only"
                )

    def refused(self, config: StrataConfig, gpus: int) -> str | None:
        """Checked before the assets are built: the ray package, and what Ray would otherwise
        wait on (a private cluster smaller than the roles ask, an address where nothing listens)."""
        import importlib.util

        from pipeline.runtime.ray_cluster import missing_resources, unreachable

        if importlib.util.find_spec("ray") is None:
            return "runtime.type ray needs the ray package: pip install 'ray>=2.30', or use --set runtime.type=local"
        if self.address:  # a joined cluster's resources are checked once it is joined
            return unreachable(self.address)
        have = {"CPU": float(os.cpu_count() or 1), "GPU": float(self.private_gpus(config, gpus))}
        return missing_resources(self.needed(config), have)

    def needed(self, config: StrataConfig) -> dict[str, float]:
        """The CPUs and GPUs the run's Ray actors reserve."""
        pools, ranks = config.actors.num_pools, config.learner.num_ranks
        return {
            "CPU": pools * self.actor_num_cpus
            + ranks * self.learner_num_cpus
            + self.retrieval_num_cpus,
            "GPU": pools * self.actor_num_gpus + ranks * self.learner_num_gpus,
        }

    @staticmethod
    def private_gpus(config: StrataConfig, gpus: int) -> int:
        """The GPUs a private cluster gets: this machine's, less the last ones the SGLang servers
        the launcher starts take (Ray hands out the first ones)."""
        return max(0, gpus - config.actors.engine.started_gpus())

    def snapshot_publisher(self, targets: list) -> Publisher:
        from learner.weight_sync import RaySync

        return RaySync(targets)

    def rank_placement(self) -> Any:
        """In the learner's actor, on bundle 0 of its placement group: ranks 1..N-1 on the others."""
        import ray

        from learner.ranks import RayPlacement

        return RayPlacement(
            ray.util.get_current_placement_group(),
            self.learner_num_cpus,
            self.learner_num_gpus,
            self.learner_rendezvous_host,
            self.learner_rendezvous_port,
        )

    def summary_note(self, summary: RunSummary) -> str:
        return f"actor restarts {summary.actor_restarts}, retrieval restarts {summary.retrieval_restarts}; "
