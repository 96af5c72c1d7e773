"""Inference servers a run starts itself, on this machine (`ManagedServers`), and the watch that
restarts the ones that die while the run goes on (`ServerWatch`).

The vLLM servers of the CPU default (`actors.vllm_server`) and the SGLang servers of the GPU
recipes (`actors.sglang_server`) differ only in the command line and environment they start
with. Every server is bound to `host` (127.0.0.1 unless configured) on a free port, in its own
process group (stopping it stops whatever it spawned), and dies with the thread that started it
(PR_SET_PDEATHSIG), so a launcher killed outright leaves no server behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from actors.engine import EngineError


class ServerStartError(RuntimeError):
    """A server that cannot start, or a machine that cannot start one; one line saying what to do."""


@dataclass
class ManagedServer:
    url: str
    process: subprocess.Popen
    log: Path


@dataclass
class ManagedServers:
    """`count` servers of the HF model at `model_dir`; `start()` returns their URLs once all are
    healthy. Subclasses give the command line and the environment of server `index`."""

    model_dir: str
    count: int = 1
    startup_timeout_s: float = 300.0
    log_dir: str | None = None
    host: str = "127.0.0.1"
    servers: list[ManagedServer] = field(default_factory=list)

    label = "inference"  # "the <label> server at ..." in messages
    log_name = "server"  # logs are <log_dir>/<log_name>-<index>.log
    timeout_key = "actors.engine.startup_timeout_s"

    def command(self, port: int, index: int) -> list[str]:
        raise NotImplementedError

    def environment(self, index: int) -> dict[str, str]:
        """The launcher's environment without its virtual environment's and PYTHONPATH's hold on
        the child, and with nothing downloaded."""
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))
        }
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DO_NOT_TRACK="1")
        return env

    def start(self) -> list[str]:
        try:
            for i in range(self.count):
                self.servers.append(self._spawn(i))
            deadline = time.monotonic() + self.startup_timeout_s
            for server in self.servers:
                while not self._probe(server, deadline):
                    time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        return [s.url for s in self.servers]

    def _spawn(self, index: int, port: int | None = None) -> ManagedServer:
        port = port or free_port(self.host)
        log_dir = Path(self.log_dir) if self.log_dir else Path("/tmp")
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"{self.log_name}-{index}.log"
        with log.open("ab") as out:
            process = subprocess.Popen(
                self.command(port, index),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.environment(index),
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        return ManagedServer(f"http://{self.host}:{port}", process, log)

    def respawn(self, index: int) -> ManagedServer:
        """Start server `index` again on its port without waiting for it: call from the thread
        that started the others (see _die_with_parent)."""
        old = self.servers[index]
        stop_process(old.process)
        port = int(old.url.rsplit(":", 1)[1])
        self.servers[index] = self._spawn(index, port)
        return self.servers[index]

    async def wait_healthy(self, index: int) -> None:
        """Wait for server `index` to answer /health, from an event loop (checks in a thread)."""
        server = self.servers[index]
        deadline = time.monotonic() + self.startup_timeout_s
        while not await asyncio.to_thread(self._probe, server, deadline):
            await asyncio.sleep(0.5)

    def _probe(self, server: ManagedServer, deadline: float) -> bool:
        """One health check: True when healthy; ServerStartError if it exited or ran out of time."""
        if server.process.poll() is not None:
            lines = server.log.read_text(errors="replace").strip().splitlines()
            raise ServerStartError(
                f"the {self.label} server for {server.url} exited with status "
                f"{server.process.returncode} while starting (log {server.log}): "
                f"{(lines[-1:] or ['(no output)'])[0][:300]}"
            )
        if healthy(server.url):
            return True
        if time.monotonic() > deadline:
            raise ServerStartError(
                f"the {self.label} server for {server.url} did not answer /health within "
                f"{self.startup_timeout_s:g}s (log {server.log}): raise {self.timeout_key}"
            )
        return False

    def stop(self) -> None:
        for server in self.servers:
            stop_process(server.process)
        self.servers.clear()

    def __enter__(self) -> ManagedServers:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the thread that started it ends, so a launcher
    killed outright (SIGKILL, OOM) leaves no server behind. Call `start` from a thread that lives
    as long as the servers (the main thread)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """Whether `url`/health answers 200 within `timeout_s` (SGLang and vLLM both serve it)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError):
        return False  # refused, reset, garbled, or not a URL at all: not healthy


def stop_process(process: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the server's process group (the server and what it spawned), then SIGKILL."""
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
    with contextlib.suppress(ProcessLookupError):  # a child may outlive the server a moment
        os.killpg(process.pid, signal.SIGKILL)


class ServerWatch:
    """Restarts, while a run goes on, the servers of a `ManagedServers` that die.

    Every `poll_s` it looks at the server processes. For one that has exited: `hold(url)` (its
    engine stops sending it requests; its in-flight ones have already failed and were counted as
    aborted), start it again on its port, wait for /health, then `readmit(url)` (the engine loads
    the last published checkpoint into it, then routes to it again). `hold` and `readmit` are
    coroutines, so the engine may live in this process or in a Ray actor. Run it in the event loop
    of the thread that started the servers (the main thread) so that restarted servers still die
    with the launcher. A server that fails to come back `max_attempts` times in a row is left out.
    """

    def __init__(
        self, servers: ManagedServers, hold, readmit, poll_s: float = 0.5, max_attempts: int = 3
    ) -> None:
        self.servers, self.hold, self.readmit = servers, hold, readmit
        self.poll_s, self.max_attempts = poll_s, max_attempts
        self.restarts = 0
        self.left_out: set[int] = set()
        self._failures: dict[int, int] = {}

    async def run(self) -> None:
        while True:
            for index, server in enumerate(list(self.servers.servers)):
                if index not in self.left_out and server.process.poll() is not None:
                    await self._restart(index)
            await asyncio.sleep(self.poll_s)

    async def _restart(self, index: int) -> None:

        server, label = self.servers.servers[index], self.servers.label
        print(
            f"strata: the {label} server at {server.url} exited with status "
            f"{server.process.returncode}; restarting it (log {server.log})",
            flush=True,
        )
        try:
            await self.hold(server.url)
            self.servers.respawn(index)  # here, in the thread that started the others
            await self.servers.wait_healthy(index)
            version = await self.readmit(server.url)
        except (ServerStartError, EngineError) as exc:
            stop_process(self.servers.servers[index].process)  # the next poll tries again
            tries = self._failures[index] = self._failures.get(index, 0) + 1
            if tries >= self.max_attempts:
                self.left_out.add(index)
            gave_up = "; left out of the run" if index in self.left_out else ""
            print(
                f"strata: restarting the {label} server at {server.url} failed "
                f"({tries}/{self.max_attempts}){gave_up}: {exc}",
                flush=True,
            )
            return
        self._failures.pop(index, None)
        self.restarts += 1
        print(
            f"strata: the {label} server at {server.url} is back, serving version {version}",
            flush=True,
        )
