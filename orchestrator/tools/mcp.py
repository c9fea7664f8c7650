"""Tools of an MCP server (stdio or streamable HTTP), through the official `mcp` SDK.

At start-up the server is connected, initialized and asked for its tools; each becomes a tool
of the rollout (`McpTool`), with the runner's guarantees like any other. The connection lives
in one task of its own (the SDK's transports are anyio task groups, which must be left from the
task that entered them). A call's own failure (the server's `isError` result, invalid params)
is what the policy reads (`ToolError`); a broken connection is the tool's trouble: retried,
and the breaker's probe (a ping; if that fails, a new connection: a stdio server is started
again) brings the server back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from contextlib import AsyncExitStack
from typing import Any

from mcp import ClientSession, McpError, StdioServerParameters, types
from mcp.client.stdio import get_default_environment, stdio_client
from mcp.client.streamable_http import streamable_http_client

from orchestrator.config import McpServerConfig
from orchestrator.tools.base import ToolError, ToolResult

log = logging.getLogger(__name__)
PING_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 5.0
# JSON-RPC errors that are the call's fault (a bad name or bad arguments), not the server's.
_CALL_ERRORS = {types.INVALID_PARAMS, types.METHOD_NOT_FOUND, types.INVALID_REQUEST}


class McpConnection:
    """One server's session, owned by a task of its own; reconnects on `ready()`."""

    def __init__(self, cfg: McpServerConfig, label: str) -> None:
        self.cfg = cfg
        self.label = label
        self.session: ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._lock = asyncio.Lock()  # one (re)connect at a time

    async def connect(self) -> list[types.Tool]:
        """Connect, initialize and list the tools, within `connect_timeout_s`."""
        ready: asyncio.Future[list[types.Tool]] = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._own(ready, self._stop))
        try:
            async with asyncio.timeout(self.cfg.connect_timeout_s):
                return await asyncio.shield(ready)
        except BaseException:
            await self.aclose()
            raise

    async def _open(self, stack: AsyncExitStack) -> ClientSession:
        if self.cfg.command:
            cmd = self.cfg.command
            params = StdioServerParameters(
                command=cmd[0], args=cmd[1:], env={**get_default_environment(), **self.cfg.env}
            )
            read, write = await stack.enter_async_context(stdio_client(params))
        else:
            assert self.cfg.url is not None  # McpServerConfig: one of the two
            read, write, _ = await stack.enter_async_context(streamable_http_client(self.cfg.url))
        return await stack.enter_async_context(ClientSession(read, write))

    async def _own(self, ready: asyncio.Future[list[types.Tool]], stop: asyncio.Event) -> None:
        try:
            async with AsyncExitStack() as stack:
                session = await self._open(stack)
                await session.initialize()
                tools: list[types.Tool] = []
                cursor: str | None = None
                while True:  # every page
                    page = await session.list_tools(
                        params=types.PaginatedRequestParams(cursor=cursor) if cursor else None
                    )
                    tools += page.tools
                    cursor = page.nextCursor
                    if not cursor:
                        break
                self.session = session
                ready.set_result(tools)
                await stop.wait()
        except Exception as e:
            if not ready.done():
                ready.set_exception(e)
            else:
                log.warning(
                    "MCP server connection lost", extra={"server": self.label, "error": repr(e)}
                )
        finally:
            self.session = None
            if not ready.done():
                ready.cancel()

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        session = self.session
        if session is None:
            raise ConnectionError(f"MCP server {self.label!r} is not connected")
        return await session.call_tool(name, arguments)

    async def ready(self) -> bool:
        """The breaker's probe: a ping; when that fails, a new connection."""
        async with self._lock:
            if self.session is not None:
                try:
                    async with asyncio.timeout(PING_TIMEOUT_S):
                        await self.session.send_ping()
                    return True
                except Exception:
                    await self.aclose()
            try:
                await self.connect()
            except Exception as e:
                log.info("MCP server not back yet", extra={"server": self.label, "error": repr(e)})
                return False
            log.info("MCP server reconnected", extra={"server": self.label})
            return True

    async def aclose(self) -> None:
        """Leave the session (a stdio server is terminated); idempotent."""
        task, self._task = self._task, None
        self._stop.set()
        if task is None:
            return
        try:
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await asyncio.shield(task)
        except (TimeoutError, asyncio.CancelledError, Exception):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def result_text(result: types.CallToolResult) -> str:
    """The text the policy reads: the text parts, in order (others named, not dropped)."""
    parts = []
    for c in result.content:
        if isinstance(c, types.TextContent):
            parts.append(c.text)
        else:
            parts.append(f"[{c.type} content]")
    if not parts and result.structuredContent is not None:
        parts.append(json.dumps(result.structuredContent, ensure_ascii=False))
    return "\n".join(parts)


class McpTool:
    """One tool of an MCP server, as `orchestrator.tools.base.Tool`."""

    def __init__(self, conn: McpConnection, spec: types.Tool) -> None:
        self.conn = conn
        self.name = spec.name
        self.description = spec.description or ""
        self.parameters: dict[str, Any] = dict(spec.inputSchema or {"type": "object"})

    async def ready(self) -> bool:
        return await self.conn.ready()

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        try:
            result = await self.conn.call_tool(self.name, arguments)
        except McpError as e:
            if e.error.code in _CALL_ERRORS:
                raise ToolError(e.error.message) from e
            raise
        text = result_text(result)
        if result.isError:
            raise ToolError(text or f"tool {self.name!r} reported an error")
        return ToolResult(text)

    async def aclose(self) -> None:
        await self.conn.aclose()


async def connect_mcp(cfg: McpServerConfig, *, label: str, field: str) -> list[McpTool]:
    """The server's tools (those in `cfg.include`, if set); ValueError naming `field` if the
    server does not answer or lacks an included tool."""
    conn = McpConnection(cfg, label)
    try:
        specs = await conn.connect()
    except Exception as e:
        how = " ".join(cfg.command) if cfg.command else cfg.url
        raise ValueError(f"{field}: MCP server {how!r} did not answer: {e!r}") from e
    names = [s.name for s in specs]
    if cfg.include is not None:
        missing = sorted(set(cfg.include) - set(names))
        if missing:
            await conn.aclose()
            raise ValueError(f"{field}: MCP server has no tool {missing} (it has {names})")
        specs = [s for s in specs if s.name in cfg.include]
    log.info("MCP server connected", extra={"server": label, "tools": [s.name for s in specs]})
    return [McpTool(conn, s) for s in specs]
