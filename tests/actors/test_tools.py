"""The built-in tools are tools of the plug-in contract (actors/tools.py's FunctionTool): each has
the schema a plain function of its signature and docstring gets, its calls are validated the
same way (a wrong type or an unknown key is a bad call: the same observation, counted, nothing
run), and the web tools keep a trajectory's calls as create()/release() state."""

import asyncio

from actors.function_tools import function_tool
from actors.tools import (
    CURRENT_TRAJECTORY,
    FunctionTool,
    ToolResult,
    ToolStats,
    TrajectoryContext,
    call_tool,
)
from pipeline.config.schema import RetrievalConfig, StrataConfig
from pipeline.runtime.parts import make_tools


def search(query: str) -> str:
    """Search the knowledge base; returns the top passages for the query.

    Args:
        query: What to search for.
    """
    return query


def python(code: str) -> str:
    """Run Python code in a sandbox; returns what it prints.

    Args:
        code: The program to run.
    """
    return code


def web_search(query: str) -> str:
    """Search the web (Google); returns the top results' titles, snippets and URLs.

    Args:
        query: What to search for.
    """
    return query


def browse(url: str) -> str:
    """Read a web page; returns its text, cut to a budget.

    Args:
        url: The page's URL.
    """
    return url


TWINS = {f.__name__: function_tool(f) for f in (search, python, web_search, browse)}
"""Plain functions of the built-ins' signatures and docstrings, made tools as a plug-in is."""


def built_ins(**web) -> dict:
    tools = {}
    for names in (["search", "python", "browse"], ["web_search"]):  # one <search> a config
        actors = StrataConfig.model_validate({"actors": {"tools": names, "web": web}}).actors
        tools |= make_tools(actors, RetrievalConfig(), "http://127.0.0.1:9")
    return tools


def test_each_built_in_is_a_function_tool_with_the_schema_a_plain_function_gets():
    tools = built_ins()
    assert list(tools) == ["search", "python", "browse", "web_search"]
    for name, tool in tools.items():
        assert isinstance(tool, FunctionTool), name
        assert tool.schema == TWINS[name].schema, name


def test_a_built_in_refuses_a_bad_call_as_a_function_tool_does():
    tools, stats, twin_stats = built_ins(), ToolStats(), ToolStats()
    parameter = {"search": "query", "python": "code", "browse": "url", "web_search": "query"}
    bad = [lambda p: {p: 3}, lambda p: {p: "x", "topk": 5}, lambda p: {}]

    async def calls():
        out = []
        for name, tool in tools.items():
            for arguments in (make(parameter[name]) for make in bad):
                out.append(
                    (
                        await call_tool(tool, arguments, stats),
                        await call_tool(TWINS[name], arguments, twin_stats),
                    )
                )
        await asyncio.gather(*(t.close() for t in tools.values()))
        return out

    for built, twin in asyncio.run(calls()):
        assert built == twin and built.bad_call and "\n" not in built.text
    assert stats.bad_calls == stats.errors == {name: 3 for name in tools}
    assert twin_stats.bad_calls == stats.bad_calls
    # a tool of one string parameter takes the bare text, as the tags format writes it
    assert asyncio.run(TWINS["search"]("Varno Telik")) == ToolResult(True, "Varno Telik")


def test_the_web_tools_keep_a_trajectorys_calls_as_state_released_with_it():
    tools = built_ins(max_calls_per_trajectory=1)
    browse_tool, stats = tools["browse"], ToolStats()

    async def trajectory():
        context = TrajectoryContext()
        token = CURRENT_TRAJECTORY.set(context)
        try:
            first = await browse_tool({"url": "file:///etc/passwd"})  # refused, still a call
            second = await browse_tool({"url": "file:///etc/passwd"})
            held = [name for name, _ in context.releases]
        finally:
            CURRENT_TRAJECTORY.reset(token)
            await context.release(stats)
        return first, second, held, dict(context.states)

    for _ in range(2):  # a new trajectory has its own count
        first, second, held, left = asyncio.run(trajectory())
        assert "only http and https" in first.text
        assert second.text == "Browse refused: this answer has read its 1 pages."
        assert held == ["browse"] and left == {} and not stats.release_errors
    asyncio.run(browse_tool.close())
