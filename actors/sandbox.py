"""The python tool's sandbox: model-written code runs in a throwaway process with hard limits.

Every call gets its own process tree, temp dir and clean environment, plus rlimits (CPU time,
address space, processes, file size, open files, no core dumps) and a wall-clock timeout that
kills everything it started. Under bubblewrap the code also sees a read-only filesystem, no
network and only its own processes. The sandbox fails closed: where bubblewrap cannot run, a call
asking for it (isolation "bwrap", the default) is refused and runs nothing; only isolation "none",
chosen explicitly, runs code with the rlimits and the timeout alone. When we are root the code additionally runs as a throwaway
uid: the kernel exempts root from RLIMIT_NPROC, and that includes root mapped to another uid by
a user namespace (bwrap --uid), so only a real unprivileged uid makes a fork bomb hit the limit.
Each concurrent call gets its own uid so one call's fork bomb cannot starve another's processes.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import functools
import io
import itertools
import logging
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SANDBOX_DIR = "/tmp/work"
"""The code's working directory as it sees it under bwrap (outside bwrap: the host temp dir)."""
_SCRATCH_MB = 64  # size of the code's working directory under bwrap
# Throwaway uids, one per concurrent call; below 65536 so that containers with remapped user
# namespaces (which usually map only 0-65535) have them too.
_UID_BASE, _UID_SLOTS = 61000, 1000
_uid_slots = itertools.count()
_CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
_warned = False

# Runs first inside the sandbox: limits, no_new_privs, drop to the throwaway uid, then exec the
# user's script in a fresh interpreter so its tracebacks look like a plain `python main.py`.
# -I: no PYTHON* variables, user site or script dir on sys.path; -S: no site-packages, so the
# code gets the standard library only, the same on every machine whatever the venv holds (and
# starts in ~15 ms instead of paying for .pth files of torch and friends).
_LAUNCHER = """\
import ctypes, os, resource, sys
cpu, memory, nproc, fsize, nofile, uid = (int(arg) for arg in sys.argv[1:7])
for which, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, memory, memory),
                          (resource.RLIMIT_NPROC, nproc, nproc), (resource.RLIMIT_FSIZE, fsize, fsize),
                          (resource.RLIMIT_NOFILE, nofile, nofile), (resource.RLIMIT_CORE, 0, 0)):
    ceiling = resource.getrlimit(which)[1]
    if ceiling != resource.RLIM_INFINITY:
        soft, hard = min(soft, ceiling), min(hard, ceiling)
    resource.setrlimit(which, (soft, hard))
ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: setuid binaries stay powerless
if uid >= 0:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
os.execv(sys.executable, [sys.executable, "-I", "-S", sys.argv[7]])
"""


@dataclass(frozen=True)
class PythonResult:
    ok: bool
    """Exited with status 0 within the time limit."""
    output: str
    """stdout and stderr interleaved, truncated in the middle, then a status line when not ok."""
    exit_code: int | None
    """The script's exit status; -N when killed by signal N (under bwrap an exit status of
    128 + N reads as that too); None when it timed out."""
    timed_out: bool
    seconds: float
    isolation: str
    """How it ran: "bwrap", "rlimits-only" (asked for isolation "none"), or "refused" (asked for
    bwrap where it cannot run: nothing ran, `output` says why and what to do)."""


ISOLATIONS = ("bwrap", "none")
"""What a caller may ask for: bubblewrap or refuse, or explicitly no isolation (rlimits only)."""


def find_bwrap() -> str | None:
    return shutil.which("bwrap")


def bwrap_problem() -> str | None:
    """Why bubblewrap cannot run the sandbox here, or None when it can. The first call probes
    bwrap with a trivial script (~0.1 s, blocking); the answer is kept."""
    bwrap = find_bwrap()
    return "bubblewrap (bwrap) is not installed" if bwrap is None else _bwrap_problem(bwrap)


