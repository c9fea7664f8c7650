"""The retriever engine: validation, cache, batching and the backend behind one async call.

HTTP and gRPC both call `RetrieverEngine.search`; it can also be used in-process without any
server (`await RetrieverEngine.load(cfg)` then `await engine.search([...])`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prometheus_client import Counter

from retriever.backends import AsyncBackend, BackendUnavailable, BatchBackend, Hit
from retriever.backends.registry import load_backend
from retriever.batcher import MicroBatcher, Overloaded
from retriever.cache import ResultCache, normalize_query
from retriever.config import LimitsConfig, RetrieverConfig

log = logging.getLogger(__name__)

QUERIES = Counter("searchr1_retriever_queries_total", "Queries answered", ["protocol"])
ERRORS = Counter(
    "searchr1_retriever_errors_total",
    "Failed retrieval requests by kind (bad_request, overloaded, unavailable, internal)",
    ["kind", "protocol"],
)

__all__ = ["BackendUnavailable", "BadRequest", "Overloaded", "RetrieverEngine"]


class BadRequest(ValueError):
    """Invalid request: HTTP 422 / gRPC INVALID_ARGUMENT, with this message."""


def _check_unicode(i: int, q: str) -> None:
    # JSON "\ud800" parses to a lone surrogate, which has no UTF-8 form: the encoder's
    # tokenizer raises TypeError on it (failing its whole batch) and httpx cannot send it to
    # serper. gRPC cannot carry one (protobuf strings are UTF-8).
    try:
        q.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(
            f"queries.{i}: not valid Unicode (a lone surrogate {q[e.start]!r} at {e.start})"
        ) from None


def check_request(lim: LimitsConfig, queries: Any, topk: int | None) -> int:
    """Check a request against the limits; the effective topk. Raises BadRequest naming the
    field. The HTTP request model runs the same check, so both answer alike."""
    if not isinstance(queries, list) or not queries:
        raise BadRequest("queries: must be a non-empty list of strings")
    if len(queries) > lim.max_queries:
        raise BadRequest(
            f"queries: {len(queries)} queries in one request, at most {lim.max_queries}"
        )
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise BadRequest(f"queries.{i}: must be a string, got {type(q).__name__}")
        if len(q) > lim.max_query_chars:
            raise BadRequest(f"queries.{i}: {len(q)} characters, at most {lim.max_query_chars}")
        if not q.isascii():
            _check_unicode(i, q)
    if topk is None or topk == 0:
        return lim.default_topk
    if topk < 0:
        raise BadRequest(f"topk: must be >= 0 (0 or null means {lim.default_topk}), got {topk}")
    if topk > lim.max_topk:
        raise BadRequest(f"topk: at most {lim.max_topk}, got {topk}")
    return topk


class RetrieverEngine:
    def __init__(self, backend: BatchBackend | AsyncBackend, cfg: RetrieverConfig) -> None:
        self.backend = backend
        self.cfg = cfg
        self.cache = ResultCache(cfg.cache.size, max_bytes=cfg.cache.max_bytes)
        self._batcher: MicroBatcher | None = None
        if hasattr(backend, "stages"):  # a pipelined backend (dense): stages overlap
            inline = backend.inline_path() if hasattr(backend, "inline_path") else None
            self._batcher = MicroBatcher(backend.stages(), cfg.batching, inline=inline)
        elif hasattr(backend, "search_batch"):
            self._batcher = MicroBatcher(backend.search_batch, cfg.batching)  # type: ignore[union-attr]

    @classmethod
    async def load(cls, cfg: RetrieverConfig) -> RetrieverEngine:
        """Load the backend off the event loop (index loading takes seconds to minutes)."""
        backend = await asyncio.to_thread(load_backend, cfg)
        return cls(backend, cfg)

    @property
    def batcher(self) -> MicroBatcher | None:
        return self._batcher

    def validate(self, queries: Any, topk: int | None) -> int:
        """Check limits; return the effective topk. Raises BadRequest naming the field."""
        return check_request(self.cfg.limits, queries, topk)

    async def search(
        self, queries: list[str], topk: int | None = None, *, protocol: str = "python"
    ) -> list[list[Hit]]:
        """Validated, cached, batched search: one hit list per query, in request order."""
        try:
            k = self.validate(queries, topk)
            results = await self._search(queries, k)
        except BadRequest:
            ERRORS.labels("bad_request", protocol).inc()
            raise
        except Overloaded:
            ERRORS.labels("overloaded", protocol).inc()
            raise
        except BackendUnavailable:
            ERRORS.labels("unavailable", protocol).inc()
            raise
        except Exception:
            ERRORS.labels("internal", protocol).inc()
            raise
        QUERIES.labels(protocol).inc(len(queries))
        return results

    async def _search(self, queries: list[str], k: int) -> list[list[Hit]]:
        normed = [normalize_query(q) for q in queries]
        results: list[list[Hit] | None] = [self.cache.get(q, k) for q in normed]
        # Each distinct missing query is searched once, even if repeated in the request.
        missing = list(dict.fromkeys(q for q, r in zip(normed, results, strict=True) if r is None))
        if missing:
            if self._batcher is not None:
                found = await self._batcher.submit(missing, k)
            else:
                found = await self.backend.search(missing, k)  # type: ignore[union-attr]
            by_query = dict(zip(missing, found, strict=True))
            for q, hits in by_query.items():
                self.cache.put(q, k, hits)
            results = [
                r if r is not None else by_query[q] for q, r in zip(normed, results, strict=True)
            ]
        return results  # type: ignore[return-value]

    async def aclose(self) -> None:
        if self._batcher is not None:
            await asyncio.to_thread(self._batcher.close)
        if hasattr(self.backend, "aclose"):
            await self.backend.aclose()  # type: ignore[union-attr]
        else:
            self.backend.close()  # type: ignore[union-attr]
