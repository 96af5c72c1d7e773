"""Embedding shards of a build: the corpus encoded `shard_size` passages at a time, one file each.

    WORK/shard-000000.bin   MAGIC, header length (8 bytes, little endian), header JSON, padding to
                            64 bytes, then float32 [count, dim] row-major
    WORK/count.json         {"passages": N}, written by the worker that reached the corpus's end

The header names the corpus (sha256), the encoder and its style, the width, the shard's number, its
first row, the build's shard size and its passage ids, so a shard from another corpus, encoder or
shard size is refused rather than mixed in. A shard is written to a temporary name and renamed: a file with the shard's name is whole.
Shard k belongs to worker k mod W (one worker per GPU), so W processes split one corpus with no
coordination beyond the file names.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path

import numpy as np

from retrieval.corpus import Passage, iter_corpus
from retrieval.encoders import load_encoder

MAGIC = b"STRATA-SHARD\x01\n"
ALIGN = 64


class ShardError(ValueError):
    """A shard that cannot be used, or a shard write that failed; one line saying what to do."""


@dataclass(frozen=True)
class ShardHeader:
    corpus_sha256: str
    encoder: str
    encoder_style: str
    dim: int
    shard: int
    start: int
    ids: list[str]
    shard_size: int | None = (
        None  # the build's --shard-size; None in shards written before it was kept
    )

    @property
    def count(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class ShardJob:
    """What every worker of one build shares: the corpus, the encoder and the shard layout."""

    corpus: str
    corpus_sha256: str
    work: str
    encoder: str
    encoder_style: str
    dim: int
    shard_size: int
    batch_size: int = 256


def shard_path(work: str | os.PathLike[str], shard: int) -> Path:
    return Path(work) / f"shard-{shard:06d}.bin"


def owner(shard: int, workers: int) -> int:
    """The worker that encodes `shard`: round robin, so every worker gets every W-th shard."""
    return shard % workers


def _data_offset(header_bytes: int) -> int:
    raw = len(MAGIC) + 8 + header_bytes
    return -(-raw // ALIGN) * ALIGN


def write_shard(path: Path, header: ShardHeader, vectors: np.ndarray) -> None:
    """Write atomically; a full disk raises ShardError and leaves no partial file behind."""
    encoded = json.dumps(asdict(header)).encode()
    offset = _data_offset(len(encoded))
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as fh:
            fh.write(MAGIC + len(encoded).to_bytes(8, "little") + encoded)
            fh.write(b"\0" * (offset - fh.tell()))
            fh.write(np.ascontiguousarray(vectors, dtype=np.float32).tobytes())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise ShardError(
                f"disk full writing {path}: free space on {path.parent} and rerun with --resume "
                "(the shards already written are kept)"
            ) from None
        raise ShardError(f"cannot write {path}: {exc.strerror}") from None


def read_header(path: Path) -> tuple[ShardHeader, int]:
    """The header and the byte offset of the vectors; ShardError for a file that is not a shard."""
    with path.open("rb") as fh:
        magic = fh.read(len(MAGIC))
        length = int.from_bytes(fh.read(8), "little")
        raw = fh.read(length) if magic == MAGIC else b""
    try:
        header = ShardHeader(**json.loads(raw))
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError):
        raise ShardError(
            f"{path} is not a Strata shard: delete it and rerun with --resume"
        ) from None
    offset = _data_offset(length)
    expected = offset + header.count * header.dim * 4
    if path.stat().st_size != expected:
        raise ShardError(
            f"{path} holds {path.stat().st_size} bytes, its header describes {expected}: "
            "delete it and rerun with --resume"
        )
    return header, offset


def read_vectors(path: Path, out: np.ndarray | None = None) -> np.ndarray:
    """The shard's [count, dim] float32 vectors, read into `out` (reused between shards) if given."""
    header, offset = read_header(path)
    shape = (header.count, header.dim)
    if out is None or out.shape[0] < header.count or out.shape[1] != header.dim:
        out = np.empty(shape, dtype=np.float32)
    view = out[: header.count]
    with path.open("rb") as fh:
        fh.seek(offset)
        fh.readinto(memoryview(view).cast("B"))
    return view


