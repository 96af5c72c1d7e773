"""Index kinds at scale: build, bytes, load, memory, latency, recall@3 against flat, server load.

Synthetic clustered unit vectors of E5's width (768): `--clusters` Gaussian centres, each point a
centre plus a variation along 48 shared directions plus noise, normalised (`points`), so that the
nearest neighbours are not trivial for IVF or PQ. Queries are drawn the same way. For each size
and kind:
- build s: train + add (the vectors generated a chunk at a time, never all held);
- bytes: index.faiss on disk; the index directory is written as `retrieval.build` writes it;
- load s and RSS: in a fresh process, `PassageIndex.load` (mapped where faiss allows), RSS after
  the load and after the searches (anonymous and file-backed pages, from /proc/self/status);
- p50/p99 ms of `index.search` at batch 1 and at batch 64, and the Arrow memory one search of 64
  queries allocates beyond the load (its peak in a pool of its own); within the same calls, the
  p50/p99 of faiss's part (`faiss_...`, the index's own search) and of the rest (`gather_...`:
  the passages read for the hits and the result built), so a latency's growth with the corpus
  splits into the index's and Strata's; with `--compare-take`, the
  same for the search before issue 68 (Arrow's take on the whole passage table), timed on the
  same loaded index, alternating with the current one;
- recall@3: the share of flat's top 3 found in the kind's top 3;
- the retrieval server (`retrieval.server.create_app`, micro-batched, on 127.0.0.1) under 128
  concurrent clients of one query each (the pools' load): requests/s and p99 ms. Its search
  function looks the query's vector up: this measures faiss, the passages and HTTP, not the encoder.

    python benchmarks/retrieval_scale.py --sizes 100000 1000000 --kinds flat hnsw ivf ivf_pq \
        [--skip hnsw:1000000] [--compare-take] [--json docs/results/retrieval_scale.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import faiss
import numpy as np
import pyarrow as pa

from retrieval.corpus import Passage
from retrieval.index import FORMAT_VERSION, IndexMeta, PassageIndex, build_settings, write_meta
from retrieval.kinds import IndexSpec, new_index, tune
from retrieval.passages import FILENAME as PASSAGES_FILE
from retrieval.passages import write_passages
from retrieval.server import create_app, serve

DIM = 768
CHUNK = 50_000
CLIENTS = 128
QUERIES = 200


def specs(size: int, hnsw_m: int = 32) -> dict[str, IndexSpec]:
    """Each kind's settings at `size`: nlist about sqrt(n) (4 sqrt(n) trains too slowly on 2
    cores; a GPU trains faiss's 4-16 sqrt(n)), 64 training points a list, PQ of 64 bytes."""
    nlist = 2 ** round(math.log2(math.sqrt(size)))
    return {
        "flat": IndexSpec("flat"),
        "hnsw": IndexSpec("hnsw", hnsw_m=hnsw_m, ef_search=64),
        "ivf": IndexSpec("ivf", nlist=nlist, nprobe=16),
        "ivf_pq": IndexSpec("ivf_pq", nlist=nlist, nprobe=32, pq_m=64),
    }


LATENT = 48  # the shared directions points vary along: text embeddings are low-rank like this


def centres(clusters: int) -> np.ndarray:
    return np.random.default_rng(12345).standard_normal((clusters, DIM), dtype=np.float32)


def directions() -> np.ndarray:
    return 0.7 * np.random.default_rng(54321).standard_normal((LATENT, DIM), dtype=np.float32)


