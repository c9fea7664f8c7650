"""Web search through serper.dev, returning results in the Search-R1 corpus format.

Request: `POST {url}` with header `X-API-KEY` and body `{"q", "num", "gl", "hl"}`; results come
from `organic[]`. Snippet-only contents: `"\"{title}\"\n{snippet}"`, id = the link. serper has
no relevance score, so the score is the reciprocal rank (1, 1/2, 1/3, ...).
A client-side rate limit spaces requests; 429, 5xx and connection errors are retried with
exponential backoff; once retries are exhausted the query fails with BackendUnavailable (503),
never with a silently empty result.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import httpx

from retriever.backends.base import BackendUnavailable, Hit, Overloaded
from retriever.config import SerperConfig

log = logging.getLogger(__name__)

API_KEY_ENV = "SERPER_API_KEY"


class RateLimiter:
    """Spaces calls at least 1/qps apart (a token bucket of depth one); never blocks the loop."""

    def __init__(self, qps: float) -> None:
        self.interval = 1.0 / qps
        self._next = 0.0
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self._lock:
            now = time.monotonic()
            wait = self._next - now
            self._next = max(now, self._next) + self.interval
        if wait > 0:
            await asyncio.sleep(wait)


def to_hits(payload: dict[str, Any], topk: int) -> list[Hit]:
    hits: list[Hit] = []
    for rank, item in enumerate(payload.get("organic") or [], 1):
        if len(hits) >= topk:
            break
        title = str(item.get("title", "")).strip()
        snippet = str(item.get("snippet", "")).strip()
        doc = {"id": str(item.get("link") or rank), "contents": f'"{title}"\n{snippet}'}
        hits.append((doc, 1.0 / rank))
    return hits


class WebBackend:
    name = "web"

    def __init__(self, cfg: SerperConfig, api_key: str | None = None) -> None:
        api_key = api_key or os.environ.get(API_KEY_ENV)
        if not api_key:
            raise ValueError(f"the web backend needs a serper.dev API key in env {API_KEY_ENV}")
        self.cfg = cfg
        self._headers = {"X-API-KEY": api_key, "Content-Type": "application/json"}
        self._client = httpx.AsyncClient(
            timeout=cfg.timeout_s, limits=httpx.Limits(max_connections=cfg.max_concurrency)
        )
        self._limiter = RateLimiter(cfg.rate_limit_qps)
        self._sem = asyncio.Semaphore(cfg.max_concurrency)
        self.queued = 0  # queries waiting for the rate limiter or in a serper call

    async def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """Cancelling it (the server does when the client disconnects) cancels every query not
        yet sent: abandoned work does not spend the API key."""
        n = len(queries)
        if self.queued + n > self.cfg.max_queued:
            raise Overloaded(
                f"web search queue full: {self.queued} queued + {n} > "
                f"retriever.serper.max_queued {self.cfg.max_queued}"
            )
        self.queued += n
        try:
            return list(await asyncio.gather(*(self._one(q, topk) for q in queries)))
        finally:
            self.queued -= n

    async def _one(self, query: str, topk: int) -> list[Hit]:
        body = {"q": query, "num": topk, "gl": self.cfg.gl, "hl": self.cfg.hl}
        last = ""
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
            await self._limiter.acquire()
            try:
                async with self._sem:
                    resp = await self._client.post(self.cfg.url, json=body, headers=self._headers)
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if resp.status_code == 429 or resp.status_code >= 500:
                last = f"HTTP {resp.status_code}"
                continue
            if resp.status_code >= 400:
                # A bad key or request: retrying cannot help.
                raise BackendUnavailable(f"serper rejected the request: HTTP {resp.status_code}")
            try:
                payload = resp.json()
            except ValueError as e:
                raise BackendUnavailable(f"serper answered invalid JSON: {e}") from None
            if not isinstance(payload, dict):
                raise BackendUnavailable("serper answered JSON that is not an object")
            return to_hits(payload, topk)
        log.warning("serper failed after retries", extra={"attempts": attempt + 1, "error": last})
        raise BackendUnavailable(f"serper unavailable after {attempt + 1} attempts ({last})")

    async def aclose(self) -> None:
        await self._client.aclose()
