"""The chat template's function-calling format: a message without `<tool_call>` is the answer;
each call runs (concurrently, behind its tool's runner) and the results come back as the
template's `tool` turns (`FunctionCallingFormat`). The parser (`parse_tool_calls`) and the
rendering of the turns after a model message (`ToolTurns`) live in the floor
(`searchr1/chat_template.py`, shared with the gateway) and are re-exported here; `truncate` cuts
a tool result to the observation cap.

The trainer's ids are the template's rendering of the whole conversation
(tests/unit/orchestrator/test_tools_function_calling.py), with two deliberate differences: the
model's ids are its own, and a turn cut before its end-of-turn token gets that token from the
observation (mask 0).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from orchestrator.config import RolloutConfig
from orchestrator.formats.base import TurnHost
from orchestrator.observation import Observation, Tokenizer
from orchestrator.sample import Sample, Status, ToolCallRecord, TurnRecord
from orchestrator.tools.metrics import TOOL_CALLS
from orchestrator.tools.toolbox import UNKNOWN, CallOutcome, Toolbox, describe_calls
from searchr1.chat_template import CLOSE, OPEN, ParsedCall, ToolTurns, parse_tool_calls

__all__ = [
    "CLOSE",
    "OPEN",
    "FunctionCallingFormat",
    "ParsedCall",
    "ToolTurns",
    "parse_tool_calls",
    "truncate",
]


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


class FunctionCallingFormat:
    """`<tool_call>` over the tools of `rollout.tools`."""

    tools_in_prompt = True

    def __init__(self, tools: Toolbox, tokenizer: Tokenizer) -> None:
        self.tools = tools
        self.tokenizer = tokenizer
        self.turns = ToolTurns(tokenizer, tools.schemas())

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        return self.tools.schemas()

    def stop(self, cfg: RolloutConfig) -> list[str]:
        # None by default: the engine stops at the end-of-turn token, which the template's
        # rendering of the next turn needs; rollout.stop when set.
        return list(cfg.stop) if "stop" in cfg.model_fields_set else []

    async def act(
        self,
        host: TurnHost,
        sample: Sample,
        turn: TurnRecord,
        text: str,
        result: Any,
        max_new: int,
        room: int | None,
    ) -> bool:
        calls = parse_tool_calls(text)
        if not calls:
            turn.action = "answer"
            if result.finish_reason == "length":
                sample.status = host.length_status(sample, len(result.output_ids), max_new, room)
            else:
                sample.status = Status.ANSWERED
            return True
        turn.action = "tool"
        stop = host.stop_before_observing(sample, turn.index, result, max_new, room)
        if stop is not None:
            sample.status = stop
            return True
        obs = await self.observation(sample, turn, text, calls, host.cfg.observation_max_tokens)
        return host.observe(sample, turn, obs)

    async def _call(self, call: ParsedCall) -> CallOutcome:
        if call.error:  # malformed: the policy reads why
            TOOL_CALLS.labels(
                call.name if self.tools.get(call.name) else UNKNOWN, "malformed"
            ).inc()
            return CallOutcome(call.name, call.arguments, f"Error: {call.error}", call.error, True)
        return await self.tools.call(call.name, call.arguments)

    async def observation(
        self,
        sample: Sample,
        turn: TurnRecord,
        text: str,
        calls: list[ParsedCall],
        max_tokens: int | None,
    ) -> Observation:
        """Run one turn's calls (concurrently) and render their results as `tool` turns."""
        outcomes = list(await asyncio.gather(*(self._call(c) for c in calls)))
        turn.query = describe_calls(outcomes)
        turn.error = "; ".join(o.error for o in outcomes if o.error)
        turn.doc_ids = [d for o in outcomes for d in o.doc_ids]
        turn.tool_attempts = sum(o.attempts for o in outcomes)
        turn.tool_latency_s = max(o.latency_s for o in outcomes)
        sample.tool_s += turn.tool_latency_s
        if all(o.call_error for o in outcomes):
            turn.action = "invalid"  # no call the policy made was usable
        if any(o.error and not o.call_error for o in outcomes):
            sample.infrastructure_failure = True  # a tool failed, not the policy
        results = [(o.name, truncate(self.tokenizer, o.text, max_tokens)) for o in outcomes]
        turn.tool_calls = [
            ToolCallRecord(
                o.name,
                json.dumps(o.arguments, ensure_ascii=False),
                read,
                o.error,
                o.latency_s,
                o.attempts,
            )
            for o, (_, read) in zip(outcomes, results, strict=True)
        ]
        obs_text = self.turns.text(text, results)
        return Observation(obs_text, self.tokenizer.encode(obs_text, add_special_tokens=False))
