"""A CPU stand-in for an SGLang server, used only by the tests: SGLang's native HTTP API as SGLang
0.5.7+ serves it, over the embedded policy with real log-probs. Every field and behaviour below
was checked against SGLang's source (http_server.py, io_struct.py, tokenizer_manager.py,
scheduler.py, utils/weight_versions.py of 0.5.6-0.5.23; see actors/sglang.py):

    GET  /health, /health_generate             200 once serving
    GET  /get_model_info                        model_path, tokenizer_path, is_generation,
                                                preferred_sampling_params, weight_version, ...
    GET  /get_server_info                       the server args (tp_size, ...) and version
    GET  /get_weight_version                    {"weight_version"}
    POST /generate                              input_ids, sampling_params, return_logprob,
                                                return_text_in_logprobs -> text, output_ids,
                                                meta_info {id, finish_reason, prompt_tokens,
                                                completion_tokens, cached_tokens, weight_version,
                                                total_retractions, e2e_latency,
                                                output_token_logprobs [[lp, id, text|None]],
                                                weight_versions spans (0.5.19+: `spans=True`)}
    POST /pause_generation {"mode"}             a body is required; mode "abort" (default) aborts
                                                every request in flight (each answers HTTP 200
                                                with finish_reason abort) and returns once they
                                                have; "retract" / "in_place" stop decoding until
                                                /continue_generation. New /generate calls wait.
    POST /continue_generation {}                decoding and waiting requests go on
    POST /update_weights_from_disk              {model_path, weight_version, abort_all_requests}
                                                -> {success, message, num_paused_requests}, 200
                                                or 400. Not paused: waits for every request in
                                                flight to finish, and new ones queue behind it
                                                (SGLang's writer-preferring lock); paused: loads
                                                at once. Sets weight_version and model_path.

Where it differs from SGLang: one CPU process; a retracted request goes on with the KV cache the
old weights computed instead of re-prefilling (its later tokens still carry the new version and
its true log-probs); an aborted request answers with no partial output.

In a test's event loop:

    engine = PausableEngine.from_pretrained(model_dir)
    async with await SGLangStandIn.start(engine, model_dir) as server:
        client = SGLangEngine([server.url])

As a process, with SGLang's launch_server flags (and --standin-* ones of its own):

    python -m tests.actors.sglang_standin --model-path DIR --port 30000 [--standin-spans]
        [--standin-truth FILE]  # JSON lines: its start (argv, CUDA_VISIBLE_DEVICES), each
                                # answer's output_ids and true per-token versions, each weight
                                # update; for end-to-end checks

Knobs for tests: `fail_next` (answer the next N requests with HTTP 500), `delay_s` (hold each
/generate that long first), `await stop()` (shut down: the port refuses connections). `calls`
lists the endpoints hit, in order.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path

from aiohttp import web

from actors.embedded import EmbeddedEngine
from actors.engine import Generation, SamplingParams
from pipeline.runtime.startup import uncollected
from retrieval.server import serve

PAUSE_MODES = ("abort", "retract", "in_place")


class PausableEngine(EmbeddedEngine):
    """The embedded engine with a gate before every decode step: closed, the running wave stops
    (applying weight updates that arrive meanwhile) until it opens again."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.decoding = threading.Event()
        self.decoding.set()

    def _apply_pending(self) -> None:
        while not self.decoding.is_set():
            super()._apply_pending()  # an update while paused lands before decoding goes on
            self.decoding.wait(0.02)
        super()._apply_pending()


