import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from buffers.records import from_arrow
from buffers.spill import SPILL_SCHEMA, ParquetSpill, SpillError
from buffers.testing import synthetic_trajectory as traj

ROOT = Path(__file__).resolve().parents[2]


def test_rows_round_trip_with_status_in_rolling_zstd_files(tmp_path):
    spill = ParquetSpill(tmp_path, rows_per_file=10)
    written = [traj(f"p{i // 4}", i % 4, tokens=40 + i, version=i) for i in range(25)]
    for start in range(0, 25, 5):
        spill.append(written[start : start + 5], "released", consumed_version=start)
    spill.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["part-000001.parquet", "part-000002.parquet", "part-000003.parquet"]
    assert (spill.files_written, spill.rows_written) == (3, 25)
    meta = pq.ParquetFile(tmp_path / files[0]).metadata
    assert meta.row_group(0).column(0).compression == "ZSTD"
    table = pq.read_table(tmp_path)
    assert table.schema.equals(SPILL_SCHEMA, check_metadata=False)
    back = from_arrow(table)
    for a, b in zip(written, back, strict=True):
        assert (a.key, a.token_ids.tolist(), a.created_at) == (
            b.key,
            b.token_ids.tolist(),
            b.created_at,
        )
    assert table.column("consumed_version").to_pylist() == [i // 5 * 5 for i in range(25)]


def test_a_new_spill_continues_after_existing_files(tmp_path):
    first = ParquetSpill(tmp_path, rows_per_file=1)
    first.append([traj("a", 0)], "released")
    first.close()
    second = ParquetSpill(tmp_path, rows_per_file=1)
    second.append([traj("b", 0)], "abandoned")
    second.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "part-000001.parquet",
        "part-000002.parquet",
    ]


def test_unknown_status_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown spill status"):
        ParquetSpill(tmp_path).append([traj("a", 0)], "trained")


def test_a_failed_write_leaves_no_partial_file_and_is_reported(tmp_path, monkeypatch):
    spill = ParquetSpill(tmp_path)
    spill.append([traj("a", 0)], "released")

    def crash(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(SpillError, match=r"cannot write spill file .*part-000001\.parquet"):
        spill.close()
    assert list(tmp_path.iterdir()) == []


WRITER = textwrap.dedent(
    """
    import sys
    from buffers.spill import ParquetSpill
    from buffers.testing import synthetic_trajectory
    spill = ParquetSpill(sys.argv[1], rows_per_file=64)
    rows = [synthetic_trajectory("p", i % 8, tokens=2000) for i in range(64)]
    print("ready", flush=True)
    while True:
        spill.append(rows, "released", 1)
    """
)


@pytest.mark.parametrize("delay", [0.3, 0.7, 1.1])
def test_killed_writer_leaves_only_readable_files(tmp_path, delay):
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    parts = sorted(tmp_path.glob("*.parquet"))
    assert parts, "the writer produced no file before it was killed"
    for path in parts:
        table = pq.read_table(path)
        assert table.num_rows == 64 and table.schema.equals(SPILL_SCHEMA, check_metadata=False)
    leftovers = [p.name for p in tmp_path.iterdir() if p.suffix != ".parquet"]
    assert all(name.startswith(".part-") and name.endswith(".tmp") for name in leftovers)
    assert len(leftovers) <= 1
