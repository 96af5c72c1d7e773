"""Search-R1-compatible retrieval server (aiohttp).

    POST /retrieve  {"queries": [...], "topk": k, "return_scores": bool}
        -> {"result": [[{"document": {"id": ..., "contents": ...}, "score": s}, ...], ...]}
           (bare {"id", "contents"} documents when return_scores is false)
    GET  /health    -> {"status": "ok", "passages": n, "encoder": ..., "dim": d}

Concurrent requests are micro-batched: queries that arrive while the encoder is busy (or within
`max_wait_ms`) go through one encoder forward and one faiss search together. Bad requests get
HTTP 400 with {"error": "..."} and the server keeps serving.

    python -m retrieval.server --index DIR [--host 127.0.0.1] [--port 8000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from aiohttp import web

from retrieval.corpus import Passage
from retrieval.encoders import EncoderError, load_encoder
from retrieval.gpu import GpuOptions
from retrieval.index import DEFAULT_GPU, IndexLoadError, PassageIndex
from retrieval.kinds import IndexSpec

BATCHER: web.AppKey[MicroBatcher] = web.AppKey("batcher")
SearchFn = Callable[[list[str], int], list[list[tuple[Passage, float]]]]


@dataclass(frozen=True)
class Limits:
    max_queries: int = 256  # per request
    max_query_chars: int = 2048
    max_topk: int = 100


class MicroBatcher:
    """Collects queries from concurrent requests and runs them as one batch in a worker thread."""

    def __init__(self, search: SearchFn, max_batch: int = 64, max_wait_ms: float = 2.0) -> None:
        self._search = search
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000
        self._queue: asyncio.Queue[tuple[list[str], int, asyncio.Future]] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-retrieve")
        self._worker: asyncio.Task | None = None
        self.batches = 0
        self.queries = 0

    async def search(self, queries: list[str], topk: int) -> list[list[tuple[Passage, float]]]:
        if self._worker is None:
            self._worker = asyncio.create_task(self._run())
        future = asyncio.get_running_loop().create_future()
        await self._queue.put((queries, topk, future))
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            requests = [await self._queue.get()]
            count = len(requests[0][0])
            deadline = loop.time() + self.max_wait_s
            while count < self.max_batch:
                try:
                    item = self._queue.get_nowait()  # arrived while the last batch was running
                except asyncio.QueueEmpty:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    try:
                        item = await asyncio.wait_for(self._queue.get(), remaining)
                    except TimeoutError:
                        break
                requests.append(item)
                count += len(item[0])
            queries = [q for qs, _, _ in requests for q in qs]
            topk = max(k for _, k, _ in requests)
            try:
                results = await loop.run_in_executor(self._executor, self._search, queries, topk)
            except Exception as exc:  # encoder or faiss failure: fail these requests, keep serving
                for _, _, future in requests:
                    if not future.done():
                        future.set_exception(exc)
                continue
            self.batches += 1
            self.queries += len(queries)
            offset = 0
            for qs, k, future in requests:
                if not future.done():
                    future.set_result([hits[:k] for hits in results[offset : offset + len(qs)]])
                offset += len(qs)

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        self._executor.shutdown(wait=True)


def _bad(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


def _parse(body: object, limits: Limits) -> tuple[list[str], int, bool] | str:
    """(queries, topk, return_scores) or the reason the request is bad."""
    if not isinstance(body, dict):
        return "the request body must be a JSON object"
    queries = body.get("queries")
    if queries is None:
        return "missing field 'queries' (a list of strings)"
    if not isinstance(queries, list) or not queries:
        return "'queries' must be a non-empty list of strings"
    if len(queries) > limits.max_queries:
        return f"too many queries: {len(queries)} > {limits.max_queries} per request"
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            return f"queries[{i}] is {type(q).__name__}, expected a string"
        if len(q) > limits.max_query_chars:
            return f"queries[{i}] has {len(q)} characters, more than {limits.max_query_chars}"
    topk = body.get("topk", 3)
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= limits.max_topk:
        return f"'topk' must be an integer in [1, {limits.max_topk}], got {topk!r}"
    return_scores = body.get("return_scores", False)
    if not isinstance(return_scores, bool):
        return f"'return_scores' must be true or false, got {return_scores!r}"
    return queries, topk, return_scores


def create_app(
    search: SearchFn,
    info: dict,
    max_batch: int = 64,
    max_wait_ms: float = 2.0,
    limits: Limits = Limits(),  # frozen: safe as a default
) -> web.Application:
    """The aiohttp application; `search(queries, k)` does the encoding and the faiss lookup."""
    batcher = MicroBatcher(search, max_batch=max_batch, max_wait_ms=max_wait_ms)

    async def retrieve(request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _bad("the request body is not valid JSON")
        except RecursionError:  # a hostile body of 100,000 nested lists
            return _bad("the request body nests too deeply")
        parsed = _parse(body, limits)
        if isinstance(parsed, str):
            return _bad(parsed)
        queries, topk, return_scores = parsed
        try:
            results = await batcher.search(queries, topk)
        except Exception as exc:
            return web.json_response({"error": f"retrieval failed: {exc}"}, status=500)
        if return_scores:
            payload = [[{"document": p.to_json(), "score": s} for p, s in hits] for hits in results]
        else:
            payload = [[p.to_json() for p, _ in hits] for hits in results]
        return web.json_response({"result": payload})

    async def health(request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", **info, "batches": batcher.batches, "queries": batcher.queries}
        )

    async def shutdown(app: web.Application) -> None:
        await batcher.close()

    app = web.Application(client_max_size=4 * 1024 * 1024)
    app.router.add_post("/retrieve", retrieve)
    app.router.add_get("/health", health)
    app.on_cleanup.append(shutdown)
    app[BATCHER] = batcher
    return app


def index_search(index: PassageIndex, encode: Callable[[list[str]], np.ndarray]) -> SearchFn:
    def search(queries: list[str], k: int) -> list[list[tuple[Passage, float]]]:
        return index.search(encode(queries), k)

    return search


def load_search(index_dir: str) -> SearchFn:
    """Search an index directory in-process, with the encoder its meta.json names (what the
    server answers, without the server)."""
    return _load(index_dir)[0]


def _load(
    index_dir: str, search: IndexSpec | None = None, gpu: GpuOptions = DEFAULT_GPU
) -> tuple[SearchFn, dict]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    index = PassageIndex.load(index_dir, search, gpu)
    encoder = load_encoder(index.meta.encoder, style=index.meta.encoder_style)
    info = {
        "passages": len(index),
        "encoder": index.meta.encoder,
        "dim": index.meta.dim,
        "index": index.meta.kind,
        "placement": index.placement.note,
    }
    return index_search(index, encoder.encode_queries), info


def load_app(
    index_dir: str,
    max_batch: int = 64,
    max_wait_ms: float = 2.0,
    search: IndexSpec | None = None,
    gpu: GpuOptions = DEFAULT_GPU,
) -> web.Application:
    """The server for an index directory, with the encoder its meta.json names; `search` sets
    nprobe / efSearch, `gpu` where the index searches (retrieval/gpu.py)."""
    search_fn, info = _load(index_dir, search, gpu)
    return create_app(search_fn, info, max_batch, max_wait_ms)


async def serve(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start `app` on host:port (port 0: any free one); returns the runner and the bound port."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1] if site._server else port  # type: ignore[union-attr]
    return runner, bound


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m retrieval.server", description="Search-R1-compatible retrieval server"
    )
    parser.add_argument(
        "--index", required=True, help="index directory from python -m retrieval.build"
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    parser.add_argument(
        "--max-batch", type=int, default=64, help="most queries per encoder forward"
    )
    parser.add_argument(
        "--max-wait-ms", type=float, default=2.0, help="how long a batch waits to fill"
    )
    parser.add_argument("--nprobe", type=int, default=None, help="IVF lists searched (ivf kinds)")
    parser.add_argument("--ef-search", type=int, default=None, help="HNSW candidates (hnsw)")
    parser.add_argument(
        "--gpu", default="shard", choices=["shard", "replicate", "off"], help="with faiss-gpu"
    )
    parser.add_argument("--gpu-fp32", action="store_true", help="float32 vectors on the GPUs")
    args = parser.parse_args(argv)
    try:
        search = IndexSpec(nprobe=args.nprobe, ef_search=args.ef_search)
        gpu = GpuOptions(mode=args.gpu, fp16=not args.gpu_fp32)
        app = load_app(args.index, args.max_batch, args.max_wait_ms, search, gpu)
    except (IndexLoadError, EncoderError) as exc:
        print(f"strata retrieval: error: {exc}", file=sys.stderr)
        return 2

    async def run() -> None:
        try:
            runner, port = await serve(app, args.host, args.port)
        except OSError as exc:
            raise SystemExit(
                f"strata retrieval: error: cannot listen on {args.host}:{args.port}: {exc.strerror}"
            ) from None
        print(f"serving {args.index} on http://{args.host}:{port}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
