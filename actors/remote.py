"""What every HTTP inference-server engine shares (`RemoteEngine`): the SGLang engine
(`actors.sglang`) and the vLLM engine (`actors.vllm`) differ only in their wire formats.

Each request goes to the server with the fewest requests in flight. A failed request raises
`EngineError` at once (the agent loop counts its trajectory as aborted) and never waits on a server
longer than `timeout_s`, so a dead server cannot hang the actor pool. A weight update pauses every
server, loads, and resumes them all even after a failure.

A server that fails (refused, timed out, HTTP 5xx) or answers with older weights than it was given
is *down*: out of rotation and out of weight updates from disk (an NCCL broadcast still needs
it). Every `cooldown_s` its /health is probed;
once it answers, it rejoins after loading the last published checkpoint (unless it reports that
version already), so a server someone restarted never serves its start-up weights under a newer
version's label. A server the run itself restarts (`ServerWatch`) is *held* instead, and
`readmit` does the same once it is back.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from actors.engine import EngineError, Generation, NoServerBack
from actors.servers import healthy

PauseMode = Literal["abort", "retract", "in_place"]


@dataclass
class _Server:
    url: str
    version: int
    in_flight: int = 0
    requests: int = 0
    aborts: int = 0  # requests that raised EngineError: their trajectories were aborted
    server_aborts: int = 0  # answers the server itself finished with finish_reason "abort"
    # known down (its process is being restarted by the run): out of rotation until readmitted
    held: bool = False
    # failed here: out of rotation until it answers /health again and serves the published weights
    down: bool = False
    rejoins: int = 0  # times it came back from down


class RemoteEngine:
    """What every HTTP inference-server engine shares: least-loaded routing over `urls`, cooldown
    of failed servers, timeouts, per-server versions and stats, and the pause -> update -> resume
    round of a weight update. Subclasses speak a server's wire format (`generate`, `_pause`,
    `_resume`, the update calls)."""

    name = "remote"
    tokenizer = None  # servers tokenize nothing for us: the agent uses the policy's own

    def __init__(
        self,
        urls: list[str],
        *,
        timeout_s: float = 600.0,
        version: int = 0,
        cooldown_s: float = 5.0,
        connect_timeout_s: float = 10.0,
        control_timeout_s: float = 1800.0,
        pause_mode: PauseMode = "retract",
    ) -> None:
        """`pause_mode` is what /pause_generation does to requests in flight during a weight update:
        "retract" keeps them (their later tokens are sampled, and labelled, with the new version);
        "abort" returns them early with finish_reason "abort". Older servers ignore it and abort."""
        if not urls:
            raise EngineError(
                f"the {self.name} engine needs at least one server URL (actors.engine.urls)"
            )
        self._servers = [_Server(url.rstrip("/"), version) for url in urls]
        self.timeout_s = timeout_s
        self.cooldown_s = cooldown_s
        self.pause_mode = pause_mode
        self._timeout = aiohttp.ClientTimeout(
            total=timeout_s, sock_connect=min(connect_timeout_s, timeout_s)
        )
        self._control_timeout = aiohttp.ClientTimeout(
            total=control_timeout_s, sock_connect=connect_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None
        self.generated_tokens = 0
        self._weights_group: Any = None  # torch ProcessGroup of update_weights_distributed
        self._initial_version = version
        self._published: tuple[int, str] | None = None  # the last (version, checkpoint) loaded
        self._update_lock: asyncio.Lock | None = None  # one weight change at a time
        self._back: asyncio.Event | None = None  # set while some server is in rotation
        self._recovering: dict[str, asyncio.Task] = {}  # url -> its rejoin loop
        self._closed = False  # after close(): nothing starts a rejoin loop

    async def __aenter__(self) -> RemoteEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def version(self) -> int:
        """The oldest version a live server serves: a new trajectory may be sampled with it."""
        live = self._live() or self._servers
        return min(server.version for server in live)

    async def served_versions(self) -> dict[str, int]:
        """Each server in rotation and the version it was last told to serve (a wire format
        whose servers report their own version overrides this)."""
        return {server.url: server.version for server in self._live()}

    def stats(self) -> dict[str, float]:
        """Totals, plus `<name>/<url>` per server: requests, aborts, server_aborts, in_flight,
        rejoins, version, healthy (0/1)."""
        out: dict[str, float] = {"version": self.version}
        live = self._live()
        for name in ("requests", "aborts", "server_aborts", "in_flight", "rejoins"):
            out[name] = sum(getattr(server, name) for server in self._servers)
        for server in self._servers:
            for name in ("requests", "aborts", "server_aborts", "in_flight", "rejoins", "version"):
                out[f"{name}/{server.url}"] = getattr(server, name)
            out[f"healthy/{server.url}"] = int(server in live)
        return out

    # ------------------------------------------------------------------- restarted servers

    def hold(self, url: str) -> None:
        """Take the server at `url` out of rotation: it is known down and being restarted. New
        requests go to the others (or wait, up to timeout_s, when none is left); weight updates
        skip it. `readmit` puts it back."""
        self._server(url).held = True
        if not self._live():
            self._event().clear()

    async def readmit(self, url: str) -> int:
        """Put a restarted server back in rotation once it serves what the others serve: it
        started on its model directory's weights, so the checkpoint last published to the
        engine is loaded first. Raises EngineError (the server stays held) if that fails.
        Returns the version it serves."""
        server = self._server(url)
        if self._weights_group is not None:
            raise EngineError(
                f"{url} was restarted but cannot rejoin the NCCL weight group, formed once at the "
                "first distributed update: restart the run, or publish from disk (path=)"
            )
        async with self._updating():
            server.version = await self._bring_up_to_date(server)
            server.held = False
            self._back_in_rotation(server)
        return server.version

    async def _bring_up_to_date(self, server: _Server) -> int:
        """Load the last published checkpoint into `server` unless it reports serving that
        version already; its version. Call holding the update lock."""
        if self._weights_group is not None:  # NCCL: nothing on disk to load; it rejoins as it is
            reported = await self._reported_version(server)
            if reported is not None and reported != server.version:
                raise EngineError(
                    f"{server.url} serves version {reported}, not {server.version}, and cannot "
                    "rejoin the NCCL weight group: restart the run, or publish from disk"
                )
            return server.version
        if self._published is None:
            return self._initial_version  # nothing published: its start-up weights
        version, path = self._published
        if await self._reported_version(server) != version:
            await self._load(server, version, path)
        return version

    async def _reported_version(self, server: _Server) -> int | None:
        """The weight version `server` says it serves, or None where the wire format cannot tell
        (then a rejoining server always reloads)."""
        return None

    def _back_in_rotation(self, server: _Server) -> None:
        server.down = False
        self._event().set()

    def _mark_down(self, server: _Server) -> None:
        """Take a failed server out of rotation; a task probes it until it can rejoin."""
        if server.held or server.down:
            return
        server.down = True
        if not self._live():
            self._event().clear()
        task = self._recovering.get(server.url)
        if (task is None or task.done()) and not self._closed:
            self._recovering[server.url] = asyncio.get_running_loop().create_task(
                self._recover(server)
            )

    async def _recover(self, server: _Server) -> None:
        """Every cooldown_s: once `server` answers /health, bring it up to date, continue it (an
        update may have left it paused) and put it back. A held server is left to whoever holds
        it (`readmit`). Any failure is a retry, never the end of the loop: nothing else would
        restart it."""

        while server.down and not server.held:
            await asyncio.sleep(self.cooldown_s)
            if not await asyncio.to_thread(healthy, server.url):
                continue
            async with self._updating():
                if server.held or not server.down:
                    return
                try:
                    server.version = await self._bring_up_to_date(server)
                    await self._resume(server)
                except Exception as exc:
                    print(
                        f"strata: {server.url} answers again but could not rejoin, retrying "
                        f"in {self.cooldown_s:g} s: {exc}",
                        flush=True,
                    )
                    continue
                server.rejoins += 1
                self._back_in_rotation(server)

    def _server(self, url: str) -> _Server:
        for server in self._servers:
            if server.url == url.rstrip("/"):
                return server
        raise EngineError(f"{url} is not one of this engine's servers")

    def _event(self) -> asyncio.Event:
        if self._back is None:
            self._back = asyncio.Event()
            self._back.set()
        return self._back

    def _updating(self) -> asyncio.Lock:
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        return self._update_lock

    async def close(self) -> None:
        self._closed = True
        tasks = [t for t in self._recovering.values() if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._recovering.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _live(self) -> list[_Server]:
        return [s for s in self._servers if not s.held and not s.down]

    async def _choose(self) -> _Server:
        """The least loaded live server; while every server is down or held, wait for one to
        come back rather than fail requests by the hundred, up to timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        while not self._live():
            self._event().clear()
            try:
                await asyncio.wait_for(self._event().wait(), deadline - time.monotonic())
            except TimeoutError:
                raise NoServerBack(
                    f"every {self.name} server is down and none was back within {self.timeout_s:g} s"
                ) from None
        return min(self._live(), key=lambda s: (s.in_flight, s.requests))

    # ---------------------------------------------------------------------------------- HTTP

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # no connection cap: requests waiting for a pooled connection would eat their timeout
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def _post(
        self,
        server: _Server,
        endpoint: str,
        body: dict,
        timeout: aiohttp.ClientTimeout,
        *,
        check_success: bool = False,
    ) -> Any:
        """The JSON answer; EngineError for anything else. Transport failures and HTTP 5xx put
        the server in cooldown; an answer with `"success": false` raises with its message."""
        url = f"{server.url}/{endpoint}"
        try:
            async with self._get_session().post(url, json=body, timeout=timeout) as response:
                text = await response.text()
                status = response.status
        except TimeoutError:
            self._mark_down(server)
            raise EngineError(f"no answer from {url} within {timeout.total:g} s") from None
        except aiohttp.ClientError as exc:
            self._mark_down(server)
            raise EngineError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
        if status >= 500:
            self._mark_down(server)
            raise EngineError(f"HTTP {status} from {url}: {text[:300]}")
        answer = _json_or_none(text)
        if check_success and isinstance(answer, dict) and "success" in answer:
            if answer["success"] is not True:  # SGLang: HTTP 400 with success false
                raise EngineError(f"{url} failed: {answer.get('message') or answer}")
            return answer
        if status != 200:
            raise EngineError(f"{url} refused the request (HTTP {status}): {text[:300]}")
        if answer is None or check_success:
            raise EngineError(f"malformed answer from {url}: {text[:300]!r}")
        return answer

    async def _get(self, server: _Server, endpoint: str) -> Any:
        url = f"{server.url}/{endpoint}"
        try:
            async with self._get_session().get(url, timeout=self._control_timeout) as response:
                response.raise_for_status()
                return await response.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise EngineError(f"GET {url} failed: {type(exc).__name__}: {exc}") from None

    async def _generate_on(self, server: _Server, endpoint: str, body: dict, parse) -> Generation:
        """POST one generation request to `server` and keep its books: in flight, requests,
        aborts (EngineError: the trajectory is aborted), answers the server itself aborted, and
        tokens generated. `parse(payload, believed_version)` makes the Generation; the version is
        the one the server served when the request left (never fresher than the truth)."""
        believed = server.version
        server.in_flight += 1
        server.requests += 1
        try:
            generation = parse(await self._post(server, endpoint, body, self._timeout), believed)
        except EngineError:
            server.aborts += 1
            raise
        finally:
            server.in_flight -= 1
        if generation.finish_reason == "abort":
            server.server_aborts += 1
        if generation.versions and min(generation.versions) < believed:
            # older weights than it was given: restarted behind our back (labelled as they are)
            print(
                f"strata: {server.url} served version {min(generation.versions)}, not the "
                f"{believed} it was given (restarted?): reloading it",
                flush=True,
            )
            self._mark_down(server)
        self.generated_tokens += len(generation.token_ids)
        return generation

    async def _pause(self, server: _Server) -> None:
        raise NotImplementedError

    async def _resume(self, server: _Server) -> None:
        raise NotImplementedError

    path_only = "this engine's servers load weights from an HF checkpoint directory: pass path="

    async def update_weights(
        self,
        version: int,
        *,
        state_dict: Mapping[str, object] | None = None,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        """Every server loads the HF checkpoint at `path` (a directory they can all read): pause,
        load, continue. A server whose load fails keeps its previous weights and version (the
        raised EngineError names it); the next publish retries it with the newer checkpoint."""
        if state_dict is not None or path is None:
            raise EngineError(self.path_only)
        weights = os.path.abspath(os.fspath(path))
        self._check_checkpoint(weights, version)
        async with self._updating():
            self._published = (version, weights)  # what a restarted server loads (readmit)
            await self._update_everywhere(version, lambda s: self._load(s, version, weights))

    def _check_checkpoint(self, path: str, version: int) -> None:
        """Raise EngineError if no server should be asked to load `path` (nothing checked here)."""

    async def _load(self, server: _Server, version: int, path: str) -> None:
        """Have `server` load the checkpoint at `path` and serve it as `version`."""
        raise NotImplementedError

    async def _update_everywhere(self, version: int, update, sender=None) -> None:
        """Pause every server, run `update(server)` on those that paused, then continue them, even
        after a failed update so that none stays paused. A dead server does not hold the others
        back, except with a `sender` (the NCCL broadcast, run alongside the updates): every
        receiver must take part. Servers out of rotation (held or down) are skipped: they load
        the published checkpoint when they come back. Raises, naming each server that failed,
        once all are done. A broadcast (`sender`) needs every member of its group: a down server
        takes part (or makes the update fail), only held ones are left out."""
        servers = self._live() if sender is None else [s for s in self._servers if not s.held]
        paused = await asyncio.gather(*(self._pause(s) for s in servers), return_exceptions=True)
        problems: dict[str, list[str]] = {}
        for server, result in zip(servers, paused, strict=True):
            if isinstance(result, BaseException):
                problems[server.url] = [f"pause failed: {result}"]
        ready = [s for s in servers if s.url not in problems]
        if sender is not None and problems:
            ready = []  # a broadcast to a missing receiver would hang
        jobs = [update(s) for s in ready] + ([sender()] if sender is not None and ready else [])
        outcomes = await asyncio.gather(*jobs, return_exceptions=True)
        for where, outcome in zip([s.url for s in ready] + ["broadcast"], outcomes, strict=False):
            if isinstance(outcome, BaseException) and not isinstance(outcome, EngineError):
                raise outcome  # a bug or a cancellation, not a server problem
            if isinstance(outcome, EngineError):
                problems.setdefault(where, []).append(str(outcome))
        if "broadcast" in problems:
            problems.update({s.url: ["the broadcast failed"] for s in ready})
        for server in ready:
            if server.url not in problems:
                server.version = version
        to_resume = [
            s for s, p in zip(servers, paused, strict=True) if not isinstance(p, BaseException)
        ]
        resumed = await asyncio.gather(
            *(self._resume(s) for s in to_resume), return_exceptions=True
        )
        for server, result in zip(to_resume, resumed, strict=True):
            if isinstance(result, BaseException):
                done = "" if server.url in problems else f"it serves version {version} but "
                message = f"{done}generation could not be resumed: {result}"
                problems.setdefault(server.url, []).append(message)
        if problems:
            raise EngineError(
                f"weight update to version {version} failed: "
                + "; ".join(f"{where}: {', '.join(said)}" for where, said in problems.items())
            )


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
