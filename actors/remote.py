"""SGLang rollout engine (`actors.engine.type: sglang`): an aiohttp client of running SGLang servers.

Each request goes to the server with the fewest requests in flight; a server that just failed
(refused, timed out, HTTP 5xx) is skipped for `cooldown_s` while another one is healthy. A failed
request raises `EngineError` at once (the agent loop counts its trajectory as aborted) and never
waits on a server longer than `timeout_s`, so a dead server cannot hang the actor pool.

The SGLang HTTP API as used here, checked against SGLang's own source (sgl-project/sglang:
python/sglang/srt/entrypoints/http_server.py, managers/io_struct.py, managers/tokenizer_manager.py,
managers/schedule_batch.py, utils/weight_versions.py; docs.sglang.io basic_usage/sampling_params):

    POST /generate {"input_ids", "sampling_params": {...}, "return_logprob": true}
      -> {"text", "output_ids": [id, ...], "meta_info": {
            "output_token_logprobs": [[logprob, token_id, text or null], ...],
            "finish_reason": {"type": "stop", "matched": str | token id}
                           | {"type": "length", "length": n} | {"type": "abort", "message": ...},
            "weight_version": str,                                  # "default" unless set
            "weight_versions": [{"version", "start", "end"}, ...],  # newer servers: per-token spans
            "prompt_tokens", "completion_tokens", ...}}
    POST /pause_generation {"mode": "abort" | "retract" | "in_place"}   (older servers: no body)
    POST /continue_generation {}
    POST /update_weights_from_disk {"model_path", "weight_version"} -> {"success", "message"}
         (HTTP 400 with success false when it fails)
    POST /init_weights_update_group {"master_address", "master_port", "rank_offset", "world_size",
                                     "group_name", "backend"} -> {"success", "message"}
    POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name", "flush_cache",
                                           "weight_version"} -> {"success", "message"}

SGLang (layers/sampler.py) reports log_softmax(logits / temperature) of each sampled token (of the
logits when greedy), which is what `Generation.logprobs` promises, unless the server runs with
SGLANG_RETURN_ORIGINAL_LOGPROB=1: leave that unset.
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

from actors import remote_nccl
from actors.engine import EngineError, FinishReason, Generation, SamplingParams

PauseMode = Literal["abort", "retract", "in_place"]


@dataclass
class _Server:
    url: str
    version: int
    in_flight: int = 0
    requests: int = 0
    aborts: int = 0  # requests that raised EngineError: their trajectories were aborted
    server_aborts: int = 0  # answers the server itself finished with finish_reason "abort"
    failed_at: float | None = None  # monotonic time of the last transport failure
    # known down (its process is being restarted): out of rotation until readmitted
    held: bool = False


class RemoteEngine:
    """What every HTTP inference-server engine shares: least-loaded routing over `urls`, cooldown
    of failed servers, timeouts, per-server versions and stats, and the pause -> update -> resume
    round of a weight update. Subclasses speak a server's wire format (`generate`, `_pause`,
    `_resume`, the update calls)."""

    name = "remote"

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

    async def __aenter__(self) -> RemoteEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def version(self) -> int:
        """The oldest version a live server serves: a new trajectory may be sampled with it."""
        live = self._live() or [s for s in self._servers if not s.held] or self._servers
        return min(server.version for server in live)

    def stats(self) -> dict[str, float]:
        """Totals, plus `<name>/<url>` per server: requests, aborts, server_aborts, in_flight,
        version, healthy (0/1)."""
        out: dict[str, float] = {"version": self.version}
        live = self._live()
        for name in ("requests", "aborts", "server_aborts", "in_flight"):
            out[name] = sum(getattr(server, name) for server in self._servers)
        for server in self._servers:
            for name in ("requests", "aborts", "server_aborts", "in_flight", "version"):
                out[f"{name}/{server.url}"] = getattr(server, name)
            out[f"healthy/{server.url}"] = int(server in live)
        return out

    # ------------------------------------------------------------------- restarted servers

    def hold(self, url: str) -> None:
        """Take the server at `url` out of rotation: it is known down and being restarted. New
        requests go to the others (or wait, up to timeout_s, when none is left); weight updates
        skip it. `readmit` puts it back."""
        self._server(url).held = True
        if all(s.held for s in self._servers):
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
            if self._published is not None:
                version, path = self._published
                await self._load(server, version, path)
            else:
                version = self._initial_version
            server.version, server.held, server.failed_at = version, False, None
            self._event().set()
        return version

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
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _live(self) -> list[_Server]:
        now = time.monotonic()
        return [
            s
            for s in self._servers
            if not s.held and (s.failed_at is None or now - s.failed_at >= self.cooldown_s)
        ]

    async def _choose(self) -> _Server:
        """The least loaded live server; while every server is held (restarting), wait for one
        to be readmitted rather than fail requests by the hundred, up to timeout_s."""
        if all(s.held for s in self._servers):
            try:
                await asyncio.wait_for(self._event().wait(), self.timeout_s)
            except TimeoutError:
                raise EngineError(
                    f"every {self.name} server is down and none was back within {self.timeout_s:g} s"
                ) from None
        unheld = [s for s in self._servers if not s.held]
        candidates = self._live() or unheld  # all failed recently: try anyway
        return min(candidates, key=lambda s: (s.in_flight, s.requests))

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
            server.failed_at = time.monotonic()
            raise EngineError(f"no answer from {url} within {timeout.total:g} s") from None
        except aiohttp.ClientError as exc:
            server.failed_at = time.monotonic()
            raise EngineError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
        if status >= 500:
            server.failed_at = time.monotonic()
            raise EngineError(f"HTTP {status} from {url}: {text[:300]}")
        server.failed_at = None  # it answered: alive, whatever it said
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
        receiver must take part. Held servers (restarting) are skipped: `readmit` loads the
        published checkpoint into them. Raises, naming each server that failed, once all are done."""
        servers = [s for s in self._servers if not s.held]
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


