import asyncio
import logging
import os
import socket
import time
import uuid

import pytest

from actors import sandbox
from actors.sandbox import run_python, sandbox_mode

MODE = sandbox_mode()
# Skip only where bubblewrap is not installed: installed but unable to run is a failure to see.
needs_bwrap = pytest.mark.skipif(sandbox.find_bwrap() is None, reason="bubblewrap is not installed")


def test_an_installed_bubblewrap_is_used():
    if sandbox.find_bwrap() is None:
        pytest.skip("bubblewrap is not installed")
    assert MODE == "bwrap", sandbox._bwrap_problem(sandbox.find_bwrap())


def run(code: str, timeout_s: float = 2.0, **kwargs) -> sandbox.PythonResult:
    return asyncio.run(run_python(code, timeout_s, **kwargs))


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains `marker`, killed so a failing test leaves nothing."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if marker.encode() in cmdline.read():
                    found.append(int(pid))
                    os.kill(int(pid), 9)
        except OSError:
            pass
    return found


@pytest.fixture
def without_bwrap(monkeypatch):
    monkeypatch.setattr(sandbox, "find_bwrap", lambda: None)
    monkeypatch.setattr(sandbox, "_warned", False)


def test_runs_plain_code():
    result = run("print(1998 - 1961)")
    assert (result.ok, result.output, result.exit_code, result.timed_out) == (
        True,
        "37\n",
        0,
        False,
    )
    assert result.isolation == MODE and 0 < result.seconds < 2


def test_imports_the_standard_library_only():
    result = run("import math, json, re, fractions\nprint(json.dumps(math.floor(2.5)))")
    assert result.ok and result.output == "2\n"
    assert "ModuleNotFoundError" in run("import torch").output  # -S: no site-packages


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("def f(:\n", "SyntaxError: invalid syntax"),
        ("\xff\ud800\x1b[2J\x07 garbage", "SyntaxError"),  # not valid UTF-8 once encoded
        ("raise ValueError('bad input')", "ValueError: bad input"),
        ("import sys; sys.exit(3)", "[exit status 3]"),
    ],
)
def test_failures_come_back_with_the_reason(code, expected):
    result = run(code)
    assert not result.ok and not result.timed_out and expected in result.output


def test_infinite_loop_times_out():
    result = run("while True: pass", timeout_s=1.0)
    assert result.timed_out and not result.ok and result.exit_code is None
    assert "timed out after 1 s" in result.output and result.seconds < 2.5


def test_allocating_10_gb_fails_with_memory_error():
    result = run("x = bytearray(10**10)")
    assert not result.ok and "MemoryError" in result.output


def test_10_mb_of_output_is_truncated_quickly():
    result = run("print('x' * 10**7)", max_output_chars=100)
    assert result.ok and result.seconds < 2
    assert "…[truncated 9999901 chars]…" in result.output
    assert result.output.startswith("x" * 50) and result.output.endswith("x" * 49 + "\n")


def test_capture_keeps_head_and_tail_and_splits_characters_safely():
    capture = sandbox._Capture(10)
    data = "0123456789é-abcdefghij".encode()
    for i in range(len(data)):  # byte by byte: "é" arrives in two halves
        capture.feed(data[i : i + 1])
    capture.feed(b"", final=True)
    assert capture.text() == "01234\n…[truncated 12 chars]…\nfghij"


def test_environment_is_clean(monkeypatch):
    monkeypatch.setenv("STRATA_SECRET", "hunter2")
    result = run("import os\nprint(sorted(os.environ))")
    assert result.ok and "STRATA_SECRET" not in result.output
    assert "PATH" in result.output


def test_each_call_gets_a_fresh_writable_directory():
    first = run("open('notes.txt', 'w').write('x')\nimport os\nprint(sorted(os.listdir('.')))")
    assert first.ok and first.output == "['main.py', 'notes.txt']\n"
    assert run("import os\nprint(os.path.exists('notes.txt'))").output == "False\n"


def test_concurrent_calls_do_not_interfere():
    async def many():
        return await asyncio.gather(*(run_python(f"print({i} * 2)") for i in range(4)))

    results = asyncio.run(many())
    assert [r.output for r in results] == ["0\n", "2\n", "4\n", "6\n"]


