"""`actors.engine.type: embedded`: in-process torch generation (the CPU default), batching the
requests of concurrent agent loops (`actors/embedded.py`). Weights arrive as a state dict over
the runtime's transport; it starts no servers."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from pipeline.backends.engine import EngineBackend, PathLike

if TYPE_CHECKING:
    from actors.engine import RolloutEngine
    from pipeline.config.schema import StrataConfig


class EmbeddedEngine(EngineBackend):
    """In-process torch generation, batching the requests of concurrent agent loops (CPU default)."""

    in_process: ClassVar[bool] = True

    type: Literal["embedded"] = "embedded"
    """Generate inside the actor process with torch."""
    max_batch_size: int = Field(16, ge=1, le=4096)
    """Most sequences decoded together in one step."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the embedded engine runs."""

    def refused(self, config: StrataConfig, gpus: int) -> str | None:
        if self.device == "cuda" and not gpus:
            return "actors.engine.device cuda: this machine has no CUDA GPU: use --set actors.engine.device=cpu"
        return None

    def build(
        self, config: StrataConfig, model_path: PathLike, urls: list[str] | None
    ) -> RolloutEngine:
        from actors.embedded import EmbeddedEngine as Engine

        return Engine.from_pretrained(
            model_path,
            device=self.device,
            dtype=config.model.param_dtype,
            max_batch_size=self.max_batch_size,
            seed=config.runtime.seed,
        )
