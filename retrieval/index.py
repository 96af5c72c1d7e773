"""Inner-product faiss index over a passage corpus, saved as a self-describing directory.

    DIR/index.faiss       the faiss index (always saved as a CPU index)
    DIR/passages.parquet  id and contents of every passage, row i = faiss id i
    DIR/meta.json         encoder, dimension, index kind, passage count, corpus path and sha256

faiss-gpu is used for search when it is installed and a GPU is visible (flat and IVF indexes;
HNSW has no GPU version and stays on the CPU); faiss-cpu otherwise.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from retrieval.corpus import Passage

IndexKind = Literal["flat", "hnsw", "ivf"]
FORMAT_VERSION = 1


class IndexLoadError(ValueError):
    """An index directory that cannot be used; the message says which file and why."""


@dataclass(frozen=True)
class IndexMeta:
    encoder: str
    encoder_style: str
    dim: int
    kind: str
    count: int
    corpus: str
    corpus_sha256: str
    faiss_version: str
    format: int = FORMAT_VERSION


def _new_index(kind: IndexKind, dim: int, count: int) -> faiss.Index:
    if kind == "flat":
        return faiss.IndexFlatIP(dim)
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 80
        index.hnsw.efSearch = 64
        return index
    if kind == "ivf":
        # ~sqrt(n) lists, and at least 39 training points per list (faiss's own rule of thumb).
        nlist = max(1, min(int(math.sqrt(count)), count // 39))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.nprobe = min(nlist, 16)
        return index
    raise ValueError(f"unknown index kind {kind!r}: use flat, hnsw or ivf")


def gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


class PassageIndex:
    """Passages plus their faiss index: embeddings in, (passage, score) lists out."""

    def __init__(self, index: faiss.Index, passages: pa.Table, meta: IndexMeta) -> None:
        self.meta = meta
        self.passages = passages  # columns id, contents; row i is faiss id i
        self._cpu_index = index
        self.index = index
        if gpu_available() and meta.kind != "hnsw":
            self._gpu = faiss.StandardGpuResources()
            self.index = faiss.index_cpu_to_gpu(self._gpu, 0, index)

    def __len__(self) -> int:
        return self.passages.num_rows

    def search(self, embeddings: np.ndarray, k: int) -> list[list[tuple[Passage, float]]]:
        """Top-k passages per query embedding (fewer if the corpus is smaller), best first."""
        k = min(k, len(self))
        scores, ids = self.index.search(np.ascontiguousarray(embeddings, dtype=np.float32), k)
        flat = ids.ravel()
        found = flat[flat >= 0]
        rows = self.passages.take(pa.array(found, pa.int64())).to_pydict() if found.size else None
        by_id = {}
        if rows is not None:
            for faiss_id, pid, contents in zip(
                found.tolist(), rows["id"], rows["contents"], strict=True
            ):
                by_id[faiss_id] = Passage(id=pid, contents=contents)
        return [
            [
                (by_id[i], float(s))
                for i, s in zip(row_ids.tolist(), row_scores.tolist(), strict=True)
                if i >= 0
            ]
            for row_ids, row_scores in zip(ids, scores, strict=True)
        ]

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the three files into `directory` (which must exist)."""
        out = Path(directory)
        faiss.write_index(self._cpu_index, str(out / "index.faiss"))
        pq.write_table(self.passages, out / "passages.parquet", compression="zstd")
        (out / "meta.json").write_text(json.dumps(asdict(self.meta), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> PassageIndex:
        root = Path(directory)
        meta_path = root / "meta.json"
        if not meta_path.is_file():
            raise IndexLoadError(
                f"{root} is not an index directory (no meta.json): build one with "
                "python -m retrieval.build --corpus FILE.jsonl --out DIR"
            )
        try:
            meta = IndexMeta(**json.loads(meta_path.read_text()))
        except (json.JSONDecodeError, TypeError) as exc:
            raise IndexLoadError(f"{meta_path}: not a Strata index description ({exc})") from None
        if meta.format != FORMAT_VERSION:
            raise IndexLoadError(
                f"{meta_path}: index format {meta.format}, this Strata reads {FORMAT_VERSION}"
            )
        try:
            index = faiss.read_index(str(root / "index.faiss"))
            passages = pq.read_table(root / "passages.parquet", columns=["id", "contents"])
        except (RuntimeError, OSError, pa.ArrowException) as exc:
            raise IndexLoadError(
                f"{root}: cannot read the index ({str(exc).splitlines()[0]})"
            ) from None
        if index.ntotal != passages.num_rows or index.d != meta.dim:
            raise IndexLoadError(
                f"{root}: index holds {index.ntotal} vectors of dim {index.d}, "
                f"but {passages.num_rows} passages of dim {meta.dim} are described"
            )
        return cls(index, passages, meta)


def build_index(
    passages: Sequence[Passage],
    embed: Callable[[list[str]], np.ndarray],
    dim: int,
    kind: IndexKind,
    meta: dict,
    batch_size: int = 256,
    progress: Callable[[int], None] | None = None,
) -> PassageIndex:
    """Embed every passage (title and text, as in the corpus) and index the vectors."""
    vectors = np.empty((len(passages), dim), dtype=np.float32)
    for start in range(0, len(passages), batch_size):
        chunk = passages[start : start + batch_size]
        vectors[start : start + len(chunk)] = embed([p.contents for p in chunk])
        if progress is not None:
            progress(len(chunk))
    index = _new_index(kind, dim, len(passages))
    if not index.is_trained:
        index.train(vectors)
    index.add(vectors)
    table = pa.table(
        {
            "id": pa.array([p.id for p in passages], pa.string()),
            "contents": [p.contents for p in passages],
        }
    )
    full_meta = IndexMeta(
        dim=dim, kind=kind, count=len(passages), faiss_version=faiss.__version__, **meta
    )
    return PassageIndex(index, table, full_meta)


def save_atomically(
    index: PassageIndex, directory: str | os.PathLike[str], force: bool = False
) -> None:
    """Write into a temporary sibling, then rename: a crash never leaves a half index behind."""
    target = Path(directory)
    if target.exists() and any(target.iterdir()) and not force:
        raise IndexLoadError(f"{target} exists and is not empty: pass --force to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        index.save(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
