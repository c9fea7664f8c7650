"""What every search backend returns, and the errors the engine maps to status codes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

# One result: the corpus row exactly as the reference returns it ({"id", "contents", ...})
# and its score (higher is better).
Hit = tuple[dict[str, Any], float]


class BackendUnavailable(RuntimeError):
    """The backend cannot answer now (e.g. serper down or out of retries): HTTP 503."""


class Overloaded(RuntimeError):
    """Too many queries queued: the caller should back off (HTTP 429)."""


@dataclass(frozen=True)
class InlinePath:
    """A pipelined backend's one-call search for a batch of at most `max_queries` queries that
    finds the pipeline idle (nothing queued, nothing in a later stage): the batching thread runs
    it itself, skipping the hand-offs between stage threads (for dense, the encoder child process
    too). It must return exactly what the stages would."""

    search: Callable[[list[str], int], list[list[Hit]]]
    max_queries: int


class BatchBackend(Protocol):
    """A CPU/GPU-bound backend, called from the batching worker thread only (never concurrently).

    It may also offer `stages() -> list[Callable]`, the same work split into pipeline stages
    (the first takes `(queries, topk)`, the last returns the hits); the batcher then runs each
    stage on its own thread so consecutive batches overlap. Such a backend may also offer
    `inline_path() -> InlinePath | None`, for small batches when nothing else is waiting.
    """

    name: str

    def search_batch(self, queries: list[str], topk: int) -> list[list[Hit]]: ...

    def close(self) -> None: ...


class AsyncBackend(Protocol):
    """An I/O-bound backend (web search), awaited directly on the event loop."""

    name: str

    async def search(self, queries: list[str], topk: int) -> list[list[Hit]]: ...

    async def aclose(self) -> None: ...
