"""Retrieval server throughput (micro-batched vs one forward per query) and recall@3 on the mini world.

Builds the small mini-GAIA world and a flat MiniLM index in a temporary directory, then:
1. serves it twice on loopback, micro-batched (up to 64 queries per forward) and unbatched (one
   forward per query), and sends the same queries from 64 concurrent clients to each;
2. searches the first-hop query of every question and checks the gold passage is in the top 3.

    python benchmarks/retrieval_server.py [--queries 1024] [--size small]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import aiohttp
import pyarrow.parquet as pq

from pipeline.assets.world import build_world, write_world
from retrieval.build import build
from retrieval.encoders import load_encoder
from retrieval.index import PassageIndex
from retrieval.server import create_app, index_search, serve

CLIENTS = 64


async def throughput(search, queries: list[str], max_batch: int, max_wait_ms: float) -> float:
    """Queries/s answered by a server on 127.0.0.1 with CLIENTS concurrent clients, one query each call."""
    app = create_app(search, {}, max_batch=max_batch, max_wait_ms=max_wait_ms)
    runner, port = await serve(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/retrieve"
    connector = aiohttp.TCPConnector(limit=CLIENTS)
    try:
        async with aiohttp.ClientSession(connector=connector) as session:

            async def client(mine: list[str]) -> None:
                for q in mine:
                    async with session.post(url, json={"queries": [q], "topk": 3}) as response:
                        response.raise_for_status()
                        await response.read()

            start = time.perf_counter()
            await asyncio.gather(*(client(queries[i::CLIENTS]) for i in range(CLIENTS)))
            return len(queries) / (time.perf_counter() - start)
    finally:
        await runner.cleanup()


def first_hops(world_dir: Path) -> tuple[list[str], list[str]]:
    queries, gold = [], []
    for split in ("train", "test"):
        for extra in pq.read_table(world_dir / f"{split}.parquet", columns=["extra_info"])[
            "extra_info"
        ].to_pylist():
            queries.append(extra["hop_queries"][0])
            gold.append(extra["gold_doc_ids"][0])
    return queries, gold


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=1024, help="queries sent to each server")
    parser.add_argument("--size", default="small", choices=["small", "medium"])
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        world_dir, index_dir = Path(tmp) / "world", Path(tmp) / "index"
        write_world(build_world(seed=0, size=args.size), world_dir)
        start = time.perf_counter()
        build(str(world_dir / "corpus.jsonl"), str(index_dir), quiet=True)
        build_s = time.perf_counter() - start
        index = PassageIndex.load(index_dir)
        encoder = load_encoder(index.meta.encoder)
        search = index_search(index, encoder.encode_queries)

        hop_queries, gold = first_hops(world_dir)
        hits = index.search(encoder.encode_queries(hop_queries), 3)
        recall = sum(g in {p.id for p, _ in h} for g, h in zip(gold, hits, strict=True)) / len(gold)

        sample = (hop_queries * (args.queries // len(hop_queries) + 1))[: args.queries]
        batched = asyncio.run(throughput(search, sample, max_batch=64, max_wait_ms=2.0))
        single = asyncio.run(throughput(search, sample, max_batch=1, max_wait_ms=0.0))

    print(
        f"retrieval on the mini world ({args.size}): {len(index)} passages, MiniLM {index.meta.dim}-d, flat index"
    )
    print(
        f"  index build       : {build_s:8.1f} s ({len(index) / build_s:.0f} passages/s, model load included)"
    )
    print(f"  recall@3, 1st hop : {recall:8.3f} over {len(gold)} questions (target >= 0.9)")
    print(f"  micro-batched     : {batched:8.0f} queries/s, {CLIENTS} concurrent clients")
    print(f"  one forward/query : {single:8.0f} queries/s, same queries and clients")
    print(f"  speed-up          : {batched / single:8.1f}x (target >= 5x)")


if __name__ == "__main__":
    main()
