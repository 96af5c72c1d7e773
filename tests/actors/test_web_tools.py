"""web_search and browse against a local stand-in on 127.0.0.1 speaking Serper's JSON and serving
hostile pages: results, the disk cache (a rerun asks nothing), budgets, retries, failures as
observations, the key never written, and the agent loop calling web_search through `<search>`."""

from __future__ import annotations

import asyncio
import time

import pytest

import pipeline.assets.cache as cache
from actors.agent import AgentLoop, AgentSettings
from actors.browse import BrowseTool, GuardedResolver
from actors.embedded import EmbeddedEngine
from actors.tools import CURRENT_TRAJECTORY, TrajectoryContext
from actors.web_search import DiskCache, RateLimit, SerperProvider, WebSearchTool, WebStats
from pipeline.config.loader import ConfigError, load_config
from pipeline.config.schema import StrataConfig
from pipeline.runtime.parts import make_tools
from tests.actors.test_agent import Script, Task
from tests.actors.web_standin import KEY, WebStandIn, free_port

ENV = "STRATA_TEST_SERPER_KEY"


@pytest.fixture(scope="module")
def standin():
    with WebStandIn() as server:
        yield server


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(ENV, KEY)


def search_tool(standin, cache_dir, **limits) -> WebSearchTool:
    options = dict(
        max_calls_per_run=100,
        max_calls_per_trajectory=100,
        requests_per_second=1000,
        retries=2,
        timeout_s=5,
        backoff_s=0.01,
    )
    options.update(limits)
    provider = SerperProvider(f"{standin.base}/search", num_results=2)
    return WebSearchTool(provider, DiskCache(cache_dir), ENV, **options)


async def in_trajectory(calls):
    """Run `calls` (coroutine factories) as one trajectory's tool calls."""
    token = CURRENT_TRAJECTORY.set(TrajectoryContext())
    try:
        return [await call() for call in calls]
    finally:
        CURRENT_TRAJECTORY.reset(token)


def test_results_are_cached_on_disk_so_a_rerun_asks_the_provider_nothing(standin, key, tmp_path):
    before = len(standin.searches)
    tool = search_tool(standin, tmp_path / "cache")
    first, again = asyncio.run(
        in_trajectory([lambda: tool("Varno  Telik"), lambda: tool("Varno Telik")])
    )
    assert first.ok and first.text == again.text
    assert "Doc 1 (Title: Answer) The answer to Varno Telik" in first.text
    assert (
        f"Doc 2 (Title: Varno Telik - result 1) Snippet 1 about Varno Telik.\nURL: {standin.base}/page.html?r=1"
        in first.text
    )
    assert len(standin.searches) == before + 1 and standin.searches[-1] == {
        "q": "Varno Telik",
        "num": 2,
    }
    assert tool.stats.outcomes == {"provider": 1, "cache_hit": 1}
    rerun = search_tool(standin, tmp_path / "cache")  # a new process, the same cache
    assert asyncio.run(in_trajectory([lambda: rerun("Varno Telik")]))[0].text == first.text
    assert len(standin.searches) == before + 1 and rerun.stats.provider_requests == 0
    written = b"".join(p.read_bytes() for p in (tmp_path / "cache").rglob("*") if p.is_file())
    assert KEY.encode() not in written and b"Varno Telik" in written
    asyncio.run(tool.close())


def test_identical_searches_asked_at_once_share_one_request(standin, key, tmp_path):
    tool = search_tool(standin, tmp_path / "c")
    before = len(standin.searches)

    async def group():
        return await asyncio.gather(*(in_trajectory([lambda: tool("same")]) for _ in range(4)))

    results = [r for (r,) in asyncio.run(group())]
    assert all(r.ok for r in results) and len({r.text for r in results}) == 1
    assert len(standin.searches) == before + 1
    assert tool.stats.outcomes == {"provider": 1, "joined": 3}
    asyncio.run(tool.close())


