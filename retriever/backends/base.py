"""What every search backend returns, and the errors the engine maps to status codes."""

from __future__ import annotations

from typing import Any, Protocol

# One result: the corpus row exactly as the reference returns it ({"id", "contents", ...})
# and its score (higher is better).
Hit = tuple[dict[str, Any], float]


class BackendUnavailable(RuntimeError):
    """The backend cannot answer now (e.g. serper down or out of retries): HTTP 503."""


class Overloaded(RuntimeError):
    """Too many queries queued: the caller should back off (HTTP 429)."""


class BatchBackend(Protocol):
    """A CPU/GPU-bound backend, called from the batching worker thread only (never concurrently).

    It may also offer `stages() -> list[Callable]`, the same work split into pipeline stages
    (the first takes `(queries, topk)`, the last returns the hits); the batcher then runs each
    stage on its own thread so consecutive batches overlap.
    """

    name: str

    def search_batch(self, queries: list[str], topk: int) -> list[list[Hit]]: ...

    def close(self) -> None: ...


class AsyncBackend(Protocol):
    """An I/O-bound backend (web search), awaited directly on the event loop."""

    name: str

    async def search(self, queries: list[str], topk: int) -> list[list[Hit]]: ...

    async def aclose(self) -> None: ...
