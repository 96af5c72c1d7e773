"""MCP servers as tool sources (actors/mcp_tools.py) against a real server written with the SDK
(tests/actors/mcp_standin.py): over stdio, started and stopped here, and over streamable HTTP on
127.0.0.1. Its tools are listed with their schemas and called with arguments; a call that does
not fit a schema never reaches the server; the server killed in the middle of a call makes that
call a failed observation, counted, and the next call works on a restarted server; a URL off this
machine is refused in one line."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.mcp_tools import McpError, McpServerSpec, open_mcp_tools, remote_host
from actors.tools import ToolStats, call_tool
from pipeline.config.loader import ConfigError, load_config

STANDIN = str(Path(__file__).with_name("mcp_standin.py"))
STDIO = [sys.executable, STANDIN]


def run(coro):
    return asyncio.run(coro)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead: it waits for its parent only
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_stdio_servers_tools_are_listed_with_their_schemas_and_called(tmp_path):
    async def scenario():
        spec = McpServerSpec("calc", command=STDIO, tools=["add", "shout", "fail"], timeout_s=60)
        servers, tools = await open_mcp_tools([spec], log_dir=tmp_path)
        stats = ToolStats()
        try:
            results = {
                "add": await call_tool(tools["calc_add"], {"a": 2, "b": 40}, stats),
                "shout": await call_tool(tools["calc_shout"], "quiet", stats),  # the bare string
                "bad": await call_tool(tools["calc_add"], {"a": "2", "c": 1}, stats),
                "fail": await call_tool(tools["calc_fail"], {}, stats),
            }
        finally:
            for server in servers:
                await server.close()
        return tools, results, stats

    tools, results, stats = run(scenario())
    assert list(tools) == ["calc_add", "calc_shout", "calc_fail"]  # the allow-list, prefixed
    add = tools["calc_add"].schema["function"]
    assert add["name"] == "calc_add" and add["description"] == "Add two integers."
    assert add["parameters"] == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "The first."},
            "b": {"type": "integer", "description": "The second."},
        },
        "required": ["a", "b"],
    }
    assert results["add"].ok and results["add"].text == "42"
    assert results["shout"].ok and results["shout"].text == "QUIET"
    bad = results["bad"]
    assert bad.bad_call and not bad.ok and bad.text.startswith("Invalid call of calc_add: ")
    assert "'b' is a required property" in bad.text and "\n" not in bad.text
    assert not results["fail"].ok and "fail" in results["fail"].text
    assert stats.calls == {"calc_add": 2, "calc_shout": 1, "calc_fail": 1}
    assert stats.errors == {"calc_add": 1, "calc_fail": 1} and stats.bad_calls == {"calc_add": 1}
    assert (tmp_path / "mcp-calc.log").is_file()  # the server's stderr, not the run's


def test_python_is_the_actors_own_interpreter_whatever_path_finds(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no python on it

    async def scenario():
        spec = McpServerSpec("calc", command=["python", STANDIN], tools=["add"], timeout_s=60)
        servers, tools = await open_mcp_tools([spec], log_dir=tmp_path)
        try:
            return await tools["calc_add"]({"a": 1, "b": 2})
        finally:
            await servers[0].close()

    assert run(scenario()).text == "3"


def test_a_server_killed_mid_call_fails_that_call_and_the_next_call_restarts_it(tmp_path):
    async def scenario():
        spec = McpServerSpec("calc", command=STDIO, timeout_s=60)
        servers, tools = await open_mcp_tools([spec], log_dir=tmp_path)
        (server,) = servers
        stats = ToolStats()
        try:
            first = int((await call_tool(tools["calc_pid"], {}, stats)).text)
            slow = asyncio.create_task(call_tool(tools["calc_slow"], {"seconds": 30}, stats))
            await asyncio.sleep(1.0)  # the call is on the server now
            os.kill(first, signal.SIGKILL)
            started = time.monotonic()
            died = await slow
            waited = time.monotonic() - started
            after = await call_tool(tools["calc_add"], {"a": 1, "b": 1}, stats)
            second = int((await call_tool(tools["calc_pid"], {}, stats)).text)
            restarts = server.restarts
        finally:
            await server.close()
        return first, second, died, waited, after, restarts, stats, alive(second)

    first, second, died, waited, after, restarts, stats, running = run(scenario())
    assert not died.ok and "calc (MCP) failed during the call" in died.text and waited < 20
    assert after.ok and after.text == "2" and restarts == 1 and second != first
    assert stats.errors == {"calc_slow": 1} and stats.calls["calc_slow"] == 1
    assert not running  # stopped with the run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def http_server(tmp_path):
    port = free_port()
    log = open(tmp_path / "http.log", "w")  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, STANDIN, "http", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if process.poll() is not None:
                pytest.fail((tmp_path / "http.log").read_text())
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}/mcp"
    process.terminate()
    process.wait(30)
    log.close()


def test_a_streamable_http_server_on_loopback(http_server):
    async def scenario():
        spec = McpServerSpec("web", url=http_server, tools=["add"], timeout_s=60)
        servers, tools = await open_mcp_tools([spec])
        try:
            return list(tools), await tools["web_add"]({"a": 3, "b": 4})
        finally:
            for server in servers:
                await server.close()

    names, result = run(scenario())
    assert names == ["web_add"] and result.ok and result.text == "7"


@pytest.mark.parametrize("url", ["http://10.0.0.7:8000/mcp", "https://mcp.example.com/mcp"])
def test_a_url_off_this_machine_is_refused_in_one_line(url, tmp_path):
    with pytest.raises(McpError) as refused:
        McpServerSpec("far", url=url)
    assert "only loopback" in str(refused.value) and "\n" not in str(refused.value)
    McpServerSpec("far", url=url, allow_remote=True)  # said so: allowed (nothing is reached here)
    with pytest.raises(ConfigError) as caught:
        load_config("configs/local.yaml", [f"actors.mcp_servers=[{{name: far, url: '{url}'}}]"])
    message = str(caught.value)
    assert "actors.mcp_servers[0]: far: url" in message and "allow_remote: true" in message
    assert "\n" not in message
    config = load_config(
        "configs/local.yaml",
        [f"actors.mcp_servers=[{{name: far, url: '{url}', allow_remote: true, tools: [add]}}]"],
    )
    assert config.actors.tool_names == ["search", "python", "far_add"]


def test_the_config_and_the_actors_judge_a_host_alike():
    from pipeline.config import schema

    urls = ["http://127.0.0.1:1/mcp", "http://127.9.9.9/mcp", "http://localhost:8/mcp"]
    urls += ["http://[::1]:8/mcp", "http://10.0.0.7/mcp", "http://127.0.0.1.nip.io/mcp"]
    judged = [schema.remote_host(u) for u in urls]
    assert judged == [remote_host(u) for u in urls]
    assert judged == [None, None, None, None, "10.0.0.7", "127.0.0.1.nip.io"]


def test_an_allow_list_naming_a_tool_the_server_lacks_is_refused_when_it_starts(tmp_path):
    spec = McpServerSpec("calc", command=STDIO, tools=["add", "multiply"], timeout_s=60)
    with pytest.raises(McpError) as refused:
        run(open_mcp_tools([spec], log_dir=tmp_path))
    assert str(refused.value).startswith("mcp server calc: multiply not among its tools (add,")


def test_a_command_that_is_no_server_is_one_line():
    spec = McpServerSpec("none", command=[sys.executable, "-c", "pass"], timeout_s=20)
    with pytest.raises(McpError) as refused:
        run(open_mcp_tools([spec]))
    assert str(refused.value).startswith("mcp server none (") and "\n" not in str(refused.value)


def test_a_runs_servers_start_with_its_acting_parts_and_stop_with_them(tmp_path):
    from pipeline.runtime.parts import Acting, _NoEngine, make_tools, open_mcp_servers

    command = f"[{sys.executable}, {STANDIN}]"
    config = load_config(
        "configs/local.yaml",
        [
            "actors.tools=[python]",
            f"actors.mcp_servers=[{{name: calc, command: {command}, tools: [add, pid]}}]",
        ],
    )
    assert config.actors.tool_names == ["python", "calc_add", "calc_pid"]

    async def scenario():
        tools = make_tools(config.actors, config.retrieval, None)
        servers = await open_mcp_servers(config.actors, tools, tmp_path / "logs")
        pid = int((await tools["calc_pid"]({})).text)
        running = alive(pid)
        await Acting(config, _NoEngine(), None, tools, None, None, servers).close()
        return list(tools), pid, running

    names, pid, running = run(scenario())
    assert names == config.actors.tool_names and running
    assert not alive(pid) and (tmp_path / "logs" / "mcp-calc.log").is_file()


def test_a_server_that_does_not_start_is_one_line_naming_its_log(tmp_path):
    from pipeline.backends.runtime import RuntimeUnavailable
    from pipeline.runtime.parts import open_mcp_servers

    crash = (
        "import sys; print('ModuleNotFoundError: no module units', file=sys.stderr); sys.exit(1)"
    )
    config = load_config(
        "configs/local.yaml",
        [
            "actors.tools=[python]",
            f"actors.mcp_servers=[{{name: units, command: [{sys.executable}, -c, {crash!r}]}}]",
        ],
    )
    log = tmp_path / "logs" / "mcp-units.log"
    log.parent.mkdir()
    log.write_text("an earlier run's last words\n")  # a resumed run appends to its log
    with pytest.raises(RuntimeUnavailable) as refused:
        run(open_mcp_servers(config.actors, {}, tmp_path / "logs"))
    message = str(refused.value)
    assert message.startswith("actors.mcp_servers: mcp server units (") and "\n" not in message
    assert message.endswith(
        f"; its stderr is in {log}, ending: ModuleNotFoundError: no module units"
    )
    with pytest.raises(McpError) as unlogged:  # no log directory: the stderr is this process's
        run(open_mcp_tools([McpServerSpec("units", command=[sys.executable, "-c", crash])]))
    assert str(unlogged.value).endswith("; its stderr is this process's (above)")
