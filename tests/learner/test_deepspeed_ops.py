"""The DeepSpeed op the CPU learner loads is built per Python environment (learner/deepspeed_ops.py):
two checkouts on one machine do not rebuild it in turn; and a build lock that a killed build left
behind is removed, not waited on forever, while one a live build holds is waited on, however old."""

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import learner.deepspeed_ops as ops
from learner.deepspeed_ops import LOCK, clear_left_lock, one_builder, use_own_extension_dir
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


# A builder as torch's FileBaton is one: it creates the lock file, keeps it open for its whole
# build, then closes and removes it (here: when told on stdin).
HOLD = (
    "import os, sys\n"
    "fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)\n"
    "print('held', flush=True)\n"
    "sys.stdin.readline()\n"
    "os.close(fd)\n"
    "os.remove(sys.argv[1])\n"
)


def holding(lock: Path) -> subprocess.Popen:
    builder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert builder.stdout.readline() == "held\n"
    return builder


def aged(lock: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(lock, (then, then))


class Sleeps:
    """`clear_left_lock`'s sleep: sleeps nothing, counts, calls `then` each time, and fails past
    `limit` calls (a wait that never ends fails the test instead of hanging it)."""

    def __init__(self, limit: int, then=None):
        self.limit, self.then, self.slept = limit, then, []

    def __call__(self, seconds: float) -> None:
        self.slept.append(seconds)
        if len(self.slept) > self.limit:
            raise AssertionError(f"still waiting on the lock after {len(self.slept)} sleeps")
        if self.then is not None:
            self.then(sum(self.slept))


def test_a_lock_a_live_build_holds_is_waited_on_not_removed_however_old(tmp_path, capsys):
    lock = tmp_path / LOCK
    builder = holding(lock)
    try:
        aged(lock, 300)  # older than any no-op load: a build can take that long

        def meanwhile(waited: float) -> None:
            assert lock.exists()
            if waited >= 65:  # waited on for over a minute: the build ends, as torch ends it
                builder.stdin.write("\n")
                builder.stdin.flush()
                builder.wait(timeout=30)

        assert clear_left_lock(tmp_path, sleep=Sleeps(200, meanwhile)) is None
        assert builder.returncode == 0, builder.stderr.read()  # its own release found its lock
    finally:
        builder.kill()
    said = capsys.readouterr().err
    assert said == f"strata: waiting on {lock}: pid {builder.pid} is building DeepSpeed's op\n"


def test_a_lock_whose_builder_was_killed_is_removed_with_one_line(tmp_path):
    lock = tmp_path / LOCK
    builder = holding(lock)
    builder.kill()  # SIGKILL: no release; the kernel closes its files
    builder.wait(timeout=30)
    aged(lock, 5)  # young: its owner being gone is what counts, not its age
    sleeps = Sleeps(20)
    said = clear_left_lock(tmp_path, sleep=sleeps)
    assert not lock.exists() and sum(sleeps.slept) < 1
    assert re.fullmatch(
        rf"strata: removed {re.escape(str(lock))}, a build lock \d+ s old that no process "
        r"holds: its build was killed \(every later process would have waited on it forever\)",
        said,
    ), said
    assert clear_left_lock(tmp_path, sleep=sleeps) is None  # none there: nothing to do


def test_a_lock_whose_holder_cannot_be_seen_is_waited_on_and_said(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ops, "holders", lambda path: None)  # no /proc
    lock = tmp_path / LOCK
    lock.touch()

    def meanwhile(waited: float) -> None:
        if waited >= 61:
            lock.unlink()  # someone removed it by hand

    assert clear_left_lock(tmp_path, sleep=Sleeps(100, meanwhile)) is None
    assert capsys.readouterr().err == (
        f"strata: waiting on {lock}: this process cannot see who holds it (no /proc, or another "
        "user's lock); remove it if no build is running\n"
    )


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
        rf"strata: removed {re.escape(str(lock))}, a build lock 3\d\d s old that no process holds",
        done.stderr,
    )
    assert not lock.exists()
