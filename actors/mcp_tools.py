"""MCP servers as tool sources (`actors.mcp_servers`), through the `mcp` SDK's client.

A server is a command Strata starts (stdio: each actor process starts its own and stops it with
the run; a command `python` or `python3` is this process's own interpreter, whatever PATH finds)
or a running streamable-HTTP endpoint, which Strata reaches on loopback only
(127.0.0.0/8, ::1, localhost) unless the config says `allow_remote: true`. A server that does not
start, or does not answer within `timeout_s`, is refused in one line that says where its stderr
went (the run directory's `logs/mcp-<name>.log`) and the last line it wrote there. At start the
server's tools are listed (every page) and, kept to the allow-list if one is given, become
Strata tools (the contract: actors/tools.py) named `<server>_<tool>`: the server's name keeps two
servers' tools (and Strata's own) apart, and the prompt and `Trajectory.tool_names` show where a
call went.
Characters a tool name cannot hold become `_`; the call reaches the server under its own name.
Each tool's schema is the server's input schema (titles dropped); its description the server's,
parameters the description's `Args:` block documents getting their lines.

A call's arguments are checked against that schema here (a bad call is an observation, counted,
and never reaches the server) and sent with the server's `timeout_s`; the result's text blocks are
the observation (structured content as JSON when there is no text; an image or a binary resource
as a line naming it); a result the server marks as an error is a failed observation. A call that
times out is a failed observation and the server is kept. A server that dies (its process exits,
its connection drops) fails the calls in flight, each an observation saying so, counted; the next
call starts it again (reconnects, for HTTP) and `restarts` counts that. A restart that fails is
that call's observation too, and the call after it tries again.

The SDK's client lives in one task of its own per connection (anyio requires its context to be
entered and left by the same task); calls from every trajectory share the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from actors.tool_schema import clean_schema, parse_docstring
from actors.tools import ToolResult, check_arguments, function_schema

_NOT_IN_A_NAME = re.compile(r"[^A-Za-z0-9_-]")


class McpError(RuntimeError):
    """A server that cannot be started or listed, or a config it refuses; one line."""


def remote_host(url: str) -> str | None:
    """The host of `url` when it is not loopback (127.0.0.0/8, ::1, localhost), else None."""
    host = (urlsplit(url).hostname or "").lower()
    if host in ("localhost", "::1") or re.fullmatch(r"127(\.\d{1,3}){3}", host):
        return None
    return host or url


@dataclass
class McpServerSpec:
    """One server as `actors.mcp_servers` gives it (pipeline/config/schema.py documents each)."""

    name: str
    command: Sequence[str] | None = None
    url: str | None = None
    tools: Sequence[str] | None = None
    timeout_s: float = 30.0
    env: dict[str, str] = field(default_factory=dict)
    allow_remote: bool = False

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise McpError(f"mcp server {self.name}: give either command or url")
        if self.url is not None and not self.allow_remote and remote_host(self.url):
            raise McpError(
                f"mcp server {self.name}: {self.url} is not on this machine (host "
                f"{remote_host(self.url)}); MCP over HTTP reaches only loopback addresses unless "
                "the server's allow_remote is true"
            )


class McpServer:
    """One MCP server: its connection, its tools, its restarts (see the module doc)."""

    def __init__(self, spec: McpServerSpec, log_dir: str | os.PathLike[str] | None = None):
        self.spec = spec
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.restarts = 0
        self.tools: dict[str, McpTool] = {}
        self._connection: _Connection | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    async def start(self) -> dict[str, McpTool]:
        """Start (or reach) the server and list its tools: name -> Strata tool. McpError (one
        line) when it cannot be started, or the allow-list names a tool it does not have."""
        log = self.log_path()
        before = _size(log)
        try:
            self._connection = await self._connect()
            listed = await asyncio.wait_for(self._list(), self.spec.timeout_s)
        except Exception as exc:
            await self.close()
            raise McpError(
                f"mcp server {self.spec.name} ({self._where()}) cannot be used: "
                f"{_first_line(exc)}{self._stderr_said(log, before)}"
            ) from None
        chosen = (
            listed if self.spec.tools is None else [t for t in listed if t.name in self.spec.tools]
        )
        missing = sorted(set(self.spec.tools or ()) - {t.name for t in listed})
        if missing:
            await self.close()
            raise McpError(
                f"mcp server {self.spec.name}: {', '.join(missing)} not among its tools "
                f"({', '.join(t.name for t in listed) or 'none'}); fix its tools allow-list"
            )
        self.tools = {}
        for listing in chosen:
            tool = McpTool(self, listing)
            if tool.name in self.tools:
                raise McpError(
                    f"mcp server {self.spec.name}: tools {listing.name!r} and "
                    f"{self.tools[tool.name].remote!r} are both named {tool.name!r} in Strata"
                )
            self.tools[tool.name] = tool
        return self.tools

    async def call(self, tool: str, arguments: dict) -> ToolResult:
        """One call of the server's `tool`; never raises (see the module doc)."""
        if self._closed:
            return ToolResult(False, f"{self.spec.name} (MCP) is stopped.")
        try:
            connection = await self._connected()
        except Exception as exc:
            return ToolResult(
                False,
                f"{self.spec.name} (MCP) could not be restarted: {_first_line(exc)}",
            )
        try:
            result = await asyncio.wait_for(
                connection.client.call_tool(
                    tool, arguments, read_timeout_seconds=self.spec.timeout_s
                ),
                self.spec.timeout_s + 5,
            )
        except Exception as exc:
            if _timed_out(exc):
                return ToolResult(
                    False, f"{tool} timed out after {self.spec.timeout_s:g} s ({self.spec.name})."
                )
            connection.broken = True  # the next call starts it again
            return ToolResult(
                False,
                f"{self.spec.name} (MCP) failed during the call: {_first_line(exc)}; it is "
                "restarted for the next call.",
            )
        return _result(result)

    async def close(self) -> None:
        """Stop the server (stdio) or leave it (HTTP); idempotent."""
        self._closed = True
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close()

    async def _connected(self) -> _Connection:
        async with self._lock:
            if self._connection is None or self._connection.broken:
                old, self._connection = self._connection, None
                if old is not None:
                    await old.close()
                self._connection = await self._connect()
                self.restarts += 1
            return self._connection

    async def _connect(self) -> _Connection:
        connection = _Connection(self._transport, self.spec.timeout_s)
        await asyncio.wait_for(connection.open(), self.spec.timeout_s)
        return connection

    def log_path(self) -> Path | None:
        """Where a stdio server's stderr goes: `log_dir/mcp-<name>.log` (the run directory's
        logs/); None without a log_dir (this process's stderr) or for an HTTP server."""
        if self.spec.command is None or self.log_dir is None:
            return None
        return self.log_dir / f"mcp-{self.spec.name}.log"

    def _stderr_said(self, log: Path | None, before: int) -> str:
        """Where to read why a stdio server did not start, for its one-line refusal: its log
        (and the last line it wrote there during this start), or this process's stderr."""
        if self.spec.command is None:
            return ""
        if log is None:
            return "; its stderr is this process's (above)"
        try:
            with open(log, "rb") as f:
                f.seek(before)
                written = f.read().decode("utf-8", "replace")
        except OSError:
            written = ""
        lines = [line.strip() for line in written.splitlines() if line.strip()]
        last = f", ending: {lines[-1][:200]}" if lines else " (empty)"
        return f"; its stderr is in {log}{last}"

    def _transport(self, stack: contextlib.AsyncExitStack):
        """The SDK's transport to the server; a stdio server's stderr goes to `log_path()`
        (else this process's stderr)."""
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client
        from mcp.client.streamable_http import streamable_http_client

        if self.spec.url is not None:
            return streamable_http_client(self.spec.url)
        command, *args = self.spec.command
        if command in ("python", "python3"):  # the actor's interpreter: its packages, its venv
            command = sys.executable
        params = StdioServerParameters(command=command, args=list(args), env=self.spec.env or None)
        errlog = sys.stderr
        log = self.log_path()
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            errlog = stack.enter_context(open(log, "a"))  # noqa: SIM115 (the stack closes it)
        return stdio_client(params, errlog=errlog)

    async def _list(self) -> list:
        client = self._connection.client
        listed, cursor = [], None
        for _ in range(1000):  # a paginator that never ends cannot hang the start
            page = await client.list_tools(cursor=cursor)
            listed += page.tools
            cursor = page.next_cursor
            if cursor is None:
                break
        return listed

    def _where(self) -> str:
        return self.spec.url or " ".join(self.spec.command)


