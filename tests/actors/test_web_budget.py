"""web_search's run budget is the run's, not a process's: processes drawing on one run directory
never pay for more than `max_calls_per_run` searches together, and a resumed run goes on with the
count. A cache that cannot be written (or read) never breaks a search."""

from __future__ import annotations

import asyncio
import fcntl
import json
import multiprocessing
import os

import pytest

from actors.tools import CURRENT_TRAJECTORY, TrajectoryContext
from actors.web_search import BUDGET_FILE, DiskCache, RunBudget, SerperProvider, WebSearchTool
from tests.actors.web_standin import KEY, WebStandIn

ENV = "STRATA_TEST_SERPER_KEY"


@pytest.fixture(scope="module")
def standin():
    with WebStandIn() as server:
        yield server


def tool_for(base, cache, run_dir=None, limit=100) -> WebSearchTool:
    return WebSearchTool(
        SerperProvider(f"{base}/search", num_results=1),
        cache,
        ENV,
        max_calls_per_run=limit,
        max_calls_per_trajectory=100,
        requests_per_second=1000,
        retries=0,
        timeout_s=10,
        run_dir=run_dir,
    )


async def ask(tool: WebSearchTool, queries: list[str]):
    """Every query at once, each its own trajectory (a group's members, different questions)."""

    async def one(query):
        token = CURRENT_TRAJECTORY.set(TrajectoryContext())
        try:
            return await tool(query)
        finally:
            CURRENT_TRAJECTORY.reset(token)

    try:
        return await asyncio.gather(*(one(q) for q in queries))
    finally:
        await tool.close()


def searching_process(base, cache_dir, run_dir, tag, n, limit, start, results) -> None:
    """One of a run's processes (a Ray generation worker): `n` different searches at once."""
    os.environ[ENV] = KEY
    tool = tool_for(base, DiskCache(cache_dir), run_dir, limit)
    start.wait(60)  # every process asks at the same moment
    asyncio.run(ask(tool, [f"{tag} {i}" for i in range(n)]))
    results.put(dict(tool.stats.outcomes))


