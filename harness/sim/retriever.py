"""A simulated retriever answering Search-R1's `/retrieve` with our measured latency curve.

Each request waits a log-normal time whose median follows the concurrency it arrives at
(`harness.sim.cost.retriever_p50_s`: our retriever's measured p50 by concurrency, then
saturated), divided over `--replicas` servers, in simulated time (`--time-scale`); `--p50-ms`
fixes the median instead (a retriever that never saturates, for benches that load the
orchestrator, not the retriever). The documents are fixed Search-R1 rows. `/sim/stats`:
requests served and in flight, simulated seconds waited.

    python -m harness.sim.retriever --port 39011 --time-scale 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from harness.sim.cost import RETRIEVER_SIGMA, Clock, retriever_p50_s

# A 100-word Wikipedia passage is ~130 Qwen2.5 tokens; the bench's tiny tokenizer splits text
# ~2.8x finer (docs/benchmarks.md, orchestrator at scale), so this passage stands for one such
# passage in its tokens: 3 of them make a ~420-token observation, as with Qwen's tokenizer.
DOC_TEXT = "Hamlet is a tragedy written by William Shakespeare around 1600. " * 3


def create_app(
    clock: Clock, replicas: int, seed: int = 0, p50_ms: float | None = None
) -> Starlette:
    rng = random.Random(seed)
    state = {"active": 0, "served": 0, "latency_s": 0.0}
    docs: dict[int, list[dict[str, Any]]] = {}

    def hits(topk: int, scores: bool) -> list[dict[str, Any]]:
        if topk not in docs:
            docs[topk] = [
                {"id": str(i), "contents": f'"Hamlet {i}"\n{DOC_TEXT}'} for i in range(topk)
            ]
        rows = docs[topk]
        return [{"document": d, "score": 0.5} for d in rows] if scores else rows

    async def retrieve(request: Request) -> Response:
        req = json.loads(await request.body())
        state["active"] += 1
        try:
            p50 = p50_ms / 1000 if p50_ms else retriever_p50_s(state["active"] / replicas)
            sim_s = p50 * math.exp(rng.gauss(0.0, RETRIEVER_SIGMA))
            state["latency_s"] += sim_s
            await asyncio.sleep(clock.real_s(sim_s))
        finally:
            state["active"] -= 1
            state["served"] += 1
        topk = int(req.get("topk") or 3)
        found = hits(topk, bool(req.get("return_scores")))
        return JSONResponse({"result": [found for _ in req["queries"]]})

    async def health(request: Request) -> Response:
        return Response("ok")

    async def stats(request: Request) -> Response:
        return JSONResponse(state)

    async def reset(request: Request) -> Response:
        state.update(served=0, latency_s=0.0)
        return JSONResponse({"success": True})

    return Starlette(
        routes=[
            Route("/retrieve", retrieve, methods=["POST"]),
            Route("/health", health),
            Route("/ready", health),
            Route("/sim/stats", stats),
            Route("/sim/reset", reset, methods=["POST"]),
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--p50-ms", type=float, help="a fixed median (default: the measured curve)")
    args = p.parse_args()
    app = create_app(Clock(args.time_scale), args.replicas, p50_ms=args.p50_ms)
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        backlog=8192,
        access_log=False,
        timeout_keep_alive=600,
    )


if __name__ == "__main__":
    main()
