"""`actors.agent: {type: openai}`: any agent that speaks OpenAI's chat API, trained unchanged.

Each trajectory gets a session of this actor process's endpoint (actors/openai_endpoint.py,
127.0.0.1), named by an unguessable API key, and the agent is pointed at it:

    path: "pkg.agents:search_agent"     agent(task, endpoint) -> str | float | None
        async: awaited on the pool's event loop; sync: run in a thread of its own (daemon:
        one that never returns cannot hold the process's exit, as an executor's would), so
        it cannot stall the pool. `endpoint.base_url`, `.api_key`, `.model` are what a client
        needs (`AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)`), and
        `.search_url` Strata's retrieval server (POST /retrieve) with actors.tools [search].
    command: [prog, args...]            a program, started per trajectory in a process group
        of its own, with OPENAI_BASE_URL, OPENAI_API_KEY, STRATA_MODEL (and
        STRATA_SEARCH_URL) in its environment and the task as JSON on stdin; its stdout,
        stripped, is the answer; its stderr is appended to `log_dir/agent-<pool>.log`.

Past `actors.agent.deadline_s` the agent is cancelled: a coroutine at its next await, a
program's whole process group killed; a sync function's thread cannot be stopped, so its session
is closed and every request it makes from then on is refused (404 `finished_session`). The
session is closed when the trajectory ends however it ends. What the trajectory is, how it is
scored and how its failures are counted: actors/session_agent.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.agent import AgentSettings, TaskLike
from actors.agent_session import TrajectorySession
from actors.session_agent import AgentFailed, SessionAgent
from actors.tools import Tool


@dataclass(frozen=True)
class Endpoint:
    """What `agent(task, endpoint)` is given: where this trajectory's session is served."""

    base_url: str
    """`http://127.0.0.1:<port>/v1`: OpenAI's base URL for any client."""
    api_key: str
    """This trajectory's session: the key names it, and dies with it."""
    model: str
    """The name the endpoint answers to (any name is taken: there is one policy)."""
    search_url: str | None = None
    """Strata's retrieval server (`POST {search_url}/retrieve {"queries": [...], "topk": k}`)
    when actors.tools holds search; None otherwise."""

    def client(self, **options: Any):
        """An `openai.AsyncOpenAI` for this trajectory, cheaply: the process's one client for this
        endpoint (on this event loop) with this trajectory's key (`with_options`, which shares
        its connections). Making an `AsyncOpenAI(base_url=..., api_key=...)` per trajectory
        works as well but costs ~50 ms of CPU each on 2 cores (benchmarks/agent_endpoint.py),
        taken from the engine when it runs in this process. `options`: `with_options`'s
        (`max_retries`, `timeout`, ...)."""
        from openai import AsyncOpenAI  # the agent's own dependency, not Strata's

        key = (self.base_url, id(asyncio.get_running_loop()))
        shared = _CLIENTS.get(key)
        if shared is None:
            shared = _CLIENTS[key] = AsyncOpenAI(base_url=self.base_url, api_key="unset")
        return shared.with_options(api_key=self.api_key, **options)


_CLIENTS: dict[tuple[str, int], Any] = {}
"""`Endpoint.client`'s shared clients, by base URL and event loop (a client's connections
belong to the loop that opened them)."""


def task_json(task: TaskLike) -> dict[str, Any]:
    """The task as a program gets it on stdin: the question and its row, not the answers."""
    return {
        "id": str(task.id),
        "question": task.question,
        "data_source": task.data_source,
        "level": getattr(task, "level", None),
        "messages": _listed(getattr(task, "messages", None)),
        "tools": _listed(getattr(task, "tools", None)),
        "extra": dict(getattr(task, "extra", None) or {}),
    }


def _listed(value: Any) -> list | None:
    return None if value is None else list(value)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and scalars from Parquet rows
        return value.tolist()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


async def _in_a_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a daemon thread of its own; its result (or exception) here. Cancelling
    the wait leaves the thread to finish alone."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def target() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # the agent's own: handed to the waiting coroutine
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name="strata-agent", daemon=True).start()
    return await done