def sandbox_mode(isolation: str = "bwrap") -> str:
    """How a call asking for `isolation` runs here: "bwrap", "refused" (bwrap asked for and not
    possible) or "rlimits-only" (isolation "none"). Warns once, saying what is missing."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"unknown sandbox isolation {isolation!r}: expected one of {ISOLATIONS}")
    if isolation == "none":
        _warn_once(None)
        return "rlimits-only"
    problem = bwrap_problem()
    if problem is None:
        return "bwrap"
    _warn_once(problem)
    return "refused"


def refusal(problem: str) -> str:
    """The observation of a refused call: what is missing and the two ways on."""
    return (
        f"[python tool refused: {problem}; it runs model-written code only inside bubblewrap. "
        "Install it (apt-get install bubblewrap) or set actors.python_isolation: none to run "
        "code with rlimits and a timeout only, NOT isolated]"
    )


async def run_python(
    code: str,
    timeout_s: float = 10.0,
    *,
    memory_mb: int = 512,
    max_output_chars: int = 4096,
    isolation: str = "bwrap",
    files: Sequence[str] = (),
) -> PythonResult:
    """Runs `code` as a script in a fresh sandbox. Whatever the code does comes back as a result
    (ok=False with the reason in `output`); only a host that cannot start processes raises OSError.
    `isolation` "bwrap" (the default) refuses to run anything where bubblewrap cannot run; "none"
    runs with rlimits, a timeout, a temp dir and a clean environment only. `files` (a question's
    attachments) are copied into the code's working directory under their own names, read-only
    (a read-only mount under bwrap; with isolation "none" a 0444 copy, which root may still
    change: the original never)."""
    start = time.monotonic()
    mode = await asyncio.to_thread(sandbox_mode, isolation)  # the first call probes bwrap
    if mode == "refused":
        output = refusal(bwrap_problem() or "bubblewrap cannot run here")
        return PythonResult(False, output, None, False, time.monotonic() - start, mode)
    isolation = mode
    uid = _sandbox_uid(isolation)
    workdir = tempfile.mkdtemp(prefix="strata-python-")
    # Our own pipe, not asyncio's: its Process.wait() would also wait for every grandchild
    # holding stdout to close it, and the script's exit is what decides ok and timed_out.
    read_fd, write_fd = os.pipe()
    pipe = os.fdopen(read_fd, "rb", buffering=0)
    capture = _Capture(max_output_chars)
    proc = reader = None
    try:
        _prepare(workdir, uid, code, isolation)
        try:
            names = _attach(workdir, files)
        except OSError as exc:  # an attachment gone since the questions were loaded
            output = f"An attached file cannot be read: {exc.filename or exc}"
            return PythonResult(False, output, None, False, time.monotonic() - start, isolation)
        argv, env = _command(isolation, workdir, uid, timeout_s, memory_mb, names)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=write_fd,
            stderr=write_fd,
            cwd=workdir,
            env=env,
            start_new_session=True,
        )
        os.close(write_fd)
        write_fd = -1
        reader = asyncio.create_task(capture.drain(pipe))
        timed_out = False
        try:
            async with asyncio.timeout(timeout_s):
                await proc.wait()
        except TimeoutError:
            timed_out = True
        await _kill_all(proc, isolation, uid)
        with contextlib.suppress(TimeoutError):  # EOF once all holders of the pipe are dead;
            await asyncio.wait_for(reader, 0.5)  # one that escaped the kill gets cut off
        exit_code = None if timed_out else _exit_code(proc.returncode, isolation)
        status = _status_line(exit_code, timed_out, timeout_s)
        output = capture.text() + (f"\n{status}" if status else "")
        seconds = time.monotonic() - start
        return PythonResult(exit_code == 0, output, exit_code, timed_out, seconds, isolation)
    finally:
        if proc is not None and proc.returncode is None:  # cancelled mid-run
            _killpg(proc)
        if reader is not None:
            reader.cancel()
        if write_fd >= 0:
            os.close(write_fd)
        pipe.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _attach(workdir: str, files: Sequence[str]) -> list[str]:
    """Copies of `files` in `workdir`, read-only to everyone; their names."""
    names = []
    for path in files:
        name = os.path.basename(path)
        if name in ("main.py", *names):  # the script's own name, or two files of one name
            continue
        copy = os.path.join(workdir, name)
        shutil.copyfile(path, copy)
        os.chmod(copy, 0o444)
        names.append(name)
    return names


def _command(
    isolation: str,
    workdir: str,
    uid: int,
    timeout_s: float,
    memory_mb: int,
    attached: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """argv and environment that run `workdir/main.py` under the launcher, inside bwrap or not."""
    inner_dir = SANDBOX_DIR if isolation == "bwrap" else workdir
    limits = [math.ceil(timeout_s) + 1, memory_mb * 2**20, 64, 16 * 2**20, 256, uid]
    launcher = [sys.executable, "-I", "-S", "-c", _LAUNCHER, *map(str, limits), "main.py"]
    env = {**_CLEAN_ENV, "HOME": inner_dir, "TMPDIR": inner_dir}
    if isolation != "bwrap":
        return launcher, env
    args = [find_bwrap() or "bwrap", "--ro-bind", "/", "/"]
    if uid >= 0:  # the throwaway uid cannot enter e.g. /root: hide it all but the interpreter
        hidden, paths = _interpreter_behind_closed_dirs()
        args += [arg for path in hidden for arg in ("--tmpfs", path)]
        args += [arg for path in paths for arg in ("--ro-bind", path, path)]
    # The code's files live in a size-capped tmpfs rather than on the host disk, which no rlimit
    # caps (RLIMIT_FSIZE bounds one file, not how many); the script itself is mounted read-only.
    args += ["--tmpfs", "/tmp", "--chdir", SANDBOX_DIR]
    # A virtualenv under /tmp (a CI checkout, say) would vanish under that tmpfs: show it again.
    # bwrap would create the directories leading to it 0700, closed to the throwaway uid: make
    # them 0755 first.
    for path in _interpreter_dirs():
        if path.startswith("/tmp/"):
            parts = path.strip("/").split("/")
            for depth in range(2, len(parts)):
                args += ["--perms", "0755", "--dir", "/" + "/".join(parts[:depth])]
            args += ["--ro-bind", path, path]
    args += ["--perms", "0777", "--size", str(_SCRATCH_MB * 2**20), "--tmpfs", SANDBOX_DIR]
    for name in ("main.py", *attached):
        args += ["--ro-bind", os.path.join(workdir, name), f"{SANDBOX_DIR}/{name}"]
    args += ["--dev", "/dev", "--proc", "/proc", "--unshare-net", "--unshare-pid"]
    args += ["--unshare-ipc", "--unshare-uts", "--hostname", "sandbox", "--unshare-cgroup-try"]
    args += ["--die-with-parent", "--new-session", "--clearenv"]
    args += [arg for name, value in env.items() for arg in ("--setenv", name, value)]
    return [*args, "--", *launcher], {}


def _interpreter_dirs() -> list[str]:
    """Where the interpreter lives: the venv, the base installation, the executable's real dir
    (a venv's python is often a link into a base installation elsewhere); outermost only."""
    wanted = {
        sys.prefix,
        sys.base_prefix,
        os.path.dirname(os.path.abspath(sys.executable)),
        os.path.dirname(os.path.realpath(sys.executable)),
    }
    kept: list[str] = []
    for path in sorted(wanted):  # a parent sorts before its children
        if not any(path == outer or path.startswith(outer + "/") for outer in kept):
            kept.append(path)
    return kept


@functools.cache
def _bwrap_problem(bwrap: str) -> str | None:
    """Why bwrap cannot run our sandbox here (e.g. user namespaces disabled), or None."""
    workdir = tempfile.mkdtemp(prefix="strata-python-probe-")
    try:
        uid = _sandbox_uid("bwrap")
        _prepare(workdir, uid, "pass", "bwrap")
        argv, env = _command("bwrap", workdir, uid, 10.0, 512)
        done = subprocess.run(argv, capture_output=True, timeout=30, cwd=workdir, env=env)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bubblewrap at {bwrap} failed to start: {exc}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if done.returncode != 0:
        error = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
        return f"bubblewrap at {bwrap} cannot run the sandbox here ({error.strip()[-500:]})"
    return None


def _prepare(workdir: str, uid: int, code: str, isolation: str) -> None:
    if uid >= 0 and isolation != "bwrap":  # under bwrap the code works in its own tmpfs
        os.chown(workdir, uid, uid)
    with open(os.path.join(workdir, "main.py"), "wb") as script:
        script.write(code.encode("utf-8", errors="surrogatepass"))  # bad bytes → SyntaxError


def _warn_once(problem: str | None) -> None:
    """Once per process: why calls are refused (`problem`), or, with isolation "none" (None),
    what the code can reach."""
    global _warned
    if _warned:
        return
    _warned = True
    if problem is not None:
        logger.warning("%s", refusal(problem).strip("[]"))
        return
    if os.geteuid() == 0 and _interpreter_behind_closed_dirs()[0]:
        who = (
            "root (the interpreter is in a directory other uids cannot enter), so RLIMIT_NPROC "
            "does not stop a fork bomb and a process that calls setsid() can outlive the call"
        )
    else:
        who = "a throwaway uid" if os.geteuid() == 0 else "this process's user"
    logger.warning(
        "actors.python_isolation is none, so the python tool runs model-written code with rlimits, "
        "a timeout, a temp dir and a clean environment only, as %s. NOT isolated: the network (it "
        "can open connections), filesystem writes outside its temp dir (wherever that user may "
        "write), and other processes (it sees them and may signal those of that user). "
        "To isolate it: apt-get install bubblewrap and python_isolation: bwrap.",
        who,
    )


def _sandbox_uid(isolation: str) -> int:
    """A throwaway uid for this call when we are root and it can run the interpreter, else -1."""
    if os.geteuid() != 0 or (isolation != "bwrap" and _interpreter_behind_closed_dirs()[0]):
        return -1
    return _UID_BASE + next(_uid_slots) % _UID_SLOTS


@functools.cache
def _interpreter_behind_closed_dirs() -> tuple[list[str], list[str]]:
    """Directories others cannot enter (like /root) that hold the interpreter, and its paths there."""
    wanted = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    hidden, paths = set(), []
    for path in sorted(wanted):  # a parent sorts before its children
        if any(path == bound or path.startswith(bound + "/") for bound in paths):
            continue
        parts = path.strip("/").split("/")
        for depth in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:depth])
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                hidden.add(ancestor)  # bwrap would make the dirs between it and `path` 0700
                paths.append("/" + "/".join(parts[: depth + 1]))
                break
    return sorted(hidden), paths


