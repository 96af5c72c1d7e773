"""The run directory's disk fills up mid-run (a small tmpfs): one line says so, the run stops with
its last complete checkpoint, nothing is left half-written, and once there is space again
`--resume` goes on and the books still add up."""

import os
import subprocess

import pytest

from buffers.reader import read_trajectories
from learner.checkpoint import latest_checkpoint
from tests.conftest import assert_accounting
from tests.pipeline.test_local_run import launch

SIZE_MB = 20  # a checkpoint of the tiny policy is ~12 MB: the second save (two kept) cannot fit


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE_MB}m", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "--lazy", str(disk)], check=True)


@pytest.mark.system
def test_a_full_disk_stops_the_run_in_one_line_and_it_resumes_after(small_disk, run_cache):
    run_dir = small_disk / "run"
    sets = ["--set", "learner.checkpoint_every=1", "--set", "buffer.spill_flush_s=0.05"]
    proc = launch(run_dir, run_cache, *sets, "--set", "learner.max_steps=40")
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 1, err[-3000:]
    assert err.count("\n") == 1 and f"the disk of {run_dir} is full" in err, err
    assert "--resume --run-dir" in err
    step = int(latest_checkpoint(run_dir / "checkpoints").name.split("-")[1])  # complete, named
    assert f"checkpoints/step-{step:06d}" in err
    assert 1 <= step < 40
    temporaries = [p for p in run_dir.rglob(".*")]
    assert not temporaries, temporaries  # no checkpoint, spill file or books under a temporary name
    _, bad = read_trajectories(run_dir / "trajectories", ["status"])
    assert not bad

    subprocess.run(["mount", "-o", f"remount,size={SIZE_MB * 10}m", str(small_disk)], check=True)
    again = launch(run_dir, run_cache, *sets, "--set", f"learner.max_steps={step + 2}", "--resume")
    out, err = again.communicate(timeout=900)
    assert again.returncode == 0, err[-3000:]
    assert f"(resumed at step {step})" in out
    assert_accounting(run_dir)