def points(start: int, count: int, means: np.ndarray, seed: int = 0) -> np.ndarray:
    """Rows start..start+count of the synthetic set (the same whatever the chunking): a cluster
    centre, plus a variation along LATENT shared directions (0.7 of the centre's norm), plus
    isotropic noise (0.5): IVF's lists and PQ's codes both lose neighbours on it. (Centres plus
    isotropic noise alone made every neighbour a cluster-mate: IVF found all, PQ nearly none.)"""
    rng = np.random.default_rng([seed, start])
    x = means[rng.integers(0, len(means), count)]
    x += rng.standard_normal((count, LATENT), dtype=np.float32) @ DIRECTIONS / np.sqrt(LATENT)
    x += 0.5 * rng.standard_normal((count, DIM), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


DIRECTIONS = directions()


def chunks(size: int, means: np.ndarray):
    for start in range(0, size, CHUNK):
        yield points(start, min(CHUNK, size - start), means)


def build_one(size: int, spec: IndexSpec, means: np.ndarray, out: Path, passages: Path) -> dict:
    start = time.perf_counter()
    index = new_index(spec, DIM, size)
    if not index.is_trained:
        nlist = faiss.extract_index_ivf(index).nlist
        index.train(points(0, min(size, 64 * nlist), means))
    for chunk in chunks(size, means):
        index.add(chunk)
    build_s = time.perf_counter() - start
    out.mkdir(parents=True)
    faiss.write_index(index, str(out / "index.faiss"))
    os.link(passages, out / PASSAGES_FILE)
    meta = IndexMeta(
        encoder="synthetic",
        encoder_style="auto",
        dim=DIM,
        kind=spec.kind,
        count=size,
        corpus="synthetic",
        corpus_sha256="0",
        faiss_version=faiss.__version__,
        settings=build_settings(spec),
        format=FORMAT_VERSION,
    )
    write_meta(meta, out)
    return {"build_s": build_s, "bytes": (out / "index.faiss").stat().st_size}


def memory() -> dict[str, float]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 2**20  # GiB
    return fields


def take_search(index: PassageIndex, embeddings: np.ndarray, k: int) -> list:
    """`PassageIndex.search` before issue 68: Arrow's take on the whole table, which concatenates
    every record batch's text first. Kept here to be timed against the current search."""
    k = min(k, len(index))
    scores, ids = index.index.search(np.ascontiguousarray(embeddings, dtype=np.float32), k)
    flat = ids.ravel()
    found = flat[flat >= 0]
    rows = index.passages.take(pa.array(found, pa.int64())).to_pydict()
    by_id = {
        i: Passage(id=pid, contents=text)
        for i, pid, text in zip(found.tolist(), rows["id"], rows["contents"], strict=True)
    }
    return [
        [
            (by_id[i], float(s))
            for i, s in zip(r_ids.tolist(), r_scores.tolist(), strict=True)
            if i >= 0
        ]
        for r_ids, r_scores in zip(ids, scores, strict=True)
    ]


SEARCHES = {"search": lambda index, rows: index.search(rows, 3)}
SEARCHES_COMPARED = SEARCHES | {"take": lambda index, rows: take_search(index, rows, 3)}


class FaissClock:
    """A faiss index that keeps the ms of its last search: set as a `PassageIndex`'s `index`, it
    splits one call of `PassageIndex.search` into faiss's part and the rest."""

    def __init__(self, index) -> None:
        self.inner, self.last_ms = index, 0.0

    def search(self, embeddings: np.ndarray, k: int):
        start = time.perf_counter()
        found = self.inner.search(embeddings, k)
        self.last_ms = (time.perf_counter() - start) * 1000
        return found


def latencies(
    index: PassageIndex, queries: np.ndarray, batch: int, rounds: int, searches: dict
) -> dict[str, list[float]]:
    """ms of each search function, round by round alternating, so all see the same machine; each
    on queries of its own, since a query searched a second time finds its graph or lists cached.
    `index.index` is a `FaissClock`: `faiss` and `gather` split each call of `search`."""
    times: dict[str, list[float]] = {name: [] for name in [*searches, "faiss", "gather"]}
    for r in range(rounds):
        for j, (name, search) in enumerate(searches.items()):
            first = (r * len(searches) + j) * batch
            rows = queries[(np.arange(batch) + first) % len(queries)]
            start = time.perf_counter()
            search(index, rows)
            times[name].append((time.perf_counter() - start) * 1000)
            if name == "search":
                times["faiss"].append(index.index.last_ms)
                times["gather"].append(times[name][-1] - index.index.last_ms)
    return times


def arrow_peak_mib(action) -> float:
    """MiB of Arrow memory `action()` held at most: its allocations go to a pool of their own."""
    default = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(default)
    pa.set_memory_pool(pool)
    try:
        action()
    finally:
        pa.set_memory_pool(default)
    return pool.max_memory() / 2**20


async def server_load(index: PassageIndex, queries: np.ndarray, requests: int) -> dict:
    def search(texts: list[str], k: int):
        return index.search(queries[[int(t[1:]) % len(queries) for t in texts]], k)

    app = create_app(search, {}, max_batch=64, max_wait_ms=2.0)
    runner, port = await serve(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/retrieve"
    times: list[float] = []
    try:
        connector = aiohttp.TCPConnector(limit=CLIENTS)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def client(ids: range) -> None:
                for i in ids:
                    sent = time.perf_counter()
                    async with session.post(url, json={"queries": [f"q{i}"], "topk": 3}) as r:
                        r.raise_for_status()
                        await r.read()
                    times.append((time.perf_counter() - sent) * 1000)

            start = time.perf_counter()
            await asyncio.gather(*(client(range(c, requests, CLIENTS)) for c in range(CLIENTS)))
            elapsed = time.perf_counter() - start
    finally:
        await runner.cleanup()
    return {"server_rps": requests / elapsed, "server_p99_ms": float(np.percentile(times, 99))}


def measure(directory: str, truth: str, clusters: int, requests: int, compare: bool) -> dict:
    """In a fresh process: load, memory, latencies, recall against flat's answers, server load."""
    start = time.perf_counter()
    index = PassageIndex.load(directory)
    load_s = time.perf_counter() - start
    loaded = memory()
    queries = points(10**12, QUERIES, centres(clusters), seed=1)
    _, found = index.index.search(queries, 3)
    exact = np.load(truth)
    recall = float(np.mean([len(set(a) & set(b)) / 3 for a, b in zip(exact, found, strict=True)]))
    sweep = {}
    for setting, values in (("nprobe", (8, 32, 128)), ("ef_search", (32, 128))):
        for value in values:
            try:
                tune(index.index, IndexSpec(**{setting: value}))
            except (RuntimeError, AttributeError):  # not this kind's setting
                break
            _, other = index.index.search(queries, 3)
            hits = [len(set(a) & set(b)) / 3 for a, b in zip(exact, other, strict=True)]
            sweep[f"{setting}={value}"] = float(np.mean(hits))
    index = PassageIndex.load(directory)  # back to the built setting
    index.index = FaissClock(index.index)
    searches = SEARCHES_COMPARED if compare else SEARCHES
    one = latencies(index, queries, 1, 50, searches)
    many = latencies(index, queries, 64, 8, searches)
    result = {
        "load_s": load_s,
        "rss_loaded_gib": loaded["VmRSS"],
        "recall_at_3": recall,
        "recall_sweep": sweep,
    }
    for name, search in searches.items():
        prefix = "" if name == "search" else f"{name}_"
        result |= {
            f"{prefix}p50_ms_b1": float(np.percentile(one[name], 50)),
            f"{prefix}p99_ms_b1": float(np.percentile(one[name], 99)),
            f"{prefix}p50_ms_b64": float(np.percentile(many[name], 50)),
            f"{prefix}p99_ms_b64": float(np.percentile(many[name], 99)),
            f"{prefix}arrow_mib_b64": arrow_peak_mib(lambda s=search: s(index, queries[:64])),
        }
    for part in ("faiss", "gather"):  # the parts of the calls of `search` timed above
        for batch, times in (("b1", one[part]), ("b64", many[part])):
            result[f"{part}_p50_ms_{batch}"] = float(np.percentile(times, 50))
            result[f"{part}_p99_ms_{batch}"] = float(np.percentile(times, 99))
    if compare:
        new, old = index.search(queries[:64], 3), take_search(index, queries[:64], 3)
        result["take_same_results"] = new == old
    if requests:
        result.update(asyncio.run(server_load(index, queries, requests)))
    after = memory()
    result.update(rss_searched_gib=after["VmRSS"], rss_anon_gib=after["RssAnon"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--kinds", nargs="+", default=["flat", "hnsw", "ivf", "ivf_pq"])
    parser.add_argument("--skip", nargs="*", default=[], help="kind:size pairs not to run")
    parser.add_argument("--clusters", type=int, default=1_000)
    parser.add_argument("--hnsw-m", type=int, default=32, help="HNSW links a node (build time)")
    parser.add_argument(
        "--requests", type=int, default=2_048, help="server requests a kind (0: no server load)"
    )
    parser.add_argument(
        "--compare-take", action="store_true", help="also time the search before issue 68"
    )
    parser.add_argument("--json", default=None, help="append each result to this JSON file")
    parser.add_argument("--work", default=None)
    parser.add_argument("--child", nargs=4, metavar=("DIR", "TRUTH", "CLUSTERS", "REQUESTS"))
    args = parser.parse_args()
    if args.child:
        directory, truth, clusters, requests = args.child
        result = measure(directory, truth, int(clusters), int(requests), args.compare_take)
        print(json.dumps(result))
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="strata-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    means = centres(args.clusters)
    results = (
        json.loads(Path(args.json).read_text()) if args.json and Path(args.json).exists() else []
    )
    for size in args.sizes:
        # Flat's answers are the truth: computed once per size, a chunk of vectors at a time.
        queries = points(10**12, QUERIES, means, seed=1)
        best = np.full((QUERIES, 3), -np.inf, np.float32)
        ids = np.zeros((QUERIES, 3), np.int64)
        for offset, chunk in zip(range(0, size, CHUNK), chunks(size, means), strict=True):
            scores = queries @ chunk.T
            top = np.argpartition(-scores, 3, axis=1)[:, :3]
            both_s = np.concatenate([best, np.take_along_axis(scores, top, 1)], 1)
            both_i = np.concatenate([ids, top + offset], 1)
            order = np.argsort(-both_s, axis=1)[:, :3]
            best, ids = np.take_along_axis(both_s, order, 1), np.take_along_axis(both_i, order, 1)
        truth = work / f"truth-{size}.npy"
        np.save(truth, ids)
        # Passages the length of wiki-18's (about 100 words), so the server's take() is realistic.
        passages = work / f"passages-{size}.arrow"
        body = "lorem ipsum " * 50
        write_passages((Passage(str(i), f'"P{i}"\n{body}') for i in range(size)), passages)
        for kind in args.kinds:
            if f"{kind}:{size}" in args.skip:
                continue
            spec = specs(size, args.hnsw_m)[kind]
            directory = work / f"{kind}-{size}"
            shutil.rmtree(directory, ignore_errors=True)
            row = {"kind": kind, "size": size, "settings": build_settings(spec)}
            row |= {"nprobe": spec.nprobe} if spec.nprobe else {}
            row |= build_one(size, spec, means, directory, passages)
            child = [sys.executable, __file__, "--child", str(directory), str(truth)]
            child += [str(args.clusters), str(args.requests)]
            child += ["--compare-take"] if args.compare_take else []
            measured = subprocess.run(child, capture_output=True, text=True, check=True)
            row |= json.loads(measured.stdout.strip().splitlines()[-1])
            shutil.rmtree(directory)
            print(json.dumps(row), flush=True)
            results.append(row)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
