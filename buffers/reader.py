"""Read trajectory Parquet files (the spill's, or anyone's that follow the schema) for analysis.

A file conforms when it has every column of TRAJECTORY_SCHEMA with a type that casts to ours, but
for `tool_names` (read as null where absent) and the columns added to the schema later
(`records.ADDED_LATER`, read as their defaults); `status` and `consumed_version` are read when
present. Only the columns asked for are loaded, so replaying a large run does not read its token
arrays.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from buffers.records import ADDED_LATER
from buffers.spill import SPILL_SCHEMA

OPTIONAL = ("tool_names", *ADDED_LATER, "status", "consumed_version")
"""Columns a conforming file may lack."""


class TrajectoryFileError(ValueError):
    """A file that is not readable Parquet or does not follow the trajectory schema."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


def trajectory_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Every `*.parquet` under `directory` (recursively), in name order; temporary files excluded."""
    root = Path(directory)
    return sorted(p for p in root.rglob("*.parquet") if not p.name.startswith("."))


def _reason(exc: Exception) -> str:
    """The first line of an Arrow error (thrift's add lines of their own)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _castable(source: pa.DataType, target: pa.DataType) -> bool:
    try:
        pa.array([], type=source).cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return False
    return True


def read_trajectory_file(path: Path, columns: list[str]) -> pa.Table:
    """`columns` of one conforming file, cast to the schema's types; absent optional ones are
    filled (null, or the default of a column added later)."""
    try:
        schema = pq.read_schema(path)
        names = schema.names
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:  # the last: a column's name
        raise TrajectoryFileError(path, f"not a readable Parquet file ({_reason(exc)})") from None
    for field in SPILL_SCHEMA:
        if field.name not in names:
            if field.name in OPTIONAL:
                continue
            raise TrajectoryFileError(
                path, f"missing column '{field.name}' of the trajectory schema"
            )
        if names.count(field.name) > 1:  # schema.field() would raise KeyError
            raise TrajectoryFileError(path, f"column '{field.name}' appears more than once")
        if not _castable(schema.field(field.name).type, field.type):
            raise TrajectoryFileError(
                path,
                f"column '{field.name}' is {schema.field(field.name).type}, expected {field.type}",
            )
    present = [c for c in columns if c in names]
    try:
        table = pq.read_table(path, columns=present)
        table.validate(full=True)  # data that is not what the schema says (strings not UTF-8)
    except (pa.ArrowException, OSError) as exc:
        raise TrajectoryFileError(path, f"cannot read ({_reason(exc)})") from None
    arrays = []
    for name in columns:
        target = SPILL_SCHEMA.field(name).type
        if name in present:
            try:
                arrays.append(table.column(name).cast(target))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise TrajectoryFileError(path, f"column '{name}': {_reason(exc)}") from None
        elif name in ADDED_LATER:  # an earlier schema's file: what its rows meant
            arrays.append(pa.array([ADDED_LATER[name]] * table.num_rows, target))
        else:
            arrays.append(pa.nulls(table.num_rows, target))
    return pa.Table.from_arrays(arrays, schema=pa.schema([SPILL_SCHEMA.field(c) for c in columns]))


def read_trajectories(
    directory: str | os.PathLike[str], columns: list[str], skip_bad: bool = False
) -> tuple[pa.Table, list[TrajectoryFileError]]:
    """All conforming rows under `directory`, and the files skipped (only with `skip_bad`)."""
    unknown = [c for c in columns if c not in SPILL_SCHEMA.names]
    if unknown:
        raise ValueError(f"unknown trajectory columns {unknown}")
    tables, bad = [], []
    for path in trajectory_files(directory):
        try:
            tables.append(read_trajectory_file(path, columns))
        except TrajectoryFileError as exc:
            if not skip_bad:
                raise
            bad.append(exc)
    schema = pa.schema([SPILL_SCHEMA.field(c) for c in columns])
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    return table, bad
