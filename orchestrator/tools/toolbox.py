"""The rollout's tools by name, each behind its runner: one call in, one outcome out, whatever
went wrong (an unknown name, arguments that fail the schema, a timeout, a tool that is down).

Every outcome is counted (`searchr1_tool_calls_total{tool, outcome}`) and carries the text the
policy reads: the result, or an error observation. Nothing is dropped.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from orchestrator.config import CallLimits
from orchestrator.tools.base import Tool, ToolError, ToolResult, function_schema, validate_arguments
from orchestrator.tools.metrics import TOOL_CALLS, UNKNOWN, RunnerMetrics
from orchestrator.tools.runner import ToolRunner

log = logging.getLogger(__name__)
DEFAULT_FAILURE = "Tool {name} failed: {error}"


@dataclass
class CallOutcome:
    name: str
    arguments: Any
    text: str  # what the policy reads: the result, or the error observation
    error: str = ""
    # The policy's fault (unknown tool, bad arguments, the tool's own ToolError): it learns
    # from it. Otherwise an error is the tool's trouble: an infrastructure failure.
    call_error: bool = False
    doc_ids: list[str] = field(default_factory=list)
    attempts: int = 0
    latency_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """For the turn record (the result itself is in the response, as the policy read it)."""
        d: dict[str, Any] = {"name": self.name, "arguments": self.arguments}
        if self.error:
            d["error"] = self.error
        return d


@dataclass
class Entry:
    tool: Tool
    runner: ToolRunner
    failure_observation: str = DEFAULT_FAILURE


class Toolbox:
    def __init__(self, entries: list[Entry]) -> None:
        self.entries: dict[str, Entry] = {}
        for e in entries:
            if e.tool.name in self.entries:
                raise ValueError(f"rollout.tools: two tools are named {e.tool.name!r}")
            self.entries[e.tool.name] = e

    @classmethod
    def of(cls, *tools: Tool, limits: CallLimits | None = None) -> Toolbox:
        """Tools with default runners (a tool with its own `runner`, as search, keeps it)."""
        return cls([entry(t, limits or CallLimits()) for t in tools])

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    def get(self, name: str) -> Tool | None:
        e = self.entries.get(name)
        return e.tool if e else None

    def schemas(self) -> list[dict[str, Any]]:
        """What the chat template's `tools=` takes."""
        return [function_schema(e.tool) for e in self.entries.values()]

    async def call(self, name: str, arguments: Any) -> CallOutcome:
        e = self.entries.get(name)
        if e is None:
            TOOL_CALLS.labels(UNKNOWN, "unknown").inc()
            error = f"unknown tool {name!r}; the tools are: {', '.join(self.names)}"
            return CallOutcome(name, arguments, f"Error: {error}", error, call_error=True)
        try:
            validate_arguments(e.tool, arguments)
        except ToolError as err:
            TOOL_CALLS.labels(name, "malformed").inc()
            return CallOutcome(name, arguments, f"Error: {err}", str(err), call_error=True)
        out = await e.runner.run(lambda: e.tool.call(arguments))
        result: ToolResult | None = out.value
        if out.error or result is None:
            TOOL_CALLS.labels(name, "failed").inc()
            error = out.error or "no result"
            return CallOutcome(
                name,
                arguments,
                e.failure_observation.format(name=name, error=error),
                error,
                call_error=out.call_error,
                attempts=out.attempts,
                latency_s=out.latency_s,
            )
        TOOL_CALLS.labels(name, "ok").inc()
        return CallOutcome(
            name,
            arguments,
            result.text,
            doc_ids=list(result.doc_ids),
            attempts=out.attempts,
            latency_s=out.latency_s,
        )

    async def aclose(self) -> None:
        await close_tools(list(self.entries.values()))


async def close_tools(entries: list[Entry]) -> None:
    """Close the tools that hold something (an MCP server's connection, a client)."""
    for e in entries:
        close = getattr(e.tool, "aclose", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()


def entry(tool: Tool, limits: CallLimits, failure_observation: str = DEFAULT_FAILURE) -> Entry:
    """A tool behind a runner: its own (`tool.runner`, e.g. search's) or one of `limits`, whose
    breaker probes `tool.ready` when the tool has one."""
    runner = getattr(tool, "runner", None)
    if not isinstance(runner, ToolRunner):
        runner = ToolRunner(limits, RunnerMetrics(tool.name), ready=getattr(tool, "ready", None))
    return Entry(tool, runner, failure_observation)


def describe_calls(outcomes: list[CallOutcome]) -> str:
    """The calls of one turn as JSON (the turn record's `query`): name, arguments, error."""
    return json.dumps([o.as_dict() for o in outcomes], ensure_ascii=False)