class SGLangStandIn:
    def __init__(
        self,
        engine: PausableEngine,
        model_path: str = "",
        *,
        spans: bool = True,
        truth: str | os.PathLike[str] | None = None,
        server_args: dict | None = None,
    ) -> None:
        self.engine = engine
        self.model_path = str(model_path)
        self.spans = spans  # per-token weight_versions in meta_info, as SGLang 0.5.19+ reports
        self.truth = Path(truth) if truth is not None else None
        self.server_args = server_args or {}
        self.weight_version = str(self.server_args.get("weight_version", "default"))
        self._labels = {engine.version: self.weight_version}  # engine version -> its label
        self.calls: list[str] = []
        self.bodies: list[tuple[str, dict]] = []
        self.fail_next = 0
        self.delay_s = 0.0
        self.url = ""
        self.paused = False
        self._resumed = asyncio.Event()  # set while not paused
        self._resumed.set()
        self._closing = asyncio.Event()
        self._generating: set[asyncio.Task] = set()
        self._lock = _WriterPreferringLock()
        self._runner: web.AppRunner | None = None

    @classmethod
    async def start(
        cls,
        engine: PausableEngine,
        model_path: str = "",
        host: str = "127.0.0.1",
        port: int = 0,
        **options,
    ) -> SGLangStandIn:
        server = cls(engine, str(model_path), **options)
        server._runner, bound = await serve(server.app(), host, port)
        server.url = f"http://{host}:{bound}"
        return server

    async def stop(self) -> None:
        """Shut the HTTP server down (the engine stays open): later requests are refused."""
        self._closing.set()  # release held requests so that shutdown does not wait on them
        self.engine.decoding.set()
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

    def app(self) -> web.Application:
        app = web.Application()
        for name in (
            "generate",
            "pause_generation",
            "continue_generation",
            "update_weights_from_disk",
        ):
            app.router.add_post(f"/{name}", self._recorded(name, f"_{name}"))
        for name in ("get_model_info", "get_server_info", "get_weight_version"):
            app.router.add_get(f"/{name}", self._recorded(name, f"_{name}"))
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health)
        return app

    def _recorded(self, name: str, method: str):
        async def recorded(request: web.Request) -> web.StreamResponse:
            self.calls.append(name)
            try:
                body = await request.json() if request.can_read_body else None
            except ValueError:
                return _error(400, "the body is not JSON")
            self.bodies.append((name, body or {}))
            if self.fail_next > 0:
                self.fail_next -= 1
                return _error(500, "injected failure")
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

    def _record_truth(self, event: dict) -> None:
        if self.truth is not None:
            with self.truth.open("a") as fh:
                fh.write(json.dumps({**event, "pid": os.getpid()}) + "\n")

    # ------------------------------------------------------------------------------ generate

    async def _generate(self, body: dict | None) -> web.Response:
        started = time.monotonic()
        body = body or {}
        input_ids = body.get("input_ids")
        if not isinstance(input_ids, list) or not all(isinstance(t, int) for t in input_ids):
            return _error(400, "input_ids must be a list of ints")
        if not await self._held(self._resumed.wait()):  # paused: new requests wait
            return _error(503, "server shutting down")
        async with self._lock.reading():  # a whole request: an update waits for it
            if self.delay_s and not await self._held(asyncio.sleep(self.delay_s)):
                return _error(503, "server shutting down")
            sp = body.get("sampling_params") or {}
            stop = sp.get("stop") or ()
            params = SamplingParams(
                temperature=float(sp.get("temperature", 1.0)),
                top_p=float(sp.get("top_p", 1.0)),
                max_new_tokens=int(sp.get("max_new_tokens", 128)),
                stop=(stop,) if isinstance(stop, str) else tuple(stop),
            )
            task = asyncio.ensure_future(self.engine.generate(input_ids, params))
            self._generating.add(task)
            try:
                generation = await task
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # this handler itself was cancelled
                generation = Generation(finish_reason="abort")  # /pause_generation mode abort
            finally:
                self._generating.discard(task)
        ids = generation.token_ids
        if ids:
            self._record_truth(
                {"event": "generate", "output_ids": ids, "versions": generation.versions}
            )
        meta = {
            "id": body.get("rid") or uuid.uuid4().hex,
            "finish_reason": _finish_reason(generation),
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": self._labels[generation.versions[-1]] if ids else self.weight_version,
            "total_retractions": 0,
            "e2e_latency": time.monotonic() - started,
        }
        if self.spans and ids:
            meta["weight_versions"] = _spans([self._labels[v] for v in generation.versions])
        if body.get("return_logprob"):
            tokenizer = self.engine.tokenizer
            texts = (
                tokenizer.batch_decode([[t] for t in ids])
                if body.get("return_text_in_logprobs")
                else [None] * len(ids)
            )
            meta["output_token_logprobs"] = [
                [lp, t, text] for lp, t, text in zip(generation.logprobs, ids, texts, strict=True)
            ]
        skip = sp.get("skip_special_tokens", True)
        text = self.engine.tokenizer.decode(ids, skip_special_tokens=skip)
        return web.json_response({"text": text, "output_ids": ids, "meta_info": meta})

    # ------------------------------------------------------------------------------ control

    async def _pause_generation(self, body: dict | None) -> web.Response:
        if body is None:
            return _error(400, 'pause_generation needs a JSON body ({} or {"mode": ...})')
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _error(400, f"mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}")
        self.paused = True
        self._resumed.clear()
        if mode == "abort":  # every request in flight answers with finish_reason abort first
            for task in list(self._generating):
                task.cancel()
            while self._generating:
                await asyncio.sleep(0.01)
        else:
            self.engine.decoding.clear()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue_generation(self, body: dict | None) -> web.Response:
        if body is None:
            return _error(400, "continue_generation needs a JSON body ({})")
        self.paused = False
        self.engine.decoding.set()
        self._resumed.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _update_weights_from_disk(self, body: dict | None) -> web.Response:
        body = body or {}
        if not isinstance(body.get("model_path"), str):
            return _error(400, "model_path is required")
        if body.get("abort_all_requests"):
            for task in list(self._generating):
                task.cancel()
        if self.paused:  # SGLang loads at once while paused
            return await self._load(body)
        async with self._lock.writing():  # waits for the requests in flight; new ones queue
            return await self._load(body)

    async def _load(self, body: dict) -> web.Response:
        label = body.get("weight_version")
        try:
            version = int(label) if label is not None else self.engine.version
            await self.engine.update_weights(version, path=body["model_path"])
        except Exception as exc:  # SGLang answers a failed load with HTTP 400 and success false
            self._record_truth(
                {"event": "update", "model_path": body["model_path"], "success": False}
            )
            message = f"Failed to update weights: {type(exc).__name__}: {exc}"
            return web.json_response(
                {"success": False, "message": message, "num_paused_requests": 0}, status=400
            )
        self.model_path = body["model_path"]
        message = "Succeeded to update model weights."
        if label is not None:
            self.weight_version = self._labels[version] = str(label)
            message += f" Weight version updated to {label}."
        self._record_truth(
            {
                "event": "update",
                "model_path": self.model_path,
                "weight_version": label,
                "success": True,
            }
        )
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def _get_model_info(self, body: dict | None) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        )

    async def _get_server_info(self, body: dict | None) -> web.Response:
        args = {"tp_size": 1, "dp_size": 1, **self.server_args, "model_path": self.model_path}
        # standin_in_flight: generations running now (its own field: tests kill it mid-request)
        return web.json_response(
            {**args, "version": "stand-in", "standin_in_flight": len(self._generating)}
        )

    async def _get_weight_version(self, body: dict | None) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})


