"""The HTTP layer of the reference engine: SGLang's native API subset over `TorchEngine`.

Field names follow SGLang's `io_struct.py` (checked against the current release): weight
versions travel as strings ("weight_version"), update responses are `{"success", "message"}`,
`/pause_generation` takes `{"mode": "abort" | "in_place" | "retract"}`. Each route validates,
calls one engine method, and maps ValueError to 400, overload to 429.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field, SecretStr, WithJsonSchema, field_validator

from inference.engine import TorchEngine
from inference.join import Joiner
from inference.memory import MemoryReleased
from inference.sampling import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
    check_text,
)
from inference.scheduler import REJECTED, EngineOverloaded, EngineStopped
from searchr1.service import ClientGone, create_service_app, require_token, unless_disconnected
from searchr1.weightsync.handover_receiver import parse_handover
from searchr1.weightsync.protocol import Bucket, GroupDestroy, GroupJoin
from searchr1.weightsync.receiver import GroupAlreadyFreed

log = logging.getLogger(__name__)
T = TypeVar("T")
DISCONNECTED = Counter(
    "searchr1_inference_client_disconnects_total",
    "Requests aborted because their client went away before the answer",
)


class _Req(BaseModel):
    # SGLang ignores fields it does not use (rid, stream, ...); so do we.
    model_config = ConfigDict(extra="ignore")


class SamplingParamsDoc(BaseModel):
    """The schema published for `sampling_params` (SGLang's names). Documentation only: the
    route checks the dict with `SamplingParams.from_dict`, which answers 400 naming the field as
    SGLang does (a model here would make those 422s); a property test keeps the two in step."""

    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int = Field(default=128, ge=0)
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(default=-1, ge=-1, description="-1 (off) or >= 1")
    stop: (
        Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
        | Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
            Field(max_length=MAX_STOP_STRINGS),
        ]
        | None
    ) = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS
    )
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    sampling_seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    # Accepted and ignored (SGLang clients send them).
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    spaces_between_special_tokens: bool | None = None


class GenerateReq(_Req):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: Annotated[
        dict[str, Any], WithJsonSchema(SamplingParamsDoc.model_json_schema())
    ] = Field(default_factory=dict)
    return_logprob: bool = False
    rid: str | None = None
    stream: bool = False

    @field_validator("rid")
    @classmethod
    def _rid_is_text(cls, rid: str | None) -> str | None:
        # Echoed in meta_info.id: a lone surrogate would fail the answer's encoding (a 500).
        if rid is not None:
            check_text("rid", rid)
        return rid


class PauseReq(_Req):
    mode: Literal["abort", "in_place", "retract"] = "abort"


class DiskUpdateReq(_Req):
    model_path: str
    weight_version: str | None = None
    abort_all_requests: bool = False


class MemoryReq(_Req):
    """SGLang's Release/ResumeMemoryOccupationReqInput: none or [] means every tag."""

    tags: list[Annotated[str, Field(max_length=64)]] | None = Field(default=None, max_length=8)


class TensorUpdateReq(_Req):
    """SGLang's UpdateWeightsFromTensorReqInput (`serialized_named_tensors`: one entry per TP
    rank; ours must be `load_format="searchr1_handles"` descriptions, never pickles)."""

    serialized_named_tensors: list[str] = Field(min_length=1, max_length=64)
    load_format: str | None = Field(default=None, max_length=256)
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


def _version(v: str | None) -> int | None:
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise HTTPException(400, f"weight_version must be an integer string (got {v!r})") from None


def _fail(e: Exception, status: int = 400) -> JSONResponse:
    # A destroy of a group this engine freed at a newer join ends every takeover: not a fault.
    level = logging.DEBUG if isinstance(e, GroupAlreadyFreed) else logging.WARNING
    log.log(level, "admin request failed", extra={"error": str(e), "status": status})
    return JSONResponse({"success": False, "message": str(e)}, status_code=status)


async def _answer(
    call: Awaitable[T],
    body: Callable[[T], dict[str, Any]],
    *,
    other_errors: int | None = None,
) -> JSONResponse:
    """SGLang's answer to an admin call: `{"success": true, **body(result)}`, or
    `{"success": false, "message"}` with 400 for a ValueError (the engine refused) and with
    `other_errors` for any other exception (by default those propagate: a 500 with a traceback)."""
    try:
        result = await call
    except ValueError as e:
        return _fail(e)
    except Exception as e:
        if other_errors is None:
            raise
        return _fail(e, other_errors)
    return JSONResponse({"success": True, **body(result)})


def create_app(
    engine: TorchEngine, *, admin_token: SecretStr | None = None, joiner: Joiner | None = None
) -> FastAPI:
    """The inference service app; the engine is created (and shut down) by the caller.
    `joiner`: pull the current weights from the weight store first (`inference.join`)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        joining = asyncio.create_task(joiner.run(), name="join") if joiner else None
        yield
        if joiner is not None and joining is not None:
            joining.cancel()
            await asyncio.gather(joining, return_exceptions=True)
            await joiner.stop()
        engine.shutdown()

    async def model_loaded() -> str:
        # Ready while released: the trainer must still reach the engine (through a Service
        # that lists ready pods only) to resume it; generation itself answers 503 meanwhile.
        memory = engine.memory.describe()
        return f"{engine.model_path} v{engine.weight_version} ({memory})"

    checks = {"model": model_loaded} | ({"weights": joiner.check} if joiner else {})
    app = create_service_app("inference", ready_checks=checks, lifespan=lifespan)
    REJECTED.labels("memory_released")  # at 0 from start-up
    admin = [Depends(require_token(admin_token))]

    @app.post("/generate")
    async def generate(req: GenerateReq, request: Request) -> JSONResponse:
        if req.stream:
            raise HTTPException(400, "stream=true is not supported by the reference engine")
        try:
            params = SamplingParams.from_dict(req.sampling_params)
        except ValueError as e:
            REJECTED.labels("bad_request").inc()
            raise HTTPException(400, str(e)) from None
        try:
            out = await unless_disconnected(
                request, engine.generate(req.input_ids, params, text=req.text, rid=req.rid)
            )
        except ClientGone:
            DISCONNECTED.inc()
            return JSONResponse({"detail": "client disconnected"}, status_code=499)
        except ValueError as e:  # counted and logged by the engine
            raise HTTPException(400, str(e)) from None
        except EngineOverloaded as e:
            raise HTTPException(429, str(e)) from None
        except EngineStopped as e:
            raise HTTPException(503, str(e)) from None
        except MemoryReleased as e:
            REJECTED.labels("memory_released").inc()
            raise HTTPException(503, str(e)) from None
        rid = req.rid or ""
        return JSONResponse(
            {
                "text": out.text,
                "output_ids": out.output_ids,
                "meta_info": out.meta_info(rid, req.return_logprob),
            }
        )

    @app.get("/health_generate")
    async def health_generate() -> dict[str, str]:
        # A real one-token round trip through the scheduler, like SGLang's.
        try:
            out = await engine.generate([0], SamplingParams(max_new_tokens=1, temperature=0))
        except MemoryReleased as e:
            raise HTTPException(503, str(e)) from None
        return {"status": "ok", "weight_version": str(out.weight_version)}

    @app.get("/weights_checksum", dependencies=admin)
    async def weights_checksum() -> dict[str, Any]:
        """`delta.state_checksum` of every tensor the model holds (its state dict): equal to
        the trainer's (and the weight store's) where the weights are bit for bit the same."""
        return await engine.run_command(engine.weights_checksum)

    @app.get("/model_info")
    @app.get("/get_model_info")  # SGLang's older name, still served (deprecated there)
    async def get_model_info() -> dict[str, Any]:
        return engine.model_info()

    async def flush_cache() -> PlainTextResponse:
        await engine.flush_cache()
        return PlainTextResponse("Cache flushed.\n")  # SGLang answers text here

    # Two routes, not one api_route: the OpenAPI document needs one operation id per method.
    app.get("/flush_cache", dependencies=admin, operation_id="flush_cache_get")(flush_cache)
    app.post("/flush_cache", dependencies=admin, operation_id="flush_cache")(flush_cache)

    @app.post("/pause_generation", dependencies=admin)
    async def pause_generation(req: PauseReq | None = None) -> JSONResponse:
        return await _answer(
            engine.pause((req or PauseReq()).mode), lambda _: {"message": "Generation paused."}
        )

    @app.post("/continue_generation", dependencies=admin)
    async def continue_generation() -> JSONResponse:
        await engine.resume()
        return JSONResponse({"success": True, "message": "Generation continued."})

    @app.post("/update_weights_from_disk", dependencies=admin)
    async def update_weights_from_disk(req: DiskUpdateReq) -> JSONResponse:
        version = _version(req.weight_version)

        async def update() -> int:
            if req.abort_all_requests:
                await engine.abort_all("aborted for a weight update")
            return await engine.update_weights_from_disk(req.model_path, version)

        return await _answer(
            update(),
            lambda new: {
                "message": f"Succeeded to update model weights (weight_version {new}).",
                "num_paused_requests": 0,
                "weight_version": str(new),
            },
        )

    @app.post("/begin_weight_update", dependencies=admin)
    async def begin_weight_update() -> JSONResponse:
        return await _answer(engine.begin_weight_update(), lambda _: {"message": "Success"})

    @app.post("/end_weight_update", dependencies=admin)
    async def end_weight_update() -> JSONResponse:
        return await _answer(
            engine.end_weight_update(),
            lambda new: {"message": "Success", "weight_version": str(new)},
        )

    @app.post("/init_weights_update_group", dependencies=admin)
    async def init_weights_update_group(req: GroupJoin) -> JSONResponse:
        return await _answer(
            engine.init_weights_update_group(req),
            lambda _: {"message": "Succeeded to initialize group."},
            other_errors=500,  # rendezvous timeout, unreachable master
        )

    @app.post("/destroy_weights_update_group", dependencies=admin)
    async def destroy_weights_update_group(req: GroupDestroy) -> JSONResponse:
        return await _answer(
            engine.destroy_weights_update_group(req.group_name),
            lambda _: {"message": "Succeeded to destroy the group."},
        )

    @app.post("/update_weights_from_distributed", dependencies=admin)
    async def update_weights_from_distributed(req: Bucket) -> JSONResponse:
        version = _version(req.weight_version)

        async def update() -> int:
            if req.abort_all_requests:
                await engine.abort_all("aborted for a weight update")
            return await engine.update_weights_from_distributed(req, version)

        return await _answer(
            update(),
            lambda new: {
                "message": "Succeeded to receive the bucket; applied at end_weight_update.",
                "weight_version": str(new),
            },
        )

    # GET too, as SGLang serves them (api_route(["GET", "POST"])); one operation id each.
    async def release_memory_occupation(req: MemoryReq | None = None) -> JSONResponse:
        return await _answer(
            engine.release_memory((req or MemoryReq()).tags),
            lambda _: {"message": f"Memory released ({engine.memory.describe()})."},
        )

    async def resume_memory_occupation(req: MemoryReq | None = None) -> JSONResponse:
        return await _answer(
            engine.resume_memory((req or MemoryReq()).tags),
            lambda _: {"message": f"Memory resumed ({engine.memory.describe()})."},
        )

    for path, fn in (
        ("/release_memory_occupation", release_memory_occupation),
        ("/resume_memory_occupation", resume_memory_occupation),
    ):
        name = path.strip("/")
        app.post(path, dependencies=admin, operation_id=name)(fn)
        app.get(path, dependencies=admin, operation_id=f"{name}_get")(fn)

    @app.post("/update_weights_from_tensor", dependencies=admin)
    async def update_weights_from_tensor(req: TensorUpdateReq) -> JSONResponse:
        version = _version(req.weight_version)

        async def update() -> int:
            handover = parse_handover(req.serialized_named_tensors, req.load_format)
            if req.abort_all_requests:
                await engine.abort_all("aborted for a weight update")
            return await engine.update_weights_from_tensor(
                handover, version, flush_cache=req.flush_cache
            )

        return await _answer(
            update(),
            lambda new: {"message": "Success", "weight_version": str(new)},
        )

    return app
