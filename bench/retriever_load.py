"""Load generation for `bench/retriever.py`: one-query `/retrieve` requests from N keep-alive
connections, and the side-by-side comparison with another running server (`--reference-url`).

Two clients: `raw` (a minimal HTTP/1.1 client on asyncio streams: httpx costs ~1-2 ms of CPU per
request, which on a 2-core machine shares the cores with the server and would be measured too)
and `httpx` (works against any server, e.g. one answering with chunked bodies). A side-by-side
run sends the same requests with the same client to both servers, alternating which goes first.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
import numpy as np


class Client(Protocol):
    async def post_json(self, path: str, body: bytes) -> tuple[int, bytes]: ...

    async def close(self) -> None: ...


class RawHttpClient:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams (Content-Length bodies only)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_json(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class HttpxClient:
    """One httpx keep-alive connection (one per simulated client)."""

    def __init__(self, url: str) -> None:
        self._client = httpx.AsyncClient(
            base_url=url,
            timeout=120,
            limits=httpx.Limits(max_connections=1),
            headers={"Content-Type": "application/json"},
        )

    async def post_json(self, path: str, body: bytes) -> tuple[int, bytes]:
        r = await self._client.post(path, content=body)
        return r.status_code, r.content

    async def close(self) -> None:
        await self._client.aclose()


CLIENTS: dict[str, type[RawHttpClient] | type[HttpxClient]] = {
    "raw": RawHttpClient,
    "httpx": HttpxClient,
}


@dataclass
class Level:
    """One load level against one server."""

    latencies_s: list[float]
    errors: int
    elapsed_s: float
    next_query: int

    @property
    def qps(self) -> float:
        return len(self.latencies_s) / self.elapsed_s

    def ms(self, q: float) -> float:
        return float(np.percentile(np.array(self.latencies_s) * 1000, q))

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.latencies_s) * 1000


def request_body(queries: list[str], topk: int, return_scores: bool) -> bytes:
    return json.dumps({"queries": queries, "topk": topk, "return_scores": return_scores}).encode()


def answer_ok(status: int, data: bytes, n_queries: int, topk: int, return_scores: bool) -> bool:
    """Status 200 and topk hits for every query (a cheap count, not a full parse)."""
    key = b'"document"' if return_scores else b'"contents"'
    return status == 200 and data.count(key) == n_queries * topk


async def load_level(
    url: str,
    queries: list[str],
    conc: int,
    duration: float,
    start: int,
    *,
    client: str = "raw",
    return_scores: bool = False,
    topk: int = 3,
) -> Level:
    """`conc` clients, each sending one-query requests back to back for `duration` seconds."""
    lat: list[float] = []
    errors = 0
    counter = [start]
    stop_at = time.perf_counter() + duration

    async def worker() -> None:
        nonlocal errors
        c: Client = CLIENTS[client](url)
        try:
            while time.perf_counter() < stop_at:
                q = queries[counter[0] % len(queries)]
                counter[0] += 1
                body = request_body([q], topk, return_scores)
                t = time.perf_counter()
                status, data = await c.post_json("/retrieve", body)
                lat.append(time.perf_counter() - t)
                if not answer_ok(status, data, 1, topk, return_scores):
                    errors += 1
        finally:
            await c.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return Level(lat, errors, time.perf_counter() - t0, counter[0])


async def big_requests(
    url: str, queries: list[str], n_requests: int, size: int, *, client: str, topk: int = 3
) -> list[float]:
    """Latency (s) of `n_requests` sequential requests of `size` distinct queries each
    (return_scores=true: the original Search-R1 client's request for a turn's queries)."""
    c: Client = CLIENTS[client](url)
    lat = []
    try:
        for i in range(n_requests):
            qs = queries[i * size : (i + 1) * size]
            t = time.perf_counter()
            status, data = await c.post_json("/retrieve", request_body(qs, topk, True))
            lat.append(time.perf_counter() - t)
            if not answer_ok(status, data, len(qs), topk, True):
                raise SystemExit(f"{url}: bad answer to a {size}-query request: {data[:300]!r}")
    finally:
        await c.close()
    return lat


def hit_ids(url: str, queries: list[str], topk: int = 3) -> list[list[tuple[str, float]]]:
    """(id, score) per hit, one query per request (return_scores=true)."""
    out = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for q in queries:
            r = c.post("/retrieve", json={"queries": [q], "topk": topk, "return_scores": True})
            r.raise_for_status()
            out.append([(h["document"]["id"], float(h["score"])) for h in r.json()["result"][0]])
    return out


def same_hits(a: list[list[tuple[str, float]]], b: list[list[tuple[str, float]]]) -> int:
    """How many queries got the same ids in the same order (and scores within 1e-4)."""
    return sum(
        [i for i, _ in x] == [i for i, _ in y]
        and all(abs(s - t) < 1e-4 for (_, s), (_, t) in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


def pooled(levels: list[Level]) -> Level:
    """Several runs of one level as one: all latencies, total time."""
    lat = [x for lv in levels for x in lv.latencies_s]
    return Level(lat, sum(lv.errors for lv in levels), sum(lv.elapsed_s for lv in levels), 0)


def summarize(levels: list[Level]) -> dict[str, Any]:
    """Pooled statistics of several runs of one level: QPS of each run, percentiles pooled."""
    p = pooled(levels)
    return {
        "qps_runs": [lv.qps for lv in levels],
        "qps": p.qps,
        "p50": p.ms(50),
        "p99": p.ms(99),
        "errors": p.errors,
        "n": len(p.latencies_s),
    }