def test_processes_of_one_run_share_its_budget(standin, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(2), ctx.Queue()
    before = len(standin.searches)
    workers = [
        ctx.Process(
            target=searching_process,
            args=(standin.base, tmp_path / "cache", tmp_path, tag, 12, 15, start, results),
        )
        for tag in ("first", "second")
    ]
    for w in workers:
        w.start()
    outcomes = [results.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(30)
        assert w.exitcode == 0
    assert sum(o.get("provider", 0) for o in outcomes) == 15  # 24 asked, 15 paid for
    assert sum(o.get("refused_run_budget", 0) for o in outcomes) == 9
    assert len(standin.searches) - before == 15
    assert int((tmp_path / BUDGET_FILE).read_text()) == 15


def test_the_count_is_read_and_written_under_the_runs_lock(tmp_path):
    """While another process holds the count (its flock), a request waits for it and reads what
    that one wrote: a count read before the lock would grant a request the run no longer has."""
    budget = RunBudget(5, tmp_path)

    async def scenario():
        with open(tmp_path / BUDGET_FILE, "a+") as other:
            fcntl.flock(other, fcntl.LOCK_EX)
            asking = asyncio.ensure_future(budget.take())
            await asyncio.sleep(0.3)
            waited = not asking.done()
            other.write("5\n")  # the other process spends the last ones
            other.flush()
            fcntl.flock(other, fcntl.LOCK_UN)
            return waited, await asking

    assert asyncio.run(scenario()) == (True, False)
    assert (tmp_path / BUDGET_FILE).read_text() == "5\n"


def test_a_resumed_run_goes_on_with_its_count(standin, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, KEY)
    cache = DiskCache(tmp_path / "cache")
    first = tool_for(standin.base, cache, tmp_path, limit=3)
    assert all(r.ok for r in asyncio.run(ask(first, ["one", "two"])))
    resumed = tool_for(standin.base, cache, tmp_path, limit=3)  # a new process, the same run
    results = asyncio.run(ask(resumed, ["three", "four", "five", "one"]))
    # the three new queries race for the one search left (whichever takes the lock first gets
    # it); "one" is a free cache hit
    assert sorted(r.ok for r in results[:3]) == [False, False, True] and results[3].ok
    refused = [r for r in results[:3] if not r.ok]
    assert all("budget of 3 web searches is spent" in r.text for r in refused)
    assert resumed.stats.outcomes == {"provider": 1, "refused_run_budget": 2, "cache_hit": 1}
    assert int((tmp_path / BUDGET_FILE).read_text()) == 3
    other_run = tool_for(standin.base, cache, tmp_path / "next-run", limit=3)
    (tmp_path / "next-run").mkdir()
    assert asyncio.run(ask(other_run, ["six"]))[0].ok  # another run has its own budget


class BadValueCache(DiskCache):
    def put(self, provider, request, response) -> None:
        raise TypeError("Object of type bytes is not JSON serializable")


def test_a_cache_that_fails_never_breaks_a_search(standin, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ENV, KEY)
    (tmp_path / "a-file").write_text("")
    unwritable = DiskCache(tmp_path / "a-file" / "cache")  # its directory cannot be made
    for cache in (unwritable, BadValueCache(tmp_path / "bad")):
        tool = tool_for(standin.base, cache)
        results = asyncio.run(ask(tool, ["Varno Telik", "Varno Telik", "Quorvex", "Quorvex"]))
        assert all(r.ok and "Doc 1 (Title: Answer) The answer to" in r.text for r in results)
        assert tool.stats.outcomes == {"provider": 2, "joined": 2}
        assert tool.stats.cache_put_failures == 2
        logged = [line for line in capsys.readouterr().out.splitlines() if "cache" in line]
        assert len(logged) == 1 and "cannot write" in logged[0], logged  # once, not per search
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_cache_file_of_another_shape_is_asked_again(standin, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, KEY)
    cache = DiskCache(tmp_path / "cache")
    tool = tool_for(standin.base, cache)
    path = cache.path("serper", tool.provider.request("odd"))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(["not", "a", "record"]))
    (result,) = asyncio.run(ask(tool, ["odd"]))
    assert result.ok and tool.stats.outcomes == {"provider": 1}


def test_a_count_that_cannot_be_read_refuses_the_request(standin, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, KEY)
    (tmp_path / BUDGET_FILE).write_text("garbage")
    tool = tool_for(standin.base, DiskCache(tmp_path / "cache"), tmp_path)
    (result,) = asyncio.run(ask(tool, ["anything"]))
    assert (
        not result.ok and "budget cannot be counted" in result.text and "not a count" in result.text
    )
    assert tool.stats.outcomes == {"budget_uncounted": 1} and tool.stats.provider_requests == 0


def test_the_runs_tools_count_in_its_directory(standin, tmp_path, monkeypatch):
    """The runtimes build web_search through `make_tools` with the run's directory: two pools'
    tools (and a resume's) share the run's budget, an evaluation's tools (no run_dir) their own."""
    from pipeline.config.schema import ActorsConfig, RetrievalConfig
    from pipeline.runtime.parts import make_tools

    monkeypatch.setenv(ENV, KEY)
    actors = ActorsConfig.model_validate(
        {
            "format": "chat_tools",
            "tools": ["web_search"],
            "web": {
                "url": f"{standin.base}/search",
                "api_key_env": ENV,
                "cache_dir": str(tmp_path / "cache"),
                "num_results": 1,
                "max_calls_per_run": 3,
            },
        }
    )

    async def search(run_dir, queries):
        tool = make_tools(actors, RetrievalConfig(), None, run_dir)["web_search"]
        try:
            out = []
            for query in queries:
                token = CURRENT_TRAJECTORY.set(TrajectoryContext())
                try:
                    out.append((await tool({"query": query})).ok)
                finally:
                    CURRENT_TRAJECTORY.reset(token)
            return out
        finally:
            await tool.close()

    run = tmp_path / "run"
    run.mkdir()
    assert asyncio.run(search(run, ["pool 0 a", "pool 0 b"])) == [True, True]
    assert asyncio.run(search(run, ["pool 1 a", "pool 1 b"])) == [True, False]
    assert (run / BUDGET_FILE).read_text().strip() == "3"
    assert asyncio.run(search(None, ["eval a", "eval b"])) == [True, True]  # its own count
