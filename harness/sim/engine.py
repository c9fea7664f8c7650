"""Simulated inference engines behind one router URL, answering SGLang's HTTP protocol.

`/generate` (input_ids, sampling_params.max_new_tokens, return_logprob), `/model_info` and
`/get_model_info`, `/pause_generation` (abort | retract | in_place) and `/continue_generation`,
the weight routes the trainer's `WeightSender` drives (`/begin_weight_update`,
`/init_weights_update_group`: this process joins the weight group as one rank for all its
engines, `/update_weights_from_distributed`: receives the broadcast, then charges the modelled
transfer of the real model size, `/end_weight_update`, `/destroy_weights_update_group`),
`/flush_cache`, `/health`, `/health_generate`. `/sim/stats` and `/sim/reset` are the bench's.

Each engine runs a continuous-batching scheduler in simulated time (`harness.sim.cost`): all
running requests advance one token per decode iteration, whose duration depends on the batch
and the context held; an admission stalls decoding for the part of its prompt its own prefix
cache (`harness.sim.prefix_cache`, sized from its memory) does not hold; admission waits for
`max_running` and the KV pool; a new weight version flushes the caches (as SGLang's weight
updates do). Between events progress is computed, not stepped, so one process simulates 64
engines. Routing (`--routing`) decides which engine, so which cache, a call meets: `affinity`
sends a call with an `X-SMG-Routing-Key` header to the engine its key first went to (anything
else to the least loaded), `least_loaded` and `round_robin` ignore the key.

    python -m harness.sim.engine --port 39010 --model DIR --engines 8 --time-scale 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import json
import os
import random
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from harness.sim.cost import Clock, EngineCost, Workload
from harness.sim.prefix_cache import SimulatedPrefixCache
from searchr1.redis_server import free_port
from searchr1.supervisor import ServiceProcess, ServiceSpec
from searchr1.weightsync.group import destroy_weight_group, dtype_from_name, new_weight_group

ROUTING_KEY_HEADER = "x-smg-routing-key"  # engine_client's header, as Starlette reads it
ROUTINGS = ("affinity", "least_loaded", "round_robin")
EPS = 1e-9


@dataclass(eq=False)
class Req:
    tokens: int
    context: int
    fut: asyncio.Future[tuple[int, str]]
    start_version: int = 0
    finish_v: float = 0.0
    prompt: Sequence[int] = ()  # token ids: what the prefix cache matches and keeps
    output: Sequence[int] = ()  # the ids it will return (kept in the cache when it finishes)
    cached: int = 0  # context tokens its admission took from the prefix cache


@dataclass
class EngineStats:
    busy_s: float = 0.0  # decoding or prefilling, not paused
    paused_s: float = 0.0
    batch_s: float = 0.0  # integral of the running batch over time
    tokens: int = 0  # generated and returned (aborted turns' tokens included)
    aborted_tokens: int = 0  # generated, then thrown away by an abort
    prefill_computed: int = 0
    prefill_cached: int = 0
    requests: int = 0  # admitted
    finished: int = 0  # returned (done or aborted)


class SimEngine:
    """One engine's continuous batching in simulated time (see the module docstring)."""

    def __init__(self, cost: EngineCost, clock: Clock) -> None:
        self.cost, self.clock = cost, clock
        unit = cost.token_unit
        size = cost.kv_tokens if cost.prefix_cache_tokens is None else cost.prefix_cache_tokens
        self.cache = SimulatedPrefixCache(size // unit)
        self.running: dict[int, Req] = {}
        self.heap: list[tuple[float, int]] = []
        self.waiting: deque[Req] = deque()
        self.v = 0.0  # tokens every running request has gained since the engine started
        self.kv = 0  # context tokens held by running requests
        self.stall_until = 0.0  # decoding waits for prefills (and KV recomputes) until then
        self.last = clock.now()
        self.paused = False
        self.version = 0
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._wake = asyncio.Event()

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    async def generate(
        self, tokens: int, context: int, prompt: Sequence[int] = (), output: Sequence[int] = ()
    ) -> tuple[int, str, int, int, int]:
        """(tokens generated, finish "done" | "abort", version at start, version at end,
        context tokens served from the prefix cache). `tokens` are real tokens (each generated
        id stands for `cost.token_unit` of them), `context` the prompt's ids (so a unit above 1
        fits single-call shapes); `prompt` and `output` are the ids the cache keeps."""
        req = Req(tokens, context, asyncio.get_running_loop().create_future(), prompt=prompt,
                  output=output)  # fmt: skip
        self.waiting.append(req)
        self._wake.set()
        n, how = await req.fut
        return n, how, req.start_version, self.version, req.cached

    def prefill(self, prompt: Sequence[int]) -> int:
        """Ids of `prompt` this engine's cache holds; the prompt is cached from then on (SGLang
        inserts a request's prefix once it is prefilled)."""
        if self.cost.prefix_cache_tokens is None:  # the pool's free part (running KV first)
            self.cache.capacity = max(self.cost.kv_tokens - self.kv, 0) // self.cost.token_unit
        hit = self.cache.match(prompt)
        self.cache.insert(prompt)
        return hit

    def flush(self) -> None:
        self.cache.clear()

    def _done(self, req: Req, n: int, how: str, prefilled: bool = True) -> None:
        self.stats.finished += 1
        if req.prompt and prefilled:
            self.cache.insert([*req.prompt, *req.output[: n // self.cost.token_unit]])
        if not req.fut.done():
            req.fut.set_result((n, how))

    def _advance(self, now: float) -> None:
        dt = now - self.last
        if dt <= 0:
            return
        s = self.stats
        if self.paused:
            s.paused_s += dt
        else:
            stalled = min(max(self.stall_until - self.last, 0.0), dt)
            if self.running or stalled > 0:
                s.busy_s += dt
            if self.running:
                s.batch_s += len(self.running) * dt
                step = self.cost.decode_step_s(len(self.running), self.kv)
                self.v += (dt - stalled) / step
        self.last = now

    def _finish_due(self) -> None:
        while self.heap and self.heap[0][0] <= self.v + 1e-6:
            _, rid = heapq.heappop(self.heap)
            req = self.running.pop(rid)
            self.kv -= req.context + req.tokens
            self.stats.tokens += req.tokens
            self._done(req, req.tokens, "done")

    def _admit(self, now: float) -> None:
        c = self.cost
        while self.waiting and len(self.running) < c.max_running:
            req = self.waiting[0]
            if self.running and self.kv + req.context + req.tokens > c.kv_tokens:
                break
            self.waiting.popleft()
            cached = min(self.prefill(req.prompt), req.context)
            req.cached = cached
            self.stats.prefill_cached += cached
            self.stats.prefill_computed += req.context - cached
            self.stats.requests += 1
            prefill_s = (req.context - cached) / c.prefill_tokens_per_s
            self.stall_until = max(self.stall_until, now) + prefill_s
            req.start_version = self.version
            req.finish_v = self.v + req.tokens
            rid = next(self._ids)
            self.running[rid] = req
            heapq.heappush(self.heap, (req.finish_v, rid))
            self.kv += req.context + req.tokens

    def _next_event_s(self, now: float) -> float | None:
        """Simulated seconds until the next request finishes (None: nothing to wait for)."""
        if self.paused or not self.running:
            return None
        step = self.cost.decode_step_s(len(self.running), self.kv)
        return max(self.stall_until - now, 0.0) + max(self.heap[0][0] - self.v, 0.0) * step

    async def run(self) -> None:
        while True:
            now = self.clock.now()
            self._advance(now)
            self._finish_due()
            if not self.paused:
                self._admit(now)
            wait = self._next_event_s(now)
            self._wake.clear()
            timeout = None if wait is None else max(self.clock.real_s(wait), 1e-4)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def pause(self, mode: str) -> None:
        self._advance(self.clock.now())
        if mode == "abort":
            for req in self.running.values():
                done = max(0, min(req.tokens, int(self.v - (req.finish_v - req.tokens))))
                self.stats.tokens += done
                self.stats.aborted_tokens += done
                self._done(req, done, "abort")
            for req in self.waiting:
                self._done(req, 0, "abort", prefilled=False)
            self.running.clear()
            self.waiting.clear()
            self.heap.clear()
            self.kv = 0
        self.paused = True
        self._wake.set()

    def resume(self, recompute: bool) -> None:
        now = self.clock.now()
        self._advance(now)
        self.paused = False
        if recompute and self.running:  # retract: the KV of running requests is rebuilt
            held = sum(r.context + self.v - (r.finish_v - r.tokens) for r in self.running.values())
            self.stall_until = max(self.stall_until, now) + held / self.cost.prefill_tokens_per_s
        self._wake.set()


@dataclass
class Cluster:
    engines: list[SimEngine]
    clock: Clock
    cost: EngineCost
    workload: Workload
    routing: str = "affinity"
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    keys: dict[str, int] = field(default_factory=dict)
    version: int = 0
    pending_version: int | None = None
    pause_mode: str | None = None
    groups: dict[str, Any] = field(default_factory=dict)
    push_s: float = 0.0  # simulated seconds charged for transfers
    _rr: itertools.cycle[int] = field(default_factory=lambda: itertools.cycle([0]))

    def route(self, key: str | None) -> SimEngine:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        key = key if self.routing == "affinity" else None
        if key is not None and key in self.keys:
            return self.engines[self.keys[key]]
        if self.routing == "round_robin":
            i = next(self._rr)
        else:
            i = min(range(len(self.engines)), key=lambda j: self.engines[j].load)
        if key is not None:
            self.keys[key] = i
        return self.engines[i]

    def set_version(self, version: int) -> None:
        if version != self.version:
            for e in self.engines:
                e.flush()  # the cached KV was computed by the old weights
        self.version = version
        for e in self.engines:
            e.version = version


def create_app(cluster: Cluster, model_path: str, vocab_size: int, filler: list[int],
               tails: dict[str, tuple[list[int], str]]) -> Starlette:  # fmt: skip
    info = {
        "model_path": model_path,
        "vocab_size": vocab_size,
        "context_length": 32768,
        "dtype": "float32",
    }

    async def generate(request: Request) -> Response:
        body = json.loads(await request.body())
        params = body.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens", 128))
        n, search, cut = cluster.workload.draw(cluster.rng, max_new)
        tail_ids, tail_text = tails["search" if search else "answer"]
        if not cut:
            n = max(n, len(tail_ids) + 1)
            if n > max_new:
                n, cut = max_new, True
        engine = cluster.route(request.headers.get(ROUTING_KEY_HEADER))
        prompt = body.get("input_ids") or []
        o = cluster.rng.randrange(len(filler) // 2)  # each sample's own text, as sampling gives
        out = filler[o : o + n] if cut else filler[o : o + n - len(tail_ids)] + tail_ids
        unit = cluster.cost.token_unit
        got, how, v0, v1, cached = await engine.generate(
            n * unit, len(prompt), prompt=prompt, output=out
        )
        got //= unit
        if how == "abort" or cut:
            ids, reason = out[:got], {"type": "abort" if how == "abort" else "length"}
        else:
            ids = out
            reason = {"type": "stop", "matched": "</search>" if search else "</answer>"}
        meta: dict[str, Any] = {
            "finish_reason": reason,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "cached_tokens": cached,
            "weight_version": str(v1),
        }
        if v0 != v1:
            meta["weight_versions"] = [{"version": str(v0)}, {"version": str(v1)}]
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.25, t, None] for t in ids]
        text = "" if cut or how == "abort" else tail_text
        return JSONResponse({"text": text, "output_ids": ids, "meta_info": meta})

    async def model_info(request: Request) -> Response:
        return JSONResponse({**info, "weight_version": str(cluster.version)})

    async def ok(request: Request) -> Response:
        return JSONResponse({"success": True, "message": "ok"})

    async def flush(request: Request) -> Response:
        for e in cluster.engines:
            e.flush()
        return JSONResponse({"success": True, "message": "ok"})

    async def pause(request: Request) -> Response:
        mode = (json.loads(await request.body() or b"{}") or {}).get("mode", "abort")
        cluster.pause_mode = mode
        for e in cluster.engines:
            e.pause(mode)
        return JSONResponse({"success": True, "message": "Generation paused."})

    async def resume(request: Request) -> Response:
        for e in cluster.engines:
            e.resume(recompute=cluster.pause_mode == "retract")
        cluster.pause_mode = None
        return JSONResponse({"success": True, "message": "Generation continued."})

    async def init_group(request: Request) -> Response:
        join = json.loads(await request.body())
        group = await asyncio.to_thread(
            new_weight_group,
            backend=join.get("backend", "gloo"),
            master_address=join["master_address"],
            master_port=int(join["master_port"]),
            world_size=int(join["world_size"]),
            rank=int(join["rank_offset"]),
            group_name=join["group_name"],
            timeout_s=120,
        )
        cluster.groups[join["group_name"]] = group
        return JSONResponse({"success": True, "message": "Succeeded to initialize group."})

    async def destroy_group(request: Request) -> Response:
        name = json.loads(await request.body()).get("group_name", "")
        group = cluster.groups.pop(name, None)
        if group is None:
            return JSONResponse({"success": False, "message": f"group {name} does not exist"}, 400)
        destroy_weight_group(group)
        return JSONResponse({"success": True, "message": "destroyed"})

    async def update_distributed(request: Request) -> Response:
        bucket = json.loads(await request.body())
        group = cluster.groups.get(bucket.get("group_name", ""))
        if group is None:
            return JSONResponse({"success": False, "message": "call init first"}, 400)
        tensors = [
            torch.empty(shape, dtype=dtype_from_name(d))
            for d, shape in zip(bucket["dtypes"], bucket["shapes"], strict=True)
        ]

        def receive() -> None:
            for t in tensors:
                torch.distributed.broadcast(t, src=0, group=group)

        await asyncio.to_thread(receive)
        if bucket.get("weight_version") is not None:
            # The real model's transfer, charged once per push (the trainer sends one tensor).
            cluster.push_s += cluster.cost.push_s()
            await asyncio.sleep(cluster.clock.real_s(cluster.cost.push_s()))
            cluster.pending_version = int(bucket["weight_version"])
        return JSONResponse({"success": True, "weight_version": str(cluster.version)})

    async def end_update(request: Request) -> Response:
        if cluster.pending_version is not None:
            cluster.set_version(cluster.pending_version)
            cluster.pending_version = None
        return JSONResponse({"success": True, "weight_version": str(cluster.version)})

    async def stats(request: Request) -> Response:
        now = cluster.clock.now()
        for e in cluster.engines:
            e._advance(now)
        return JSONResponse(
            {
                "now": now,
                "version": cluster.version,
                "push_s": cluster.push_s,
                "in_flight": sum(e.load for e in cluster.engines),
                "served": sum(e.stats.finished for e in cluster.engines),
                "engines": [asdict(e.stats) for e in cluster.engines],
            }
        )

    async def reset(request: Request) -> Response:
        for e in cluster.engines:
            e.stats = EngineStats()
            e.flush()
        cluster.set_version(0)
        cluster.push_s = 0.0
        cluster.keys.clear()
        return JSONResponse({"success": True})

    async def health(request: Request) -> Response:
        return Response("ok")

    return Starlette(
        routes=[
            Route("/generate", generate, methods=["POST"]),
            Route("/model_info", model_info),
            Route("/get_model_info", model_info),
            Route("/health", health),
            Route("/health_generate", health),
            Route("/flush_cache", flush, methods=["GET", "POST"]),
            Route("/pause_generation", pause, methods=["POST"]),
            Route("/continue_generation", resume, methods=["POST"]),
            Route("/begin_weight_update", ok, methods=["POST"]),
            Route("/end_weight_update", end_update, methods=["POST"]),
            Route("/init_weights_update_group", init_group, methods=["POST"]),
            Route("/destroy_weights_update_group", destroy_group, methods=["POST"]),
            Route("/update_weights_from_distributed", update_distributed, methods=["POST"]),
            Route("/sim/stats", stats),
            Route("/sim/reset", reset, methods=["POST"]),
        ]
    )


def build(args: argparse.Namespace) -> tuple[Cluster, Starlette]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    # Varied ids (a constant period would let the prefix cache match different outputs).
    filler_text = " ".join(f"step {i} checks fact {i * 7 % 101}." for i in range(2400))
    filler = tok(filler_text, add_special_tokens=False)["input_ids"]
    tails = {}
    for kind, text in (
        ("search", " </think>\n<search> who wrote the play hamlet </search>"),
        ("answer", " </think>\n<answer> Paris </answer>"),
    ):
        tails[kind] = (tok(text, add_special_tokens=False)["input_ids"], text)
    cost = EngineCost(**json.loads(args.cost or "{}"))
    workload = Workload(**json.loads(args.workload or "{}"))
    clock = Clock(args.time_scale)
    cluster = Cluster(
        [SimEngine(cost, clock) for _ in range(args.engines)],
        clock,
        cost,
        workload,
        routing=args.routing,
        rng=random.Random(args.seed),
        _rr=itertools.cycle(range(args.engines)),
    )
    return cluster, create_app(cluster, args.model, len(tok), filler, tails)


class SimEngineProcess(ServiceProcess):
    """This module's server as a child process on a free loopback port (`start()` returns once
    `/health` answers): `bench/prefix_routing.py --engine sim`."""

    def __init__(
        self, model_dir: str, *, engines: int = 1, cost: EngineCost | None = None,
        routing: str = "affinity", time_scale: float = 1.0, port: int | None = None,
    ) -> None:  # fmt: skip
        self.port = port or free_port()
        command = [
            sys.executable, "-m", "harness.sim.engine", "--port", str(self.port),
            "--model", str(model_dir), "--engines", str(engines), "--routing", routing,
            "--time-scale", str(time_scale), "--cost", json.dumps(asdict(cost or EngineCost())),
        ]  # fmt: skip
        root = str(Path(__file__).resolve().parents[2])  # this module's, from anywhere
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        spec = ServiceSpec("sim-engine", command, ready_url=f"{self.url}/health",
                           env={"OMP_NUM_THREADS": "1", "PYTHONPATH": path})  # fmt: skip
        super().__init__(spec)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True, help="tokenizer directory (reported as model_path)")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--routing", choices=ROUTINGS, default="affinity")
    p.add_argument("--cost", help="EngineCost fields as JSON (overrides)")
    p.add_argument("--workload", help="Workload fields as JSON (overrides)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cluster, app = build(args)

    async def serve() -> None:
        tasks = [asyncio.create_task(e.run()) for e in cluster.engines]
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=args.port,
            log_level="warning",
            backlog=8192,
            access_log=False,
            timeout_keep_alive=600,
        )
        try:
            await uvicorn.Server(config).serve()
        finally:
            for t in tasks:
                t.cancel()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
