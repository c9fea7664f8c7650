"""JSON over HTTP for the clients on the rollout's hot path: a body of bytes in, a `Reply` out.

The orchestrator keeps thousands of `/generate` and `/retrieve` calls in flight. Through
httpx's `AsyncClient` each call builds httpx's request and response objects (URL merging,
headers, cookies) on top of the aiohttp pool that does the actual I/O, and `json` encodes the
token-id context in pure Python: together about a third of the orchestrator's CPU per turn
(bench/orchestrator_scale.py). Here:

- `AiohttpJson` calls one aiohttp pool directly (no cookie jar, URLs parsed once);
- `HttpxJson` wraps an `httpx.AsyncClient` (the default, and what tests drive with
  `httpx.MockTransport`);
- `dumps`/`loads` are pydantic-core's JSON (Rust; already a dependency through pydantic):
  4x faster than `json` on a 3,000-id context, the same values both ways.

Both transports raise httpx's exception types (aiohttp's mapped as httpx-aiohttp maps them),
so a caller classifies failures one way, whichever transport it was given. Their connections
carry TCP keepalive and TCP_USER_TIMEOUT (`tcp_timeout_s`, `searchr1.sockets`): a call across
a network cut fails within that bound instead of waiting out the retransmission backoff.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from pydantic_core import from_json, to_json

from searchr1.sockets import HTTP_TCP_TIMEOUT_S, socket_options

JSON_HEADERS = {"Content-Type": "application/json"}


def dumps(obj: Any) -> bytes:
    """Compact JSON, UTF-8 (non-ASCII text as is, like httpx's `json=`)."""
    return to_json(obj)


def loads(data: bytes | str) -> Any:
    """Parse JSON; ValueError on malformed input (as `json.loads`)."""
    return from_json(data)


@dataclass(frozen=True)
class Reply:
    status: int
    content: bytes
    reason: str = ""

    def json(self) -> Any:
        return loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


class JsonTransport(Protocol):
    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        *,
        timeout_s: float,
        connect_s: float,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        """One HTTP exchange; `timeout_s` bounds waiting for the pool and each read; `headers`
        add to the transport's own."""
        ...

    async def aclose(self) -> None: ...


def _request_headers(body: bytes | None, extra: dict[str, str] | None) -> dict[str, str] | None:
    if extra is None:
        return JSON_HEADERS if body is not None else None
    return {**JSON_HEADERS, **extra} if body is not None else extra


def httpx_client(
    base_url: str,
    *,
    max_connections: int,
    headers: dict[str, str] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    tcp_timeout_s: float = HTTP_TCP_TIMEOUT_S,
) -> httpx.AsyncClient:
    """An `httpx.AsyncClient` pooling up to `max_connections`, each connection bounded by
    `tcp_timeout_s` (`searchr1.sockets`); `transport` (tests: a fake server) replaces the pool."""
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections
    )
    if transport is None:
        transport = httpx.AsyncHTTPTransport(
            limits=limits, socket_options=socket_options(tcp_timeout_s)
        )
    return httpx.AsyncClient(
        base_url=base_url, headers=headers or {}, limits=limits, transport=transport
    )


def _socket_factory(tcp_timeout_s: float) -> Callable[[Any], socket.socket]:
    """aiohttp's `socket_factory`: a socket for one address, bounded by `tcp_timeout_s`."""
    options = socket_options(tcp_timeout_s)

    def make(addr_info: Any) -> socket.socket:
        family, type_, proto, _, _ = addr_info
        sock = socket.socket(family=family, type=type_, proto=proto)
        try:
            for level, option, value in options:
                sock.setsockopt(level, option, value)
        except OSError:
            sock.close()
            raise
        return sock

    return make


class HttpxJson:
    """Over an `httpx.AsyncClient` (its base URL, headers and transport)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        *,
        timeout_s: float,
        connect_s: float,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        resp = await self.client.request(
            method,
            path,
            content=body,
            headers=_request_headers(body, headers),
            timeout=httpx.Timeout(timeout_s, connect=connect_s),
        )
        return Reply(resp.status_code, resp.content, resp.reason_phrase)

    async def aclose(self) -> None:
        await self.client.aclose()


class AiohttpJson:
    """Over one aiohttp connection pool of `max_connections` (created on first use, inside the
    running loop). Idle connections are kept `keepalive_s`: a connection idle for a whole turn
    (seconds) is still reused; the servers keep theirs longer (`http.keep_alive_s`), so the
    client is the side that closes an idle one. Each connection is bounded by `tcp_timeout_s`
    (`searchr1.sockets`)."""

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int,
        keepalive_s: float = 60.0,
        headers: dict[str, str] | None = None,
        tcp_timeout_s: float = HTTP_TCP_TIMEOUT_S,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self._make_socket = _socket_factory(tcp_timeout_s)  # checks tcp_timeout_s now
        self.headers = dict(headers or {})
        self._session: Any = None  # aiohttp.ClientSession
        self._urls: dict[str, Any] = {}  # path -> yarl.URL, parsed once

    def _url(self, path: str) -> Any:
        url = self._urls.get(path)
        if url is None:
            from yarl import URL

            url = self._urls[path] = URL(self.base_url + path)
        return url

    def _get_session(self) -> Any:
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self.max_connections,
                    keepalive_timeout=self.keepalive_s,
                    socket_factory=self._make_socket,
                ),
                cookie_jar=aiohttp.DummyCookieJar(),
                headers=self.headers,
                auto_decompress=False,
            )
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        *,
        timeout_s: float,
        connect_s: float,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        import aiohttp
        from httpx_aiohttp.transport import map_aiohttp_exceptions

        session = self._get_session()
        # httpx's timeouts as httpx-aiohttp maps them: connect -> sock_connect, read ->
        # sock_read, pool -> connect (waiting for a free connection, and connecting).
        timeout = aiohttp.ClientTimeout(
            sock_connect=connect_s, sock_read=timeout_s, connect=timeout_s
        )
        with map_aiohttp_exceptions():
            async with session.request(
                method,
                self._url(path),
                data=body,
                headers=_request_headers(body, headers),
                timeout=timeout,
                allow_redirects=False,
            ) as resp:
                return Reply(resp.status, await resp.read(), resp.reason or "")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
