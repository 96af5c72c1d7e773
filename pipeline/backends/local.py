"""`runtime.type: local`: every role in one process on one machine (`pipeline/runtime/local.py`);
weights reach in-process engines as a snapshot in memory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pipeline.backends.runtime import RuntimeBackend

if TYPE_CHECKING:
    from learner.weight_sync import Publisher
    from pipeline.assets.cache import Assets
    from pipeline.config.schema import StrataConfig
    from pipeline.runtime.stream import RunSummary


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

    async def run(
        self,
        config: StrataConfig,
        assets: Assets,
        run_dir: Path,
        progress: Any,
        summary: RunSummary,
        resume: bool,
    ) -> RunSummary:
        from pipeline.runtime.local import run_local

        return await run_local(config, assets, run_dir, progress, summary, resume=resume)

    def snapshot_publisher(self, targets: list) -> Publisher:
        from learner.weight_sync import InProcessSync

        return InProcessSync(targets)
