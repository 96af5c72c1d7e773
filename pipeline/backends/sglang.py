"""`actors.engine.type: sglang`: SGLang servers (GPU clusters), given by URL or started by the
launcher on this machine's GPUs (`actors/sglang_server.py`), reached over HTTP
(`actors/sglang.py`). Weights arrive as an HF checkpoint the servers reload, or with
`weight_sync: nccl` as a broadcast from the learner's process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from pipeline.backends.engine import PathLike, ServerEngine, server_logs

if TYPE_CHECKING:
    from actors.engine import RolloutEngine
    from actors.servers import ManagedServers
    from learner.weight_sync import Publisher
    from pipeline.config.schema import StrataConfig


class SGLangEngine(ServerEngine):
    """SGLang servers (GPU clusters): given by URL and reached over HTTP wherever they run, or
    started by the launcher on this machine's GPUs (`python -m sglang.launch_server`)."""

    STARTED_ONLY: ClassVar[tuple[str, ...]] = (
        "num_servers",
        "tp_size",
        "gpus",
        "mem_fraction_static",
        "python",
        "extra_args",
        "startup_timeout_s",
    )

    type: Literal["sglang"] = "sglang"
    """Generate through SGLang's /generate endpoint."""
    urls: list[str] = Field(default_factory=list)
    """Running servers, e.g. http://127.0.0.1:30000 (requests go to the least loaded); empty: the
    launcher starts `num_servers` on this machine's GPUs and stops them at the end."""
    num_servers: int = Field(1, ge=1, le=64)
    """Servers the launcher starts when `urls` is empty, each on its own `tp_size` GPUs."""
    tp_size: int = Field(1, ge=1, le=64)
    """GPUs per started server (SGLang's --tp-size)."""
    gpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """GPU ids the started servers take, `tp_size` per server in order; empty: the machine's last
    num_servers x tp_size GPUs (the learner keeps the first ones)."""
    mem_fraction_static: float = Field(0.8, gt=0, lt=1)
    """Share of each started server's GPU memory for weights and KV cache (--mem-fraction-static)."""
    python: str | None = None
    """Interpreter with sglang installed that starts the servers; null: the launcher's own."""
    extra_args: list[str] = Field(default_factory=list)
    """More `sglang.launch_server` flags for started servers, passed as given."""
    startup_timeout_s: float = Field(900.0, gt=0, le=7200)
    """How long a started server may take to answer /health (loading the model, CUDA graphs)."""
    timeout_s: float = Field(600.0, gt=0, le=86400)
    """A request without an answer after this long aborts its trajectory (counted)."""
    weight_sync: Literal["disk", "nccl"] = "disk"
    """disk: HF checkpoint + /update_weights_from_disk; nccl: SGLang's distributed update group."""

    @model_validator(mode="after")
    def _gpus_fit(self) -> SGLangEngine:
        wanted = self.num_servers * self.tp_size
        if self.gpus and (len(self.gpus) != wanted or len(set(self.gpus)) != len(self.gpus)):
            raise ValueError(
                f"gpus {self.gpus} must name {wanted} different GPUs (num_servers "
                f"{self.num_servers} x tp_size {self.tp_size}), or be left empty"
            )
        return self

    def refused(self, config: StrataConfig, gpus: int) -> str | None:
        if self.weight_sync == "nccl" and not config.runtime.one_process:
            return (
                "actors.engine.weight_sync nccl broadcasts from the process that holds both the "
                "learner and the engine client, which runtime.type ray splits: use weight_sync "
                "disk under Ray, or runtime.type local"
            )
        return super().refused(config, gpus)

    def launch_refused(self, config: StrataConfig, gpus: int) -> str | None:
        from actors.sglang_server import launch_problem

        return launch_problem(self, self.python, gpus, config.runtime.cluster)

    def build(
        self, config: StrataConfig, model_path: PathLike, urls: list[str] | None
    ) -> RolloutEngine:
        from actors.sglang import SGLangEngine as Engine

        return Engine(list(urls or self.urls), timeout_s=self.timeout_s)

    def publisher(
        self,
        config: StrataConfig,
        targets: list,
        run_dir: PathLike,
        model: Any = None,
        tokenizer: Any = None,
    ) -> Publisher:
        if self.weight_sync == "nccl":
            from learner.weight_sync import NcclSync

            return NcclSync(targets)
        return super().publisher(config, targets, run_dir, model, tokenizer)

    def servers(
        self, config: StrataConfig, policy_dir: PathLike, log_dir: PathLike | None
    ) -> ManagedServers | None:
        if self.urls:
            return None
        import torch

        from actors.sglang_server import SGLangServers, gpu_sets

        sets = gpu_sets(self.num_servers, self.tp_size, self.gpus, torch.cuda.device_count())
        return SGLangServers(
            str(policy_dir),
            self.num_servers,
            self.startup_timeout_s,
            server_logs(policy_dir, log_dir),
            gpu_sets=sets,
            tp_size=self.tp_size,
            mem_fraction_static=self.mem_fraction_static,
            python=self.python,
            dtype=config.model.param_dtype,
            seed=config.runtime.seed,
            extra_args=list(self.extra_args),
        )

    def started_gpus(self) -> int:
        return 0 if self.urls else self.num_servers * self.tp_size