@needs_bwrap
@pytest.mark.parametrize("then", ["pass", "while True: pass"])
def test_no_process_outlives_the_call(then):
    marker = f"1000.{uuid.uuid4().int % 10**9}"
    code = f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n{then}"
    result = run(code, timeout_s=1.0)
    assert result.timed_out == (then != "pass") and result.seconds < 2.5
    assert processes_with(marker) == []


@needs_bwrap
def test_fork_bomb_is_contained():
    start = time.monotonic()
    result = run("import os\nwhile True: os.fork()", timeout_s=2.0)
    assert not result.ok and time.monotonic() - start < 4
    assert "BlockingIOError" in result.output or result.timed_out  # RLIMIT_NPROC refused forks
    assert processes_with("-I\0-S\0main.py") == []


@needs_bwrap
def test_limits_are_in_force_inside():
    code = (
        "import os, resource as r\n"
        "print([r.getrlimit(k) for k in (r.RLIMIT_CPU, r.RLIMIT_AS, r.RLIMIT_NPROC, r.RLIMIT_FSIZE, r.RLIMIT_CORE)])\n"
        "print(os.getuid() != 0, open('/proc/self/status').read().count('NoNewPrivs:\\t1'))"
    )
    result = run(code, timeout_s=2.0, memory_mb=256)
    limits = "[(3, 4), (268435456, 268435456), (64, 64), (16777216, 16777216), (0, 0)]"
    assert result.output == f"{limits}\nTrue 1\n"


@needs_bwrap
def test_no_network_even_to_a_listening_loopback_port():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
        result = run(code)
    assert not result.ok and "connected" not in result.output.splitlines()
    assert "ConnectionRefusedError" in result.output


@needs_bwrap
def test_filesystem_is_read_only_outside_the_working_directory(tmp_path):
    target = tmp_path / "escape.txt"
    code = (
        "for path in ['/work/main/escape.txt', '/etc/escape.txt', '/tmp/escape.txt', "
        f"'{target}']:\n"
        "    try:\n        open(path, 'w').write('x'); print('WROTE', path)\n"
        "    except OSError as exc:\n        print(type(exc).__name__)\n"
        "open('here.txt', 'w').write('x'); print('cwd ok')"
    )
    result = run(code)
    assert result.ok and "WROTE" not in result.output and "cwd ok" in result.output
    assert not target.exists() and not os.path.exists("/etc/escape.txt")


