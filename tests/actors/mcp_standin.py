"""A real MCP server written with the SDK (mcp.server.mcpserver.MCPServer, FastMCP's successor)
for tests/actors/test_mcp_tools.py:

    python tests/actors/mcp_standin.py                 stdio
    python tests/actors/mcp_standin.py http PORT       streamable HTTP on 127.0.0.1:PORT/mcp
"""

import asyncio
import os
import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("standin", log_level="WARNING")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


@server.tool()
def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: What to shout.
    """
    return text.upper()


@server.tool()
async def slow(seconds: float) -> str:
    """Answer after a while.

    Args:
        seconds: How long to wait.
    """
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def pid() -> int:
    """This server's process id."""
    return os.getpid()


@server.tool()
def fail() -> str:
    """Always raises."""
    raise RuntimeError("the tool is on fire")


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
