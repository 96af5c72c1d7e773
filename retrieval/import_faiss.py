"""Importing a faiss index built elsewhere, such as Search-R1's wiki-18 E5 index, without re-encoding.

Search-R1's indexer (FlashRAG's) encodes the corpus in file order with E5 ("passage: " prefix,
mean pooling, unit norm), adds the vectors to `faiss.index_factory(768, "Flat",
METRIC_INNER_PRODUCT)` and writes `e5_Flat.index`: faiss id i is the corpus's line i. The import
checks what can be checked without the encoder's weights (the vector count against the corpus's
passages, the width against the encoder's config, the metric) and writes Strata's index directory
around the file: a hard link to it where the filesystem allows (no 64 GB copy), a copy otherwise.
The file is mapped, not read, for the checks: flat and HNSW vectors and IVF lists alike.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import faiss

from retrieval.corpus import corpus_hash, iter_corpus
from retrieval.encoders import encoder_dim
from retrieval.index import FORMAT_VERSION, IndexLoadError, IndexMeta, write_meta
from retrieval.kinds import KINDS
from retrieval.passages import FILENAME as PASSAGES_FILE
from retrieval.passages import write_passages

# faiss's classes, by the kind Strata calls them.
IMPORTABLE = {
    "IndexFlatIP": "flat",
    "IndexFlat": "flat",
    "IndexHNSWFlat": "hnsw",
    "IndexIVFFlat": "ivf",
    "IndexIVFPQ": "ivf_pq",
}

# The four bytes faiss writes first, naming the class, for the importable ones: the kind's mmap flag
# is picked from them before reading (faiss's mapped reader, IO_FLAG_MMAP_IFC, cannot serve IVF
# lists, and IO_FLAG_MMAP does not map flat vectors).
FOURCC = {b"IxFI": "flat", b"IxF2": "flat", b"IHNf": "hnsw", b"IwFl": "ivf", b"IwPQ": "ivf_pq"}


def read_mapped(path: Path) -> faiss.Index:
    """The index at `path`, read-only, its vectors or lists mapped from the file."""
    with path.open("rb") as fh:
        kind = FOURCC.get(fh.read(4), "flat")
    return faiss.read_index(str(path), KINDS[kind].mmap_flag | faiss.IO_FLAG_READ_ONLY)


def _kind_of(index: faiss.Index, path: Path) -> str:
    if index.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise IndexLoadError(
            f"{path} ranks by L2 distance, Strata's indexes by inner product: build it with "
            "METRIC_INNER_PRODUCT (as Search-R1 does) or with python -m retrieval.build"
        )
    name = type(faiss.downcast_index(index)).__name__
    if name not in IMPORTABLE:
        raise IndexLoadError(
            f"{path} is a faiss {name}; Strata imports {', '.join(sorted(set(IMPORTABLE)))}"
        )
    return IMPORTABLE[name]


def import_faiss(
    index_file: str,
    corpus: str,
    encoder: str,
    out: str,
    style: str = "auto",
    force: bool = False,
) -> IndexMeta:
    """Write the index directory `out` around `index_file`, whose row i is `corpus`'s passage i."""
    source, target = Path(index_file).absolute(), Path(out)
    if target.exists() and any(target.iterdir()) and not force:
        raise IndexLoadError(f"{target} exists and is not empty: pass --force to replace it")
    try:
        index = read_mapped(source)  # a 64 GB index is opened in a second
    except OSError as exc:
        raise IndexLoadError(f"cannot open {source}: {exc.strerror}") from None
    except RuntimeError as exc:
        raise IndexLoadError(
            f"{source} is not a faiss index ({str(exc).splitlines()[0][:120]})"
        ) from None
    kind = _kind_of(index, source)
    dim = encoder_dim(encoder)
    if index.d != dim:
        raise IndexLoadError(
            f"{source} holds {index.d}-d vectors, encoder {encoder} makes {dim}-d ones: import it "
            "with the encoder that built it (Search-R1's wiki-18 index: e5-base-v2, 768-d)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        count = write_passages(iter_corpus(corpus), tmp / PASSAGES_FILE)
        if count != index.ntotal:
            raise IndexLoadError(
                f"{source} holds {index.ntotal} vectors but {corpus} {count} passages: faiss id i "
                "is passage i of the corpus the index was built from; import it with that corpus"
            )
        try:
            os.link(source, tmp / "index.faiss")
        except OSError:  # another filesystem: copy
            shutil.copyfile(source, tmp / "index.faiss")
        meta = IndexMeta(
            encoder=encoder,
            encoder_style=style,
            dim=dim,
            kind=kind,
            count=count,
            corpus=str(Path(corpus).absolute()),
            corpus_sha256=corpus_hash(corpus),
            faiss_version=faiss.__version__,
            source=f"imported from {source}",
            format=FORMAT_VERSION,
        )
        write_meta(meta, tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta
