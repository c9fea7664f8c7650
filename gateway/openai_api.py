"""The OpenAI chat-completions wire format, at the edge: the request, its messages in one
canonical form (for the template and for comparing histories), the answer and its SSE chunks.

Served: `messages` (system, developer (rendered as system), user, assistant, tool; text
content, as a string or text parts), `tools` (functions), `tool_choice` `auto` / `none`,
`temperature`, `top_p`, `max_tokens` / `max_completion_tokens`, `stop`, `seed`, `stream`
(+ `stream_options.include_usage`), `user`. Accepted and ignored: `parallel_tool_calls`,
`store`, `metadata`, `logprobs`, penalties, `reasoning_effort` and the like. Refused (400):
`n` > 1, a non-text `response_format`, `tool_choice` `required` or a named function (they
need constrained decoding), non-text content parts.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import GatewayError

ROLES = {"system", "user", "assistant", "tool"}


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = ""
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > 4 or any(not s for s in stops):
            raise GatewayError(400, "bad_request", "stop: up to 4 non-empty strings")
        return stops

    def check(self) -> None:
        """What a chat request must not ask of a gateway recording one trajectory per call."""
        if self.n not in (None, 1):
            raise GatewayError(400, "bad_request", "n: only 1 (one session is one trajectory)")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise GatewayError(
                400, "bad_request", f"response_format {kind!r} is not served (only text)"
            )

    def parse_tool_calls(self) -> bool:
        """Whether the model's `<tool_call>` blocks are returned as tool calls."""
        choice = self.tool_choice
        if choice is None or choice == "auto":
            return bool(self.tools)
        if choice == "none":
            return False
        raise GatewayError(
            400,
            "unsupported_tool_choice",
            f"tool_choice {choice!r} is not served: only 'auto' and 'none' (required or named "
            "functions would need constrained decoding)",
        )


def check_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """The request's function tools, as the chat template takes them; 400 naming the problem."""
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise GatewayError(400, "invalid_tools", f'{where}: expected {{"type": "function"}}')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise GatewayError(400, "invalid_tools", f"{where}.function: expected an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise GatewayError(400, "invalid_tools", f"{where}.function.name: a non-empty string")
        if name in names:
            raise GatewayError(400, "invalid_tools", f"{where}: duplicate function {name!r}")
        params = fn.get("parameters", {})
        if not isinstance(params, dict):
            raise GatewayError(400, "invalid_tools", f"{where}.function.parameters: an object")
        if not isinstance(fn.get("description", ""), str):
            raise GatewayError(400, "invalid_tools", f"{where}.function.description: a string")
        names.add(name)
        out.append({"type": "function", "function": fn})
    return out


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "output_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise GatewayError(
                    400, "invalid_messages", f"{where}.content[{j}]: {kind!r} parts are not served"
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise GatewayError(400, "invalid_messages", f"{where}.content: a string or text parts")


def _arguments(raw: Any, where: str) -> Any:
    """Tool-call arguments as an object: OpenAI sends a JSON string, templates render a dict."""
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            raise GatewayError(
                400, "invalid_messages", f"{where}.arguments: not JSON ({e.msg})"
            ) from None
    return raw if raw is not None else {}


def canonical_messages(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's messages in the form the chat template renders (Hugging Face's: text
    content, tool-call arguments as objects, `tool` messages named after their call)."""
    out: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise GatewayError(400, "invalid_messages", f"{where}: expected an object")
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ROLES:
            raise GatewayError(400, "invalid_messages", f"{where}.role: {m.get('role')!r}")
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise GatewayError(
                        400, "invalid_messages", f"{where}.tool_calls[{j}]: expected a function"
                    )
                args = _arguments(fn.get("arguments"), f"{where}.tool_calls[{j}].function")
                cid = str(c.get("id") or "")
                calls.append(
                    {
                        "id": cid,
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": args},
                    }
                )
                call_names[cid] = fn["name"]
            msg["tool_calls"] = calls
        if role == "tool":
            cid = str(m.get("tool_call_id") or "")
            msg["tool_call_id"] = cid
            name = m.get("name") or call_names.get(cid)
            if name:
                msg["name"] = str(name)
        elif m.get("name"):
            msg["name"] = str(m["name"])
        out.append(msg)
    return out


def message_key(m: dict[str, Any]) -> str:
    """What two messages must share to be the same turn: what the template can render, minus
    the call ids (clients rewrite those; arguments compare as parsed JSON)."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])]
    return json.dumps(
        [m["role"], m["content"], m.get("name", ""), calls], sort_keys=True, ensure_ascii=False
    )


def tools_key(tools: list[dict[str, Any]]) -> str:
    return json.dumps(tools, sort_keys=True, ensure_ascii=False)


@dataclass
class ChatReply:
    """One answer: the assistant message as returned, and the numbers around it."""

    content: str
    tool_calls: list[dict[str, Any]]  # OpenAI format: arguments as JSON strings
    finish_reason: str  # stop | length | tool_calls
    prompt_tokens: int
    completion_tokens: int
    model: str
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def completion(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": self.message(),
                    "logprobs": None,
                    "finish_reason": self.finish_reason,
                }
            ],
            "usage": self.usage(),
        }

    def chunks(self, include_usage: bool) -> list[dict[str, Any]]:
        """The answer as streamed chunks (computed whole first: the engine call is not
        streamed, so the ids and logprobs are complete before the first byte goes out)."""

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            out: dict[str, Any] = {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }
            if include_usage:
                out["usage"] = None
            return out

        out = [chunk({"role": "assistant", "content": ""})]
        if self.content:
            out.append(chunk({"content": self.content}))
        for i, call in enumerate(self.tool_calls):
            out.append(chunk({"tool_calls": [{"index": i, **call}]}))
        out.append(chunk({}, self.finish_reason))
        if include_usage:
            out.append({**chunk({}), "choices": [], "usage": self.usage()})
        return out


def openai_tool_call(name: str, arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def returned_message(reply: ChatReply) -> dict[str, Any]:
    """The assistant message as the client will send it back, in canonical form."""
    return canonical_messages([reply.message()])[0]
