"""HTTP server: the Search-R1 `POST /retrieve` API, byte-for-byte, plus the gRPC twin.

The request and response shapes are the reference server's (spec section 3):
    {"queries": [str, ...], "topk": int | null, "return_scores": bool}
    -> {"result": [[{"id", "contents"}, ...], ...]}                        (return_scores=false)
    -> {"result": [[{"document": {"id", "contents"}, "score": float}, ...]]} (return_scores=true)
serialized as FastAPI does (compact separators, UTF-8 unescaped). Unknown request fields are
ignored, as the reference does.

Routes only: `retriever.wiring` loads the index in the background after the port opens
(/health answers at once, /ready and /retrieve answer 503 until the index is loaded) and runs
the gRPC server beside this app.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from pydantic import BaseModel, Field, SecretStr, create_model, model_validator

from retriever.backends import BackendUnavailable, Hit
from retriever.config import LimitsConfig, RetrieverConfig
from retriever.engine import BadRequest, Overloaded, RetrieverEngine, check_request
from searchr1.service import ClientGone, create_service_app, require_token, unless_disconnected

log = logging.getLogger(__name__)
DISCONNECTED = Counter(
    "searchr1_retriever_client_disconnects_total",
    "Requests whose client went away before the answer; their searches were cancelled",
)


class RetrieveRequest(BaseModel):
    queries: list[str]
    topk: int | None = None
    return_scores: bool = False


def retrieve_request_model(limits: LimitsConfig) -> type[RetrieveRequest]:
    """RetrieveRequest with the configured limits in its schema (published in /openapi.json,
    where a fuzzer aims at them) and enforced with the engine's own messages (`check_request`,
    which gRPC requests go through), as a 422 before any work."""

    def within_limits(data: Any) -> Any:
        # Only well-typed input: a mistyped field gets pydantic's message naming it.
        if isinstance(data, dict):
            queries, topk = data.get("queries"), data.get("topk")
            typed_topk = topk is None or (isinstance(topk, int) and not isinstance(topk, bool))
            if (
                isinstance(queries, list)
                and all(isinstance(q, str) for q in queries)
                and typed_topk
            ):
                check_request(limits, queries, topk)
        return data

    query = Annotated[str, Field(max_length=limits.max_query_chars)]
    return create_model(
        "RetrieveRequest",
        __base__=RetrieveRequest,
        __validators__={"within_limits": model_validator(mode="before")(within_limits)},
        queries=(list[query], Field(min_length=1, max_length=limits.max_queries)),  # type: ignore[valid-type]
        topk=(
            int | None,
            Field(
                default=None,
                ge=0,
                le=limits.max_topk,
                description=f"0 or null: {limits.default_topk}",
            ),
        ),
    )


def format_results(results: list[list[Hit]], return_scores: bool) -> list[list[dict[str, Any]]]:
    if return_scores:
        return [[{"document": doc, "score": score} for doc, score in hits] for hits in results]
    return [[doc for doc, _ in hits] for hits in results]


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message, "detail": message}, status_code=status)


@dataclass
class Serving:
    """What the routes answer from: the engine once loaded (None while it loads), why loading
    failed, and the bound gRPC port (`retriever.wiring` fills these in)."""

    engine: RetrieverEngine | None = None
    error: BaseException | None = None
    grpc_port: int | None = None


def create_app(
    cfg: RetrieverConfig,
    serving: Serving | None = None,
    *,
    admin_token: SecretStr | None = None,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
) -> FastAPI:
    """The retriever's HTTP routes over `serving` (routes only: `retriever.wiring` loads the
    engine and runs the gRPC server, in `lifespan`)."""
    state = serving if serving is not None else Serving()

    async def index_loaded() -> str:
        if state.error is not None:
            raise RuntimeError(f"backend failed to load: {state.error}")
        if state.engine is None:
            raise RuntimeError("index is still loading")
        backend = state.engine.backend
        if hasattr(backend, "healthy") and not backend.healthy():
            raise RuntimeError("the encoder process died")
        return backend.name

    app = create_service_app("retriever", ready_checks={"index": index_loaded}, lifespan=lifespan)
    app.state.retriever = state

    async def retrieve(req: RetrieveRequest, request: Request) -> JSONResponse:
        eng = state.engine
        if eng is None:
            return _error(503, "index is still loading; poll /ready")
        try:
            results = await unless_disconnected(
                request, eng.search(req.queries, req.topk, protocol="http")
            )
        except ClientGone:  # its queries were cancelled: web searches not yet sent never are
            DISCONNECTED.inc()
            return _error(499, "client disconnected")
        except BadRequest as e:
            return _error(422, str(e))
        except Overloaded as e:
            return _error(429, str(e))
        except BackendUnavailable as e:
            return _error(503, str(e))
        # JSONResponse directly: the same bytes FastAPI would produce, without jsonable_encoder.
        return JSONResponse({"result": format_results(results, req.return_scores)})

    # The model carries this config's limits; annotations are strings here (future import),
    # so the class itself is put in for FastAPI to read.
    retrieve.__annotations__["req"] = retrieve_request_model(cfg.limits)
    app.post("/retrieve")(retrieve)

    @app.post("/flush_cache", dependencies=[Depends(require_token(admin_token))])
    async def flush_cache() -> dict[str, Any]:
        eng = state.engine
        n = 0
        if eng is not None:
            n = len(eng.cache)
            eng.cache.clear()
        return {"flushed": n}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        eng = state.engine
        if eng is None:
            return {"loaded": False}
        b = eng.batcher
        return {
            "loaded": True,
            "backend": eng.backend.name,
            "cache": {
                "size": len(eng.cache),
                "bytes": eng.cache.bytes,
                "hits": eng.cache.hits,
                "misses": eng.cache.misses,
            },
            "batches": b.batches if b else 0,
            "batched_queries": b.batched_queries if b else 0,
            "inline_batches": b.inline_batches if b else 0,
            "stage_busy_s": b.stage_busy_s if b else [],
            "grpc_port": state.grpc_port,
        }

    return app
