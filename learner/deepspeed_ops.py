"""Build the DeepSpeed op the CPU learner loads at start, once, at set-up time.

    python -m learner.deepspeed_ops

On a CPU, DeepSpeed's process group loads a shared-memory communication op that it compiles on
first use (about 30 s on 2 cores, with g++ and ninja, into torch's extension cache). `make setup`
runs this so that the first run, or the first test of a suite, does not wait for the compiler.
On a GPU machine there is nothing to build; a machine without a compiler skips with one line (the
op is then compiled, or done without, by DeepSpeed at run time as before).

The op is built for one environment (its include paths are the venv's), and torch keeps one build
per op name in ~/.cache/torch_extensions: two checkouts on one machine would rebuild it in turn,
each time the other one ran (30-60 s each on 2 cores). `use_own_extension_dir` gives each
environment its own directory; every process that loads the op calls it first.

torch guards a build with a lock file it removes when the build ends; a build whose process was
killed (SIGKILL, a closed terminal, a CI timeout) leaves it, and every later process waited on it
forever, printing nothing. So the op is loaded here (`load_cpu_op`) before DeepSpeed asks for it
(DeepSpeed then takes the loaded module and builds nothing), by one process at a time under an
flock, which the kernel releases when its holder dies: whoever holds it knows that no other
Strata process is building. A lock file there may still be a live build of another program's
(a build takes a minute or more on few cores), so it is removed only when no process holds it:
torch's builder keeps the file open for its whole build, and the kernel closes it when the builder
dies, so the kernel's open files (/proc/<pid>/fd) say whether its owner is gone. Removed, it is
said in one line; a live one is waited on, and said once it has been for a minute.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path

LOCK = "lock"  # torch.utils.cpp_extension's build lock, in each op's build directory
SAY_AFTER_S = 60.0  # waiting on a live build this long, say what is waited on (once)
# torch's release closes the lock file, then removes it: a lock seen unheld is looked at again
# this much later before it is taken to be a killed build's
RELEASE_S = 0.5


def use_own_extension_dir() -> None:
    """torch's compiled extensions under this Python environment (`sys.prefix`), unless
    TORCH_EXTENSIONS_DIR is set or the environment is not writable."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ and os.access(sys.prefix, os.W_OK):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch_extensions")


@contextmanager
def one_builder(root: Path) -> Iterator[None]:
    """Held by one process at a time (an flock on `root`/.strata-build.lock), released by the
    kernel when its holder dies, however it dies."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".strata-build.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def holders(path: Path) -> list[int] | None:
    """The pids of the processes that have `path` open, from the kernel's open files
    (/proc/<pid>/fd; this user's processes, everyone's as root); None where there is no /proc."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = os.path.realpath(path)
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with suppress(OSError):  # gone meanwhile, or another user's
            for fd in os.scandir(entry / "fd"):
                with suppress(OSError):
                    if os.readlink(fd.path) == target:
                        found.append(int(entry.name))
                        break
    return found


def _owners(lock: Path) -> list[int] | None:
    """Who holds torch's `lock`: pids (none: its build is gone), or None when this process cannot
    tell (no /proc, or a lock another user made, whose processes it cannot see)."""
    if lock.stat().st_uid != os.geteuid() and os.geteuid() != 0:
        return None
    return holders(lock)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def clear_left_lock(
    build_dir: Path,
    sleep: Callable[[float], None] = time.sleep,
    say: Callable[[str], None] = _say,
) -> str | None:
    """Remove torch's build lock in `build_dir` if one is there and no process holds it (its build
    was killed), to be called under `one_builder`: no Strata process is building then. A lock a
    live process holds is waited on however long its build takes, and said once after
    SAY_AFTER_S. Returns the line saying what was removed, or None."""
    lock = build_dir / LOCK
    waited, told = 0.0, False
    while True:
        try:
            owners = _owners(lock)
            if owners == []:
                sleep(RELEASE_S)  # a build that is ending may be between close and remove
                made = lock.stat().st_mtime
                if _owners(lock) == []:
                    lock.unlink(missing_ok=True)
                    return (
                        f"strata: removed {lock}, a build lock {time.time() - made:.0f} s old "
                        "that no process holds: its build was killed (every later process "
                        "would have waited on it forever)"
                    )
                continue
        except FileNotFoundError:  # its build ended
            return None
        if waited >= SAY_AFTER_S and not told:
            told = True
            say(
                f"strata: waiting on {lock}: pid {', '.join(map(str, owners))} is building "
                "DeepSpeed's op"
                if owners
                else f"strata: waiting on {lock}: this process cannot see who holds it (no "
                "/proc, or another user's lock); remove it if no build is running"
            )
        sleep(1.0)
        waited += 1.0


def load_cpu_op() -> str:
    """DeepSpeed's shared-memory op loaded into this process (built first if need be) under
    `one_builder`, with a lock a killed build left removed. Returns what happened, in a line."""
    use_own_extension_dir()
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return "no shared-memory op to build on this accelerator"
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    guarded = bool(root) and _writable(Path(root))  # a read-only one: builds nothing, no lock
    with one_builder(Path(root)) if guarded else nullcontext():
        if guarded and (removed := clear_left_lock(Path(root) / builder.NAME)):
            print(removed, file=sys.stderr, flush=True)
        try:
            builder.load(verbose=False)
        except Exception as exc:  # no compiler here: DeepSpeed tries again at run time
            return f"could not build {builder.NAME} ({exc}); runs build it on first use"
    return f"{builder.NAME} is built"


def _writable(root: Path) -> bool:
    with suppress(OSError):
        root.mkdir(parents=True, exist_ok=True)
    return os.access(root, os.W_OK)


def main() -> int:
    os.environ.setdefault("DS_BUILD_OPS", "0")
    print(f"learner.deepspeed_ops: {load_cpu_op()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
