import asyncio

import pytest
from aiohttp import web

from retrieval.client import RetrievalClient, RetrievalError
from retrieval.server import serve

HIT = {"document": {"id": "d1", "contents": '"T"\ntext'}, "score": 0.5}


def with_stub(handler, scenario):
    """A stand-in server on a free loopback port whose /retrieve is `handler`."""

    async def main():
        app = web.Application()
        app.router.add_post("/retrieve", handler)
        runner, port = await serve(app, "127.0.0.1", 0)
        try:
            return await scenario(f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_retries_server_errors_then_succeeds():
    seen = []

    async def handler(request):
        seen.append(await request.json())
        if len(seen) < 3:
            return web.json_response({"error": "busy"}, status=503)
        return web.json_response({"result": [[HIT] for _ in seen[-1]["queries"]]})

    async def scenario(url):
        async with RetrievalClient(url, retries=2, backoff_s=0.01) as client:
            hits = await client.search("q")
        assert hits[0][0].id == "d1" and hits[0][1] == 0.5
        assert seen[-1] == {"queries": ["q"], "topk": 3, "return_scores": True}

    with_stub(handler, scenario)
    assert len(seen) == 3


def test_bad_request_is_not_retried():
    seen = []

    async def handler(request):
        seen.append(1)
        return web.json_response({"error": "'topk' must be an integer"}, status=400)

    async def scenario(url):
        async with RetrievalClient(url, retries=3) as client:
            with pytest.raises(RetrievalError, match="refused the request"):
                await client.search("q")

    with_stub(handler, scenario)
    assert seen == [1]


def test_timeout_and_dead_server_become_retrieval_errors():
    async def slow(request):
        await asyncio.sleep(2)
        return web.json_response({"result": [[]]})

    async def scenario(url):
        async with RetrievalClient(url, timeout_s=0.1, retries=1, backoff_s=0.01) as client:
            with pytest.raises(RetrievalError, match="after 2 attempts"):
                await client.search("q")

    with_stub(slow, scenario)

    async def dead():
        async with RetrievalClient("http://127.0.0.1:9", retries=0) as client:
            with pytest.raises(RetrievalError, match="ClientConnectorError"):
                await client.search("q")

    asyncio.run(dead())


def test_malformed_answer():
    async def handler(request):
        return web.json_response({"result": [[{"document": {"id": "x"}}]]})

    async def scenario(url):
        async with RetrievalClient(url, retries=0) as client:
            with pytest.raises(RetrievalError, match="malformed answer"):
                await client.search("q")

    with_stub(handler, scenario)


def test_identical_queries_are_answered_from_the_cache():
    calls = []

    async def handler(request):
        body = await request.json()
        calls.append(body["queries"])
        return web.json_response(
            {"result": [[{**HIT, "score": float(len(calls))}] for _ in body["queries"]]}
        )

    async def scenario(url):
        async with RetrievalClient(url, cache_size=2) as client:
            first = await client.search("a")
            again = await client.search_many(["a", "b", "a"])
            await client.search("c")  # evicts "b", the least recently used
            assert await client.search("a") == first
            await client.search("b")
        assert again[0] == first and again[2] == first  # same passages, same scores
        assert calls == [["a"], ["b"], ["c"], ["b"]]

    with_stub(handler, scenario)


@pytest.mark.parametrize("cache_size", [0, 1])
def test_more_new_queries_than_the_cache_holds_are_all_answered(cache_size):
    """A KeyError once: the fetched hits were read back from a cache that had evicted them."""

    async def handler(request):
        body = await request.json()
        return web.json_response(
            {"result": [[{**HIT, "score": float(len(q))}] for q in body["queries"]]}
        )

    async def scenario(url):
        async with RetrievalClient(url, cache_size=cache_size) as client:
            hits = await client.search_many(["a", "bb", "ccc", "bb"])
            assert [h[0][1] for h in hits] == [1.0, 2.0, 3.0, 2.0]
            assert len(client._cache) == cache_size

    with_stub(handler, scenario)
