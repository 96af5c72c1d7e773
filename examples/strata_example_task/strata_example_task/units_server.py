"""An MCP server of unit conversions, over stdio: `python -m strata_example_task.units_server`.

Written with the `mcp` SDK's MCPServer (FastMCP's name before mcp 2.x). Strata starts one per
actor process (`actors.mcp_servers`), lists its tools and offers the allowed ones to the model as
`units_<tool>`.
"""

from mcp.server.mcpserver import MCPServer

from strata_example_task.atlas import km_to_miles as _km_to_miles

server = MCPServer("units", log_level="WARNING")


@server.tool()
def km_to_miles(km: float) -> str:
    """Convert kilometres to miles, rounded to a whole mile.

    Args:
        km: The distance in kilometres.
    """
    return str(_km_to_miles(km))


@server.tool()
def miles_to_km(miles: float) -> str:
    """Convert miles to kilometres, rounded to a whole kilometre.

    Args:
        miles: The distance in miles.
    """
    return str(round(miles / 0.621371))


def main() -> None:
    server.run("stdio")


if __name__ == "__main__":
    main()
