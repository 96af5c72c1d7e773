import asyncio
import json

import aiohttp
import pytest

from retrieval.index import PassageIndex
from retrieval.server import BATCHER, create_app, index_search, serve


@pytest.fixture(scope="module")
def search(index_dir, encoder):
    return index_search(PassageIndex.load(index_dir), encoder.encode_queries)


def with_server(search, scenario, **app_kwargs):
    """Run `scenario(session, url, app)` against the real app on a free loopback port."""

    async def main():
        app = create_app(search, {"passages": 40}, **app_kwargs)
        runner, port = await serve(app, "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                return await scenario(session, f"http://127.0.0.1:{port}", app)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_api_shape_is_search_r1s(search):
    async def scenario(session, url, app):
        async with session.post(
            f"{url}/retrieve",
            json={"queries": ["figs", "Belvaro"], "topk": 2, "return_scores": True},
        ) as r:
            assert r.status == 200
            body = await r.json()
        assert list(body) == ["result"] and len(body["result"]) == 2
        for hits in body["result"]:
            assert len(hits) == 2
            for hit in hits:
                assert set(hit) == {"document", "score"} and isinstance(hit["score"], float)
                assert set(hit["document"]) == {"id", "contents"}
        assert body["result"][0][0]["document"]["id"] == "city-5"
        async with session.post(f"{url}/retrieve", json={"queries": ["figs"], "topk": 1}) as r:
            bare = await r.json()
        assert bare == {"result": [[body["result"][0][0]["document"]]]}  # no scores by default
        async with session.get(f"{url}/health") as r:
            health = await r.json()
        assert health["status"] == "ok" and health["passages"] == 40

    with_server(search, scenario)


BAD = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (json.dumps({"topk": 3}).encode(), "missing field 'queries'"),
    (json.dumps({"queries": []}).encode(), "non-empty list"),
    (json.dumps({"queries": "figs"}).encode(), "non-empty list"),
    (json.dumps({"queries": ["ok", 7]}).encode(), "queries[1] is int"),
    (
        json.dumps({"queries": ["figs"], "topk": 0}).encode(),
        "'topk' must be an integer in [1, 100]",
    ),
    (json.dumps({"queries": ["figs"], "topk": 10**9}).encode(), "'topk' must be an integer"),
    (json.dumps({"queries": ["figs"], "topk": "3"}).encode(), "'topk' must be an integer"),
    (json.dumps({"queries": ["figs"], "return_scores": "yes"}).encode(), "'return_scores' must be"),
    (json.dumps({"queries": ["x" * 5000]}).encode(), "more than 2048"),
    (json.dumps({"queries": ["q"] * 300}).encode(), "too many queries"),
    (b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),  # was a 500 (RecursionError)
]


def test_bad_requests_get_400_and_the_server_keeps_serving(search):
    async def scenario(session, url, app):
        for body, message in BAD:
            async with session.post(f"{url}/retrieve", data=body) as r:
                assert r.status == 400, body
                assert message in (await r.json())["error"]
        async with session.post(f"{url}/retrieve", json={"queries": ["figs"]}) as r:
            assert r.status == 200

    with_server(search, scenario)


def test_concurrent_clients_are_micro_batched(search):
    queries = [f"what does {c} grow" for c in ["Ardenport", "Belvaro", "Ciskan", "Dorvelle"]] * 16

    async def scenario(session, url, app):
        async def ask(q):
            async with session.post(f"{url}/retrieve", json={"queries": [q], "topk": 3}) as r:
                return (await r.json())["result"][0]

        alone = {q: await ask(q) for q in set(queries)}
        before = app[BATCHER].batches
        together = await asyncio.gather(*(ask(q) for q in queries))
        batches = app[BATCHER].batches - before
        assert [together[i] for i in range(len(queries))] == [alone[q] for q in queries]
        return batches

    batches = with_server(search, scenario, max_wait_ms=20)
    assert batches < len(queries) / 4  # 64 concurrent requests went through a few forwards


def test_a_failing_search_is_a_500_not_a_dead_server():
    calls = []

    def flaky(queries, k):
        calls.append(queries)
        if len(calls) == 1:
            raise RuntimeError("faiss exploded")
        return [[] for _ in queries]

    async def scenario(session, url, app):
        async with session.post(f"{url}/retrieve", json={"queries": ["a"]}) as r:
            assert r.status == 500 and "faiss exploded" in (await r.json())["error"]
        async with session.post(f"{url}/retrieve", json={"queries": ["a"]}) as r:
            assert r.status == 200 and (await r.json()) == {"result": [[]]}

    with_server(flaky, scenario)


def test_the_server_cli_serves_an_index_on_loopback(index_dir):
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrieval.server", "--index", str(index_dir), "--port", "0"],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving ") and "http://127.0.0.1:" in line, proc.stderr.read()
        url = line.split()[-1]
        with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
            assert json.loads(response.read())["passages"] == 40
        request = urllib.request.Request(
            f"{url}/retrieve",
            data=json.dumps({"queries": ["figs"], "topk": 1}).encode(),
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.loads(response.read())["result"][0][0]["id"] == "city-5"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_server_cli_refuses_a_missing_index(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "retrieval.server", "--index", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        done.returncode == 2
        and "not an index directory" in done.stderr
        and "Traceback" not in done.stderr
    )
