"""`runtime.type: local`: every role in one process on one machine (`pipeline/runtime/local.py`);
weights reach in-process engines as a snapshot in memory."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pipeline.backends.runtime import RuntimeBackend

if TYPE_CHECKING:
    from learner.weight_sync import Publisher
    from pipeline.config.schema import StrataConfig


class LocalRuntime(RuntimeBackend):
    """Everything in one process on one machine (asyncio, threads as needed)."""

    type: Literal["local"] = "local"
    """Run on this machine."""

    def refused(self, config: StrataConfig, gpus: int) -> str | None:
        if gpus and config.learner.num_ranks > gpus:
            return (
                f"learner.num_ranks {config.learner.num_ranks} needs a GPU per rank, this machine has "
                f"{gpus}: lower learner.num_ranks"
            )
        return None

    def snapshot_publisher(self, targets: list) -> Publisher:
        from learner.weight_sync import InProcessSync

        return InProcessSync(targets)
