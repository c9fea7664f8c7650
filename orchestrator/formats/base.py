"""What the rollout loop asks of an action format, and what a format may use of the loop.

The loop (orchestrator/rollout.py) generates a turn; the format reads the model's message and
either ends the sample or appends the next observation (loss mask 0) through the loop's
`observe`. Formats never call the engine.
"""

from __future__ import annotations

from typing import Any, Protocol

from orchestrator.config import RolloutConfig
from orchestrator.observation import Observation, Tokenizer
from orchestrator.sample import Sample, Status, TurnRecord


class TurnHost(Protocol):
    """What a format uses of the rollout loop (`orchestrator.rollout.Rollout`)."""

    cfg: RolloutConfig
    tokenizer: Tokenizer

    def stop_before_observing(
        self, sample: Sample, turn_index: int, result: Any, max_new: int, room: int | None
    ) -> Status | None:
        """Why a sample whose turn asked for an observation ends here (None: it goes on)."""
        ...

    def observe(self, sample: Sample, turn: TurnRecord, obs: Observation) -> bool:
        """Append the observation; True when it does not fit and the sample ends."""
        ...

    def length_status(
        self, sample: Sample, generated: int, max_new: int, room: int | None = None
    ) -> Status:
        """Why a turn ended on its token limit."""
        ...


class TurnFormat(Protocol):
    """One action format, as the rollout loop runs it."""

    # The prompt is rendered with the tools passed to the chat template (a sample's prompt ids
    # are re-rendered so when its first turn starts).
    tools_in_prompt: bool

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tool schemas the chat template renders into the prompt (None: no tools)."""
        ...

    def stop(self, cfg: RolloutConfig) -> list[str]:
        """The stop strings sent to the engine."""
        ...

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
        """After the model's message (`text`, the engine's `result`): end the sample (True) or
        append what answers it (False)."""
        ...
