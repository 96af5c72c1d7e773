"""The passage store of an index directory: `passages.arrow`, an uncompressed Arrow IPC file.

Row i is faiss id i (columns `id`, `contents`). It is written a batch at a time, so a build never
holds the corpus's text, and it is memory-mapped when read, so a server's load time and resident
memory do not grow with the text: a search touches only the pages of the rows it returns.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa

from retrieval.corpus import Passage

FILENAME = "passages.arrow"
SCHEMA = pa.schema([("id", pa.string()), ("contents", pa.large_string())])


def write_passages(
    passages: Iterable[Passage], path: str | os.PathLike[str], batch_rows: int = 65_536
) -> int:
    """Stream `passages` into an Arrow IPC file, `batch_rows` at a time; returns the row count."""
    rows = 0
    ids: list[str] = []
    contents: list[str] = []
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
        for passage in passages:
            ids.append(passage.id)
            contents.append(passage.contents)
            if len(ids) == batch_rows:
                writer.write_batch(pa.record_batch([ids, contents], schema=SCHEMA))
                rows += len(ids)
                ids, contents = [], []
        if ids or not rows:
            writer.write_batch(pa.record_batch([ids, contents], schema=SCHEMA))
            rows += len(ids)
    return rows


def copy_passages(table: pa.Table, path: str | os.PathLike[str], batch_rows: int = 65_536) -> None:
    """Write a passages table (a mapped one: its batches are copied from the map, nothing becomes a
    Python object) as `write_passages` would."""
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
        writer.write_table(table.cast(SCHEMA), max_chunksize=batch_rows)


def open_passages(path: str | os.PathLike[str]) -> pa.Table:
    """The passages as a table over a memory map of the file (no copy of the text)."""
    return pa.ipc.open_file(pa.memory_map(str(Path(path)), "r")).read_all()