class McpTool:
    """One tool of an MCP server, on the Strata contract."""

    open_tag, close_tag = "<result>", "</result>"

    def __init__(self, server: McpServer, listing) -> None:
        self.server = server
        self.remote = listing.name
        self.name = _NOT_IN_A_NAME.sub("_", f"{server.spec.name}_{listing.name}")[:64]
        description, about = parse_docstring(listing.description or "")
        parameters = clean_schema(dict(listing.input_schema or {"type": "object"}))
        parameters.setdefault("type", "object")
        for key, prop in (parameters.get("properties") or {}).items():
            if key in about and isinstance(prop, dict) and "description" not in prop:
                prop["description"] = about[key]
        self.schema = function_schema(self.name, description or listing.name, parameters)

    async def __call__(self, arguments: dict) -> ToolResult:
        refused = check_arguments(self, arguments)
        if refused is not None:
            return refused
        return await self.server.call(self.remote, arguments)

    async def close(self) -> None:
        await self.server.close()


class _Connection:
    """The SDK's client, entered and left in one task of its own."""

    def __init__(self, transport, timeout_s: float) -> None:
        self._transport = transport
        self._timeout_s = timeout_s
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.client: Any = None
        self.broken = False

    async def open(self) -> None:
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._hold(ready))
        try:
            self.client = await ready
        except BaseException:
            await self.close()
            raise

    async def _hold(self, ready: asyncio.Future) -> None:
        from mcp import Client

        try:
            async with contextlib.AsyncExitStack() as stack:
                transport = self._transport(stack)
                client = Client(transport, read_timeout_seconds=self._timeout_s)
                await stack.enter_async_context(client)
                ready.set_result(client)
                await self._stop.wait()
        except Exception as exc:  # a server that would not start, or the exit of a dead one
            if not ready.done():
                ready.set_exception(exc)
        finally:
            self.broken = True
            if not ready.done():
                ready.set_exception(McpError("the connection ended before it was made"))

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 10)
            except TimeoutError:
                self._task.cancel()


