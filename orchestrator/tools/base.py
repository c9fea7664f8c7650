"""The tool interface: a name, a description, a JSON schema of its arguments, an async call.

A tool only does its work. What every call gets (a concurrency cap, deadlines, retries, the
circuit breaker, metrics, the failure observation) is the runner's (`runner.ToolRunner`), and
how the policy calls it (tags or the chat template's `<tool_call>`) is the action format's
(`formats`). A tool raises `ToolError` for a call that is the caller's fault (bad arguments, a
division by zero): it is not retried, does not count towards the breaker, and its message is
what the policy reads. Any other exception is the tool's trouble: retried, then shown as a
failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import jsonschema


class ToolError(Exception):
    """The call's own fault: shown to the policy as it is, never retried."""


@dataclass
class ToolResult:
    text: str  # what the policy reads (the format wraps it)
    doc_ids: list[str] = field(default_factory=list)  # documents returned (the turn record)


@runtime_checkable
class Tool(Protocol):
    """What a tool implements. Optional: `async ready() -> bool` (the breaker's probe; without
    it the breaker is a cool-down) and `async aclose()` (called when the rollout stops)."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments: {"type": "object", ...}

    async def call(self, arguments: dict[str, Any]) -> ToolResult: ...


def function_schema(tool: Tool) -> dict[str, Any]:
    """The tool as the chat templates take it (`apply_chat_template(tools=[...])`): OpenAI's
    function format."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        },
    }


def check_schema(tool: Tool) -> None:
    """At start-up: a tool whose schema is not a valid JSON schema of an object is a config
    error, not a runtime surprise."""
    try:
        jsonschema.Draft202012Validator.check_schema(tool.parameters)
    except jsonschema.SchemaError as e:
        raise ValueError(f"tool {tool.name!r}: its parameters are no JSON schema: {e}") from e
    if tool.parameters.get("type") != "object":
        raise ValueError(f"tool {tool.name!r}: its parameters must be a JSON schema of an object")


def validate_arguments(tool: Tool, arguments: Any) -> None:
    """ToolError naming what is wrong when `arguments` do not fit the tool's schema."""
    if not isinstance(arguments, dict):
        raise ToolError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    try:
        jsonschema.validate(arguments, tool.parameters, jsonschema.Draft202012Validator)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise ToolError(f"bad arguments{f' at {where}' if where else ''}: {e.message}") from e
