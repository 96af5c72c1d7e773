"""SGLang rollout engine (`actors.engine.type: sglang`): an aiohttp client of running SGLang servers.

Routing, timeouts, cooldown, the pause -> update -> resume round and restarted servers are
`actors.remote.RemoteEngine`'s, shared with the vLLM engine; this module is SGLang's wire format.

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
from collections.abc import Mapping
from typing import Any

from actors import remote_nccl
from actors.engine import EngineError, FinishReason, Generation, SamplingParams
from actors.remote import RemoteEngine, _Server


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

    async def _reported_version(self, server: _Server) -> int | None:
        info = await self._get(server, "get_model_info")
        label = info.get("weight_version") if isinstance(info, dict) else None
        return None if label is None else _as_version(label, -1)

    async def _load(self, server: _Server, version: int, path: str) -> None:
        await self._post(
            server,
            "update_weights_from_disk",
            {"model_path": path, "weight_version": str(version)},
            self._control_timeout,
            check_success=True,
        )

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
                await self._post(
                    server,
                    "update_weights_from_distributed",
                    remote_nccl.bucket_body(bucket, group_name, version, i == len(buckets) - 1),
                    self._control_timeout,
                    check_success=True,
                )

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
            self._post(
                server,
                "init_weights_update_group",
                {
                    "master_address": master_address,
                    "master_port": master_port,
                    "rank_offset": offset,
                    "world_size": world_size,
                    "group_name": group_name,
                    "backend": backend,
                },
                self._control_timeout,
                check_success=True,
            )
            for server, offset in zip(self._servers, offsets, strict=True)
        ]
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
    """A weight_version as a number. SGLang's is "default" until an update names one: the
    weights the server started with, version 0 of a run."""
    if value == "default":
        return 0
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return fallback


def _token_versions(meta: dict, n: int, believed: int) -> list[int]:
    """Per-token versions: the server's spans where it reports them; elsewhere the older of the
    version served when the request left (`believed`) and the server's `weight_version`, which is
    its version when the output was built: tokens sampled before an update in between are older
    than that, and a label must never be fresher than the weights that produced the token."""
    versions = [min(believed, _as_version(meta.get("weight_version"), believed))] * n
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
