"""The gateway's HTTP layer over `gateway.core.Gateway`: the OpenAI routes, sessions, and the
service's /health, /ready, /metrics (searchr1.service). Each route parses, calls one Gateway
method and answers; refusals are OpenAI-style errors (`{"error": {"message", "type",
"code"}}`, `code` the metric's reason).

A session is named by `X-Session-Id` (the body's `user` as fallback) on `/v1/...`, joining
the group of `X-Group-Id` + `X-Group-Size` on its first call; or by the path of a registered
session's base URL, `/sessions/{id}/v1/...` (what `searchr1 agent run` hands its agents, so
they need no headers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, SecretStr, field_validator

from gateway.core import Gateway
from gateway.errors import GatewayError
from gateway.openai_api import ChatReply, ChatRequest
from gateway.sessions import Ident
from searchr1.service import (
    ClientGone,
    ReadyCheck,
    create_service_app,
    require_token,
    unless_disconnected,
)

log = logging.getLogger(__name__)


class SessionOpen(BaseModel):
    id: str
    group_id: str | None = Field(default=None, min_length=1, max_length=400)
    group_size: int | None = Field(default=None, ge=1, le=4096)
    row_id: str = Field(default="", max_length=400)
    data_source: str = Field(default="", max_length=200)
    timeout_s: float | None = Field(default=None, gt=0)


def _finite(value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


class RewardBody(BaseModel):
    reward: float
    turn: int | None = Field(default=None, ge=0, description="A call's index; none: final.")
    components: dict[str, float] = Field(default_factory=dict)

    _check = field_validator("reward")(_finite)


class EndBody(BaseModel):
    reward: float | None = Field(default=None, description="The final reward, if not given yet.")
    components: dict[str, float] = Field(default_factory=dict)

    _check = field_validator("reward")(_finite)


def _ident(
    body: ChatRequest,
    session_id: str | None,
    group_id: str | None,
    group_size: str | None,
    row_id: str | None,
    data_source: str | None,
) -> Ident:
    sid = session_id or body.user
    if not sid:
        raise GatewayError(
            400, "no_session", "name the session: X-Session-Id header (or the body's user)"
        )
    size = None
    if group_size is not None:
        if not group_size.isdigit() or int(group_size) < 1:
            raise GatewayError(400, "bad_request", "X-Group-Size: a positive integer")
        size = int(group_size)
    if (size is None) != (group_id is None):
        raise GatewayError(400, "bad_request", "X-Group-Id and X-Group-Size go together")
    return Ident(sid, group_id, size, row_id or "", data_source or "")


def create_app(
    gateway: Gateway,
    *,
    token: SecretStr | None = None,
    ready_checks: Mapping[str, ReadyCheck] | None = None,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        reaper = asyncio.create_task(gateway.reap_forever())
        try:
            yield
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            await gateway.shutdown()

    app = create_service_app("gateway", ready_checks=ready_checks, lifespan=lifespan)
    guard = [Depends(require_token(token))]

    @app.exception_handler(GatewayError)
    async def refused(request: Request, exc: GatewayError) -> JSONResponse:
        if exc.status < 500:  # the engine's failures were logged where they happened
            log.info(
                "refused",
                extra={"status": exc.status, "reason": exc.reason, "error": exc.message[:500]},
            )
        return JSONResponse(exc.body(), status_code=exc.status)

    async def answer(request: Request, body: ChatRequest, ident: Ident, registered: bool) -> Any:
        try:
            reply = await unless_disconnected(
                request, gateway.chat(body, ident, registered=registered)
            )
        except ClientGone:
            return JSONResponse({"error": {"message": "client gone"}}, status_code=499)
        if not body.stream:
            return reply.completion()
        usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(_sse(reply, usage), media_type="text/event-stream")

    @app.post("/v1/chat/completions", dependencies=guard)
    async def chat(
        request: Request,
        body: ChatRequest,
        x_session_id: str | None = Header(default=None),
        x_group_id: str | None = Header(default=None),
        x_group_size: str | None = Header(default=None),
        x_row_id: str | None = Header(default=None),
        x_data_source: str | None = Header(default=None),
    ) -> Any:
        ident = _ident(body, x_session_id, x_group_id, x_group_size, x_row_id, x_data_source)
        return await answer(request, body, ident, registered=False)

    @app.post("/sessions/{session_id}/v1/chat/completions", dependencies=guard)
    async def session_chat(request: Request, session_id: str, body: ChatRequest) -> Any:
        return await answer(request, body, Ident(session_id), registered=True)

    def models() -> dict[str, Any]:
        model = {"id": gateway.model_name, "object": "model", "created": 0, "owned_by": "searchr1"}
        return {"object": "list", "data": [model]}

    app.get("/v1/models", dependencies=guard)(models)

    @app.get("/sessions/{session_id}/v1/models", dependencies=guard)
    async def session_models(session_id: str) -> dict[str, Any]:
        gateway.table.get(session_id)  # a live session's URL only
        return models()

    @app.post("/v1/sessions", dependencies=guard)
    async def open_session(body: SessionOpen) -> dict[str, Any]:
        ident = Ident(body.id, body.group_id, body.group_size, body.row_id, body.data_source)
        s = gateway.open_session(ident, body.timeout_s)
        return {
            "id": s.id,
            "group_id": s.group.id,
            "group_size": s.group.size,
            "base_path": f"/sessions/{s.id}/v1",
        }

    @app.get("/v1/sessions/{session_id}", dependencies=guard)
    async def describe(session_id: str) -> dict[str, Any]:
        s = gateway.table.get(session_id)
        last = s.segments[-1] if s.segments else None
        decode = gateway.renderer.decode
        return {
            "id": s.id,
            "group_id": s.group.id,
            "row_id": s.row_id,
            "turns": s.turns,
            "reward": s.reward,
            # What a rubric scores (`agent run --task`): the latest segment's response as the
            # orchestrator's Scorer sees one (model and template tokens, decoded from the ids),
            # and each model message of it as generated (end-of-turn token included).
            "response_text": decode(last.response_ids) if last else "",
            "turn_texts": [decode(ids) for ids in last.model_ids()] if last else [],
            "segments": [
                {
                    "index": seg.index,
                    "reason": seg.reason,
                    "prompt_tokens": len(seg.prompt_ids),
                    "response_tokens": len(seg.response_ids),
                    "turns": len(seg.turns),
                }
                for seg in s.segments
            ],
        }

    @app.post("/v1/sessions/{session_id}/reward", dependencies=guard)
    async def reward(session_id: str, body: RewardBody) -> dict[str, Any]:
        gateway.reward(session_id, body.reward, turn=body.turn, components=body.components)
        return {"id": session_id, "reward": body.reward, "turn": body.turn}

    @app.post("/v1/sessions/{session_id}/end", dependencies=guard)
    async def end(session_id: str, body: EndBody | None = None) -> dict[str, Any]:
        body = body or EndBody()
        status = await gateway.end(session_id, body.reward, body.components)
        return {"id": session_id, "status": status}

    return app


async def _sse(reply: ChatReply, include_usage: bool) -> AsyncIterator[bytes]:
    for chunk in reply.chunks(include_usage):
        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()
    yield b"data: [DONE]\n\n"