def check_header(path: Path, header: ShardHeader, job: ShardJob, shard: int) -> None:
    """Refuse a shard that another build left: other corpus, encoder, width or layout."""
    mine = (job.corpus_sha256, job.encoder, job.encoder_style, job.dim)
    theirs = (header.corpus_sha256, header.encoder, header.encoder_style, header.dim)
    if mine != theirs:
        raise ShardError(
            f"{path} was encoded by {header.encoder} ({header.encoder_style}, {header.dim}-d) from "
            f"corpus sha256 {header.corpus_sha256[:12]}, not by {job.encoder} ({job.encoder_style}, "
            f"{job.dim}-d) from {job.corpus_sha256[:12]}: delete {path.parent} or build with that "
            "corpus and encoder"
        )
    if header.shard_size is not None and header.shard_size != job.shard_size:
        raise ShardError(
            f"{path} was encoded with --shard-size {header.shard_size}, this build has "
            f"--shard-size {job.shard_size}: resume with --shard-size {header.shard_size}, or "
            f"delete {path.parent} to start over"
        )
    if header.count > job.shard_size:
        raise ShardError(
            f"{path} holds {header.count} passages, more than --shard-size {job.shard_size}: "
            f"resume with the interrupted build's --shard-size, or delete {path.parent} to start over"
        )
    if header.shard != shard or header.start != shard * job.shard_size:
        raise ShardError(
            f"{path} starts at passage {header.start}, a build with --shard-size "
            f"{job.shard_size} expects {shard * job.shard_size}: use the interrupted build's "
            f"--shard-size or delete {path.parent}"
        )


def complete_shard(job: ShardJob, shard: int, rows: int) -> bool:
    """Whether shard `shard`, of `rows` passages, is on disk, whole and this build's (ShardError if
    another build's)."""
    path = shard_path(job.work, shard)
    if not path.exists():
        return False
    header, _ = read_header(path)
    check_header(path, header, job, shard)
    if header.count != rows:
        raise ShardError(
            f"{path} holds {header.count} passages, this corpus's shard {shard} at --shard-size "
            f"{job.shard_size} has {rows}: resume with the interrupted build's --shard-size, or "
            f"delete {path.parent} to start over"
        )
    return True


def check_shards(job: ShardJob) -> None:
    """Refuse, before any work, the shards on disk that another build left (another corpus,
    encoder, width or shard size): ShardError naming the first."""
    for path in sorted(Path(job.work).glob("shard-*.bin")):
        try:
            shard = int(path.stem.removeprefix("shard-"))
        except ValueError:
            continue  # not a name this build writes
        check_header(path, read_header(path)[0], job, shard)


def _chunks(passages: Iterator[Passage], size: int) -> Iterator[list[Passage]]:
    while chunk := list(islice(passages, size)):
        yield chunk


def encode_shards(
    job: ShardJob,
    worker: int = 0,
    workers: int = 1,
    device: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Encode this worker's missing shards; returns the corpus's passage count.

    The encoder is loaded only when a shard needs it, so a resumed build whose shards are all
    there loads nothing."""
    encoder = None
    total = 0
    for shard, chunk in enumerate(_chunks(iter_corpus(job.corpus), job.shard_size)):
        total += len(chunk)
        if owner(shard, workers) != worker or complete_shard(job, shard, len(chunk)):
            continue
        if encoder is None:
            kwargs = {"device": device} if device else {}
            encoder = load_encoder(job.encoder, style=job.encoder_style, **kwargs)
        vectors = np.empty((len(chunk), job.dim), dtype=np.float32)
        for start in range(0, len(chunk), job.batch_size):
            texts = [p.contents for p in chunk[start : start + job.batch_size]]
            vectors[start : start + len(texts)] = encoder.encode_passages(texts)
            if progress is not None:
                progress(len(texts))
        header = ShardHeader(
            corpus_sha256=job.corpus_sha256,
            encoder=job.encoder,
            encoder_style=job.encoder_style,
            dim=job.dim,
            shard=shard,
            start=shard * job.shard_size,
            ids=[p.id for p in chunk],
            shard_size=job.shard_size,
        )
        write_shard(shard_path(job.work, shard), header, vectors)
    count = Path(job.work) / "count.json"
    tmp = count.with_name(f"count.json.{worker}.tmp")
    tmp.write_text(json.dumps({"passages": total}) + "\n")
    os.replace(tmp, count)
    return total
