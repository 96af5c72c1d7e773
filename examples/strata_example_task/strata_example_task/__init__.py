"""Strata's worked plug-in: a fictional atlas, asked about with a lookup tool and an MCP server.

    strata_example_task.tools.lookup          a tool: a plain function, schema from its signature
    strata_example_task.units_server          an MCP server (the SDK's MCPServer, stdio)
    strata_example_task.reward.score          a reward that reads the answer and the tool calls
    strata_example_task.data.load             a dataset loader: the bundled splits by name

The package's pyproject.toml registers them under Strata's entry-point groups, so a config
names them `lookup`, `atlas` (reward and dataset); nothing in Strata is edited.
"""
