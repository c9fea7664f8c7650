"""What flows between the engine's event-loop side and its scheduler thread.

`Request` is one generation in flight; its result goes back to the awaiting coroutine through
`loop.call_soon_threadsafe`. `CommandResult` does the same for control commands (weight
updates, pause) that run on the scheduler thread between decode steps.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from inference.prefix_cache import Lease
from inference.sampling import SamplingParams


@dataclass
class GenerateOutput:
    text: str
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict[str, Any]
    prompt_tokens: int
    weight_version: int
    # (old version, output tokens made so far) at each weight change while this request ran
    version_events: list[tuple[int, int]] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def weight_versions(self) -> list[dict[str, Any]]:
        """SGLang's `meta_info.weight_versions`: which version made which output tokens, as
        spans `{"version", "start", "end"}` (end exclusive; versions as strings)."""
        n = len(self.output_ids)
        spans: list[dict[str, Any]] = []
        for version, end in [*self.version_events, (self.weight_version, n)]:
            end = min(end, n)
            if spans and end <= spans[-1]["end"]:
                continue
            if spans and spans[-1]["version"] == str(version):
                spans[-1]["end"] = end
                continue
            start = spans[-1]["end"] if spans else 0
            spans.append({"version": str(version), "start": start, "end": end})
        return spans

    def meta_info(self, rid: str, return_logprob: bool) -> dict[str, Any]:
        """SGLang's `meta_info` (weight_version as a string, as SGLang reports it)."""
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
        }
        spans = self.weight_versions()
        # As SGLang: the version of the last span, i.e. of the weights that made the output's end.
        meta["weight_version"] = spans[-1]["version"]
        meta["weight_versions"] = spans
        if return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(self.logprobs, self.output_ids, strict=True)
            ]
        return meta


@dataclass(eq=False)
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[GenerateOutput]
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    next_logits: torch.Tensor | None = None
    cancelled: bool = False
    version_events: list[tuple[int, int]] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens its first admission took from the prefix cache
    cache_lease: Lease | None = None  # held while it runs: its prefix is not evicted
    cache_generation: int = -1  # the cache generation its K/V belongs to (stale after a flush)

    def resolve(self, out: GenerateOutput | BaseException) -> None:
        def set_it() -> None:
            if self.future.done():
                return
            if isinstance(out, BaseException):
                self.future.set_exception(out)
            else:
                self.future.set_result(out)

        # The loop is gone only when the process is shutting down: nobody is waiting then.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(set_it)


class CommandResult:
    """Carries a command's return value (or exception) back to the awaiting coroutine."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future[Any] = loop.create_future()

    def run(self, fn: Callable[[], Any]) -> None:
        try:
            value: Any = fn()
        except BaseException as e:
            settle, arg = _set_exception, e
        else:
            settle, arg = _set_result, value
        with contextlib.suppress(RuntimeError):  # loop closed: the process is exiting
            self.loop.call_soon_threadsafe(settle, self.future, arg)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