def test_budgets_per_trajectory_and_per_run_refuse_with_an_observation(standin, key, tmp_path):
    tool = search_tool(standin, tmp_path / "c", max_calls_per_trajectory=2, max_calls_per_run=1)
    a, b, c = asyncio.run(
        in_trajectory([lambda: tool("alpha"), lambda: tool("beta"), lambda: tool("alpha")])
    )
    assert a.ok
    assert not b.ok and "budget of 1 web searches is spent" in b.text  # a second paid request
    assert not c.ok and "used its 2 web searches" in c.text  # the trajectory's third call
    (d,) = asyncio.run(in_trajectory([lambda: tool("alpha")]))  # another trajectory: cached
    assert d.ok and d.text == a.text
    assert tool.stats.outcomes == {
        "provider": 1,
        "refused_run_budget": 1,
        "refused_trajectory_budget": 1,
        "cache_hit": 1,
    }


def test_retries_then_failures_are_observations_never_exceptions(
    standin, key, tmp_path, monkeypatch
):
    tool = search_tool(standin, tmp_path / "c", retries=2)
    standin.fail_next = 2
    (ok,) = asyncio.run(in_trajectory([lambda: tool("retried")]))
    assert ok.ok and tool.stats.provider_requests == 3
    standin.fail_next = 3
    (failed,) = asyncio.run(in_trajectory([lambda: tool("given up")]))
    assert not failed.ok and failed.text.startswith("Search failed: the provider answered HTTP 503")
    monkeypatch.setenv(ENV, "wrong")
    (refused,) = asyncio.run(in_trajectory([lambda: tool("unauthorised")]))
    assert not refused.ok and "HTTP 401" in refused.text and "wrong" not in refused.text
    monkeypatch.delenv(ENV)
    (nokey,) = asyncio.run(in_trajectory([lambda: tool("no key")]))
    assert not nokey.ok and f"{ENV} is not set" in nokey.text
    monkeypatch.setenv(ENV, KEY)
    down = WebSearchTool(
        SerperProvider(f"http://127.0.0.1:{free_port()}/search", 2),
        DiskCache(tmp_path / "c2"),
        ENV,
        max_calls_per_run=9,
        max_calls_per_trajectory=9,
        requests_per_second=1000,
        retries=1,
        timeout_s=2,
        backoff_s=0.01,
    )
    (gone,) = asyncio.run(in_trajectory([lambda: down("anything")]))
    assert not gone.ok and gone.text.startswith("Search failed:") and "2 attempts" in gone.text
    for t in (tool, down):
        asyncio.run(t.close())


def test_requests_are_spaced_by_the_rate_limit():
    async def starts():
        limit, begun = RateLimit(per_second=20), time.monotonic()
        for _ in range(4):
            await limit.wait()
        return time.monotonic() - begun

    assert asyncio.run(starts()) >= 3 * 0.05 * 0.95  # the first at once, then every 1/20 s


def browse(standin, allow=True, **options) -> BrowseTool:
    settings = dict(max_bytes=100_000, max_chars=2000, max_calls_per_trajectory=50, timeout_s=5)
    settings.update(options)
    allowed = (f"127.0.0.1:{standin.port}",) if allow else ()
    return BrowseTool(allow_hosts=allowed, stats=WebStats(), **settings)


@pytest.mark.parametrize(
    ("path", "ok", "expected"),
    [
        ("page.html", True, "Varno Telik\nBorn in Quorvex."),
        ("to-page", True, "Varno Telik\nBorn in Quorvex."),  # a redirect to an allowed address
        ("latin1", True, "Café Müller"),
        ("not-utf8", True, "caf\ufffd \ufffd\ufffd ok"),
        ("binary", False, "Browse failed: not a text page (image/png)"),
        ("unlabelled-binary", False, "Browse failed: not a text page (binary content)"),
        ("to-localhost", False, "localhost is a loopback, private or reserved address"),
        ("to-private", False, "10.0.0.1 is a loopback, private or reserved address"),
        ("to-metadata", False, "169.254.169.254 is a loopback, private or reserved address"),
        ("loop", False, "more than 5 redirects"),
        ("missing", False, "Browse failed: HTTP 404"),
    ],
)
def test_browse_reads_text_and_refuses_hostile_pages(standin, path, ok, expected):
    tool = browse(standin)
    (result,) = asyncio.run(in_trajectory([lambda: tool(f"{standin.base}/{path}")]))
    assert result.ok == ok and expected in result.text, result.text
    assert "secret" not in result.text
    asyncio.run(tool.close())


