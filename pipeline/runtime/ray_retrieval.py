"""The retrieval server as a Ray actor of a `runtime.type: ray` run, kept serving on its port."""

from __future__ import annotations

import asyncio

from pipeline.runtime.ray_cluster import actor_gone_errors
from pipeline.runtime.startup import resumed
from pipeline.runtime.stream import RunSummary
from retrieval.server import load_app, serve


class RetrievalWorker:
    """The retrieval HTTP server, serving from this actor's event loop. Ray restarts the actor
    when it dies (a fresh one serves nothing): `watch_retrieval` starts it again on its port."""

    def __init__(self) -> None:
        resumed()  # the worker imported this module with the collector paused
        self.runner = None

    async def start(self, index_dir: str, host: str, port: int, options: dict | None = None) -> int:
        """`options`: `parts.retrieval_load_options` of the run's config."""
        self.runner, bound = await serve(load_app(index_dir, **(options or {})), host, port)
        return bound

    def serving(self) -> bool:
        return self.runner is not None

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def watch_retrieval(
    worker,
    index_dir: str,
    host: str,
    port: int,
    summary: RunSummary,
    poll_s: float = 1.0,
    options: dict | None = None,
) -> None:
    """Keeps the retrieval actor serving on `port` (the URL every pool's search tool has): when
    Ray has restarted it after a death, starts its server again there. Meanwhile searches fail
    and the agents see error observations, counted as tool errors. Counts restarts in `summary`."""
    errors = actor_gone_errors()
    while True:
        await asyncio.sleep(poll_s)
        try:
            if await worker.serving.remote():
                continue
            await worker.start.remote(index_dir, host, port, options)
        except errors:  # dead, or being restarted by Ray: look again later
            continue
        summary.retrieval_restarts += 1
        print(f"strata: the retrieval server died; restarted on port {port}", flush=True)
