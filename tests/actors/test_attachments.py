"""GAIA attachments: a question's file reaches the python tool's working directory read-only,
and its prompt says so; a file the metadata names but that is missing is refused at load."""

from __future__ import annotations

import asyncio
import json

import pytest

from actors.sandbox import sandbox_mode
from actors.tools import CURRENT_TRAJECTORY, PythonTool, TrajectoryContext
from pipeline.assets.datasets import DatasetError, load_gaia

READ_AND_WRITE = """
print(open('sales.csv').read().strip())
try:
    open('sales.csv', 'w').write('changed')
    print('written')
except OSError as exc:
    print('refused', type(exc).__name__)
"""


def gaia(tmp_path, file_name: str):
    rows = [
        {
            "task_id": "t1",
            "Question": "Total sales?",
            "Level": "1",
            "Final answer": "7",
            "file_name": file_name,
        },
        {
            "task_id": "t2",
            "Question": "No file here.",
            "Level": 2,
            "Final answer": "x",
            "file_name": "",
        },
    ]
    path = tmp_path / "metadata.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_named_file_is_mentioned_in_the_prompt_and_carried_with_the_question(tmp_path):
    (tmp_path / "sales.csv").write_text("a,3\nb,4\n")
    first, second = load_gaia(gaia(tmp_path, "sales.csv"))
    assert first.question.startswith("Total sales?\n\n") and "sales.csv" in first.question
    assert first.extra["attachments"] == (str((tmp_path / "sales.csv").resolve()),)
    assert second.question == "No file here." and "attachments" not in second.extra


@pytest.mark.parametrize("name", ["missing.csv", "../outside.csv"])
def test_a_missing_or_outside_file_is_refused_at_load_in_one_line(tmp_path, name):
    (tmp_path.parent / "outside.csv").write_text("x")
    with pytest.raises(DatasetError) as caught:
        load_gaia(gaia(tmp_path, name))
    message = str(caught.value)
    assert "metadata.jsonl: line 1: field 'file_name'" in message and "\n" not in message


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
def test_the_python_tool_reads_the_trajectorys_file_and_cannot_change_it(tmp_path, isolation):
    if isolation == "bwrap" and sandbox_mode("bwrap") != "bwrap":
        pytest.skip("bubblewrap cannot run here")
    source = tmp_path / "sales.csv"
    source.write_text("a,3\nb,4\n")
    tool = PythonTool(timeout_s=10, isolation=isolation)

    async def call(files):
        token = CURRENT_TRAJECTORY.set(TrajectoryContext(files=files))
        try:
            return await tool({"code": READ_AND_WRITE})
        finally:
            CURRENT_TRAJECTORY.reset(token)

    result = asyncio.run(call((str(source),)))
    assert "a,3\nb,4" in result.text, result.text
    if isolation == "bwrap":  # a read-only mount; without bwrap root writes a 0444 copy anyway
        assert "refused" in result.text and "written" not in result.text, result.text
    assert source.read_text() == "a,3\nb,4\n"
    without = asyncio.run(call(()))  # another trajectory's question: no file
    assert not without.ok and "FileNotFoundError" in without.text
