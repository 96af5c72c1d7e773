"""The run's books (pipeline/runtime/accounting.py) from a real buffer and its Parquet spill, at
unit level: what each kind of trajectory is counted as, that a resumed run's books add up, and
that the audit finds each way the books and the spill can disagree."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from buffers.group_buffer import GroupBuffer
from buffers.records import InvalidTrajectory
from buffers.spill import ParquetSpill
from buffers.testing import synthetic_trajectory as traj
from pipeline.runtime.accounting import (
    accounting,
    add_accounting,
    audit,
    read_accounting,
    write_json,
)


def stratum_of(t, s):
    t.stratum = s
    return t


async def a_run(run_dir):
    """Two groups of two trained, one abandoned with one member in, one rejected record and a
    complete group left in the buffer at the end: strata 0 and 1."""
    spill = ParquetSpill(run_dir / "trajectories")
    buffer = GroupBuffer(group_size=2, max_staleness=4, groups_per_step=2, spill=spill)
    for prompt in ("a", "b", "c", "d"):
        await buffer.admit(prompt)
    for prompt, s in (("a", 0), ("b", 1)):
        for i in range(2):
            await buffer.put(stratum_of(traj(prompt, i), s))
    await buffer.put(stratum_of(traj("c", 0), 1))
    with pytest.raises(InvalidTrajectory):
        await buffer.put(stratum_of(traj("a", 0), 0))  # its group is complete already
    groups = await buffer.next_groups(0, 2)
    buffer.trained(groups, 1)
    buffer.abandon("c")
    for i in range(2):
        await buffer.put(stratum_of(traj("d", i), 0))
    return await buffer.close()


def test_the_books_count_each_fate_per_stratum_and_the_audit_passes(tmp_path):
    stats = asyncio.run(a_run(tmp_path))
    pools = [
        SimpleNamespace(stats=SimpleNamespace(aborted=2)),
        SimpleNamespace(stats=SimpleNamespace(aborted=1)),
    ]
    books = accounting(stats, pools)
    assert books["per_stratum"] == {
        0: {
            "generated": 5,
            "trained": 2,
            "filtered": 0,
            "dropped_stale": 0,
            "abandoned": 0,
            "failed": 1,
            "in_flight": 2,
        },
        1: {
            "generated": 3,
            "trained": 2,
            "filtered": 0,
            "dropped_stale": 0,
            "abandoned": 1,
            "failed": 0,
            "in_flight": 0,
        },
    }
    assert books["total"] == {
        "generated": 8,
        "trained": 4,
        "filtered": 0,
        "dropped_stale": 0,
        "abandoned": 1,
        "failed": 1,
        "in_flight": 2,
        "aborted": 3,
    }
    write_json(tmp_path / "accounting.json", books)
    assert audit(tmp_path) == []
    assert json.loads((tmp_path / "accounting.json").read_text())["total"]["aborted"] == 3


def test_the_audit_names_each_disagreement(tmp_path):
    stats = asyncio.run(a_run(tmp_path))
    books = accounting(stats, [])
    assert audit(tmp_path) == [f"{tmp_path / 'accounting.json'}: missing"]
    wrong = json.loads(json.dumps(books))
    wrong["per_stratum"]["0"]["trained"] += 1  # the parts no longer sum, nor match the spill
    write_json(tmp_path / "accounting.json", wrong)
    problems = audit(tmp_path)
    assert problems[0].startswith("stratum 0: generated 5 != 6, the sum of its parts")
    assert "stratum 0: 3 trained in the books, 2 rows 'released' in the spill" in problems
    assert len(problems) == 2
    more = json.loads(json.dumps(books))
    more["per_stratum"]["1"]["generated"] += 1
    more["per_stratum"]["1"]["in_flight"] += 1
    write_json(tmp_path / "accounting.json", more)
    assert audit(tmp_path) == [
        "stratum 1: 1 in_flight in the books, 0 rows 'pending' in the spill",
        "the spill holds 7 rows, the books 8",
    ]
    write_json(tmp_path / "accounting.json", {"per_stratum": {}, "total": {}})
    assert audit(tmp_path) == [
        "no trajectory was accounted for",
        "the spill holds 7 rows, the books 0",
    ]


def test_a_resumed_runs_books_add_up():
    earlier = {
        "per_stratum": {"0": {"generated": 3, "trained": 2}},
        "total": {"generated": 3, "aborted": 1},
    }
    now = {
        "per_stratum": {0: {"generated": 1, "failed": 1}, 2: {"generated": 4}},
        "total": {"generated": 5},
    }
    assert add_accounting(earlier, now) == {
        "per_stratum": {0: {"generated": 4, "trained": 2, "failed": 1}, 2: {"generated": 4}},
        "total": {"generated": 8, "aborted": 1},
    }
    assert add_accounting({}, now)["total"] == {"generated": 5}


def test_a_run_without_books_reads_as_empty_books_and_one_with_them_reads_them(tmp_path):
    assert read_accounting(tmp_path) == {"per_stratum": {}, "total": {}}
    books = {"per_stratum": {"0": {"generated": 2}}, "total": {"generated": 2}}
    write_json(tmp_path / "accounting.json", books)
    assert read_accounting(tmp_path) == books
    assert [p.name for p in tmp_path.iterdir()] == ["accounting.json"]  # no temporary left


def test_books_written_before_a_part_existed_still_balance_and_a_missing_part_reads_as_0(tmp_path):
    stats = asyncio.run(a_run(tmp_path))
    books = json.loads(json.dumps(accounting(stats, [])))
    for row in books["per_stratum"].values():
        del row["filtered"]  # books from before dynamic sampling: no `filtered` key
    write_json(tmp_path / "accounting.json", books)
    assert audit(tmp_path) == []
    del books["per_stratum"]["0"]["trained"]
    write_json(tmp_path / "accounting.json", books)
    assert audit(tmp_path) == [
        "stratum 0: generated 5 != 3, the sum of its parts ("
        + str(read_accounting(tmp_path)["per_stratum"]["0"])
        + ")",
        "stratum 0: 0 trained in the books, 2 rows 'released' in the spill",
    ]


def test_books_without_a_total_add_as_none():
    earlier = {"per_stratum": {"0": {"generated": 3}}, "total": {"generated": 3}}
    assert add_accounting(earlier, {})["total"] == {"generated": 3}
    assert add_accounting({}, {}) == {"per_stratum": {}, "total": {}}


def test_the_books_are_written_sorted_one_space_indented(tmp_path):
    write_json(tmp_path / "accounting.json", {"total": {"trained": 2, "generated": 3}, "a": 1})
    text = (tmp_path / "accounting.json").read_text()
    assert text == '{\n "a": 1,\n "total": {\n  "generated": 3,\n  "trained": 2\n }\n}\n'