def _result(result) -> ToolResult:
    """A CallToolResult as the observation."""
    texts = []
    for block in result.content or ():
        kind = getattr(block, "type", "")
        if kind == "text":
            texts.append(block.text)
        elif kind == "resource" and hasattr(block.resource, "text"):
            texts.append(block.resource.text)
        elif kind == "resource":
            texts.append(f"[resource {block.resource.uri}]")
        elif kind == "resource_link":
            texts.append(f"[resource {block.uri}]")
        else:
            texts.append(f"[{kind} {getattr(block, 'mime_type', '')}]".replace(" ]", "]"))
    if not texts and result.structured_content is not None:
        texts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return ToolResult(not result.is_error, "\n".join(texts))


def _timed_out(exc: BaseException) -> bool:
    from mcp_types import REQUEST_TIMEOUT

    return isinstance(exc, TimeoutError) or (getattr(exc, "code", None) == REQUEST_TIMEOUT)


def _size(path: Path | None) -> int:
    """The file's size (0 when there is none): where what is written next begins."""
    try:
        return 0 if path is None else path.stat().st_size
    except OSError:
        return 0


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return _first_line(exc.exceptions[0])
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


async def open_mcp_tools(
    specs: Sequence[McpServerSpec], log_dir: str | os.PathLike[str] | None = None
) -> tuple[list[McpServer], dict[str, McpTool]]:
    """Start every server (in parallel) and gather their tools; on any failure the started ones
    are stopped and the first McpError raised."""
    servers = [McpServer(spec, log_dir) for spec in specs]
    results = await asyncio.gather(*(s.start() for s in servers), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        await asyncio.gather(*(s.close() for s in servers))
        raise failed[0]
    tools: dict[str, McpTool] = {}
    for found in results:
        for name, tool in found.items():
            if name in tools:
                await asyncio.gather(*(s.close() for s in servers))
                raise McpError(
                    f"mcp servers {tools[name].server.spec.name} and {tool.server.spec.name} "
                    f"both have a tool named {name!r} in Strata: rename one server"
                )
            tools[name] = tool
    return servers, tools