class _WriterPreferringLock:
    """SGLang's model_update_lock: many requests read at once; an update writes alone, and new
    readers queue behind a waiting writer."""

    def __init__(self) -> None:
        self._readers = 0
        self._writing = False
        self._waiting_writers = 0
        self._changed = asyncio.Condition()

    def reading(self):
        return _Held(self, write=False)

    def writing(self):
        return _Held(self, write=True)


class _Held:
    def __init__(self, lock: _WriterPreferringLock, write: bool) -> None:
        self.lock, self.write = lock, write

    async def __aenter__(self) -> None:
        lock = self.lock
        async with lock._changed:
            if self.write:
                lock._waiting_writers += 1
                await lock._changed.wait_for(lambda: not lock._writing and lock._readers == 0)
                lock._waiting_writers -= 1
                lock._writing = True
            else:
                await lock._changed.wait_for(
                    lambda: not lock._writing and lock._waiting_writers == 0
                )
                lock._readers += 1

    async def __aexit__(self, *exc: object) -> None:
        lock = self.lock
        async with lock._changed:
            if self.write:
                lock._writing = False
            else:
                lock._readers -= 1
            lock._changed.notify_all()


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _finish_reason(generation: Generation) -> dict:
    if generation.finish_reason == "stop":
        matched = generation.stop if generation.stop is not None else generation.token_ids[-1]
        return {"type": "stop", "matched": matched}  # a string, or the EOS token id
    if generation.finish_reason == "length":
        return {"type": "length", "length": len(generation.token_ids)}
    return {"type": "abort", "message": "Aborted", "status_code": 200, "err_type": None}


def _spans(labels: list[str]) -> list[dict]:
    spans: list[dict] = []
    for i, label in enumerate(labels):
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": label, "start": i, "end": i + 1})
    return spans


# ------------------------------------------------------------------------------- as a process


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sglang.launch_server (stand-in)")
    parser.add_argument("--model-path", "--model", required=True)
    parser.add_argument("--tokenizer-path")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--random-seed", type=int)
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--max-running-requests", type=int)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--served-model-name")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--skip-server-warmup", action="store_true")
    parser.add_argument(
        "--standin-spans",
        action="store_true",
        help="report per-token weight_versions, as SGLang 0.5.19+ does",
    )
    parser.add_argument(
        "--standin-truth", help="append JSON lines of what was generated with which weights"
    )
    return parser


async def _serve_forever(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    dtype = "float32" if args.dtype in ("auto", "float", "float32") else args.dtype
    with uncollected():  # transformers' model code imports here (pipeline/runtime/startup.py)
        engine = PausableEngine.from_pretrained(
            args.model_path,
            dtype=dtype,
            max_batch_size=args.max_running_requests or 16,
            seed=args.random_seed or 0,
        )
    server_args = {
        "tp_size": args.tp_size,
        "dp_size": 1,
        "mem_fraction_static": args.mem_fraction_static,
        "random_seed": args.random_seed,
        "weight_version": args.weight_version,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    server = await SGLangStandIn.start(
        engine,
        args.model_path,
        args.host,
        args.port,
        spans=args.standin_spans,
        truth=args.standin_truth,
        server_args=server_args,
    )
    server._record_truth(
        {
            "event": "start",
            "pid": os.getpid(),
            "argv": sys.argv[1:],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
    )
    print(f"stand-in SGLang server on {server.url} (pid {os.getpid()})", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_forever(args))
    return 0


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sys.exit(main())
