"""The record types that flow through the orchestrator: prompt -> sample -> trajectory."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """One dataset row, as the rollout needs it."""

    prompt_id: str  # stable: "<data_source>/<split>/<index>"
    data_source: str
    messages: list[dict[str, str]]
    golds: list[str]
    metadata: dict[str, str] = field(default_factory=dict)


class Status(StrEnum):
    ANSWERED = "answered"
    MAX_TURNS = "max_turns"
    RESPONSE_BUDGET = "response_budget"
    CONTEXT_LIMIT = "context_limit"
    TRUNCATED = "truncated"  # a turn hit max_tokens_per_turn (slime semantics stop there)
    ABORTED = "aborted"
    ERROR = "error"


@dataclass
class ToolCallRecord:
    """One call of a function-calling turn: what the policy asked for and what it read back."""

    name: str  # as the policy wrote it ("" when the block could not be read)
    arguments_json: str  # the arguments as JSON ("null" when there were none)
    result: str = ""  # the text the policy read: the result or the error observation
    error: str = ""  # why the call failed, if it did
    latency_s: float = 0.0
    attempts: int = 0  # 0: never sent to the tool (malformed, unknown, bad arguments)


def count_searches(turn: Any) -> int:
    """Retrieval calls in a turn (a `TurnRecord`, or the trajectory proto's `Turn`): a
    Search-R1 `<search>` turn is one; a function-calling turn has as many as its calls to the
    `search` tool (`SearchTool.name`)."""
    if turn.action == "search":
        return 1
    return sum(c.name == "search" for c in turn.tool_calls)


@dataclass
class TurnRecord:
    index: int
    action: str  # search | tool | answer | invalid | none
    query: str = ""
    doc_ids: list[str] = field(default_factory=list)
    tool_latency_s: float = 0.0
    tool_attempts: int = 0
    error: str = ""
    generated_tokens: int = 0
    observation_tokens: int = 0
    generate_latency_s: float = 0.0
    engine_finish_reason: str = ""
    weight_version: int = 0
    cached_tokens: int = 0  # input tokens the engine served from its prefix cache
    tool_calls: list[ToolCallRecord] = field(default_factory=list)  # function calling
    reward: float = 0.0  # a task's environment: its reward for this turn

    @property
    def searches(self) -> int:
        return count_searches(self)


@dataclass
class Sample:
    """One rollout sample. The token arrays are the truth; `response_text` mirrors them.

    `response_text` is built by concatenating the engine's text of each turn and the
    observation text, so `decode(response_ids) == response_text` is a checkable invariant.
    """

    prompt: Prompt
    group_id: str
    sample_index: int
    group_size: int
    prompt_ids: list[int]
    rollout_step: int = 0
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    has_logprobs: bool = True
    response_text: str = ""
    turns: list[TurnRecord] = field(default_factory=list)
    status: Status | None = None
    error: str = ""
    weight_versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    created_at: float = 0.0
    finished_at: float = 0.0
    generate_s: float = 0.0
    tool_s: float = 0.0
    # A search failed after every retry (retriever down): not the policy's doing.
    infrastructure_failure: bool = False
    reward_s: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)
    # The sampling temperature sent to the engine (0 = greedy); its logprobs are of logits / T.
    temperature: float = 1.0

    @property
    def trajectory_id(self) -> str:
        return f"{self.group_id}/{self.sample_index}"

    @property
    def golds(self) -> list[str]:
        return self.prompt.golds

    def append_model(self, ids: list[int], logprobs: list[float] | None, text: str) -> None:
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        if logprobs is None:
            self.has_logprobs = False
            self.logprobs += [0.0] * len(ids)
        else:
            assert len(logprobs) == len(ids), "engine logprobs must align with its token ids"
            self.logprobs += list(logprobs)
        self.response_text += text

    def append_observation(self, ids: list[int], text: str) -> None:
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.response_text += text


def new_group(
    prompt: Prompt, prompt_ids: list[int], *, group_size: int, rollout_step: int, run_id: str
) -> list[Sample]:
    """The `group_size` samples of one prompt at one step; ids are deterministic.

    `group_id` = run/step/prompt: a restarted orchestrator regenerating the same step produces
    the same trajectory ids, which the bus deduplicates.
    """
    group_id = f"{run_id}/{rollout_step}/{prompt.prompt_id}"
    return [
        Sample(
            prompt=prompt,
            group_id=group_id,
            sample_index=i,
            group_size=group_size,
            prompt_ids=list(prompt_ids),
            rollout_step=rollout_step,
        )
        for i in range(group_size)
    ]
