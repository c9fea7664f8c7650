"""Async client of SGLang's native HTTP API (a real SGLang, sglang-router, or our engine).

Connection pooling via one `httpx.AsyncClient`, or (`http_backend="aiohttp"`, what the
orchestrator uses) one aiohttp pool called directly (`searchr1.json_http`); retries with
exponential backoff on connection errors, timeouts and 5xx only (never on 4xx: a bad request
stays bad). Weight versions are
strings on the wire (SGLang's "default" before any update counts as 0) and ints here.

Where SGLang crashes on input instead of rejecting it (an out-of-vocabulary token id kills the
whole SGLang 0.5.21 server), the client refuses to send it: set `vocab_size` (the orchestrator
does, from its tokenizer) and such a request fails here with `InferenceBadRequest`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx
from prometheus_client import Counter

from searchr1.json_http import (
    AiohttpJson,
    HttpxJson,
    JsonTransport,
    Reply,
    dumps,
    httpx_client,
)
from searchr1.weightsync.protocol import Bucket, EngineRefused, GroupJoin

log = logging.getLogger(__name__)

CLIENT_RETRIES = Counter(
    "searchr1_inference_client_retries_total", "Retried inference calls", ["path"]
)
CLIENT_FAILURES = Counter(
    "searchr1_inference_client_failures_total", "Failed inference calls", ["path", "kind"]
)


# sglang-router's sticky-session key (its `manual` policy; SGLang's own servers ignore it).
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


class Generator(Protocol):
    """What a caller that only generates needs of an engine (the rollout, the gateway);
    `InferenceClient` and `EnginePool` implement it, test engines too."""

    async def generate(self, input_ids: list[int], **kwargs: Any) -> Any: ...


class InferenceError(Exception):
    """Any failure of an inference call."""


class InferenceUnavailable(InferenceError):
    """Connection error, timeout or 5xx, after the client's own retries."""


# Also an `EngineRefused`: the weight sender (in the floor, which cannot import this module)
# recognises an engine's refusal by that base class.
class InferenceBadRequest(InferenceError, EngineRefused):
    """A 4xx answer (never retried); `status` is the HTTP status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class InferencePartialFailure(InferenceBadRequest):
    """A 2xx that says some servers failed: sglang-router answers an admin call that a worker
    refused with `206 {"status": "partial_success", "message": "... 0 succeeded, 2 failed"}`.
    Never retried (the call may have done part of its work); `status` is the HTTP status."""


@dataclass
class GenerateResult:
    text: str
    output_ids: list[int]
    logprobs: list[float] | None  # one per output id, when return_logprob
    finish_reason: str  # "stop" | "length" | "abort"
    matched_stop: str | int | None
    prompt_tokens: int
    completion_tokens: int
    weight_version: int  # the weights of the last token
    start_weight_version: int  # the weights of the first token (differs if an update landed)
    cached_tokens: int = 0  # prompt tokens the engine served from its prefix cache


def parse_weight_version(value: Any) -> int:
    """SGLang reports a string ("default" until someone sets one); we count from 0."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def parse_start_version(meta: dict[str, Any]) -> int:
    """SGLang lists `weight_versions` spans over the output ([{version, start, end}, ...]);
    the first span's version made the first token. Without spans, the request ran on one."""
    spans = meta.get("weight_versions")
    if isinstance(spans, list) and spans and isinstance(spans[0], dict):
        return parse_weight_version(spans[0].get("version"))
    return parse_weight_version(meta.get("weight_version"))


def parse_generate(body: dict[str, Any], return_logprob: bool) -> GenerateResult:
    meta = body.get("meta_info") or {}
    reason = meta.get("finish_reason") or {}
    if not isinstance(reason, dict):  # SGLang: null while running; a string in old releases
        reason = {"type": str(reason)} if reason else {}
    output_ids = [int(t) for t in body.get("output_ids") or []]
    logprobs = None
    if return_logprob:
        triples = meta.get("output_token_logprobs") or []
        logprobs = [float(t[0]) if t[0] is not None else float("nan") for t in triples]
    return GenerateResult(
        text=body.get("text", ""),
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=str(reason.get("type", "abort")),
        matched_stop=reason.get("matched"),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
        weight_version=parse_weight_version(meta.get("weight_version")),
        start_weight_version=parse_start_version(meta),
        cached_tokens=int(meta.get("cached_tokens") or 0),
    )


