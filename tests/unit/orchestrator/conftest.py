"""Fixtures for orchestrator unit tests: the tiny model's real tokenizer, scripted policies.

The scripted engine stands in for the policy only in unit tests of the loop's bookkeeping (a
random tiny model never emits tags on cue); integration tests run the real engine process.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@dataclass
class Result:
    text: str
    output_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    matched_stop: str | int | None
    prompt_tokens: int
    completion_tokens: int
    weight_version: int
    start_weight_version: int
    cached_tokens: int = 0


@dataclass
class ScriptedEngine:
    """Returns scripted turn texts as token ids with distinct, checkable logprobs.

    Logprob of the k-th token it ever emitted is -(k + 1) / 1000, so tests can tell exactly
    which engine value landed where.
    """

    tokenizer: Any
    turns: list[str]
    weight_version: int = 0
    # The version of each turn's first token; None: the same as weight_version (no update
    # landed mid-turn).
    start_weight_version: int | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    emitted: int = 0
    # context after each returned turn -> that turn's index (samples interleave freely)
    _after: dict[tuple[int, ...], int] = field(default_factory=dict)

    async def get_model_info(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "model_path": "scripted"}

    def _turn_index(self, input_ids: list[int]) -> int:
        done = [k for ctx, k in self._after.items() if tuple(input_ids[: len(ctx)]) == ctx]
        return max(done) + 1 if done else 0

    async def generate(self, input_ids: list[int], **kw: Any) -> Result:
        self.calls.append({"input_ids": list(input_ids), **kw})
        turn = self._turn_index(input_ids)
        # A perfect prefix cache: everything an earlier call read or wrote.
        cached = max(
            (len(ctx) for ctx in self._after if tuple(input_ids[: len(ctx)]) == ctx), default=0
        )
        text = self.turns[min(turn, len(self.turns) - 1)]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        finish = "stop"
        if len(ids) > kw["max_new_tokens"]:
            ids, finish = ids[: kw["max_new_tokens"]], "length"
        lps = [-(self.emitted + i + 1) / 1000 for i in range(len(ids))]
        self.emitted += len(ids)
        self._after[tuple(input_ids) + tuple(ids)] = turn
        return Result(
            text=self.tokenizer.decode(ids),
            output_ids=ids,
            logprobs=lps,
            finish_reason=finish,
            matched_stop=None,
            prompt_tokens=len(input_ids),
            completion_tokens=len(ids),
            weight_version=self.weight_version,
            start_weight_version=(
                self.weight_version
                if self.start_weight_version is None
                else self.start_weight_version
            ),
            cached_tokens=cached,
        )


async def until(condition, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    """Poll `condition` until it holds (True) or `timeout` passes (False): a test's wait
    that a loaded machine cannot make fail, unlike a fixed sleep."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True
