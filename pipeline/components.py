"""Build the system's parts from config sections: the one place config meets constructors."""

from __future__ import annotations

import os
from pathlib import Path

from buffers.group_buffer import GroupBuffer
from buffers.spill import ParquetSpill
from pipeline.config import BufferConfig


def make_buffer(config: BufferConfig, run_dir: str | os.PathLike[str]) -> GroupBuffer:
    """The group buffer of a run, spilling to `run_dir/trajectories/` when `config.spill` is set."""
    spill = None
    if config.spill:
        spill = ParquetSpill(
            Path(run_dir) / "trajectories",
            rows_per_file=config.spill_rows_per_file,
            flush_s=config.spill_flush_s,
        )
    return GroupBuffer(
        group_size=config.group_size,
        max_staleness=config.max_staleness,
        max_groups_in_flight=config.max_groups_in_flight,
        max_resident_bytes=config.max_resident_mb * 1024 * 1024,
        group_timeout_s=config.group_timeout_s,
        spill=spill,
    )
