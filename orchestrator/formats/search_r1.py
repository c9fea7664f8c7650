"""Search-R1's action format: `<search> q </search>` or `<answer> a </answer>`, the search's
documents appended in `<information>` (spec section 2); anything else gets the correction
message (`rollout.invalid_action_message`).

One tool, search (orchestrator/tools/search.py). A search whose retries and breaker wait ran
out is shown as `search.failure_observation` and flags the sample as an infrastructure failure.
"""

from __future__ import annotations

import re
from typing import Any

from orchestrator.config import RolloutConfig
from orchestrator.formats.base import TurnHost
from orchestrator.observation import (
    Observation,
    Tokenizer,
    format_docs,
    tokenize_message,
    tokenize_observation,
)
from orchestrator.sample import Sample, Status, TurnRecord
from orchestrator.tools.search import SearchTool

_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


def parse_action(text: str) -> tuple[str | None, str]:
    """The first `<search>`/`<answer>` block of one turn's text: (action, stripped content)."""
    m = _ACTION.search(text)
    if m is None:
        return None, ""
    return m.group(1), m.group(2).strip()


class SearchR1Format:
    """The tags format over the search tool."""

    tools_in_prompt = False

    def __init__(self, search: SearchTool, tokenizer: Tokenizer, cfg: RolloutConfig) -> None:
        self.search = search
        self.tokenizer = tokenizer
        self._invalid = tokenize_message(tokenizer, cfg.invalid_action_message)

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        return None  # the tool is described in the prompt's text

    def stop(self, cfg: RolloutConfig) -> list[str]:
        return list(cfg.stop)

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
        action, content = parse_action(text)
        turn.action = action or "invalid"
        if action == "answer":
            sample.status = Status.ANSWERED
            return True
        stop = host.stop_before_observing(sample, turn.index, result, max_new, room)
        if stop is not None:
            sample.status = stop
            return True
        if action == "search":
            turn.query = content
            obs = await self.observation(sample, turn, content, host.cfg.observation_max_tokens)
        else:
            obs = self._invalid
        return host.observe(sample, turn, obs)

    async def observation(
        self, sample: Sample, turn: TurnRecord, query: str, max_tokens: int | None
    ) -> Observation:
        """The search's documents (or its failure) as the `<information>` block."""
        outcome = await self.search.search(query)
        turn.tool_latency_s = outcome.latency_s
        turn.tool_attempts = outcome.attempts
        sample.tool_s += outcome.latency_s
        if outcome.error:
            turn.error = outcome.error
            sample.infrastructure_failure = True
            body = self.search.cfg.failure_observation.format(error=outcome.error)
        else:
            turn.doc_ids = [str(d.id) for d in outcome.docs]
            body = format_docs(outcome.docs)
        return tokenize_observation(self.tokenizer, body, max_tokens)
