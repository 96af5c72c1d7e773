"""Checkpoints of the whole run, not only of the learner, so a run killed outright resumes whole.

After a SIGKILL (an OOM kill, a lost node) the learner's last checkpoint is not the run's last
state: the dead process went on generating, training and spilling, and its books died with it.
So every checkpoint also records, at one instant between learner steps (`save_run_checkpoint`):
- `books`: the run's accounting up to then, earlier processes included (`pipeline.runtime.accounting`);
- `spill_files`: the last spill file holding rows from before then (on disk before the
  checkpoint is named `latest`);
- the trajectories the buffer held then, in `checkpoints/held/step-NNNNNN.parquet` (as `pending`).

Resuming (`resume_run_dir`) puts the run directory back to that instant: metrics.jsonl and
eval.jsonl keep only the checkpoint's steps (the later ones are redone), spill files written after
it move to `lost/after-step-NNNNNN/` (kept for analysis, but out of `trajectories/`, so no group
is counted or trained twice) and the held trajectories, which the resumed run never sees, join the
spill as `pending`. After a clean stop nothing follows the final checkpoint and nothing is held,
so the same code changes nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from actors.pool import ActorPool
from buffers.group_buffer import GroupBuffer
from buffers.records import Trajectory
from buffers.spill import part_number, spill_table, wait_written
from pipeline.runtime.accounting import accounting, add_accounting, read_accounting

BOOKS_KEY = "books"
SPILL_KEY = "spill_files"


async def save_run_checkpoint(
    roles: Any,
    buffer: GroupBuffer,
    pools: Sequence[ActorPool],
    run_dir: Path,
    extra: dict,
    books_before: dict,
) -> Path:
    """Checkpoint the learner (`roles.checkpoint`) with the books, the spill's position and the
    held trajectories of this instant. `extra` holds `step`; `books_before`: the books of the
    processes before this one (empty for a fresh run)."""
    step = int(extra["step"])
    # One instant: nothing below awaits until the books, the position and the held rows are read.
    books = add_accounting(books_before, accounting(buffer.stats(), pools))
    spill = buffer.spill  # none (buffer.spill: false): nothing on disk to keep consistent
    held = buffer.held() if spill is not None else []
    last_file, writes = spill.mark() if spill is not None else (0, [])
    checkpoints = run_dir / "checkpoints"
    held_file = _held_file(checkpoints, step)
    await asyncio.to_thread(_make_durable, writes, held, held_file)
    path = await roles.checkpoint(checkpoints, {**extra, BOOKS_KEY: books, SPILL_KEY: last_file})
    if not held:  # the snapshot of an earlier checkpoint of this step (the final one repeats it)
        held_file.unlink(missing_ok=True)
    for old in (checkpoints / "held").glob("step-*.parquet"):  # those of pruned checkpoints
        if (
            not (checkpoints / old.stem).exists()
            and not (checkpoints / f"{old.stem}.json").exists()
        ):
            old.unlink(missing_ok=True)
    return path


def _held_file(checkpoints: Path, step: int) -> Path:
    return checkpoints / "held" / f"step-{step:06d}.parquet"


def _make_durable(writes: list, held: list[Trajectory], held_file: Path) -> None:
    wait_written(writes)
    if held:
        _write_whole(
            held_file,
            lambda fh: pq.write_table(
                spill_table([(t, "pending", -1) for t in held]), fh, compression="zstd"
            ),
        )


def _write_whole(path: Path, write) -> None:
    """`path` whole or not at all: a temporary name, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def resume_run_dir(run_dir: Path, extra: dict, step: int) -> tuple[dict, list[dict]]:
    """Put `run_dir` back to its checkpoint of `step` (whose saved `extra` is given). Returns the
    books of the run so far and the metrics.jsonl lines kept. Says in one line what it moved."""
    metrics = _keep_steps(run_dir / "metrics.jsonl", step)
    _keep_steps(run_dir / "eval.jsonl", step)
    _remove_temporaries(run_dir)
    if SPILL_KEY not in extra:  # a checkpoint older than these records: its run stopped cleanly
        return read_accounting(run_dir), metrics
    spill = run_dir / "trajectories"
    later = sorted(
        p for p in spill.glob("part-*.parquet") if (part_number(p) or 0) > extra[SPILL_KEY]
    )
    said = []
    if later:
        lost = _fresh_dir(run_dir / "lost" / f"after-step-{step:06d}")
        for path in later:
            path.rename(lost / path.name)
        said.append(
            f"{len(later)} spill file(s) written after it moved to {lost.relative_to(run_dir)} (those steps are redone)"
        )
    held = _held_file(run_dir / "checkpoints", step)
    if held.is_file():
        into = spill / f"part-{extra[SPILL_KEY] + 1:06d}.parquet"
        _write_whole(into, lambda fh: fh.write(held.read_bytes()))
        said.append(
            f"{pq.read_metadata(into).num_rows} trajectories in flight at it spilled as pending"
        )
    if said:
        print(f"strata: resuming at step {step}: {'; '.join(said)}", flush=True)
    return extra[BOOKS_KEY], metrics


def _keep_steps(path: Path, up_to_step: int) -> list[dict]:
    """Keep the JSON lines of `path` whose step is at most `up_to_step` (a line cut by a kill is
    dropped); returns them."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step", up_to_step + 1) <= up_to_step:
            kept.append(row)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
    tmp.replace(path)
    return kept


def _remove_temporaries(run_dir: Path) -> None:
    """What a kill mid-write leaves: checkpoint directories and files under temporary names."""
    for pattern in (
        "checkpoints/.step-*",
        "checkpoints/.latest.tmp",
        "checkpoints/held/.*.tmp",
        "trajectories/.part-*.tmp",
    ):
        for path in run_dir.glob(pattern):
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def _fresh_dir(path: Path) -> Path:
    """`path`, or `path-2`, `path-3`, ... when a run resumed from the same checkpoint before."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    candidate.mkdir(parents=True)
    return candidate
