"""Checkpoints of the whole run: what a checkpoint records at its instant, and how resuming puts
a run directory back to it (the end-to-end kill -9 test is tests/faults/test_kill_resume.py)."""

import asyncio
import json

import pyarrow.parquet as pq

from buffers.group_buffer import GroupBuffer
from buffers.spill import ParquetSpill, spill_table
from buffers.testing import synthetic_trajectory as traj
from pipeline.runtime.recovery import BOOKS_KEY, SPILL_KEY, resume_run_dir, save_run_checkpoint


class Roles:
    """The learner side of `stream`, as far as a checkpoint needs it: it keeps the extra."""

    def __init__(self):
        self.saved = []

    async def checkpoint(self, directory, extra):
        self.saved.append(extra)
        path = directory / f"step-{extra['step']:06d}"
        path.mkdir(parents=True)
        return path


def part(spill_dir, n, prompt, status="released"):
    rows = [(traj(prompt, i), status, 0) for i in range(2)]
    pq.write_table(spill_table(rows), spill_dir / f"part-{n:06d}.parquet")


def test_a_checkpoint_records_books_spill_position_and_what_was_held(tmp_path):
    async def scenario():
        buffer = GroupBuffer(
            group_size=2, max_staleness=1, spill=ParquetSpill(tmp_path / "trajectories", flush_s=0)
        )
        for i in range(2):
            await buffer.put(traj("done", i))
        await buffer.next_groups(0, 1)  # released: spilled
        await buffer.put(traj("open", 0))  # held at the checkpoint
        roles = Roles()
        before = {
            "per_stratum": {
                "1": {
                    "generated": 3,
                    "trained": 3,
                    "dropped_stale": 0,
                    "abandoned": 0,
                    "failed": 0,
                    "in_flight": 0,
                }
            },
            "total": {},
        }
        await save_run_checkpoint(roles, buffer, [], tmp_path, {"step": 1}, before)
        (extra,) = roles.saved
        assert (
            extra[SPILL_KEY] == 1 and (tmp_path / "trajectories" / "part-000001.parquet").is_file()
        )
        books = extra[BOOKS_KEY]["per_stratum"][1]
        assert (books["generated"], books["trained"], books["in_flight"]) == (
            6,
            5,
            1,
        )  # plus before
        held = pq.read_table(tmp_path / "checkpoints" / "held" / "step-000001.parquet")
        assert held["prompt_id"].to_pylist() == ["open"] and held["status"].to_pylist() == [
            "pending"
        ]

    asyncio.run(scenario())


def test_resuming_sets_later_files_aside_spills_the_held_and_trims_the_logs(tmp_path, capsys):
    spill = tmp_path / "trajectories"
    spill.mkdir()
    for n in (1, 2, 3):
        part(spill, n, f"p{n}")
    (tmp_path / "checkpoints" / "held").mkdir(parents=True)
    part(tmp_path / "checkpoints" / "held", 0, "held", "pending")
    (tmp_path / "checkpoints" / "held" / "part-000000.parquet").rename(
        tmp_path / "checkpoints" / "held" / "step-000004.parquet"
    )
    (tmp_path / "checkpoints" / ".step-000006.x1y2").mkdir()  # a kill mid-save
    (spill / ".part-000004.tmp").write_bytes(b"cut")
    lines = [json.dumps({"step": s}) for s in (3, 4, 5, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 7, "cut')
    (tmp_path / "eval.jsonl").write_text(
        json.dumps({"step": 0}) + "\n" + json.dumps({"step": 6}) + "\n"
    )
    extra = {"step": 4, SPILL_KEY: 1, BOOKS_KEY: {"per_stratum": {}, "total": {"generated": 2}}}

    books, metrics = resume_run_dir(tmp_path, extra, 4)
    assert books == extra[BOOKS_KEY] and [m["step"] for m in metrics] == [3, 4]
    assert [json.loads(x)["step"] for x in (tmp_path / "eval.jsonl").read_text().splitlines()] == [
        0
    ]
    assert sorted(p.name for p in (tmp_path / "lost" / "after-step-000004").iterdir()) == [
        "part-000002.parquet",
        "part-000003.parquet",
    ]
    assert sorted(p.name for p in spill.iterdir()) == ["part-000001.parquet", "part-000002.parquet"]
    assert pq.read_table(spill / "part-000002.parquet")["prompt_id"].to_pylist() == ["held"] * 2
    assert not list(tmp_path.rglob(".*"))  # the temporaries of the kill
    out = capsys.readouterr().out
    assert (
        "resuming at step 4: 2 spill file(s) written after it moved to lost/after-step-000004"
        in out
    )
    assert "2 trajectories in flight at it spilled as pending" in out

    # Killed again before the next checkpoint and resumed from the same one: the first resumed
    # process's files (the held copy included) go aside too, into a directory of their own.
    part(spill, 3, "again")
    resume_run_dir(tmp_path, extra, 4)
    assert sorted(p.name for p in (tmp_path / "lost" / "after-step-000004-2").iterdir()) == [
        "part-000002.parquet",
        "part-000003.parquet",
    ]
    assert sorted(p.name for p in spill.iterdir()) == ["part-000001.parquet", "part-000002.parquet"]


def test_a_checkpoint_from_before_these_records_resumes_from_the_books_file(tmp_path):
    (tmp_path / "accounting.json").write_text(
        json.dumps({"per_stratum": {}, "total": {"generated": 5}})
    )
    books, metrics = resume_run_dir(tmp_path, {"step": 2, "tasks_started": 3}, 2)
    assert books["total"] == {"generated": 5} and metrics == []
