"""Async client of a Search-R1-style retrieval server, with timeouts, retries and a result cache.

The LRU cache makes identical queries give identical results within a run, so a replayed
trajectory sees the passages its original saw even if the index is rebuilt meanwhile.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import aiohttp

from retrieval.corpus import Passage


class RetrievalError(RuntimeError):
    """The search failed (server down, timeout, bad answer); the agent sees it as a tool error."""


class RetrievalClient:
    def __init__(
        self,
        url: str,
        topk: int = 3,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.2,
        cache_size: int = 100_000,
    ) -> None:
        self.url = url.rstrip("/")
        self.topk = topk
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.retries = retries
        self.backoff_s = backoff_s
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, int], list[tuple[Passage, float]]] = OrderedDict()
        self._session: aiohttp.ClientSession | None = None
        self.requests = 0
        self.cache_hits = 0

    async def __aenter__(self) -> RetrievalClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def health(self) -> dict:
        session = self._get_session()
        async with session.get(f"{self.url}/health") as response:
            response.raise_for_status()
            return await response.json()

    async def search(self, query: str, topk: int | None = None) -> list[tuple[Passage, float]]:
        return (await self.search_many([query], topk))[0]

    async def search_many(
        self, queries: list[str], topk: int | None = None
    ) -> list[list[tuple[Passage, float]]]:
        """Top-k (passage, score) lists, one per query; cached queries skip the server."""
        k = topk or self.topk
        found = {q: self._cache[(q, k)] for q in dict.fromkeys(queries) if (q, k) in self._cache}
        missing = [q for q in dict.fromkeys(queries) if q not in found]
        if missing:  # answered from what was fetched: more new queries than the cache holds, or
            # another search evicting meanwhile, must not lose them
            found.update(zip(missing, await self._post(missing, k), strict=True))
        self.cache_hits += len(queries) - len(missing)
        for query in queries:  # in order of use: the last used is the last evicted
            self._cache[(query, k)] = found[query]
            self._cache.move_to_end((query, k))
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return [found[query] for query in queries]

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self._session

    async def _post(self, queries: list[str], k: int) -> list[list[tuple[Passage, float]]]:
        body = {"queries": queries, "topk": k, "return_scores": True}
        last_error = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                self.requests += 1
                async with self._get_session().post(f"{self.url}/retrieve", json=body) as response:
                    if 400 <= response.status < 500:  # our request is wrong: retrying will not help
                        raise RetrievalError(
                            f"retrieval server refused the request: {await response.text()}"
                        )
                    if response.status >= 500:
                        last_error = f"HTTP {response.status} from {self.url}"
                        continue
                    payload = await response.json()
                return _parse_result(payload, len(queries))
            except (aiohttp.ClientError, TimeoutError) as exc:
                last_error = f"{type(exc).__name__} talking to {self.url}: {exc}"
        raise RetrievalError(f"search failed after {self.retries + 1} attempts: {last_error}")


def _parse_result(payload: object, expected: int) -> list[list[tuple[Passage, float]]]:
    try:
        result = payload["result"]  # type: ignore[index]
        if len(result) != expected:
            raise ValueError(f"{len(result)} result lists for {expected} queries")
        return [
            [
                (
                    Passage(id=str(hit["document"]["id"]), contents=hit["document"]["contents"]),
                    float(hit["score"]),
                )
                for hit in hits
            ]
            for hits in result
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise RetrievalError(f"malformed answer from the retrieval server: {exc}") from None
