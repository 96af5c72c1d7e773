"""Parquet spill: every trajectory that leaves the buffer, with its fate, in rolling zstd files.

Rows accumulate in memory and are written by one background thread, `rows_per_file` at a time (or
when the oldest row has waited `flush_s`), each file under a temporary name first and renamed
into place after an fsync: a process killed at any moment leaves only complete files behind
(plus, at worst, one `.part-*.tmp` that readers ignore).
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from buffers.records import TRAJECTORY_SCHEMA, Trajectory, to_arrow

STATUSES = ("released", "filtered", "dropped_stale", "abandoned", "pending")
"""released: given to the learner; filtered: a complete group dynamic sampling left out at
consumption (rewards all equal); dropped_stale: older than η at consumption; abandoned: its group
never completed; pending: still buffered when the buffer closed."""

SPILL_SCHEMA = TRAJECTORY_SCHEMA.append(pa.field("status", pa.string())).append(
    pa.field("consumed_version", pa.int32())
)
"""TRAJECTORY_SCHEMA plus the fate of the row and the learner's policy version when it was
released or dropped (-1 otherwise): staleness = consumed_version - policy_version."""

_PART = re.compile(r"part-(\d+)\.parquet")


def part_number(path: Path) -> int | None:
    """N of a spill file named part-N.parquet; None for any other name."""
    match = _PART.fullmatch(path.name)
    return int(match.group(1)) if match else None


class SpillError(RuntimeError):
    """Writing a spill file failed (disk full, permissions); the message names the file."""


def spill_table(rows: list[tuple[Trajectory, str, int]]) -> pa.Table:
    """Rows of (trajectory, status, consumed_version) as a table of SPILL_SCHEMA."""
    batch = to_arrow([t for t, _, _ in rows])
    status = pa.array([s for _, s, _ in rows], pa.string())
    consumed = pa.array([v for _, _, v in rows], pa.int32())
    columns = [*batch.columns, status, consumed]
    return pa.Table.from_arrays(columns, schema=SPILL_SCHEMA)


class ParquetSpill:
    """Append-only trajectory log under `directory`: `part-000001.parquet`, `part-000002.parquet`, ..."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        rows_per_file: int = 4096,
        flush_s: float = 30.0,
        compression: str = "zstd",
        max_queued_files: int = 2,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rows_per_file = rows_per_file
        self.flush_s = flush_s
        self.compression = compression
        self.max_queued_files = max_queued_files
        existing = [n for p in self.directory.iterdir() if (n := part_number(p)) is not None]
        self._next_seq = max(existing, default=0) + 1  # a resumed run appends after what is there
        self._rows: list[tuple[Trajectory, str, int]] = []
        self._first_at = 0.0
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-spill")
        self._writes: list[Future[int]] = []
        self.rows_written = 0
        self.bytes_written = 0
        self.files_written = 0

    def append(
        self,
        trajectories: list[Trajectory] | tuple[Trajectory, ...],
        status: str,
        consumed_version: int = -1,
    ) -> None:
        if status not in STATUSES:
            raise ValueError(f"unknown spill status {status!r}: use one of {', '.join(STATUSES)}")
        if not self._rows:
            self._first_at = time.monotonic()
        self._rows.extend((t, status, consumed_version) for t in trajectories)
        if (
            len(self._rows) >= self.rows_per_file
            or time.monotonic() - self._first_at >= self.flush_s
        ):
            self.flush()

    def flush(self) -> None:
        """Hand the accumulated rows to the writer thread.

        Returns at once unless the writer is `max_queued_files` behind: then it waits for the
        oldest write, so a disk slower than the producers bounds memory instead of growing it.
        """
        self._raise_failed()
        if not self._rows:
            return
        while len(self._writes) >= self.max_queued_files:
            self._writes[0].exception()  # wait for the oldest write
            self._raise_failed()
        rows, self._rows = self._rows, []
        path = self.directory / f"part-{self._next_seq:06d}.parquet"
        self._next_seq += 1
        self._writes.append(self._writer.submit(self._write, rows, path))

    def mark(self) -> tuple[int, list[Future[int]]]:
        """Hand every row appended so far to the writer. Returns the number of the last file that
        holds them (files after it hold only later rows) and the writes to wait for
        (`wait_written`) before they are all on disk: a checkpoint records that position."""
        self.flush()
        return self._next_seq - 1, list(self._writes)

    def close(self) -> None:
        """Write everything still held and wait for the writer; raises `SpillError` if a write failed."""
        self.flush()
        for future in self._writes:
            future.exception()  # wait
        self._writer.shutdown(wait=True)
        self._raise_failed()

    def _raise_failed(self) -> None:
        done = [f for f in self._writes if f.done()]
        self._writes = [f for f in self._writes if not f.done()]
        for future in done:
            error = future.exception()
            if error is not None:
                raise SpillError(str(error)) from error

    def _write(self, rows: list[tuple[Trajectory, str, int]], path: Path) -> int:
        table = spill_table(rows)
        tmp = path.with_name(f".{path.stem}.tmp")
        try:
            with open(tmp, "wb") as fh:
                pq.write_table(table, fh, compression=self.compression)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise SpillError(f"cannot write spill file {path}: {exc}") from exc
        size = path.stat().st_size
        self.rows_written += len(rows)
        self.bytes_written += size
        self.files_written += 1
        return size


def wait_written(writes: list[Future[int]]) -> None:
    """Block until the writes `ParquetSpill.mark` returned are on disk; SpillError if one failed.
    Safe in another thread: it touches only the futures."""
    for future in writes:
        error = future.exception()
        if error is not None:
            raise SpillError(str(error)) from error
