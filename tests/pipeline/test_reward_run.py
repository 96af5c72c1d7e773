"""Plug-in rewards end to end (`python -m pipeline.launch` on the embedded default): a weighted
list of a dict reward that reads the tool calls and a reward that raises on every third
trajectory. The parts reach metrics.jsonl and the spill, the failures are counted and said, the
run finishes and its books balance."""

import json
import textwrap

import pyarrow.compute as pc

from buffers.reader import read_trajectories
from tests.conftest import assert_accounting
from tests.pipeline.test_local_run import launch

REWARDS = """
import itertools

_calls = itertools.count()


def judged(view, task):
    searched = [args for name, args in view.tool_calls if name == "search"]
    right = view.answer is not None and view.answer.lower() == task.answers[0].lower()
    return {"correct": float(right), "searched": 0.25 * float(bool(searched))}


def flaky(view, task):
    if next(_calls) % 3 == 0:
        raise RuntimeError("the judge is out to lunch")
    return float(len(view.observations) == len(view.tool_calls))
"""


def test_plug_in_rewards_are_logged_by_part_and_one_that_raises_is_counted(tmp_path, run_cache):
    plugin = tmp_path / "my_rewards.py"
    plugin.write_text(textwrap.dedent(REWARDS))
    run_dir = tmp_path / "run"
    reward = f"[{{fn: {plugin}:judged}}, {{fn: {plugin}:flaky, weight: 0.5}}]"
    proc = launch(
        run_dir, run_cache, "--set", f"actors.reward={reward}", "--set", "learner.max_steps=2"
    )
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-2000:]
    assert "strata: reward 'flaky' raised RuntimeError: the judge is out to lunch: scored 0" in out

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for step in steps:
        assert {"reward/judged/correct", "reward/judged/searched", "reward/flaky"} <= set(step)
        # a part's mean over the step's trajectories; the ones it raised on are scored 0, and
        # those may all fall in other steps' groups (the count is over every call): below
        assert 0 <= step["reward/flaky"] <= 1
    assert steps[-1]["reward_errors"] >= 1

    table, bad = read_trajectories(
        run_dir / "trajectories", ["reward", "reward_components", "tool_names", "status"]
    )
    assert not bad
    rows = table.filter(pc.equal(table["status"], "released")).to_pylist()
    assert rows
    for row in rows:
        parts = dict(row["reward_components"])
        assert set(parts) == {"judged/correct", "judged/searched", "flaky"}
        assert parts["judged/searched"] == 0.25 * bool(row["tool_names"].count("search"))
        expected = parts["judged/correct"] + parts["judged/searched"] + 0.5 * parts["flaky"]
        assert abs(row["reward"] - expected) < 1e-6
    failed = sum(dict(r["reward_components"])["flaky"] == 0 for r in table.to_pylist())
    assert failed >= 1
    assert_accounting(run_dir)
