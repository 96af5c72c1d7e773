"""The index kinds: each made from its settings, with a recall against flat, and refused settings."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa
import pytest
from packaging.requirements import Requirement

from pipeline.config.schema import BUILD_SETTINGS, INDEX_SETTINGS, RetrievalConfig
from retrieval.corpus import Passage, make_contents
from retrieval.index import IndexLoadError, PassageIndex, build_index
from retrieval.kinds import FAISS_FLOOR, KINDS, IndexSpec, check_spec, default_nlist, new_index

ROOT = Path(__file__).resolve().parents[2]


def clustered(n: int, dim: int = 64, centres: int = 50, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    means = rng.standard_normal((centres, dim)).astype(np.float32)
    x = means[rng.integers(0, centres, n)] + 0.6 * rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture
def one_thread():
    """faiss's OpenMP threads spin against each other on a busy 2-core machine (PQ training took
    14 s on 2 threads, 3 s on one): these sizes need one."""
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(threads)


def test_the_config_and_the_registry_agree_on_which_setting_acts_for_which_kind():
    for key, kinds in INDEX_SETTINGS.items():
        assert {k for k, v in KINDS.items() if key in v.settings} == set(kinds)
    assert set(RetrievalConfig.model_fields["index"].annotation.__args__) == set(KINDS)
    assert set(BUILD_SETTINGS) < set(INDEX_SETTINGS)


@pytest.mark.parametrize(
    "spec, recall",
    [
        (IndexSpec("hnsw", hnsw_m=16, ef_search=64), 0.9),
        (IndexSpec("ivf", nlist=32, nprobe=8), 0.9),
        (IndexSpec("ivf_pq", nlist=32, nprobe=8, pq_m=32), 0.5),
    ],
)
def test_each_kind_takes_its_settings_and_finds_what_flat_finds(spec, recall, one_thread):
    data, queries = clustered(4_000), clustered(100, seed=1)
    flat = new_index(IndexSpec("flat"), 64, len(data))
    flat.add(data)
    index = new_index(spec, 64, len(data))
    if not index.is_trained:
        index.train(data)
    index.add(data)
    if spec.kind == "hnsw":
        assert index.hnsw.efSearch == 64 and index.hnsw.nb_neighbors(0) == 2 * 16
    else:
        ivf = faiss.extract_index_ivf(index)
        assert (ivf.nlist, ivf.nprobe) == (32, 8)
        if spec.kind == "ivf_pq":
            assert (
                faiss.downcast_index(index).pq.M == 32
            )  # pq_m codes a vector (6 bits: 4,000 points train 64)
    _, exact = flat.search(queries, 3)
    _, found = index.search(queries, 3)
    measured = np.mean([len(set(a) & set(b)) / 3 for a, b in zip(exact, found, strict=True)])
    assert measured >= recall


def test_settings_of_another_kind_are_refused_in_one_line():
    assert check_spec(IndexSpec("flat", nlist=10)) == (
        "nlist acts only for index ivf or ivf_pq, not flat: remove it"
    )
    assert "unknown index kind 'lsh'" in check_spec(IndexSpec("lsh"))
    assert default_nlist(1_000_000) == 4_000 and default_nlist(100) == 2
    with pytest.raises(ValueError, match=r"retrieval\.pq_m acts only for index ivf_pq, not ivf"):
        RetrievalConfig(index="ivf", pq_m=8)
    with pytest.raises(ValueError, match=r"retrieval\.nlist acts on the index Strata builds"):
        RetrievalConfig(index="ivf", nlist=8, index_dir="/x")
    with pytest.raises(ValueError, match=r"gpu_fp16 acts only with retrieval\.gpu shard"):
        RetrievalConfig(gpu="off", gpu_fp16=False)
    assert RetrievalConfig(index="ivf", nprobe=4, index_dir="/x").nprobe == 4  # a search setting


def test_a_loaded_index_maps_its_passages_and_takes_search_settings(tmp_path):
    passages = [Passage(f"p{i}", make_contents(f"T{i}", "x" * 2_000)) for i in range(2_000)]
    vectors = clustered(len(passages))
    meta = {"encoder": "e", "encoder_style": "auto", "corpus": "c", "corpus_sha256": "0"}
    spec = IndexSpec("ivf", nlist=16)
    built = build_index(passages, lambda texts: vectors[: len(texts)], 64, spec, meta)
    built.index.reset()
    built.index.add(vectors)
    built.save(tmp_path)
    before = pa.total_allocated_bytes()
    loaded = PassageIndex.load(tmp_path, search=IndexSpec(nprobe=5))
    assert pa.total_allocated_bytes() - before < 100_000  # 4 MB of text, none of it copied
    assert faiss.extract_index_ivf(loaded.index).nprobe == 5
    assert loaded.placement.gpus == 0 and loaded.meta.settings == {"nlist": 16}
    assert loaded.search(vectors[[7]], 1)[0][0][0].id == "p7"


def test_a_search_setting_of_another_kind_is_refused_at_load(index_dir):
    with pytest.raises(IndexLoadError, match="nprobe acts only for index ivf or ivf_pq, not flat"):
        PassageIndex.load(index_dir, search=IndexSpec(nprobe=4))


def test_a_faiss_that_cannot_map_flat_vectors_is_refused_in_one_line(tmp_path):
    """faiss 1.8-1.10 have no IO_FLAG_MMAP_IFC: the import said only that an attribute was missing."""
    (tmp_path / "faiss").mkdir()
    (tmp_path / "faiss" / "__init__.py").write_text('__version__ = "1.10.0"\n')
    done = subprocess.run(
        [sys.executable, "-c", "import retrieval.kinds"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: faiss 1.10.0 cannot map flat or HNSW vectors"), last
    assert f"pip install 'faiss-cpu>={FAISS_FLOOR}'" in last


def test_the_declared_faiss_floor_is_the_one_the_code_needs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["gpu"]
    declared += [
        line.strip()
        for path in (ROOT / "constraints").glob("*.txt")
        for line in path.read_text().splitlines()
        if line.strip().startswith("faiss")
    ]
    faiss_lines = [Requirement(r) for r in declared if r.startswith("faiss")]
    assert {r.name for r in faiss_lines} >= {"faiss-cpu", "faiss-gpu-cu12"}
    for requirement in faiss_lines:
        assert not requirement.specifier.contains("1.10.0"), requirement
        assert requirement.specifier.contains(faiss.__version__), requirement