def test_browse_cuts_a_huge_page_and_refuses_loopback_not_allowed(standin):
    tool = browse(standin, max_bytes=200_000, max_chars=1000)
    (huge,) = asyncio.run(in_trajectory([lambda: tool(f"{standin.base}/huge")]))
    assert huge.ok and huge.text.endswith("[... page cut at 1000 characters]")
    closed = browse(standin, allow=False)
    results = asyncio.run(
        in_trajectory(
            [lambda: closed(f"{standin.base}/page.html"), lambda: closed("file:///etc/passwd")]
        )
    )
    assert "127.0.0.1 is a loopback" in results[0].text and not results[0].ok
    assert "only http and https" in results[1].text
    for t in (tool, closed):
        asyncio.run(t.close())


def test_search_and_web_search_share_the_search_tag_so_tags_refuses_both():
    with pytest.raises(ConfigError, match="search and web_search both answer <search>"):
        load_config("configs/local.yaml", ["actors.tools=[search,web_search]"])
    config = load_config("configs/gaia.yaml", [])
    assert config.actors.tools == ["web_search", "browse", "python"]


@pytest.fixture
def engine(tiny_policy_dir):
    return EmbeddedEngine.from_pretrained(tiny_policy_dir, max_batch_size=4)


def test_the_agent_calls_web_search_through_search_tags(standin, key, tmp_path, engine):
    actors = StrataConfig.model_validate(
        {
            "actors": {
                "tools": ["web_search"],
                "web": {
                    "url": f"{standin.base}/search",
                    "api_key_env": ENV,
                    "cache_dir": str(tmp_path / "cache"),
                    "num_results": 1,
                    "max_calls_per_trajectory": 1,
                },
            }
        }
    ).actors
    tools = make_tools(actors, None, None)
    loop = AgentLoop(engine, engine.tokenizer, tools, AgentSettings())
    task = Task("q1", "Where was Varno Telik born?", ("Quorvex",))
    script = "<search> Varno Telik </search><search> again </search><answer> Quorvex </answer>"
    with Script(engine, script):
        t = asyncio.run(loop.run(task, "q1@0", 0))
    assert t.tool_names == ["web_search", "web_search"] and t.stratum == 2
    text = engine.tokenizer.decode(t.token_ids)
    assert "The answer to Varno Telik" in text
    assert "used its 1 web searches" in text  # the second call, over the trajectory's budget
    asyncio.run(tools["web_search"].close())


def test_the_connections_own_lookup_refuses_a_name_that_turned_private():
    """DNS rebinding: checked public, resolved private when connecting; the guard is the resolver."""

    async def lookup(allow):
        resolver = GuardedResolver(frozenset(allow))
        try:
            return await resolver.resolve("localhost", 80)
        finally:
            await resolver.close()

    with pytest.raises(OSError, match="localhost resolved to a loopback"):
        asyncio.run(lookup(()))
    assert asyncio.run(lookup(["localhost:80"]))  # an explicit entry passes


def test_the_tiny_policys_warm_start_for_web_search_teaches_the_search_tag(monkeypatch, tmp_path):
    """web_search answers <search> in the tags format: the tiny policy learns it from the search
    demonstrations (the warm start itself is tested in tests/pipeline/test_warm_start.py)."""
    asked = {}
    monkeypatch.setattr(cache, "warm_start_key", lambda *a, **kw: "key")
    monkeypatch.setattr(
        cache, "warm_start", lambda *a, **kw: asked.setdefault("tools", kw["tools"])
    )
    config = load_config(
        "configs/local.yaml",
        [f"runtime.cache_dir={tmp_path}", "actors.tools=[web_search,browse,python]"],
    )
    cache.prepare_policy(config, tmp_path / "world", quiet=True)
    assert asked["tools"] == ("search", "python")
