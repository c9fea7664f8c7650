"""The chat template, token-exactly: prompts rendered once, the function-calling format
(Qwen2.5/Qwen3, Hermes-style) parsed strictly, and the turns after a model message rendered as
the template renders them. Shared by the orchestrator's rollouts and the gateway.

Function calling: the tools are passed to the template (`apply_chat_template(tools=...)`), the
policy calls them as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` inside its
message, and each result comes back as a `tool` turn rendered by the template.

Parsing is strict: every `<tool_call>` block must hold exactly one JSON object with a string
`name` and an object `arguments` (what the templates render), and every opening tag its closing
one. Anything else is a malformed call (the orchestrator answers it with an error observation;
the gateway returns the text as it is and counts it). A message without any `<tool_call>` is
the policy's final answer.

What follows a model message is the template's own text (`ToolTurns`): the conversation
rendered with and without the new messages, the difference appended (after the end-of-turn
token the model emitted), tokenized once, loss mask 0. So the trainer's ids are the template's
rendering of the whole conversation, with two deliberate differences: the model's ids are its
own (a model may tokenize its text non-canonically), and a turn cut before its end-of-turn
token gets that token from the rendering (mask 0).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_SENTINEL = "\u2063assistant-content\u2063"  # stands for the model's message while rendering


def prompt_token_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Render with the chat template (`add_generation_prompt=True`) and tokenize once.

    The rendered text already holds the template's special tokens, so no others are added.
    `tools` (function schemas) are passed to the template for the function-calling format.
    """
    kwargs: dict[str, Any] = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **kwargs
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: Any
    error: str = ""  # set: the block is malformed (name/arguments as far as they were read)


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """The calls of one assistant message, in order; malformed ones carry their error."""
    calls = [_parse_one(raw) for raw in _CALL.findall(text)]
    if text.count(OPEN) != len(calls) or text.count(CLOSE) != len(calls):
        calls.append(ParsedCall("", None, f"malformed tool call: {OPEN} without {CLOSE}"))
    return calls


def strip_tool_calls(text: str) -> str:
    """`text` without its `<tool_call>` blocks: the message's own content."""
    return _CALL.sub("", text)


def _parse_one(raw: str) -> ParsedCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ParsedCall("", None, f"malformed tool call: not JSON ({e.msg} at {e.pos})")
    shape = 'expected {"name": "<tool>", "arguments": {...}}'
    if not isinstance(obj, dict):
        return ParsedCall("", None, f"malformed tool call: {shape}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall("", obj.get("arguments"), f"malformed tool call: {shape}")
    if set(obj) != {"name", "arguments"} or not isinstance(obj["arguments"], dict):
        return ParsedCall(name, obj.get("arguments"), f"malformed tool call: {shape}")
    return ParsedCall(name, obj["arguments"])


class ToolTurns:
    """Renders the turns after a model message (`tool` results, or an environment's `user`
    turns) as the tokenizer's chat template does, as text to append."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]], role: str = "tool") -> None:
        self.tok = tokenizer
        self.tools = tools
        self._base = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": _SENTINEL},
        ]
        self._before = self._render(self._base, generation_prompt=False)
        at = self._before.rfind(_SENTINEL)
        if at < 0:
            raise ValueError("the chat template does not render an assistant message's content")
        # What the template puts after a message's content: its end-of-turn token (which the
        # model emits; the engine stops on it) and what follows it (e.g. a newline).
        self.after_content = self._before[at + len(_SENTINEL) :]
        eos = getattr(tokenizer, "eos_token", None)
        self.end_of_turn = eos if isinstance(eos, str) and eos else ""
        after = self._render(
            [*self._base, {"role": role, "name": "t", "content": "r"}], generation_prompt=True
        )
        if not after.startswith(self._before):
            raise ValueError(
                f"the chat template renders the conversation before a {role} turn differently "
                f"once the turn is added: {role} turns cannot be appended token-exactly"
            )

    def _render(self, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
        return str(
            self.tok.apply_chat_template(
                messages,
                tools=self.tools or None,
                add_generation_prompt=generation_prompt,
                tokenize=False,
            )
        )

    def text(self, turn_text: str, results: list[tuple[str, str]]) -> str:
        """What follows the model's message `turn_text`: the end of its turn, the `tool` turns
        of `results` ((name, content) in call order) and the next assistant turn's header."""
        return self.messages_text(
            turn_text, [{"role": "tool", "name": n, "content": c} for n, c in results]
        )

    def messages_text(
        self, turn_text: str, messages: list[dict[str, Any]], *, strict: bool = False
    ) -> str:
        """What follows the model's message `turn_text`: the end of its turn, `messages` as the
        template renders them, and the next assistant turn's header. `strict`: ValueError when
        the template renders the conversation before `messages` differently once they are added
        (the constructor checks one turn of its role; a caller with any messages checks these)."""
        after = self._render([*self._base, *messages], generation_prompt=True)
        if strict and not after.startswith(self._before):
            raise ValueError(
                "the chat template renders the conversation before these messages differently "
                "once they are added: they cannot be appended token-exactly"
            )
        after = after[len(self._before) :]
        end = self.after_content
        eot = self.end_of_turn
        if eot and end.startswith(eot) and turn_text.endswith(eot):
            end = end[len(eot) :]  # the model emitted it
        return end + after
