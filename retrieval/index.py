"""Inner-product faiss index over a passage corpus, saved as a self-describing directory.

    DIR/index.faiss      the faiss index (always saved as a CPU index)
    DIR/passages.arrow   id and contents of every passage, row i = faiss id i (retrieval/passages.py)
    DIR/meta.json        encoder, dimension, index kind and settings, passage count, corpus sha256

Loading maps the passages and, where faiss allows it for the kind, the index file (IO_FLAG_MMAP
for ivf's lists, IO_FLAG_MMAP_IFC for flat vectors), so a load takes seconds whatever the corpus.
With faiss-gpu and GPUs the index searches on all of them (retrieval/gpu.py), else on the CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa

from retrieval.corpus import Passage
from retrieval.gpu import GpuOptions, plan_gpus, to_gpus, visible_gpu_free_bytes
from retrieval.kinds import KINDS, IndexSpec, check_spec, new_index, tune
from retrieval.passages import FILENAME as PASSAGES_FILE
from retrieval.passages import copy_passages, open_passages

DEFAULT_GPU = GpuOptions()
_FEW_ROWS = 4
"""A record batch holding at most this many of a search's hits is read row by row, not by take."""
FORMAT_VERSION = 2  # 1: passages.parquet, read whole into memory


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
    settings: dict = field(default_factory=dict)  # the build-time settings (nlist, hnsw_m, pq_m)
    source: str = "built"  # or "imported from FILE" (retrieval/import_faiss.py)
    format: int = FORMAT_VERSION


def build_settings(spec: IndexSpec) -> dict:
    return {k: getattr(spec, k) for k in ("nlist", "hnsw_m", "pq_m") if getattr(spec, k)}


class PassageIndex:
    """Passages plus their faiss index: embeddings in, (passage, score) lists out."""

    def __init__(
        self,
        index: faiss.Index,
        passages: pa.Table,
        meta: IndexMeta,
        gpu: GpuOptions = DEFAULT_GPU,
    ) -> None:
        self.meta = meta
        self.passages = passages  # columns id, contents; row i is faiss id i
        self._batches = passages.to_batches()  # zero-copy views of the mapped file's batches
        self._starts = np.cumsum([0] + [b.num_rows for b in self._batches])  # each one's first row
        self._cpu_index = index
        plan = plan_gpus(
            meta.kind, index.ntotal, index.d, _file_bytes(index), visible_gpu_free_bytes(), gpu
        )
        if isinstance(plan, str):
            raise IndexLoadError(plan)
        self.placement = plan
        self.index = to_gpus(index, plan, gpu)

    def __len__(self) -> int:
        return self.passages.num_rows

    def search(self, embeddings: np.ndarray, k: int) -> list[list[tuple[Passage, float]]]:
        """Top-k passages per query embedding (fewer if the corpus is smaller), best first."""
        k = min(k, len(self))
        scores, ids = self.index.search(np.ascontiguousarray(embeddings, dtype=np.float32), k)
        flat = ids.ravel()
        by_id = self.passages_at(flat[flat >= 0])
        return [
            [
                (by_id[i], float(s))
                for i, s in zip(row_ids.tolist(), row_scores.tolist(), strict=True)
                if i >= 0
            ]
            for row_ids, row_scores in zip(ids, scores, strict=True)
        ]

    def passages_at(self, rows: np.ndarray) -> dict[int, Passage]:
        """The passages of faiss ids `rows`, read from only the record batches they fall in: Arrow's
        take on the whole table first concatenates every batch's text (13 GB at wiki-18).

        A batch holding a few of the rows is read row by row: on a 1M-passage file a take of 1 to
        4 rows cost 59-64 us, reading them one by one 18-24 us (one query's top 3 falls in three
        batches there). By 16 rows they are close (56 against 48 us), and with about 12 hits in
        each of 16 batches reading row by row was the slower in one run, so the cut stays at 4."""
        wanted = np.unique(rows)
        batch_of = np.searchsorted(self._starts, wanted, side="right") - 1
        found: dict[int, Passage] = {}
        for batch in np.unique(batch_of).tolist():
            mine = wanted[batch_of == batch]
            at = mine - self._starts[batch]
            records = self._batches[batch]
            if len(mine) <= _FEW_ROWS:
                ids, contents = records.column(0), records.column(1)
                pairs = [(ids[r].as_py(), contents[r].as_py()) for r in at.tolist()]
            else:
                part = records.take(pa.array(at, pa.int64()))
                pairs = zip(part.column(0).to_pylist(), part.column(1).to_pylist(), strict=True)
            for row, (pid, text) in zip(mine.tolist(), pairs, strict=True):
                found[row] = Passage(id=pid, contents=text)
        return found

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the three files into `directory` (which must exist)."""
        out = Path(directory)
        faiss.write_index(self._cpu_index, str(out / "index.faiss"))
        copy_passages(self.passages, out / PASSAGES_FILE)
        write_meta(self.meta, out)

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike[str],
        search: IndexSpec | None = None,
        gpu: GpuOptions = DEFAULT_GPU,
    ) -> PassageIndex:
        """Map the directory's index and passages; `search` sets nprobe / efSearch if given."""
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
                f"{meta_path}: index format {meta.format}, this Strata reads {FORMAT_VERSION}: "
                "rebuild it with python -m retrieval.build (or delete it from the run's cache)"
            )
        if meta.kind not in KINDS:
            raise IndexLoadError(f"{meta_path}: unknown index kind {meta.kind!r}")
        try:
            index = faiss.read_index(str(root / "index.faiss"), KINDS[meta.kind].mmap_flag)
            passages = open_passages(root / PASSAGES_FILE)
        except (RuntimeError, OSError, pa.ArrowException) as exc:
            raise IndexLoadError(
                f"{root}: cannot read the index ({str(exc).splitlines()[0]})"
            ) from None
        if index.ntotal != passages.num_rows or index.d != meta.dim:
            raise IndexLoadError(
                f"{root}: index holds {index.ntotal} vectors of dim {index.d}, "
                f"but {passages.num_rows} passages of dim {meta.dim} are described"
            )
        if search is not None:
            spec = replace(search, kind=meta.kind)
            problem = check_spec(spec)
            if problem is not None:
                raise IndexLoadError(f"{root}: {problem}")
            tune(index, spec)
        return cls(index, passages, meta, gpu)


