"""The HTTP plumbing every service shares.

`create_service_app` returns a FastAPI app with:
- `GET /health`: the process is alive (never touches dependencies);
- `GET /ready`: every registered readiness check passes (Redis reachable, index loaded, ...);
  503 with the failing checks otherwise;
- `GET /metrics`: Prometheus text format;
- a request-id middleware (`X-Request-ID` in and out, attached to every log line) that also
  counts requests and observes latency per route;
- a request body limit (`http.max_body_bytes`): 413 before the body is read when
  Content-Length is over it, else as soon as the bytes read cross it (chunked bodies).

`serve_http` runs an app under uvicorn; SIGTERM/SIGINT stop accepting connections, let in-flight
requests finish (bounded by `graceful_shutdown_s`), run the app's lifespan shutdown (where a
service hands back in-flight work) and return, so the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from pydantic import SecretStr
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from searchr1.logs import request_id_var
from searchr1.sections import HttpConfig

log = logging.getLogger(__name__)

# A readiness check returns None (or a short detail string) when ready and raises when not.
ReadyCheck = Callable[[], Awaitable[str | None]]

HTTP_REQUESTS = Counter(
    "searchr1_http_requests_total",
    "HTTP requests served",
    ["service", "route", "method", "status"],
)
HTTP_LATENCY = Histogram(
    "searchr1_http_request_duration_seconds",
    "HTTP request latency",
    ["service", "route"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
HTTP_ERRORS = Counter(
    "searchr1_http_unhandled_errors_total",
    "Requests that failed with an unhandled exception (HTTP 500)",
    ["service", "route"],
)

READY_CHECK_TIMEOUT_S = 3.0
# The admin token comes from the environment only (never a config file), for every service.
ADMIN_TOKEN_ENV = "SEARCHR1_ADMIN_TOKEN"
_SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
DEFAULT_MAX_BODY_BYTES: int = HttpConfig.model_fields["max_body_bytes"].default


class RequestTooLarge(HTTPException):
    """413. An HTTPException because FastAPI re-raises those from inside its body reading, so
    a limit crossed mid-stream is answered like any other HTTP error (not as a 400 or 500)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body over {limit} bytes (http.max_body_bytes)")


def _too_large_response(message: str) -> JSONResponse:
    # Connection: close, or uvicorn keeps reading (and discarding) the rest of the body.
    return JSONResponse(
        {"error": message, "detail": message}, status_code=413, headers={"Connection": "close"}
    )


