"""The `web_search` tool: a search engine on the web through a provider, as the paper's
deep-research setting has (Google, reached through a Serper-compatible API).

- **Providers** register themselves in PROVIDERS: a name -> a class with `request(query)` (the
  HTTP request, whose key-free part is the cache key) and `parse(body)` (the results). `serper`
  speaks Serper's API: POST `{"q": ..., "num": ...}` with the key in `X-API-KEY`, answered with
  `organic: [{title, link, snippet}]` (and optionally `answerBox`).
- **The key** comes from an environment variable (`actors.web.api_key_env`) and goes only into the
  request's header: never into a log line, an observation, the cache or the run directory.
- **The cache**: every answer is kept on disk under the sha256 of (provider, url, query,
  parameters), so a rerun asks the provider nothing and reads the same results; identical
  searches asked at once (a group's members) share one request (`joined`).
- **Budgets**: `max_calls_per_run` provider requests (cache hits are free; a retry is not counted
  again) for the whole run when the tool is given the run directory: counted there (`RunBudget`),
  so every process of the run draws on one count and a resumed run goes on with it; and
  `max_calls_per_trajectory` calls of one trajectory (cache hits count: it is the agent's
  behaviour being bounded; the count is the trajectory's state, `TrajectoryCalls`). A call past
  either gets an observation saying so, and is counted.
- **Rate limit and retries**: requests are spaced `1 / requests_per_second` apart; a timeout, a
  connection error, 429 or 5xx is retried `retries` times with exponential backoff.

Every failure becomes an observation the model reads (never an exception into the agent loop),
and every outcome is counted (`WebStats`); a cache that cannot be written costs the next run a
request, never this call its result (counted, and said once).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import aiohttp

from actors.tools import FunctionTool, ToolResult

MAX_QUERY_CHARS = 512
BUDGET_FILE = "web_search_requests"
"""In the run directory: the provider requests the run has paid for (`RunBudget`)."""


class WebError(Exception):
    """A web request that failed for good (after its retries): the observation's text."""


@dataclass(frozen=True)
class SearchHit:
    title: str
    url: str
    snippet: str


@dataclass(frozen=True)
class Request:
    method: str
    url: str
    body: dict[str, Any]  # everything but the key: the cache key is made of it


class Provider(Protocol):
    name: ClassVar[str]

    def request(self, query: str) -> Request: ...

    def headers(self, key: str) -> dict[str, str]: ...

    def parse(self, body: object) -> list[SearchHit]: ...


PROVIDERS: dict[str, type] = {}
"""Provider name -> its class (`actors.web.provider`)."""


def register_provider(cls: type) -> type:
    PROVIDERS[cls.name] = cls
    return cls


@register_provider
class SerperProvider:
    """Google results through Serper's API (or any server that answers in its JSON format)."""

    name: ClassVar[str] = "serper"

    def __init__(self, url: str, num_results: int) -> None:
        self.url, self.num_results = url, num_results

    def request(self, query: str) -> Request:
        return Request("POST", self.url, {"q": query, "num": self.num_results})

    def headers(self, key: str) -> dict[str, str]:
        return {"X-API-KEY": key, "Content-Type": "application/json"}

    def parse(self, body: object) -> list[SearchHit]:
        if not isinstance(body, dict) or not isinstance(body.get("organic", []), list):
            raise WebError("the search provider answered in an unknown format")
        hits = []
        box = body.get("answerBox")
        if isinstance(box, dict):
            text = box.get("answer") or box.get("snippet")
            if isinstance(text, str) and text.strip():
                hits.append(
                    SearchHit(str(box.get("title", "Answer")), str(box.get("link", "")), text)
                )
        for item in body.get("organic", [])[: self.num_results]:
            if isinstance(item, dict) and isinstance(item.get("link"), str):
                hits.append(
                    SearchHit(
                        str(item.get("title", "")), item["link"], str(item.get("snippet", ""))
                    )
                )
        return hits


def format_hits(hits: list[SearchHit]) -> str:
    """Search results as the model reads them, numbered like the local search's passages."""
    if not hits:
        return "No results."
    return "\n".join(
        f"Doc {i} (Title: {h.title}) {h.snippet}\nURL: {h.url}" for i, h in enumerate(hits, 1)
    )


@dataclass
class WebStats:
    """What the web tools did in this process: every call lands in exactly one outcome."""

    outcomes: Counter = field(default_factory=Counter)
    provider_requests: int = 0  # HTTP requests sent to the provider, retries included
    cache_put_failures: int = 0  # answers the cache could not keep (the call still had them)

    def summary(self) -> str:
        parts = ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))
        unkept = f"; {self.cache_put_failures} not cached" if self.cache_put_failures else ""
        return (
            f"{sum(self.outcomes.values())} calls ({parts}); "
            f"{self.provider_requests} provider requests{unkept}"
        )


