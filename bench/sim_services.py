"""Simulated engine and retriever for `bench/orchestrator_scale.py`: separate processes that
answer the real HTTP protocols (SGLang's `/generate` + `/model_info`, Search-R1's `/retrieve`)
with latency models, so an orchestrator can be driven at cluster rates without GPUs.

Engine: every request decodes `--turn-tokens` tokens at min(`--decode-tok-s`,
`--engine-tok-s` / active requests) tokens per second (the rate at admission: a request does not
speed up when others leave); `--engines N` models N such engines behind a round-robin router in
one process. A turn searches with probability `--p-search`, else answers. Retriever: a
log-normal latency (median `--median-ms`, sigma 0.5), Search-R1 documents. `/stats` on both:
requests served and in flight (the bench samples them).

    python -m bench.sim_services engine --port 31000 --model DIR
    python -m bench.sim_services retriever --port 31001
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

FILLER = (
    "Let me think about what the question asks and which facts I need before answering it. " * 64
)


class Stats:
    def __init__(self) -> None:
        self.served = 0
        self.active = 0
        self.peak = 0

    def enter(self) -> None:
        self.active += 1
        self.peak = max(self.peak, self.active)

    def leave(self) -> None:
        self.active -= 1
        self.served += 1


def engine_app(args: argparse.Namespace) -> Starlette:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    stats = Stats()
    per_engine = [0] * args.engines
    rr = itertools.cycle(range(args.engines))

    def body(text_tail: str, stop: str) -> bytes:
        """The response of a turn, serialised once (the simulator must not be the bottleneck)."""
        tail = tok(text_tail, add_special_tokens=False)["input_ids"]
        head = tok(FILLER, add_special_tokens=False)["input_ids"][: args.turn_tokens - len(tail)]
        ids = head + tail
        return json.dumps(
            {
                "text": tok.decode(ids),
                "output_ids": ids,
                "meta_info": {
                    "finish_reason": {"type": "stop", "matched": stop},
                    "prompt_tokens": 0,
                    "completion_tokens": len(ids),
                    "weight_version": "0",
                    "output_token_logprobs": [[-0.25, t, None] for t in ids],
                },
            }
        ).encode()

    search = body(" </think>\n<search> who wrote the play hamlet </search>", "</search>")
    answer = body(" </think>\n<answer> Paris </answer>", "</answer>")
    info = {
        "model_path": args.model,
        "weight_version": "0",
        "vocab_size": len(tok),
        "context_length": 32768,
    }

    async def generate(request: Request) -> Response:
        await request.body()  # read (and pay for) the token-id context like a real server
        engine = next(rr)
        per_engine[engine] += 1
        stats.enter()
        try:
            rate = min(args.decode_tok_s, args.engine_tok_s / per_engine[engine])
            await asyncio.sleep(args.turn_tokens / rate)
        finally:
            per_engine[engine] -= 1
            stats.leave()
        out = search if random.random() < args.p_search else answer
        return Response(out, media_type="application/json")

    async def model_info(request: Request) -> Response:
        return JSONResponse(info)

    async def health(request: Request) -> Response:
        return Response("ok")

    async def stats_route(request: Request) -> Response:
        return JSONResponse(vars(stats))

    return Starlette(
        routes=[
            Route("/generate", generate, methods=["POST"]),
            Route("/model_info", model_info),
            Route("/get_model_info", model_info),
            Route("/health", health),
            Route("/health_generate", health),
            Route("/stats", stats_route),
        ]
    )


def retriever_app(args: argparse.Namespace) -> Starlette:
    stats = Stats()

    def docs(topk: int) -> list[dict[str, Any]]:
        text = "Hamlet is a tragedy written by William Shakespeare around 1600. " * 8
        return [
            {"document": {"id": str(i), "contents": f'"Hamlet {i}"\n{text}'}, "score": 0.5}
            for i in range(topk)
        ]

    cached: dict[int, list[dict[str, Any]]] = {}

    async def retrieve(request: Request) -> Response:
        req = json.loads(await request.body())
        stats.enter()
        try:
            await asyncio.sleep(random.lognormvariate(0.0, 0.5) * args.median_ms / 1000)
        finally:
            stats.leave()
        topk = int(req.get("topk") or 3)
        hits = cached.setdefault(topk, docs(topk))
        return JSONResponse({"result": [hits for _ in req["queries"]]})

    async def health(request: Request) -> Response:
        return Response("ok")

    async def stats_route(request: Request) -> Response:
        return JSONResponse(vars(stats))

    return Starlette(
        routes=[
            Route("/retrieve", retrieve, methods=["POST"]),
            Route("/health", health),
            Route("/ready", health),
            Route("/stats", stats_route),
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["engine", "retriever"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", help="engine: tokenizer directory (reported as model_path)")
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--decode-tok-s", type=float, default=50.0)
    p.add_argument("--engine-tok-s", type=float, default=20000.0)
    p.add_argument("--turn-tokens", type=int, default=200)
    p.add_argument("--p-search", type=float, default=0.6)
    p.add_argument("--median-ms", type=float, default=25.0)
    args = p.parse_args()
    app = engine_app(args) if args.kind == "engine" else retriever_app(args)
    # Thousands of concurrent keep-alive connections from one orchestrator.
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        backlog=8192,
        access_log=False,
        timeout_keep_alive=600,  # a client keeps its connections between turns
    )


if __name__ == "__main__":
    main()
