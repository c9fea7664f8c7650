"""Async client of the retriever's `POST /retrieve` (works against the reference server too).

No internal retries: callers (the rollout loop) retry with backoff and count attempts, so an
exhausted retry is visible there. Errors are classified for them: RetrieverUnavailable
(connection errors, timeouts, 5xx, 429: retryable) and RetrieverBadRequest (other 4xx: not).
Transport: an `httpx.AsyncClient`, or (`http_backend="aiohttp"`, the orchestrator's) one aiohttp
pool called directly (`searchr1.json_http`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import httpx

from searchr1.json_http import (
    AiohttpJson,
    HttpxJson,
    JsonTransport,
    Reply,
    dumps,
    httpx_client,
)


@dataclass(frozen=True)
class SearchHit:
    id: str
    contents: str  # "\"Title\"\nbody" as in the Search-R1 corpus
    score: float | None


class RetrieverError(Exception):
    """Base of retriever client errors."""


class RetrieverUnavailable(RetrieverError):
    """Connection error, timeout, 5xx or 429: retry later."""


class RetrieverBadRequest(RetrieverError):
    """A 4xx other than 429: the request itself is wrong; retrying cannot help."""


def _parse_hit(item: Any) -> SearchHit:
    if isinstance(item, dict) and "document" in item:
        doc, score = item["document"], item.get("score")
    else:
        doc, score = item, None
    return SearchHit(
        id=str(doc.get("id", "")),
        contents=str(doc.get("contents", "")),
        score=None if score is None else float(score),
    )


class RetrieverClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 10.0,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
        http_backend: Literal["httpx", "aiohttp"] = "httpx",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._client: JsonTransport
        if http_backend == "aiohttp":
            self._client = AiohttpJson(self.base_url, max_connections=max_connections)
        else:
            self._client = HttpxJson(
                httpx_client(
                    self.base_url,
                    max_connections=max_connections,
                    transport=transport,  # None: httpx's own pool
                )
            )

    async def _send(self, method: str, path: str, body: bytes | None = None) -> Reply:
        return await self._client.request(
            method, path, body, timeout_s=self.timeout_s, connect_s=self.timeout_s
        )

    async def search(self, queries: list[str], topk: int | None = None) -> list[list[SearchHit]]:
        """One POST /retrieve with return_scores=true; NO internal retries."""
        body = {"queries": queries, "topk": topk, "return_scores": True}
        try:
            resp = await self._send("POST", "/retrieve", dumps(body))
        except httpx.HTTPError as e:  # connect errors, timeouts, protocol errors
            raise RetrieverUnavailable(f"{type(e).__name__}: {e}") from e
        if resp.status == 429 or resp.status >= 500:
            raise RetrieverUnavailable(f"HTTP {resp.status}: {_message(resp)}")
        if resp.status >= 400:
            raise RetrieverBadRequest(f"HTTP {resp.status}: {_message(resp)}")
        try:
            result = resp.json()["result"]
            hits = [[_parse_hit(item) for item in per_query] for per_query in result]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise RetrieverUnavailable(f"malformed /retrieve response: {e}") from e
        if len(hits) != len(queries):
            raise RetrieverUnavailable(
                f"/retrieve answered {len(hits)} result lists for {len(queries)} queries"
            )
        return hits

    async def health(self) -> bool:
        """The server is up (it answers before its index is loaded)."""
        return await self._answers_ok("/health")

    async def ready(self) -> bool:
        """The index is loaded and searches are answered."""
        return await self._answers_ok("/ready")

    async def _answers_ok(self, path: str) -> bool:
        try:
            resp = await self._send("GET", path)
        except httpx.HTTPError:
            return False
        return resp.status == 200

    async def aclose(self) -> None:
        await self._client.aclose()


def _message(resp: Reply) -> str:
    try:
        body = resp.json()
        return str(body.get("error") or body.get("detail") or body)
    except ValueError:
        return resp.text[:200]
