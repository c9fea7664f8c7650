"""The chat template's function-calling format, as the rollout uses it: the parser
(`parse_tool_calls`) and the rendering of the turns after a model message (`ToolTurns`) live in
the floor (`searchr1/chat_template.py`, shared with the gateway) and are re-exported here;
`truncate` cuts a tool result to the observation cap.

The trainer's ids are the template's rendering of the whole conversation
(tests/unit/orchestrator/test_tools_function_calling.py), with two deliberate differences: the
model's ids are its own, and a turn cut before its end-of-turn token gets that token from the
observation (mask 0).
"""

from __future__ import annotations

from orchestrator.observation import Tokenizer
from searchr1.chat_template import CLOSE, OPEN, ParsedCall, ToolTurns, parse_tool_calls

__all__ = ["CLOSE", "OPEN", "ParsedCall", "ToolTurns", "parse_tool_calls", "truncate"]


def truncate(tok: Tokenizer, text: str, max_tokens: int | None) -> str:
    """`text` cut to `max_tokens` tokens (whole characters), or as it is."""
    if max_tokens is None:
        return text
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    ids = ids[:max_tokens]
    out = tok.decode(ids, skip_special_tokens=False)
    while ids and out.endswith("\ufffd"):  # a cut inside a multi-byte character
        ids = ids[:-1]
        out = tok.decode(ids, skip_special_tokens=False)
    return out + " [truncated]"