async def _kill_all(proc: asyncio.subprocess.Process, isolation: str, uid: int) -> None:
    """Kills the whole tree. Under bwrap, the pid namespace dies with bwrap; else by group and uid."""
    _killpg(proc)
    if isolation != "bwrap" and uid >= 0:  # kill(-1) as that uid also gets what setsid()'d
        sweep = await asyncio.create_subprocess_exec(
            *[sys.executable, "-I", "-S", "-c", "import os; os.kill(-1, 9)"],
            user=uid,
            group=uid,
            extra_groups=[],
            env={},
            stdin=subprocess.DEVNULL,
        )
        await sweep.wait()
    await proc.wait()


def _killpg(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _exit_code(returncode: int | None, isolation: str) -> int | None:
    if isolation == "bwrap" and returncode is not None and 128 < returncode <= 128 + 64:
        return 128 - returncode  # bwrap reports death by signal N as 128 + N
    return returncode


def _status_line(exit_code: int | None, timed_out: bool, timeout_s: float) -> str:
    if timed_out:
        return f"[timed out after {timeout_s:g} s; killed]"
    if not exit_code:
        return ""
    if exit_code > 0:
        return f"[exit status {exit_code}]"
    name = (
        signal.Signals(-exit_code).name if -exit_code in signal.valid_signals() else str(-exit_code)
    )
    why = {"SIGXCPU": ": CPU-time limit", "SIGKILL": ": CPU-time or memory limit?"}.get(name, "")
    return f"[killed by {name}{why}]"


class _Capture:
    """Keeps the first and last halves of `limit` characters of a stream and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.head_size, self.tail_size = limit - limit // 2, limit // 2
        self.head, self.tail, self.dropped = "", "", 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    async def drain(self, pipe: io.RawIOBase) -> None:
        loop = asyncio.get_running_loop()
        stream = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(stream), pipe
        )
        try:
            while chunk := await stream.read(1 << 16):
                self.feed(chunk)
            self.feed(b"", final=True)
        finally:
            transport.close()

    def feed(self, data: bytes, final: bool = False) -> None:
        text = self.decoder.decode(data, final)
        taken = text[: self.head_size - len(self.head)]
        self.head += taken
        self.tail += text[len(taken) :]
        if len(self.tail) > self.tail_size:
            self.dropped += len(self.tail) - self.tail_size
            self.tail = self.tail[len(self.tail) - self.tail_size :]

    def text(self) -> str:
        if self.dropped:
            return f"{self.head}\n…[truncated {self.dropped} chars]…\n{self.tail}"
        return self.head + self.tail