def _file_bytes(index: faiss.Index) -> int:
    """The bytes faiss would write for `index` (its size on a GPU for the compressed kinds)."""
    if index.ntotal == 0:
        return 0
    if isinstance(faiss.downcast_index(index), faiss.IndexFlat):
        return index.ntotal * index.d * 4
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        return ivf.code_size * index.ntotal + ivf.nlist * index.d * 4
    return index.ntotal * index.d * 4


def write_meta(meta: IndexMeta, directory: Path) -> None:
    (directory / "meta.json").write_text(json.dumps(asdict(meta), indent=2) + "\n")


def build_index(
    passages: Sequence[Passage],
    embed: Callable[[list[str]], np.ndarray],
    dim: int,
    kind: str | IndexSpec,
    meta: dict,
    batch_size: int = 256,
    progress: Callable[[int], None] | None = None,
) -> PassageIndex:
    """Embed every passage (title and text, as in the corpus) and index the vectors, in memory:
    for small corpora and tests; `python -m retrieval.build` streams instead."""
    spec = kind if isinstance(kind, IndexSpec) else IndexSpec(kind)
    vectors = np.empty((len(passages), dim), dtype=np.float32)
    for start in range(0, len(passages), batch_size):
        chunk = passages[start : start + batch_size]
        vectors[start : start + len(chunk)] = embed([p.contents for p in chunk])
        if progress is not None:
            progress(len(chunk))
    index = new_index(spec, dim, len(passages))
    if not index.is_trained:
        index.train(vectors)
    index.add(vectors)
    table = pa.table(
        {
            "id": pa.array([p.id for p in passages], pa.string()),
            "contents": pa.array([p.contents for p in passages], pa.large_string()),
        }
    )
    full_meta = IndexMeta(
        dim=dim,
        kind=spec.kind,
        count=len(passages),
        faiss_version=faiss.__version__,
        settings=build_settings(spec),
        **meta,
    )
    return PassageIndex(index, table, full_meta, GpuOptions(mode="off"))


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
