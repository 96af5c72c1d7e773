"""kill -9 the launcher mid-run, then `--resume`: the run goes on from its last checkpoint with the
same policy version and data cursor, no group is trained twice (read from the spill's status,
consumed_version and prompt ids), every spill file is valid and the books add up."""

import json
import re
import signal
import time
from collections import Counter

import pyarrow.compute as pc
import pytest

from buffers.reader import read_trajectories
from tests.conftest import assert_accounting
from tests.pipeline.test_local_run import launch

STEPS, EVERY = 8, 3
SERIAL = re.compile(r"@pool-0:(\d+)$")


def _wait_for_spill_after(run_dir, proc, deadline_s=600) -> dict:
    """Wait until the run has checkpointed step EVERY and spilled a file after it; returns the
    checkpoint's saved state (its `extra`)."""
    state_file = run_dir / "checkpoints" / f"step-{EVERY:06d}" / "learner.json"
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if state_file.is_file():
            extra = json.loads(state_file.read_text())["extra"]
            parts = (run_dir / "trajectories").glob("part-*.parquet")
            if any(int(p.stem.split("-")[1]) > extra["spill_files"] for p in parts):
                return extra
        time.sleep(0.2)
    raise AssertionError("the run never spilled after its checkpoint")


@pytest.mark.system
def test_a_run_killed_outright_resumes_whole(tmp_path, run_cache):
    run_dir = tmp_path / "run"
    sets = [
        "--set",
        f"learner.max_steps={STEPS}",
        "--set",
        f"learner.checkpoint_every={EVERY}",
        "--set",
        "buffer.spill_flush_s=0.05",
    ]
    first = launch(run_dir, run_cache, *sets)
    extra = _wait_for_spill_after(run_dir, first)
    first.send_signal(signal.SIGKILL)  # no handler runs: no final checkpoint, no books written
    first.communicate(timeout=60)
    assert not (run_dir / "accounting.json").exists()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{EVERY:06d}"

    again = launch(run_dir, run_cache, *sets, "--resume")
    out, err = again.communicate(timeout=900)
    assert again.returncode == 0, err[-3000:]

    # The same policy version: the learner goes on from the checkpoint's, each step once.
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [float(v) for v in range(1, STEPS + 1)]

    columns = ["prompt_id", "status", "consumed_version"]
    kept, bad = read_trajectories(run_dir / "trajectories", columns)
    lost, bad_lost = read_trajectories(run_dir / "lost", columns)
    assert not bad and not bad_lost and lost.num_rows  # every file whole and readable
    released = kept.filter(pc.equal(kept["status"], "released"))
    # No group trained twice: each released prompt once (4 members), every version consumed.
    assert set(Counter(released["prompt_id"].to_pylist()).values()) == {4}
    assert set(released["consumed_version"].to_pylist()) == set(range(STEPS))

    # The same data cursor: what the dead process had started before the checkpoint's cursor was
    # in flight at the checkpoint (its members held then are spilled as pending, the rest never
    # came); what it started after, the resumed run started again: the same question, same place.
    status_of = dict(zip(kept["prompt_id"].to_pylist(), kept["status"].to_pylist(), strict=True))
    cursor = extra["tasks_started"]
    for prompt in set(lost["prompt_id"].to_pylist()):
        if int(SERIAL.search(prompt).group(1)) < cursor:
            assert status_of.get(prompt, "pending") == "pending", prompt
        else:
            assert prompt in status_of, prompt
    assert_accounting(
        run_dir
    )  # the checkpoint's books plus the resumed process's, against the spill
    assert f"resuming at step {EVERY}: " in out and f"lost/after-step-{EVERY:06d}" in out
    assert f"(resumed at step {EVERY})" in out and f"step    {EVERY + 1}/{STEPS}" in out
    assert f"step    {EVERY}/{STEPS}" not in out  # steps up to the checkpoint are not redone
