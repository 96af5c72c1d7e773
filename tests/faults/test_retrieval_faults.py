"""The search tool against a slow and flaky retrieval server: every call ends within its time
bound as passages or an error observation the agent reads, failures are counted, and retries
are bounded. The faults (HTTP 5xx, a connection dropped mid-request, a reply slower than the
client's timeout) are injected by a stand-in in front of the real request handling."""

import asyncio
import random
import time

from aiohttp import web

from actors.tools import SearchTool, ToolStats, call_tool
from retrieval.client import RetrievalClient
from retrieval.server import serve

HIT = {"document": {"id": "d1", "contents": '"Title"\nsome text'}, "score": 0.5}
TIMEOUT_S, RETRIES, BACKOFF_S = 0.2, 2, 0.01


def flaky_server(faults: list[str], seen: list[str]):
    """/retrieve answers with the next fault of `faults` (then "ok" forever)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        fault = faults.pop(0) if faults else "ok"
        seen.append(fault)
        if fault == "5xx":
            return web.json_response({"error": "overloaded"}, status=503)
        if fault == "drop":  # the connection goes away with no answer
            request.transport.close()
            await asyncio.sleep(1)
        if fault == "slow":
            await asyncio.sleep(TIMEOUT_S * 5)
        return web.json_response({"result": [[HIT] for _ in body["queries"]]})

    app = web.Application()
    app.router.add_post("/retrieve", handler)
    return app


def run_searches(faults: list[str], queries: list[str]):
    seen: list[str] = []
    stats = ToolStats()

    async def main():
        runner, port = await serve(flaky_server(faults, seen), "127.0.0.1", 0)
        client = RetrievalClient(
            f"http://127.0.0.1:{port}", timeout_s=TIMEOUT_S, retries=RETRIES, backoff_s=BACKOFF_S
        )
        tool = SearchTool(client, topk=1)
        try:
            return await asyncio.gather(*(call_tool(tool, q, stats) for q in queries))
        finally:
            await client.close()
            await runner.cleanup()

    started = time.monotonic()
    results = asyncio.run(main())
    return results, stats, seen, time.monotonic() - started


def test_each_fault_is_retried_and_then_answered():
    for fault in ("5xx", "drop", "slow"):
        (result,), stats, seen, _ = run_searches([fault], ["q"])
        assert result.ok and "some text" in result.text, (fault, result)
        assert seen == [fault, "ok"] and stats.errors["search"] == 0


def test_a_server_failing_every_attempt_is_an_error_observation_after_bounded_retries():
    for fault in ("5xx", "drop", "slow"):
        (result,), stats, seen, elapsed = run_searches([fault] * (RETRIES + 1), ["q"])
        assert not result.ok and result.text.startswith("Search failed:"), (fault, result)
        assert f"after {RETRIES + 1} attempts" in result.text
        assert len(seen) == RETRIES + 1  # bounded: no request after the last attempt
        assert (stats.calls["search"], stats.errors["search"]) == (1, 1)
        assert elapsed < (RETRIES + 1) * (TIMEOUT_S + 0.5)


def test_a_mix_of_faults_under_concurrency_loses_no_call():
    rng = random.Random(7)
    faults = [rng.choice(["ok", "ok", "5xx", "drop", "slow"]) for _ in range(60)]
    queries = [f"query {i}" for i in range(24)]  # distinct: the client's cache answers repeats
    results, stats, seen, elapsed = run_searches(list(faults), queries)
    failed = sum(not r.ok for r in results)
    assert len(results) == 24 and all(r.ok or r.text.startswith("Search failed:") for r in results)
    assert (stats.calls["search"], stats.errors["search"]) == (24, failed)
    assert len(seen) <= 24 * (RETRIES + 1)
    assert elapsed < (RETRIES + 1) * (TIMEOUT_S + 0.5) + 2  # concurrent: about one call's bound