class BodyLimitMiddleware:
    """Cut a request body off at `limit()` bytes without ever holding more than that.

    Content-Length over the limit: 413 at once, no byte read. Otherwise (chunked) the bytes
    are counted as the app reads them and RequestTooLarge is raised the moment they cross the
    limit. The 413 says `Connection: close`, so uvicorn drops the connection instead of
    draining the rest of the body.
    """

    def __init__(self, app: ASGIApp, limit: Callable[[], int]) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > limit:
            await _too_large_response(RequestTooLarge(limit).detail)(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise RequestTooLarge(limit)
            return message

        await self.app(scope, limited, send)


def _printable(value: Any) -> Any:
    """Strings made encodable: a lone surrogate ("\\ud800" in JSON) would make the answer's
    UTF-8 encoding fail and turn a 422 into a 500. Non-finite numbers as text: a body may
    hold NaN or Infinity (not JSON, but Python's parser takes them), which JSON cannot echo."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {_printable(k): _printable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_printable(v) for v in value]
    return value


def _route_template(scope: Scope) -> str:
    # The route template ("/items/{id}"), not the raw path, keeps label cardinality bounded.
    route = scope.get("route")
    return getattr(route, "path", None) or "<unmatched>"


class RequestContextMiddleware:
    """X-Request-ID in and out (and on every log line), request metrics, and a logged 500 for
    anything unhandled.

    Plain ASGI rather than `@app.middleware("http")`: Starlette's BaseHTTPMiddleware hides the
    client's disconnect from the app, and the engine must see it to abort work for nobody."""

    def __init__(self, app: ASGIApp, service: str) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id", "")
        # A client's id is echoed in the answer and on every log line: only a short, plain one.
        rid = given if _SAFE_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex[:16]
        token = request_id_var.set(rid)
        start = time.perf_counter()
        status, started = 500, False

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
                MutableHeaders(scope=message)["X-Request-ID"] = rid
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            route = _route_template(scope)
            HTTP_ERRORS.labels(self.service, route).inc()
            log.exception("unhandled error", extra={"route": route, "method": scope["method"]})
            status = 500
            if not started:
                answer = JSONResponse(
                    {"error": "internal error", "request_id": rid},
                    status_code=500,
                    headers={"X-Request-ID": rid},
                )
                await answer(scope, receive, send)
        finally:
            route = _route_template(scope)
            HTTP_REQUESTS.labels(self.service, route, scope["method"], str(status)).inc()
            HTTP_LATENCY.labels(self.service, route).observe(time.perf_counter() - start)
            request_id_var.reset(token)


async def _request_id_header(
    x_request_id: str | None = Header(
        default=None,
        description="Ties the log lines of one request together across services; echoed. "
        "Up to 128 of A-Z a-z 0-9 . _ : - (anything else is replaced by a fresh id).",
    ),
) -> None:
    """Documentation only: RequestContextMiddleware reads the header."""


T = TypeVar("T")


class ClientGone(Exception):
    """The client of a running request disconnected."""


async def unless_disconnected(
    request: Request, work: Coroutine[Any, Any, T], poll_s: float = 0.25
) -> T:
    """Await `work`, cancelling it if the client goes away (its timeout, a crash): nothing
    is computed (or paid for) for nobody, and retries of timed-out calls do not pile up until
    the queue is full. Raises ClientGone (answer 499)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientGone


def create_service_app(
    service: str,
    *,
    ready_checks: Mapping[str, ReadyCheck] | None = None,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[Any]] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """A FastAPI app with health, readiness, metrics and request-id plumbing installed.

    `max_body_bytes` is the body limit until `uvicorn_server` sets the service's
    `http.max_body_bytes`."""
    # Every route documents X-Request-ID, so a schema-driven fuzzer sends hostile ones too.
    app = FastAPI(
        title=f"searchr1 {service}", lifespan=lifespan, dependencies=[Depends(_request_id_header)]
    )
    app.state.service = service
    app.state.ready_checks = dict(ready_checks or {})
    app.state.max_body_bytes = max_body_bytes
    # Added before the request-id middleware, so it runs inside it: 413s are counted and
    # carry a request id like every other answer.
    app.add_middleware(BodyLimitMiddleware, limit=lambda: app.state.max_body_bytes)

    app.add_middleware(RequestContextMiddleware, service=service)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # One readable sentence per problem, naming the field, instead of a nested blob only.
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            problems.append(f"{loc}: {err.get('msg')}")
        # The details can hold the raw body (bytes, not even UTF-8, when it was not JSON).
        detail = jsonable_encoder(
            exc.errors(), custom_encoder={bytes: lambda b: b.decode(errors="replace")}
        )
        return JSONResponse(
            _printable({"error": "; ".join(problems), "detail": detail}), status_code=422
        )

    @app.exception_handler(RequestTooLarge)
    async def request_too_large(request: Request, exc: RequestTooLarge) -> JSONResponse:
        return _too_large_response(exc.detail)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "service": service}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        results = await run_ready_checks(app.state.ready_checks)
        ok = all(r["ok"] for r in results.values())
        return JSONResponse(
            {"ready": ok, "service": service, "checks": results}, status_code=200 if ok else 503
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        # Every route's unhandled-error counter at 0 (not "No data" until the first 500).
        for route in app.routes:
            HTTP_ERRORS.labels(service, getattr(route, "path", "<unmatched>"))
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


async def run_ready_checks(checks: Mapping[str, ReadyCheck]) -> dict[str, dict[str, Any]]:
    async def one(check: ReadyCheck) -> dict[str, Any]:
        try:
            detail = await asyncio.wait_for(check(), READY_CHECK_TIMEOUT_S)
            return {"ok": True, "detail": detail}
        except TimeoutError:
            return {"ok": False, "detail": f"timed out after {READY_CHECK_TIMEOUT_S}s"}
        except Exception as e:  # a failing check is a result, reported in the response
            return {"ok": False, "detail": f"{type(e).__name__}: {e}"}

    names = list(checks)
    outcomes = await asyncio.gather(*(one(checks[n]) for n in names))
    return dict(zip(names, outcomes, strict=True))


def require_token(token: SecretStr | None) -> Callable[..., Awaitable[None]]:
    """A FastAPI dependency guarding state-changing endpoints with a shared bearer token.

    With no token configured the endpoint is open (local development); with one, requests
    need `Authorization: Bearer <token>` and get 401 otherwise. An empty token is refused
    here: `SecretStr("")` is falsy, and it used to leave the endpoint open without a word.
    """
    import hmac

    expected = token.get_secret_value() if token is not None else None
    if expected is not None and not expected.strip():
        raise ValueError("the admin token is empty: set a real token, or none for open routes")

    async def check(authorization: str | None = Header(default=None)) -> None:
        if expected is None:
            return
        scheme, _, given = (authorization or "").partition(" ")
        # compare_digest: the time taken does not depend on how much of the token matched.
        ok = scheme.lower() == "bearer" and given != ""
        if not ok or not hmac.compare_digest(given.encode(), expected.encode()):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token")

    return check


class InsecureListener(ValueError):
    """A service would listen beyond loopback with its guarded routes open."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name (or "") may resolve to anything
        return False


def check_exposure(http: HttpConfig, *, token_set: bool) -> None:
    """Closed by default: refuse to listen beyond loopback without an admin token, since every
    guarded route (weight updates, pause, cache flush) would then be open to the network.
    `http.auth: none` opts out explicitly (said in the log)."""
    if token_set or is_loopback(http.host):
        return
    if http.auth == "none":
        log.warning(
            "listening beyond loopback with no admin token (http.auth: none): guarded routes "
            "are open to anyone who reaches this port",
            extra={"host": http.host},
        )
        return
    raise InsecureListener(
        f"http.host is {http.host!r} (not loopback) and no admin token is set: set "
        f"{ADMIN_TOKEN_ENV}, listen on 127.0.0.1, or set http.auth: none "
        "(SEARCHR1_<SERVICE>__HTTP__AUTH=none) to serve the guarded routes open"
    )


def uvicorn_server(app: FastAPI, http: HttpConfig) -> uvicorn.Server:
    """The service's uvicorn server; raises InsecureListener (see `check_exposure`)."""
    check_exposure(http, token_set=bool(os.environ.get(ADMIN_TOKEN_ENV, "").strip()))
    app.state.max_body_bytes = http.max_body_bytes  # read per request by BodyLimitMiddleware
    config = uvicorn.Config(
        app,
        host=http.host,
        port=http.port,
        log_config=None,  # keep our logging set-up
        timeout_graceful_shutdown=http.graceful_shutdown_s,
        timeout_keep_alive=http.keep_alive_s,  # not uvicorn's 5 s: see HttpConfig
        lifespan="on",
    )
    return uvicorn.Server(config)


def exit_cleanly_after_shutdown() -> None:
    # uvicorn re-raises the captured SIGTERM/SIGINT once its graceful shutdown is done; with
    # the default handlers that kills the process (status 143). No-op handlers let serve()
    # return so the process exits 0. Only possible (and needed) in the main thread.
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)


async def serve_http(app: FastAPI, http: HttpConfig) -> None:
    """Serve until SIGTERM/SIGINT, then shut down gracefully (see module docstring)."""
    exit_cleanly_after_shutdown()
    server = uvicorn_server(app, http)
    log.info("listening", extra={"host": http.host, "port": http.port})
    await server.serve()
    log.info("stopped")


def run_http(app: FastAPI, http: HttpConfig) -> None:
    asyncio.run(serve_http(app, http))
