"""A local stand-in for an SGLang server: the endpoints `actors.sglang.SGLangEngine` uses, served by
aiohttp over an in-process `EmbeddedEngine`, with SGLang's request and answer JSON.

    async with await SGLangStandIn.start(EmbeddedEngine.from_pretrained(model_dir)) as server:
        engine = SGLangEngine([server.url])

Knobs for tests: `fail_next` (answer the next N requests with HTTP 500), `delay_s` (hold each
/generate that long first), `await stop()` (shut down: the port refuses connections). `calls`
lists the endpoints hit, in order. While paused, new /generate requests wait; requests already
generating go on (SGLang's "retract"/"in_place" pause keeps them too). Stop strings are always
kept in the output, as SGLang does with `no_stop_trim: true`.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from aiohttp import web

from actors.embedded import EmbeddedEngine
from actors.engine import Generation, SamplingParams
from retrieval.server import serve


class SGLangStandIn:
    def __init__(self, engine: EmbeddedEngine, model_path: str = "") -> None:
        self.engine = engine
        self.model_path = model_path
        self.calls: list[str] = []
        self.bodies: list[tuple[str, dict]] = []
        self.fail_next = 0
        self.delay_s = 0.0
        self.url = ""
        self._running = asyncio.Event()  # cleared while paused
        self._running.set()
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None

    @classmethod
    async def start(
        cls, engine: EmbeddedEngine, model_path: str = "", host: str = "127.0.0.1", port: int = 0
    ) -> SGLangStandIn:
        server = cls(engine, model_path)
        server._runner, bound = await serve(server.app(), host, port)
        server.url = f"http://{host}:{bound}"
        return server

    async def stop(self) -> None:
        """Shut the HTTP server down (the engine stays open): later requests are refused."""
        self._closing.set()  # release held requests so that shutdown does not wait on them
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def close(self) -> None:
        await self.stop()
        await self.engine.close()

    async def __aenter__(self) -> SGLangStandIn:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def app(self) -> web.Application:
        app = web.Application()
        for name, method in [
            ("generate", "_generate"),
            ("pause_generation", "_pause"),
            ("continue_generation", "_continue"),
            ("update_weights_from_disk", "_update_from_disk"),
        ]:
            app.router.add_post(f"/{name}", self._recorded(name, method))
        app.router.add_get("/get_model_info", self._recorded("get_model_info", "_model_info"))
        app.router.add_get("/get_server_info", self._recorded("get_server_info", "_server_info"))
        app.router.add_get("/health", self._health)
        return app

    def _recorded(self, name: str, method: str):
        async def recorded(request: web.Request) -> web.StreamResponse:
            self.calls.append(name)
            body = await request.json() if request.can_read_body else {}
            self.bodies.append((name, body))
            if self.fail_next > 0:
                self.fail_next -= 1
                return web.json_response({"error": {"message": "injected failure"}}, status=500)
            return await getattr(self, method)(body)  # looked up per call: tests may swap one

        return recorded

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _held(self, awaitable) -> bool:
        """Wait for `awaitable` unless the server shuts down first; False if it did."""
        closing = asyncio.ensure_future(self._closing.wait())
        waiting = asyncio.ensure_future(awaitable)
        await asyncio.wait([closing, waiting], return_when=asyncio.FIRST_COMPLETED)
        for task in (closing, waiting):
            task.cancel()
        return not self._closing.is_set()

    # ------------------------------------------------------------------------------ endpoints

    async def _generate(self, body: dict) -> web.Response:
        started = time.monotonic()
        if not await self._held(self._running.wait()):
            return web.json_response({"error": {"message": "server shutting down"}}, status=503)
        if self.delay_s and not await self._held(asyncio.sleep(self.delay_s)):
            return web.json_response({"error": {"message": "server shutting down"}}, status=503)
        input_ids = body.get("input_ids")
        if not isinstance(input_ids, list) or not all(isinstance(t, int) for t in input_ids):
            error = {"error": {"message": "input_ids must be a list of ints"}}
            return web.json_response(error, status=400)
        sp = body.get("sampling_params") or {}
        stop = sp.get("stop") or ()
        params = SamplingParams(
            temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)),
            max_new_tokens=int(sp.get("max_new_tokens", 128)),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
        )
        generation = await self.engine.generate(input_ids, params)
        ids = generation.token_ids
        tokenizer = self.engine.tokenizer
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": _finish_reason(generation),
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": str(generation.versions[-1] if ids else self.engine.version),
            "weight_versions": _spans(generation.versions),
            "e2e_latency": time.monotonic() - started,
        }
        if body.get("return_logprob"):
            texts = (
                tokenizer.batch_decode([[t] for t in ids])
                if body.get("return_text_in_logprobs")
                else [None] * len(ids)
            )
            meta["output_token_logprobs"] = [
                [lp, t, text] for lp, t, text in zip(generation.logprobs, ids, texts, strict=True)
            ]
        text = tokenizer.decode(ids, skip_special_tokens=sp.get("skip_special_tokens", True))
        return web.json_response({"text": text, "output_ids": ids, "meta_info": meta})

    async def _pause(self, body: dict) -> web.Response:
        self._running.clear()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, body: dict) -> web.Response:
        self._running.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _update_from_disk(self, body: dict) -> web.Response:
        label = body.get("weight_version")
        try:
            version = int(label) if label is not None else self.engine.version
            await self.engine.update_weights(version, path=body["model_path"])
        except Exception as exc:  # SGLang answers a failed load with HTTP 400 and success false
            message = f"Failed to update weights: {type(exc).__name__}: {exc}"
            return web.json_response(
                {"success": False, "message": message, "num_paused_requests": 0}, status=400
            )
        self.model_path = body["model_path"]
        message = f"Succeeded to update model weights. Weight version updated to {label}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def _model_info(self, body: dict) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": str(self.engine.version),
            }
        )

    async def _server_info(self, body: dict) -> web.Response:
        return web.json_response({"tp_size": 1, "dp_size": 1, "version": "stand-in"})


def _finish_reason(generation: Generation) -> dict:
    if generation.finish_reason == "stop":
        matched = generation.stop if generation.stop is not None else generation.token_ids[-1]
        return {"type": "stop", "matched": matched}  # a string, or the EOS token id
    if generation.finish_reason == "length":
        return {"type": "length", "length": len(generation.token_ids)}
    return {"type": "abort", "message": "aborted"}


def _spans(versions: list[int]) -> list[dict]:
    spans: list[dict] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(version), "start": i, "end": i + 1})
    return spans
