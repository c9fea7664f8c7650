"""A tiny MCP server built with the official SDK (FastMCP), for the MCP tool tests.

    python -m tests.support.mcp_server stdio
    python -m tests.support.mcp_server http PORT     (streamable HTTP at /mcp)

Its tools: `add` (a result), `slow` (a call that outlasts a deadline), `fail` (the tool's own
error, `isError`), `crash` (the server process dies: a server that is down).
"""

from __future__ import annotations

import asyncio
import os
import sys

from mcp.server.fastmcp import FastMCP


def build(port: int = 0) -> FastMCP:
    mcp = FastMCP("searchr1-test", host="127.0.0.1", port=port, log_level="WARNING")

    @mcp.tool()
    def add(a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)

    @mcp.tool()
    async def slow(seconds: float) -> str:
        """Sleep, then answer."""
        await asyncio.sleep(seconds)
        return "late"

    @mcp.tool()
    def fail(message: str) -> str:
        """Fail with the message."""
        raise ValueError(message)

    @mcp.tool()
    def crash() -> str:
        """End the server process at once."""
        os._exit(3)

    return mcp


def main(argv: list[str]) -> None:
    if argv[:1] == ["http"]:
        build(int(argv[1])).run(transport="streamable-http")
    else:
        build().run(transport="stdio")


if __name__ == "__main__":
    main(sys.argv[1:])