class SGLangEngine(RemoteEngine):
    """SGLang's native API (see the module doc)."""

    name = "sglang"
    path_only = (
        "SGLang servers cannot take an in-process state_dict: save an HF checkpoint and pass path= "
        "(update_weights_from_disk), or broadcast over NCCL with update_weights_distributed"
    )

    async def _pause(self, server: _Server) -> None:
        await self._post(
            server, "pause_generation", {"mode": self.pause_mode}, self._control_timeout
        )

    async def _resume(self, server: _Server) -> None:
        await self._post(server, "continue_generation", {}, self._control_timeout)

    # ------------------------------------------------------------------------------- generate

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if not prompt_ids:
            raise EngineError("empty prompt")
        server = await self._choose()
        body = {
            "input_ids": list(prompt_ids),
            "sampling_params": {
                "temperature": float(params.temperature),  # 0.0: greedy
                "top_p": float(params.top_p),
                "max_new_tokens": int(params.max_new_tokens),
                "stop": list(params.stop),
                "no_stop_trim": True,  # the stop string stays in the output, as the protocol says
                "skip_special_tokens": False,
            },
            "return_logprob": True,
        }
        return await self._generate_on(
            server,
            "generate",
            body,
            lambda payload, believed: _parse_generation(payload, believed, server.url),
        )

    async def _load(self, server: _Server, version: int, path: str) -> None:
        await self._post(server, "update_weights_from_disk",
                         {"model_path": path, "weight_version": str(version)},
                         self._control_timeout, check_success=True)  # fmt: skip

    # ------------------------------------------------------------------------- weights: NCCL

    async def update_weights_distributed(
        self,
        version: int,
        named_tensors: Mapping[str, Any],
        *,
        master_address: str,
        master_port: int,
        group_name: str = "strata_weight_sync",
        backend: str = "nccl",
        ranks_per_server: int | None = None,
        bucket_mb: int = 1024,
    ) -> None:
        """Broadcast `named_tensors` (HF parameter names) from this process, rank 0 of a weight
        group that every server's GPUs join, to all servers. The group is formed on first use at
        master_address:master_port (reachable from the servers); the trainer's GPU must not be
        one a server uses. `ranks_per_server`: GPUs per server (default: its tp_size)."""
        problem = remote_nccl.gpu_transport_problem(backend)
        if problem is not None:
            raise EngineError(
                f"update_weights_distributed needs torch.distributed with {backend} and a CUDA GPU "
                f"in this process ({problem}); use update_weights(path=...) instead"
            )
        if not named_tensors:
            raise EngineError("update_weights_distributed got no tensors")
        if self._weights_group is None:
            await self._init_weights_group(
                master_address, master_port, group_name, backend, ranks_per_server
            )
        buckets = remote_nccl.buckets(list(named_tensors.items()), bucket_mb << 20)

        async def update(server: _Server) -> None:
            for i, bucket in enumerate(buckets):
                await self._post(server, "update_weights_from_distributed",
                                 remote_nccl.bucket_body(bucket, group_name, version, i == len(buckets) - 1),
                                 self._control_timeout, check_success=True)  # fmt: skip

        async def broadcast() -> None:  # a server failing mid-broadcast blocks it until timeout
            for bucket in buckets:
                await asyncio.to_thread(
                    remote_nccl.broadcast, self._weights_group, [t for _, t in bucket]
                )

        async with self._updating():
            await self._update_everywhere(version, update, broadcast)

    async def _init_weights_group(
        self,
        master_address: str,
        master_port: int,
        group_name: str,
        backend: str,
        ranks_per_server: int | None,
    ) -> None:
        ranks = []
        for server in self._servers:
            if ranks_per_server is None:
                info = await self._get(server, "get_server_info")
                ranks.append(int(info.get("tp_size", 1)) if isinstance(info, dict) else 1)
            else:
                ranks.append(ranks_per_server)
        world_size = 1 + sum(ranks)
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        joins = [
            self._post(server, "init_weights_update_group",
                       {"master_address": master_address, "master_port": master_port,
                        "rank_offset": offset, "world_size": world_size,
                        "group_name": group_name, "backend": backend},
                       self._control_timeout, check_success=True)
            for server, offset in zip(self._servers, offsets, strict=True)
        ]  # fmt: skip
        group, *_ = await asyncio.gather(
            asyncio.to_thread(
                remote_nccl.join_weights_group,
                master_address,
                master_port,
                world_size,
                group_name,
                backend,
            ),
            *joins,
        )
        self._weights_group = group


