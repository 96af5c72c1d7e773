"""The faiss index kinds (registered): how each is made, trained, tuned for search and read back.

Every kind is inner product over the encoder's vectors (unit norm for E5 and MiniLM):
- flat: exact; n x d x 4 bytes; what Search-R1 publishes for wiki-18.
- hnsw: a graph over the flat vectors; fast on a CPU, no GPU version, slow to build.
- ivf: `nlist` k-means lists, `nprobe` of them searched; same bytes as flat.
- ivf_pq: ivf whose vectors are product-quantised to `pq_m` bytes (8 bits per sub-vector): the
  compressed kind for a machine without GPUs or with little memory.

Defaults follow faiss's guidelines (wiki "Guidelines to choose an index"): nlist about 4 sqrt(n),
at least 39 training points a list (the streamed build trains on 64 a list, retrieval/build.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import faiss

FAISS_FLOOR = "1.11"  # IO_FLAG_MMAP_IFC: flat and HNSW vectors mapped from the file, not read


def faiss_problem(module: object) -> str | None:
    """Why this faiss module cannot serve Strata's indexes, in one line, or None."""
    if hasattr(module, "IO_FLAG_MMAP_IFC"):
        return None
    return (
        f"faiss {getattr(module, '__version__', '(unknown version)')} cannot map flat or HNSW "
        f"vectors from an index file (IO_FLAG_MMAP_IFC came in faiss {FAISS_FLOOR}): "
        f"pip install 'faiss-cpu>={FAISS_FLOOR}' (or faiss-gpu-cu12>={FAISS_FLOOR})"
    )


if (_problem := faiss_problem(faiss)) is not None:
    raise ImportError(_problem)


@dataclass(frozen=True)
class IndexSpec:
    """A kind and its settings; None: the kind's default (or not this kind's setting)."""

    kind: str = "flat"
    nlist: int | None = None
    nprobe: int | None = None
    hnsw_m: int | None = None
    ef_search: int | None = None
    pq_m: int | None = None


@dataclass(frozen=True)
class Kind:
    make: Callable[[int, int, IndexSpec], faiss.Index]
    settings: frozenset[str]  # the IndexSpec fields that act for this kind
    mmap_flag: int  # how faiss.read_index maps this kind's file instead of reading it
    gpu: bool  # faiss-gpu can hold it


KINDS: dict[str, Kind] = {}


def register_kind(
    name: str, *settings: str, mmap_flag: int, gpu: bool
) -> Callable[[Callable[[int, int, IndexSpec], faiss.Index]], Callable]:
    def wrap(make: Callable[[int, int, IndexSpec], faiss.Index]) -> Callable:
        KINDS[name] = Kind(make, frozenset(settings), mmap_flag, gpu)
        return make

    return wrap


def default_nlist(count: int) -> int:
    """About 4 sqrt(n) lists, never fewer than 39 training points per list."""
    return max(1, min(4 * int(math.sqrt(count)), count // 39))


def check_spec(spec: IndexSpec) -> str | None:
    """Why `spec` cannot be made (unknown kind, a setting of another kind), or None."""
    kind = KINDS.get(spec.kind)
    if kind is None:
        return f"unknown index kind {spec.kind!r}: use one of {', '.join(KINDS)}"
    for field in ("nlist", "nprobe", "hnsw_m", "ef_search", "pq_m"):
        if getattr(spec, field) is not None and field not in kind.settings:
            acting = [k for k, v in KINDS.items() if field in v.settings]
            return f"{field} acts only for index {' or '.join(acting)}, not {spec.kind}: remove it"
    return None


def new_index(spec: IndexSpec, dim: int, count: int) -> faiss.Index:
    """An empty (untrained) index of `spec.kind` for `count` vectors of width `dim`."""
    problem = check_spec(spec)
    if problem is not None:
        raise ValueError(problem)
    index = KINDS[spec.kind].make(dim, count, spec)
    tune(index, spec)
    return index


def tune(index: faiss.Index, spec: IndexSpec) -> None:
    """Apply the search-time settings (nprobe, efSearch) of `spec`, where it sets them."""
    if spec.nprobe is not None:
        ivf = faiss.extract_index_ivf(index)
        ivf.nprobe = min(spec.nprobe, ivf.nlist)
    if spec.ef_search is not None:
        faiss.downcast_index(index).hnsw.efSearch = spec.ef_search


@register_kind("flat", mmap_flag=faiss.IO_FLAG_MMAP_IFC, gpu=True)
def _flat(dim: int, count: int, spec: IndexSpec) -> faiss.Index:
    return faiss.IndexFlatIP(dim)


@register_kind("hnsw", "hnsw_m", "ef_search", mmap_flag=faiss.IO_FLAG_MMAP_IFC, gpu=False)
def _hnsw(dim: int, count: int, spec: IndexSpec) -> faiss.Index:
    index = faiss.IndexHNSWFlat(dim, spec.hnsw_m or 32, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = 80
    index.hnsw.efSearch = 64
    return index


@register_kind("ivf", "nlist", "nprobe", mmap_flag=faiss.IO_FLAG_MMAP, gpu=True)
def _ivf(dim: int, count: int, spec: IndexSpec) -> faiss.Index:
    nlist = spec.nlist or default_nlist(count)
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
    index.nprobe = min(nlist, 16)
    return index


@register_kind("ivf_pq", "nlist", "nprobe", "pq_m", mmap_flag=faiss.IO_FLAG_MMAP, gpu=True)
def _ivf_pq(dim: int, count: int, spec: IndexSpec) -> faiss.Index:
    nlist = spec.nlist or default_nlist(count)
    m = spec.pq_m or 64
    if dim % m:
        raise ValueError(f"pq_m {m} must divide the encoder's width {dim}")
    # 8 bits a code (256 centroids a sub-vector) from 39 x 256 points on: fewer cannot train them.
    bits = max(1, min(8, int(math.log2(max(count // 39, 2)))))
    index = faiss.IndexIVFPQ(
        faiss.IndexFlatIP(dim), dim, nlist, m, bits, faiss.METRIC_INNER_PRODUCT
    )
    index.nprobe = min(nlist, 32)
    index.do_polysemous_training = False  # for Hamming-filtered search, which Strata does not use
    return index
