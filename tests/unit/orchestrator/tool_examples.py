"""Custom tools for the tests of `rollout.tools[].factory` (loaded by dotted path)."""

from __future__ import annotations

import asyncio
from typing import Any

from orchestrator.config import ToolConfig
from orchestrator.tools.base import ToolError, ToolResult


class Echo:
    name = "echo"
    description = "Repeat the text."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
    }

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.calls = 0

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        self.calls += 1
        if arguments["text"] == "refuse":
            raise ToolError("echo refuses that")
        return ToolResult(self.prefix + arguments["text"])


class Flaky:
    """Fails `failures` times with a ConnectionError, then answers; or sleeps `delay`."""

    name = "flaky"
    description = "A tool that fails at first."
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    def __init__(self, failures: int = 0, delay: float = 0.0) -> None:
        self.failures, self.delay = failures, delay
        self.calls = 0
        self.in_flight = self.max_in_flight = 0

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            if self.calls <= self.failures:
                raise ConnectionError("refused")
            return ToolResult("ok")
        finally:
            self.in_flight -= 1


def make_echo(cfg: ToolConfig) -> Echo:
    return Echo(**cfg.options)


class Upper(Echo):
    name = "upper"

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult(arguments["text"].upper())


async def make_two(cfg: ToolConfig) -> list[Any]:
    return [Flaky(), Upper()]


def no_args() -> Echo:
    return Echo()


def not_a_tool(cfg: ToolConfig) -> object:
    return object()


class SyncCall(Echo):
    def call(self, arguments: dict[str, Any]) -> ToolResult:  # type: ignore[override]
        return ToolResult("")


def sync_call(cfg: ToolConfig) -> SyncCall:
    return SyncCall()


class BadSchema(Echo):
    parameters: dict[str, Any] = {"type": "object", "properties": {"x": {"type": "nonsense"}}}


def bad_schema(cfg: ToolConfig) -> BadSchema:
    return BadSchema()
