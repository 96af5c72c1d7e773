"""The DeepSpeed op the CPU learner loads is built per Python environment (learner/deepspeed_ops.py):
two checkouts on one machine do not rebuild it in turn; and a build lock that a killed build left
behind is removed, not waited on forever."""

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from learner.deepspeed_ops import (
    FOREIGN_S,
    LOCK,
    clear_left_lock,
    one_builder,
    use_own_extension_dir,
)
from tests.conftest import child_env


def test_the_extensions_live_in_this_environment(monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    use_own_extension_dir()
    if os.access(sys.prefix, os.W_OK):
        assert os.environ["TORCH_EXTENSIONS_DIR"] == str(Path(sys.prefix) / "torch_extensions")
    else:  # torch's own default (~/.cache/torch_extensions)
        assert "TORCH_EXTENSIONS_DIR" not in os.environ


def test_a_directory_the_user_chose_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    use_own_extension_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path)


class Clock:
    """time.time and time.sleep for `clear_left_lock`, the sleeps only advancing the clock."""

    def __init__(self, now: float):
        self.now, self.slept = now, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def left_lock(build_dir: Path, made_at: float) -> Path:
    """torch's build lock in `build_dir`, as a build started at `made_at` left it."""
    lock = build_dir / LOCK
    lock.touch()
    os.utime(lock, (made_at, made_at))
    return lock


def test_a_lock_left_by_a_killed_build_is_removed_and_said(tmp_path):
    lock = left_lock(tmp_path, made_at=1000.0)
    clock = Clock(1000.0 + 300)
    said = clear_left_lock(tmp_path, clock, clock.sleep)
    assert not lock.exists() and clock.slept == []
    assert said == (
        f"strata: removed {lock}, a build lock 300 s old whose build was killed "
        "(every later process would have waited on it forever)"
    )
    assert clear_left_lock(tmp_path, clock, clock.sleep) is None  # none there: nothing to do


def test_a_young_lock_is_waited_on_until_it_cannot_be_a_live_load(tmp_path):
    lock = left_lock(tmp_path, made_at=1000.0)
    clock = Clock(1000.0 + 10)
    said = clear_left_lock(tmp_path, clock, clock.sleep)
    assert not lock.exists() and "a build lock 60 s old" in said
    assert sum(clock.slept) == pytest.approx(FOREIGN_S - 10) and max(clock.slept) <= 1.0


def test_a_lock_its_holder_releases_while_waited_on_is_left_alone(tmp_path):
    lock = left_lock(tmp_path, made_at=1000.0)
    clock = Clock(1000.0)

    def sleep(seconds):
        clock.sleep(seconds)
        if clock.now >= 1003:
            lock.unlink()  # the foreign load ended

    assert clear_left_lock(tmp_path, clock, sleep) is None
    assert sum(clock.slept) == pytest.approx(3.0)


def test_one_builder_is_held_by_one_process_and_freed_when_its_holder_is_killed(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from learner.deepspeed_ops import one_builder\n"
            "with one_builder(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(600)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with open(tmp_path / ".strata-build.lock", "a") as handle:
            with pytest.raises(BlockingIOError):
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            holder.kill()  # no finally, no atexit: only the kernel releases it
            holder.wait(timeout=30)
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder.kill()
    with one_builder(tmp_path):  # and a process takes it again
        pass


def test_the_op_loads_past_a_lock_a_killed_build_left(tmp_path):
    """The built op copied with torch's lock left in it: the process loads it and says what it
    removed (torch alone waited on that lock forever: 20 s of nothing, then killed)."""
    built = Path(sys.prefix) / "torch_extensions" / "deepspeed_shm_comm"
    if not (built / "deepspeed_shm_comm.so").is_file():
        pytest.skip(f"no built op at {built} (make setup builds it)")
    shutil.copytree(built, tmp_path / built.name)
    lock = tmp_path / built.name / LOCK
    lock.touch()
    os.utime(lock, (time.time() - 300, time.time() - 300))
    done = subprocess.run(
        [sys.executable, "-m", "learner.deepspeed_ops"],
        capture_output=True,
        text=True,
        env=child_env() | {"TORCH_EXTENSIONS_DIR": str(tmp_path)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("deepspeed_shm_comm is built")
    assert re.search(
        rf"strata: removed {re.escape(str(lock))}, a build lock 3\d\d s old", done.stderr
    )
    assert not lock.exists()
