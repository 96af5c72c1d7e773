"""Start and stop SGLang servers for a run on this machine's GPUs (`actors.engine.type: sglang`
with no `urls`): `python -m sglang.launch_server` per server, each on its own set of `tp_size`
GPUs (CUDA_VISIBLE_DEVICES), bound to 127.0.0.1 on a free port. How they are started, watched,
restarted and stopped is `actors.servers`'; the client is `actors.sglang`.

GPU-only: SGLang needs CUDA. On a machine without GPUs the launcher refuses such a config in one
line (`launch_problem`); the command line built here is tested against a stand-in executable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Literal

from actors.servers import ManagedServers

INSTALL = "pip install 'strata-rl[gpu]'"


@dataclass
class SGLangServers(ManagedServers):
    """`count` SGLang servers of the HF model at `model_dir`; server i runs on `gpu_sets[i]`."""

    gpu_sets: list[list[int]] = field(default_factory=list)
    tp_size: int = 1
    mem_fraction_static: float = 0.8
    python: str | None = None
    """Interpreter with sglang installed; None: this one."""
    dtype: str = "bfloat16"
    seed: int = 0
    extra_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 900.0

    label = "SGLang"
    log_name = "sglang-server"

    def command(self, port: int, index: int = 0) -> list[str]:
        return [
            self.python or sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model_dir),
            "--host",
            self.host,
            "--port",
            str(port),
            "--tp-size",
            str(self.tp_size),
            "--mem-fraction-static",
            f"{self.mem_fraction_static:g}",
            "--dtype",
            self.dtype,
            "--random-seed",
            str(self.seed + index),
            *self.extra_args,
        ]

    def environment(self, index: int = 0) -> dict[str, str]:
        env = super().environment(index)
        # the logprobs of the sampling distribution (temperature applied), as the learner expects
        env.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(physical_gpus(self.gpu_sets[index]))
        return env


def physical_gpus(ids: list[int]) -> list[str]:
    """The devices behind GPU indices of this process: through its own CUDA_VISIBLE_DEVICES."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return [visible[i] if i < len(visible) else str(i) for i in ids]


def gpu_sets(num_servers: int, tp_size: int, gpus: list[int], available: int) -> list[list[int]]:
    """The GPUs of each started server: `gpus` in order, `tp_size` each; by default the machine's
    last num_servers x tp_size GPUs, leaving the first ones to the learner."""
    wanted = num_servers * tp_size
    chosen = list(gpus) or list(range(available - wanted, available))
    return [chosen[i * tp_size : (i + 1) * tp_size] for i in range(num_servers)]


def launch_problem(
    engine, python: str | None, available: int, ray: Literal["private", "joined"] | None
) -> str | None:
    """Why the launcher cannot start `engine`'s (config.SGLangEngine) servers on this machine, in
    one line, or None. `available`: its CUDA GPUs. Under the local runtime (`ray` None) the
    learner takes GPU 0; under a "private" Ray cluster Ray hands out the GPUs the servers leave,
    from the first, so the servers must take the last ones; a "joined" cluster (runtime.address)
    hands out GPUs the launcher cannot keep the servers off."""
    if ray == "joined":
        return (
            "actors.engine.urls is empty, so the launcher would start SGLang servers on GPUs the "
            "Ray cluster at runtime.address may also hand out: start the servers yourself and "
            "name them with actors.engine.urls=[http://HOST:PORT,...]"
        )
    if available == 0:
        return (
            "actors.engine.urls is empty, so the launcher would start SGLang servers on this "
            "machine's GPUs, and it has none: name running servers with --set "
            "actors.engine.urls=[http://HOST:PORT,...], or run configs/local.yaml (the CPU default)"
        )
    wanted = engine.num_servers * engine.tp_size
    if wanted > available or any(g >= available for g in engine.gpus):
        named = f" (gpus {engine.gpus})" if engine.gpus else ""
        return (
            f"actors.engine: {engine.num_servers} SGLang server(s) x tp_size {engine.tp_size} need "
            f"{wanted} GPUs{named}, but this machine has {available}: lower num_servers or "
            "tp_size, or set gpus"
        )
    sets = gpu_sets(engine.num_servers, engine.tp_size, engine.gpus, available)
    chosen = [g for s in sets for g in s]
    if ray is None and 0 in chosen:
        return (
            f"actors.engine: the SGLang servers would take GPU 0{'' if engine.gpus else ' (all GPUs)'}, "
            "which the learner uses under runtime.type local: lower num_servers or tp_size, or set "
            "gpus to others"
        )
    last = list(range(available - len(chosen), available))
    if ray and sorted(chosen) != last:
        return (
            f"actors.engine.gpus {engine.gpus}: under runtime.type ray the started SGLang servers "
            f"take the machine's last GPUs ({last}; Ray hands out the first ones): leave gpus empty"
        )
    if not sglang_installed(python):
        where = python or sys.executable
        return (
            f"actors.engine.type sglang starts servers with {where}, which has no sglang: {INSTALL}"
        )
    return None


def sglang_installed(python: str | None) -> bool:
    if python is None:
        import importlib.util

        return importlib.util.find_spec("sglang") is not None
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"
    try:
        return (
            subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