class FunctionRunner:
    """Runs `agent(task, endpoint)`: awaited if async, else in a thread of its own."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            type(fn).__call__  # an object whose __call__ is async
        )

    async def __call__(self, task: TaskLike, endpoint: Endpoint, name: str) -> Any:
        if self.is_async:
            return await self.fn(task, endpoint)
        result = await _in_a_thread(self.fn, task, endpoint)
        if inspect.isawaitable(result):  # a sync function that made a coroutine
            result = await result
        return result


class CommandRunner:
    """Runs a program per trajectory (see the module doc)."""

    def __init__(self, argv: list[str], log_path: Path | None) -> None:
        program = sys.executable if argv[0] in ("python", "python3") else argv[0]
        self.argv = [program, *argv[1:]]
        self.log_path = log_path

    async def __call__(self, task: TaskLike, endpoint: Endpoint, name: str) -> Any:
        env = dict(os.environ)
        env.update(
            OPENAI_BASE_URL=endpoint.base_url,
            OPENAI_API_KEY=endpoint.api_key,
            STRATA_MODEL=endpoint.model,
        )
        if endpoint.search_url is not None:
            env["STRATA_SEARCH_URL"] = endpoint.search_url
        stdin = json.dumps(task_json(task), default=_jsonable).encode()
        process = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,  # a group of its own: killed whole
        )
        err = b""
        try:
            out, err = await process.communicate(stdin)
        except BaseException:  # the deadline, a stopping pool: nothing of it may outlive us
            _kill_group(process.pid)
            await process.wait()
            self._log(name, "killed (deadline or stop)", err)
            raise
        if process.returncode != 0:
            self._log(name, f"exit status {process.returncode}", err)
            last = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
            raise AgentFailed(
                "exit",
                f"{name}: {self.argv[0]} exited with status {process.returncode}"
                + (f": {last[0][:200]}" if last[0] else ""),
            )
        self._log(name, "exit status 0", err)
        return out.decode("utf-8", "replace").strip() or None

    def _log(self, name: str, how: str, err: bytes) -> None:
        if not err and how == "exit status 0":
            return
        text = err.decode("utf-8", "replace")
        if self.log_path is None:
            sys.stderr.write(text)
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a", encoding="utf-8") as log:
            log.write(f"--- {name}: {how}\n{text}")
            if text and not text.endswith("\n"):
                log.write("\n")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # gone already
        os.killpg(pid, signal.SIGKILL)


class OpenAIAgent(SessionAgent):
    """Runs the configured agent once per trajectory against `endpoint` (an
    actors.openai_endpoint.AgentEndpoint on `engine`, started)."""

    def __init__(
        self,
        runner: FunctionRunner | CommandRunner,
        endpoint: Any,
        engine: Any,
        tokenizer: Any,
        tools: dict[str, Tool],
        settings: AgentSettings,
        *,
        deadline_s: float,
        on_rewrite: str = "segment",
        actor_id: str = "actor-0",
        search_url: str | None = None,
    ) -> None:
        super().__init__(
            engine,
            tokenizer,
            tools,
            settings,
            deadline_s=deadline_s,
            on_rewrite=on_rewrite,
            actor_id=actor_id,
        )
        self.runner, self.endpoint, self.search_url = runner, endpoint, search_url

    def _open(self) -> tuple[str | None, TrajectorySession]:
        s = self.settings
        return self.endpoint.open_session(
            **self.session_limits(),
            temperature=s.temperature,
            top_p=s.top_p,
            max_tokens_default=s.max_new_tokens_per_turn,
            max_tokens_limit=s.max_new_tokens_per_turn,
        )

    async def _drive(
        self, task: TaskLike, key: str | None, session: TrajectorySession, name: str
    ) -> Any:
        handle = Endpoint(
            self.endpoint.base_url, key or "", self.endpoint.model_name, self.search_url
        )
        return await self.runner(task, handle, name)

    def _close(self, key: str | None) -> None:
        if key is not None:
            self.endpoint.close_session(key)
