"""`rollout.tools` -> a `Toolbox`, built once at start-up: the built-ins by name, custom tools by
dotted path (`factory: pkg.mod:make`, loaded and checked like the other hooks), and every tool
of an MCP server (`mcp:`). Whatever cannot be built (a typo, a wrong signature, a schema that is
no JSON schema, a server that does not answer) fails the start, naming the entry.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from orchestrator.config import ToolConfig
from orchestrator.hooks import HookError, load_hook
from orchestrator.tools.base import Tool, check_schema
from orchestrator.tools.calculator import Calculator
from orchestrator.tools.mcp import connect_mcp
from orchestrator.tools.python_exec import PythonTool
from orchestrator.tools.search import SearchTool
from orchestrator.tools.toolbox import Entry, Toolbox, close_tools, entry

# name -> builder(options) of the built-ins other than search (which needs the retriever).
BUILTINS: dict[str, Callable[..., Tool]] = {
    "calculator": Calculator,
    "python": PythonTool,
}


def _field(i: int, name: str) -> str:
    return f"rollout.tools[{i}] ({name})"


def check_tool(tool: Any, field: str) -> Tool:
    """A tool as `base.Tool` says, or HookError naming the entry."""
    if not isinstance(tool, Tool):
        raise HookError(f"{field}: {tool!r} is no tool (name, description, parameters, call)")
    if not inspect.iscoroutinefunction(tool.call):
        raise HookError(f"{field}: {type(tool).__name__}.call must be an `async def` method")
    try:
        check_schema(tool)
    except ValueError as e:
        raise HookError(f"{field}: {e}") from None
    return tool


async def _custom(cfg: ToolConfig, field: str) -> list[Tool]:
    assert cfg.factory is not None
    factory = load_hook(cfg.factory, field=f"{field}.factory", n_args=1)
    made = factory(cfg)
    if inspect.isawaitable(made):
        made = await made
    tools = made if isinstance(made, list | tuple) else [made]
    return [check_tool(t, f"{field}.factory") for t in tools]


async def build_toolbox(cfgs: list[ToolConfig], search: SearchTool | None) -> Toolbox:
    """The toolbox of `rollout.tools`; `search` is the built-in search over the retriever."""
    entries: list[Entry] = []
    opened: list[Entry] = []
    try:
        for i, c in enumerate(cfgs):
            field = _field(i, c.name)
            if c.mcp is not None:
                tools: list[Tool] = list(await connect_mcp(c.mcp, label=c.name, field=field))
            elif c.factory is not None:
                tools = await _custom(c, field)
            elif c.name == "search":
                if search is None:
                    raise ValueError(f"{field}: the search tool needs the retriever")
                entries.append(entry(search, search.cfg.limits, search.cfg.failure_observation))
                continue
            elif c.name in BUILTINS:
                try:
                    tools = [BUILTINS[c.name](**c.options)]
                except TypeError as e:
                    raise ValueError(f"{field}.options: {e}") from None
            else:
                known = ", ".join(["search", *BUILTINS])
                raise ValueError(
                    f"{field}: no built-in tool {c.name!r} (built-ins: {known}); set factory "
                    "(a dotted path) or mcp (a server) for your own"
                )
            for t in tools:
                e = entry(check_tool(t, field), c.limits, c.failure_observation)
                entries.append(e)
                opened.append(e)
        return Toolbox(entries)
    except BaseException:
        await close_tools(opened)
        raise