# ------------------------------------------------------------------------------------ parsing


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _parse_generation(payload: Any, believed: int, url: str) -> Generation:
    try:
        output_ids = [int(t) for t in payload["output_ids"]]
        meta = payload["meta_info"]
        triples = meta["output_token_logprobs"]
        if len(triples) != len(output_ids):
            raise ValueError(f"{len(output_ids)} output_ids but {len(triples)} logprobs")
        logprobs = []
        for i, (triple, token) in enumerate(zip(triples, output_ids, strict=True)):
            if int(triple[1]) != token:
                raise ValueError(
                    f"output_ids[{i}] is {token} but output_token_logprobs[{i}] is for token "
                    f"{int(triple[1])}"
                )
            logprobs.append(float(triple[0]))
        versions = _token_versions(meta, len(output_ids), believed)
        finish_reason, stop = _finish(meta.get("finish_reason"))
    except (AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:
        detail = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
        raise EngineError(f"malformed answer from {url}/generate: {detail}") from None
    return Generation(output_ids, logprobs, versions, finish_reason, stop)


def _as_version(value: object, fallback: int) -> int:
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return fallback  # SGLang's weight_version is "default" until an update sets it


def _token_versions(meta: dict, n: int, believed: int) -> list[int]:
    versions = [_as_version(meta.get("weight_version"), believed)] * n
    for span in meta.get("weight_versions") or ():  # [start, end) of output tokens per version
        version = _as_version(span["version"], believed)
        for i in range(max(0, int(span["start"])), min(n, int(span["end"]))):
            versions[i] = version
    return versions


def _finish(reason: object) -> tuple[FinishReason, str | None]:
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "stop":
        matched = reason.get("matched") if isinstance(reason, dict) else None
        return "stop", matched if isinstance(matched, str) else None  # an int: EOS token id
    if kind in ("length", "abort"):
        return kind, None  # type: ignore[return-value]
    raise ValueError(f"unknown finish_reason {reason!r}")