def _partial_failure(path: str, resp: Reply) -> InferencePartialFailure | None:
    """The error a 2xx answer carries, when it signals partial success (206/207, or a body
    whose `status` is `partial_success`); None for a plain success."""
    if resp.status == 200 and b"partial_success" not in resp.content:
        return None  # the hot path: no body parsed twice
    try:
        body = resp.json()
    except ValueError:
        body = None
    partial = isinstance(body, dict) and body.get("status") == "partial_success"
    if not partial and resp.status not in (206, 207):
        return None
    message = _error_message(resp)
    failed = body.get("failed") if isinstance(body, dict) else None
    if isinstance(failed, list) and failed:
        message += " (" + "; ".join(_describe_failure(f) for f in failed[:8]) + ")"
    return InferencePartialFailure(f"{path}: HTTP {resp.status}: {message}", resp.status)


def _describe_failure(item: Any) -> str:
    if isinstance(item, dict):
        return f"{item.get('worker', '?')}: {item.get('error', item)}"
    return str(item)


def _error_message(resp: Reply) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500] or resp.reason
    if isinstance(body, dict):
        for key in ("detail", "error", "message"):
            val = body.get(key)
            if isinstance(val, dict):
                val = val.get("message", val)
            if val:
                return str(val)
    return str(body)[:500]


class InferenceClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        token: str | None = None,
        max_connections: int = 256,
        backoff_s: float = 0.2,
        vocab_size: int | None = None,
        deadline_s: float | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        http_backend: Literal["httpx", "aiohttp"] = "httpx",
    ) -> None:
        self.vocab_size = vocab_size  # when set, token ids outside [0, vocab_size) never leave
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s  # a call's total time with its retries (None: no bound)
        self._model_info_path = "/model_info"
        self._token = token
        self._is_router: bool | None = None  # sglang-router (None: not asked yet)
        self._workers: dict[str, InferenceClient] = {}  # a router's workers, asked directly
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._http: JsonTransport
        if http_backend == "aiohttp":
            self._http = AiohttpJson(
                self.base_url, max_connections=max_connections, headers=headers
            )
        else:
            self._http = HttpxJson(
                httpx_client(
                    self.base_url,
                    headers=headers,
                    max_connections=max_connections,
                    transport=transport,  # tests: a flaky fake server; None: real connections
                )
            )

    async def _request(
        self,
        method: str,
        path: str,
        json: Any = None,
        *,
        retries: int | None = None,
        deadline_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One call with its retries, all within `deadline_s` (default: the client's) when set:
        no attempt outlives it and no retry starts past it."""
        attempts = 1 + (self.max_retries if retries is None else retries)
        budget = deadline_s if deadline_s is not None else self.deadline_s
        loop = asyncio.get_running_loop()
        deadline = None if budget is None else loop.time() + budget
        last: Exception | None = None
        out_of_time = False  # the deadline, not the retry count, ended the attempts
        body = None if json is None else dumps(json)
        for attempt in range(attempts):
            if attempt:
                CLIENT_RETRIES.labels(path).inc()
                delay = self.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random())
                if deadline is not None and loop.time() + delay >= deadline:
                    out_of_time = True
                    break
                await asyncio.sleep(delay)
            timeout_s, connect_s = self.timeout_s, min(10.0, self.timeout_s)
            if deadline is not None:
                left = deadline - loop.time()
                if left <= 0:
                    out_of_time = True
                    break
                timeout_s, connect_s = min(left, self.timeout_s), min(10.0, left)
            try:
                resp = await self._http.request(
                    method, path, body, timeout_s=timeout_s, connect_s=connect_s, headers=headers
                )
            except (httpx.TransportError, httpx.TimeoutException) as e:
                # A timed-out request's connection is closed: our engine aborts its work.
                last = e
                continue
            if resp.status >= 500:
                last = InferenceUnavailable(f"{path}: HTTP {resp.status}: {_error_message(resp)}")
                continue
            if resp.status >= 400:
                CLIENT_FAILURES.labels(path, "bad_request").inc()
                raise InferenceBadRequest(
                    f"{path}: HTTP {resp.status}: {_error_message(resp)}", resp.status
                )
            partial = _partial_failure(path, resp)
            if partial is not None:
                CLIENT_FAILURES.labels(path, "partial").inc()
                log.warning(
                    "partial success is failure", extra={"path": path, "error": str(partial)}
                )
                raise partial
            try:
                return resp.json()
            except ValueError:
                return resp.text
        CLIENT_FAILURES.labels(path, "unavailable").inc()
        log.warning("inference call failed", extra={"path": path, "error": str(last)})
        # The last attempt may itself have timed out at the deadline, with retries left.
        if out_of_time or (deadline is not None and loop.time() >= deadline - self.backoff_s):
            raise InferenceUnavailable(
                f"{path}: no answer within the call's deadline of {budget}s "
                f"(last: {type(last).__name__}: {last})"
            ) from last
        if isinstance(last, InferenceUnavailable):
            raise last
        raise InferenceUnavailable(f"{path}: {type(last).__name__}: {last}") from last

    async def generate(
        self,
        input_ids: list[int],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        no_stop_trim: bool = True,
        return_logprob: bool = True,
        seed: int | None = None,
        deadline_s: float | None = None,
        routing_key: str | None = None,
    ) -> GenerateResult:
        """One `/generate` call. `routing_key` keeps the calls that share it on one engine
        behind sglang-router's `manual` policy (the `X-SMG-Routing-Key` header; engines ignore
        it) and in `EnginePool`: the turns of a sample, or the samples of a group, meet the
        prefix cache that their earlier calls filled."""
        params: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "no_stop_trim": no_stop_trim,
        }
        if stop:
            params["stop"] = list(stop)
        if stop_token_ids:
            params["stop_token_ids"] = list(stop_token_ids)
        if seed is not None:
            params["sampling_seed"] = seed  # SGLang's name for the per-request seed
        self._check_ids(input_ids, "input_ids")
        self._check_ids(stop_token_ids or [], "stop_token_ids")
        body = {"input_ids": input_ids, "sampling_params": params}
        body["return_logprob"] = return_logprob
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        data = await self._request(
            "POST", "/generate", body, deadline_s=deadline_s, headers=headers
        )
        return parse_generate(data, return_logprob)

    def _check_ids(self, ids: list[int], field: str) -> None:
        if self.vocab_size is None or not ids or (min(ids) >= 0 and max(ids) < self.vocab_size):
            return  # min/max run in C: the whole context is checked on every turn
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            CLIENT_FAILURES.labels("/generate", "bad_request").inc()
            raise InferenceBadRequest(
                f"/generate: {field}: token ids outside the vocabulary [0, {self.vocab_size}): "
                f"{bad[:5]} (not sent: SGLang crashes on them)",
                422,
            )

    async def get_model_info(self) -> dict[str, Any]:
        """`/model_info` (SGLang 0.5.21 logs a deprecation warning for every `/get_model_info`,
        which the orchestrator polls); servers without it get the old route.

        Behind sglang-router the version is the OLDEST among its healthy workers, each asked
        directly: the router answers `/get_model_info` from one worker, which may be ahead of
        the others (after a restart, during a push); `workers_answered` says how many."""
        workers = await self.router_workers()
        if workers:
            return await self._workers_model_info(workers)
        try:
            data = await self._request("GET", self._model_info_path)
        except InferenceBadRequest as e:
            if e.status != 404 or self._model_info_path == "/get_model_info":
                raise
            self._model_info_path = "/get_model_info"
            data = await self._request("GET", self._model_info_path)
        info = dict(data)
        info["weight_version"] = parse_weight_version(info.get("weight_version"))
        return info

    async def router_workers(self) -> list[str]:
        """The healthy workers' URLs when this URL is sglang-router (its `GET /workers`); [] for
        an engine (asked once: an engine never turns into a router)."""
        if self._is_router is False:
            return []
        try:
            body = await self._request("GET", "/workers", retries=0)
        except InferenceBadRequest as e:
            if e.status not in (401, 403, 404, 405):
                raise
            body = None
        listed = body.get("workers") if isinstance(body, dict) else None
        self._is_router = isinstance(listed, list)
        if not isinstance(listed, list):
            return []
        urls = [
            str(w["url"]).rstrip("/")
            for w in listed
            if isinstance(w, dict) and w.get("url") and w.get("is_healthy", True)
        ]
        if not urls:
            raise InferenceUnavailable(f"{self.base_url}: the router lists no healthy worker")
        return urls

    async def _workers_model_info(self, urls: list[str]) -> dict[str, Any]:
        workers = self._workers
        for url in urls:
            if url not in workers:
                workers[url] = InferenceClient(
                    url,
                    timeout_s=self.timeout_s,
                    max_retries=self.max_retries,
                    token=self._token,
                    backoff_s=self.backoff_s,
                    deadline_s=self.deadline_s,
                )
        try:
            infos = await asyncio.gather(*(workers[u].get_model_info() for u in urls))
        except InferenceError as e:
            # A worker we cannot ask may serve older weights than the others: no answer beats
            # a wrong one (list the engines in engines.urls if they are remote).
            raise InferenceUnavailable(
                f"{self.base_url} is sglang-router; asking its worker failed: {e}"
            ) from e
        info = dict(infos[0])
        info["weight_version"] = min(i["weight_version"] for i in infos)
        info["workers_answered"] = len(infos)
        return info

    async def health(self, deadline_s: float) -> bool:
        """`/health` answered within `deadline_s` (one attempt): the process is not frozen."""
        try:
            await self._request("GET", "/health", retries=0, deadline_s=deadline_s)
        except InferenceError:
            return False
        return True

    async def health_generate(self) -> bool:
        try:
            await self._request("GET", "/health_generate", retries=0)
        except InferenceError:
            return False
        return True

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache")

    async def pause_generation(self, mode: str = "abort") -> None:
        """Pause the scheduler. SGLang's modes: abort (default) | in_place | retract."""
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def update_weights_from_disk(self, model_path: str, version: int | None = None) -> int:
        """Load a checkpoint directory as weight `version` (default: current + 1); returns it."""
        new = version
        if new is None:
            new = (await self.get_model_info())["weight_version"] + 1
        # Not retried: a timed-out update may still be running on the server.
        data = await self._request(
            "POST",
            "/update_weights_from_disk",
            {"model_path": model_path, "weight_version": str(new)},
            retries=0,
        )
        self._check_success("/update_weights_from_disk", data)
        return new

    async def begin_weight_update(self) -> bool:
        """Open a weight-update session (SGLang >= 0.5.21 requires one around distributed
        updates). False when the server has no such route (older SGLang: no session)."""
        try:
            data = await self._request("POST", "/begin_weight_update", {}, retries=0)
        except InferenceBadRequest as e:
            if e.status in (404, 405):
                return False
            raise
        self._check_success("/begin_weight_update", data)
        return True

    async def end_weight_update(self) -> None:
        """Close the session: the updates received in it become the served weights."""
        data = await self._request("POST", "/end_weight_update", {}, retries=0)
        self._check_success("/end_weight_update", data)

    async def destroy_weights_update_group(self, group_name: str) -> bool:
        """Ask the engine to free a weight group (SGLang's route). False when it has no such
        group, or no such route (then nothing can be freed from outside)."""
        try:
            data = await self._request(
                "POST", "/destroy_weights_update_group", {"group_name": group_name}, retries=0
            )
        except InferenceBadRequest as e:
            if e.status in (404, 405) or "does not exist" in str(e):
                return False
            raise
        return not (isinstance(data, dict) and data.get("success") is False)

    async def init_weights_update_group(self, join: GroupJoin) -> None:
        data = await self._request(
            "POST", "/init_weights_update_group", join.model_dump(), retries=0
        )
        self._check_success("/init_weights_update_group", data)

    async def update_weights_from_distributed(self, bucket: Bucket) -> None:
        body = bucket.model_dump(exclude_none=True, exclude={"abort_all_requests"})
        data = await self._request("POST", "/update_weights_from_distributed", body, retries=0)
        self._check_success("/update_weights_from_distributed", data)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the engine's memory (`kv_cache`, `weights`, `cuda_graph`; none: all)."""
        data = await self._request("POST", "/release_memory_occupation", {"tags": tags}, retries=0)
        self._check_success("/release_memory_occupation", data)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Take the released memory back; resumed weights need a weight update after it
        (unless the engine keeps a CPU backup)."""
        data = await self._request("POST", "/resume_memory_occupation", {"tags": tags}, retries=0)
        self._check_success("/resume_memory_occupation", data)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> None:
        """One bucket handed over in memory (`searchr1.weightsync.handover`)."""
        body: dict[str, Any] = {
            "serialized_named_tensors": serialized_named_tensors,
            "flush_cache": flush_cache,
        }
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = weight_version
        data = await self._request("POST", "/update_weights_from_tensor", body, retries=0)
        self._check_success("/update_weights_from_tensor", data)

    @staticmethod
    def _check_success(path: str, data: Any) -> None:
        if isinstance(data, dict) and data.get("success") is False:
            raise InferenceBadRequest(f"{path}: {data.get('message')}")

    async def aclose(self) -> None:
        await self._http.aclose()
        for worker in self._workers.values():
            await worker.aclose()

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