class DiskCache:
    """JSON answers on disk under a hash of the request (never the key)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def path(self, provider: str, request: Request) -> Path:
        identity = json.dumps(
            {"provider": provider, "url": request.url, "body": request.body}, sort_keys=True
        )
        digest = hashlib.sha256(identity.encode()).hexdigest()
        return self.directory / provider / digest[:2] / f"{digest}.json"

    def get(self, provider: str, request: Request) -> object | None:
        path = self.path(provider, request)
        try:
            return json.loads(path.read_text(encoding="utf-8"))["response"]
        except (OSError, ValueError, KeyError, TypeError):  # absent, torn, not a record: ask again
            return None

    def put(self, provider: str, request: Request, response: object) -> None:
        path = self.path(provider, request)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        record = {"provider": provider, "url": request.url, "body": request.body}
        try:
            tmp.write_text(json.dumps({"request": record, "response": response}), encoding="utf-8")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)  # what a full disk left half-written


class RunBudget:
    """At most `limit` provider requests for a whole run. With `run_dir`, the count is the file
    BUDGET_FILE there, read, incremented and written under an exclusive `flock`: every process of
    the run (the Ray runtime's generation workers) draws on the one count, and a resumed run goes
    on with it. Without one (an evaluation, a test) the count is this process's."""

    def __init__(self, limit: int, run_dir: str | os.PathLike[str] | None = None) -> None:
        self.limit = limit
        self.path = None if run_dir is None else Path(run_dir) / BUDGET_FILE
        self.spent_here = 0

    async def take(self) -> bool:
        """One request, if the run has one left. OSError or ValueError when the count cannot be
        read or written (the request is then not made)."""
        if self.path is None:
            if self.spent_here >= self.limit:
                return False
            self.spent_here += 1
            return True
        return await asyncio.to_thread(self._take_counted, self.path)  # a held lock waits here

    def _take_counted(self, path: Path) -> bool:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd is closed
            text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
            try:
                spent = int(text or 0)
            except ValueError:
                raise ValueError(f"{path} holds {text[:40]!r}, not a count") from None
            if spent >= self.limit:
                return False
            count = f"{spent + 1}\n".encode()
            os.pwrite(fd, count, 0)
            os.ftruncate(fd, len(count))
            return True
        finally:
            os.close(fd)


class RateLimit:
    """Spaces starts `1 / per_second` apart across every caller of this process."""

    def __init__(self, per_second: float) -> None:
        self.interval = 1.0 / per_second
        self.next = 0.0
        self.lock = asyncio.Lock()

    async def wait(self) -> None:
        async with self.lock:
            now = time.monotonic()
            delay = self.next - now
            self.next = max(now, self.next) + self.interval
        if delay > 0:
            await asyncio.sleep(delay)


RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass
class TrajectoryCalls:
    """A trajectory's calls of one web tool so far: the web tools' per-trajectory state (their
    `create`/`release`, actors/tools.py's FunctionTool), bounding `max_calls_per_trajectory`."""

    made: int = 0


class WebSearchTool(FunctionTool, method="web_search"):
    """`web_search`: the provider's results for the query (see the module doc)."""

    call_tag = "search"  # the tags format: Search-R1 asks its online search with <search> too
    open_tag, close_tag = "<information>", "</information>"

    def __init__(
        self,
        provider: Provider,
        cache: DiskCache,
        api_key_env: str,
        *,
        max_calls_per_run: int,
        max_calls_per_trajectory: int,
        requests_per_second: float,
        retries: int,
        timeout_s: float,
        backoff_s: float = 0.5,
        stats: WebStats | None = None,
        run_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        """`run_dir`: where the run's budget is counted across its processes and resumes (see
        RunBudget); without it, `max_calls_per_run` bounds this process only."""
        self.provider, self.cache, self.api_key_env = provider, cache, api_key_env
        self.max_calls_per_run = max_calls_per_run
        self.budget = RunBudget(max_calls_per_run, run_dir)
        self.max_calls_per_trajectory = max_calls_per_trajectory
        self.rate = RateLimit(requests_per_second)
        self.retries, self.timeout_s, self.backoff_s = retries, timeout_s, backoff_s
        self.stats = stats or WebStats()
        self.cache_failure_said = False
        self.session: aiohttp.ClientSession | None = None
        self.pending: dict[Path, asyncio.Future] = {}  # searches asked and not answered yet
        self.session_loop: asyncio.AbstractEventLoop | None = None

    async def create(self) -> TrajectoryCalls:
        return TrajectoryCalls()

    async def release(self, calls: TrajectoryCalls) -> None:
        """Nothing to give back: the count ends with its trajectory."""

    async def web_search(self, calls: TrajectoryCalls, query: str) -> ToolResult:
        """Search the web (Google); returns the top results' titles, snippets and URLs.

        Args:
            query: What to search for.
        """
        query = " ".join(query.split())[:MAX_QUERY_CHARS]
        if not query:
            return self._done("empty", False, "Empty search query.")
        if calls.made >= self.max_calls_per_trajectory:
            return self._done(
                "refused_trajectory_budget",
                False,
                f"Search refused: this answer has used its {self.max_calls_per_trajectory} web "
                "searches. Answer with what you have.",
            )
        calls.made += 1
        request = self.provider.request(query)
        body = self.cache.get(self.provider.name, request)
        outcome = "cache_hit"
        key = self.cache.path(self.provider.name, request)
        if body is None and key in self.pending:  # a group's members ask alike at once
            body, outcome = await asyncio.shield(self.pending[key]), "joined"
            if body is None:
                return self._done("failed", False, "Search failed: the same search just failed")
        if body is None:
            try:
                granted = await self.budget.take()
            except (OSError, ValueError) as exc:
                return self._done(
                    "budget_uncounted",
                    False,
                    f"Search refused: the run's web search budget cannot be counted ({exc})",
                )
            if not granted:
                return self._done(
                    "refused_run_budget",
                    False,
                    f"Search refused: the run's budget of {self.max_calls_per_run} web searches "
                    "is spent. Answer with what you have.",
                )
            waiting = self.pending[key] = asyncio.get_running_loop().create_future()
            try:
                body = await self._fetch(request)
                self._keep(request, body)
            except WebError as exc:
                return self._done("failed", False, f"Search failed: {exc}")
            finally:
                del self.pending[key]
                waiting.set_result(body)  # None when it failed
            outcome = "provider"
        try:
            hits = self.provider.parse(body)
        except WebError as exc:
            return self._done("failed", False, f"Search failed: {exc}")
        return self._done(outcome, True, format_hits(hits))

    def _keep(self, request: Request, body: object) -> None:
        """Cache `body`; a cache that fails (disk full, permissions, a value it cannot write) is
        counted and said once, and the call keeps its result."""
        try:
            self.cache.put(self.provider.name, request, body)
        except Exception as exc:
            self.stats.cache_put_failures += 1
            if not self.cache_failure_said:
                self.cache_failure_said = True
                print(
                    f"strata: web_search: the cache cannot write ({type(exc).__name__}: {exc}); "
                    "searches go on uncached, the web tools' summary counts them",
                    flush=True,
                )

    def _done(self, outcome: str, ok: bool, text: str) -> ToolResult:
        self.stats.outcomes[outcome] += 1
        return ToolResult(ok, text)

    async def _fetch(self, request: Request) -> object:
        key = os.environ.get(self.api_key_env, "")
        if not key:
            raise WebError(f"no API key: the environment variable {self.api_key_env} is not set")
        if self.session is None or self.session_loop is not asyncio.get_running_loop():
            # a session belongs to its event loop: an evaluation after a run, a test's next
            # asyncio.run, gets its own
            self.session = aiohttp.ClientSession()
            self.session_loop = asyncio.get_running_loop()
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            await self.rate.wait()
            self.stats.provider_requests += 1
            try:
                async with self.session.request(
                    request.method,
                    request.url,
                    json=request.body,
                    headers=self.provider.headers(key),
                    timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                    allow_redirects=False,
                ) as response:
                    if response.status in RETRY_STATUSES:
                        problem = f"the provider answered HTTP {response.status}"
                        continue
                    if response.status != 200:  # 401, 403, 400: asking again would not help
                        raise WebError(f"the provider answered HTTP {response.status}")
                    try:
                        return await response.json(content_type=None)
                    except ValueError:
                        raise WebError("the provider's answer is not JSON") from None
            except (aiohttp.ClientError, TimeoutError) as exc:
                problem = f"{type(exc).__name__}" + (f" ({exc})" if str(exc) else "")
        raise WebError(f"{problem}, after {self.retries + 1} attempts")

    async def close(self) -> None:
        if self.session is not None and self.session_loop is asyncio.get_running_loop():
            await self.session.close()
        self.session = None