@needs_bwrap
def test_other_processes_are_invisible():
    result = run("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    assert result.ok and result.output == "[1, 2]\n"  # bwrap's init and the script


def test_without_bwrap_every_call_is_refused_and_runs_nothing(without_bwrap, caplog, tmp_path):
    """The sandbox fails closed: no bubblewrap, no code run (a file the code would write stays
    absent), an error result that says what to do, one warning."""
    witness = tmp_path / "ran"
    with caplog.at_level(logging.WARNING, logger="actors.sandbox"):
        first, second = (run(f"open({str(witness)!r}, 'w').write('x')") for _ in range(2))
    assert not first.ok and first.isolation == second.isolation == "refused"
    assert first.exit_code is None and not first.timed_out and not witness.exists()
    assert "bubblewrap (bwrap) is not installed" in first.output
    assert "apt-get install bubblewrap" in first.output and "python_isolation: none" in first.output
    [warning] = caplog.records
    assert "python tool refused" in warning.message


def test_isolation_none_runs_with_rlimits_only_and_warns_once(without_bwrap, caplog):
    with caplog.at_level(logging.WARNING, logger="actors.sandbox"):
        first, second = (
            run("print('hi')", isolation="none"),
            run("print('again')", isolation="none"),
        )
    assert (first.output, second.output) == ("hi\n", "again\n")
    assert first.isolation == second.isolation == "rlimits-only"
    [warning] = caplog.records
    assert "NOT isolated" in warning.message and "network" in warning.message


def test_an_unknown_isolation_is_an_error():
    with pytest.raises(ValueError, match="unknown sandbox isolation 'docker'"):
        run("print(1)", isolation="docker")


def test_without_bwrap_the_basics_still_hold(without_bwrap, monkeypatch):
    monkeypatch.setenv("STRATA_SECRET", "hunter2")
    result = run(
        "import os\nopen('f', 'w').write('x')\nprint('STRATA_SECRET' in os.environ)",
        isolation="none",
    )
    assert result.ok and result.output == "False\n"
    marker = f"1000.{uuid.uuid4().int % 10**9}"
    code = f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'])\nwhile True: pass"
    result = run(code, timeout_s=1.0, isolation="none")
    assert result.timed_out and processes_with(marker) == []


def test_a_broken_bwrap_is_refused_with_the_reason(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "find_bwrap", lambda: "/bin/false")
    monkeypatch.setattr(sandbox, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="actors.sandbox"):
        assert sandbox_mode() == "refused"
        result = run("print(1)")
    assert not result.ok and "bubblewrap at /bin/false cannot run the sandbox" in result.output
    assert "bubblewrap at /bin/false cannot run the sandbox" in caplog.text


def test_the_python_tool_passes_its_isolation_and_a_refusal_is_a_counted_error(without_bwrap):
    from actors.tools import PythonTool, ToolStats, call_tool

    stats = ToolStats()
    refused = asyncio.run(call_tool(PythonTool(timeout_s=2), "print(1)", stats))
    unisolated = asyncio.run(
        call_tool(PythonTool(timeout_s=2, isolation="none"), "print(1)", stats)
    )
    assert not refused.ok and "python tool refused" in refused.text
    assert unisolated.ok and unisolated.text == "1\n"
    assert (stats.calls["python"], stats.errors["python"]) == (2, 1)


def test_without_bwrap_a_finished_script_is_not_held_up_by_its_children(without_bwrap):
    marker = f"1000.{uuid.uuid4().int % 10**9}"
    result = run(
        f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'])\nprint('done')",
        isolation="none",
    )
    assert result.ok and result.output == "done\n" and result.seconds < 1
    assert processes_with(marker) == []


@pytest.mark.skipif(
    os.geteuid() != 0 or bool(sandbox._interpreter_behind_closed_dirs()[0]),
    reason="needs root and an interpreter other uids can run (to drop to a throwaway uid)",
)
def test_without_bwrap_root_still_contains_fork_bombs_and_escapees(without_bwrap):
    assert run("import os\nprint(os.getuid())", isolation="none").output != "0\n"
    assert not run("import os\nwhile True: os.fork()", isolation="none").ok
    assert processes_with("-I\0-S\0main.py") == []
    marker = f"1000.{uuid.uuid4().int % 10**9}"
    run(
        f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)",
        isolation="none",
    )
    assert processes_with(marker) == []


def test_cancelling_the_call_kills_the_code():
    marker = f"1000.{uuid.uuid4().int % 10**9}"
    code = f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'])\nwhile True: pass"

    async def cancel_midway():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(run_python(code, 10.0), 0.5)
        await asyncio.sleep(0.2)  # bwrap's pid namespace goes down right after bwrap

    asyncio.run(cancel_midway())
    assert processes_with(marker) == []


def test_an_interpreter_anywhere_under_tmp_is_mounted_into_the_sandbox(monkeypatch, tmp_path):
    """/tmp is the code's own tmpfs inside bwrap: a venv there, and the base installation its
    python links to, are bound back read-only (a CI checkout under /tmp must still run code)."""
    monkeypatch.setattr(sandbox.sys, "prefix", "/tmp/ci/.venv")
    monkeypatch.setattr(sandbox.sys, "base_prefix", "/tmp/pythons/3.11")
    monkeypatch.setattr(sandbox.sys, "executable", "/tmp/ci/.venv/bin/python")
    argv, _ = sandbox._command("bwrap", str(tmp_path), -1, 1.0, 64)
    binds = {argv[i + 1] for i, arg in enumerate(argv) if arg == "--ro-bind"}
    assert {"/tmp/ci/.venv", "/tmp/pythons/3.11"} <= binds
    assert "/tmp/ci/.venv/bin" not in binds  # inside the venv's own bind
