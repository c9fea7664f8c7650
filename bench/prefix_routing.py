"""Prefix-cache hit rate and turn latency of multi-turn traffic, by how calls are routed.

    python -m bench.prefix_routing [--engine torch|sglang|sim] [--engines 2] [--groups 8]
        [--group-size 5] [--turns 4] [--prompt-tokens 256] [--observation-tokens 300]
        [--max-new-tokens 48] [--routes pool,pool-none,manual,round_robin,cache_aware]

Search-R1-shaped traffic (`harness.multiturn`: groups sharing a prompt, each sample's turns on
its whole conversation, an "observation" appended after each turn) against `--engines` real
engine processes (our reference engine with its prefix cache, real SGLang 0.5.21 with its radix
cache, or the simulated engine of `bench/pipeline.py`, `harness.sim`, with its LRU prefix cache:
the check that the simulator's caches answer routing as the real engines do), routed:
- `pool`: the orchestrator's EnginePool (engines.urls, no router), keyed by group;
- `pool-none`: the same pool without a key (least-loaded per call);
- `manual`, `round_robin`, `cache_aware`: a real sglang-router with that policy (manual: with
  `--assignment-mode min_load` and our client's X-SMG-Routing-Key, keyed by group), the
  interpreter with sglang-router given by `--router-python` (default: `.venv-sglang`'s, which
  `python3 dev.py sglang` builds).
Per route: the share of the cacheable prefix the engines served from cache (first turns: the
group's shared prompt; later turns: the sample's previous call), median turn latency, wall
time. With `--engine torch` or `sim`, one engine with vs without its cache (`single`) first:
prefill tokens computed per sample and the turn latency. Engines keep their caches between routes;
each route draws its own token ids, so no route hits another's entries.

The last line is key=value pairs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import tempfile
from pathlib import Path

import httpx

from engine_client.client import InferenceClient
from engine_client.pool import EnginePool
from harness.inference_server import InferenceServerProcess, RouterProcess
from harness.multiturn import PrefixStats, drive
from harness.sim.cost import EngineCost
from harness.sim.engine import SimEngineProcess
from inference.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
CACHE_TOKENS = "SEARCHR1_INFERENCE__TORCH_ENGINE__PREFIX_CACHE_TOKENS"
ROUTER_POLICY = {"manual": "manual", "round_robin": "round_robin", "cache_aware": "cache_aware"}


def computed_prefill_tokens(url: str, engine: str) -> float:
    if engine == "sim":
        stats = httpx.get(f"{url}/sim/stats").json()
        return float(sum(e["prefill_computed"] for e in stats["engines"]))
    text = httpx.get(f"{url}/metrics").text
    match = re.search(r'searchr1_inference_prefill_tokens_total\{source="computed"\} (\S+)', text)
    return float(match.group(1)) if match else 0.0


async def run_route(
    route: str, urls: list[str], args: argparse.Namespace, seed: int
) -> PrefixStats:
    router = None
    if route.startswith("pool"):
        pool = EnginePool(urls, lambda url: InferenceClient(url, timeout_s=600))
        generate, close = pool.generate, pool.aclose
    else:
        router = RouterProcess(urls, python=args.router_python, policy=ROUTER_POLICY[route])
        router.start()
        client = InferenceClient(router.url, timeout_s=600)
        generate, close = client.generate, client.aclose
    key = "none" if route in ("pool-none", "round_robin", "cache_aware") else "group"
    try:
        return await drive(
            generate,
            groups=args.groups,
            group_size=args.group_size,
            turns=args.turns,
            prompt_tokens=args.prompt_tokens,
            observation_tokens=args.observation_tokens,
            max_new_tokens=args.max_new_tokens,
            vocab=(10, 2000),
            key=key,  # type: ignore[arg-type]
            concurrency=args.concurrency,
            seed=seed,
        )
    finally:
        await close()
        if router is not None:
            router.stop()


def engine(
    model: Path, args: argparse.Namespace, cache: bool
) -> InferenceServerProcess | SimEngineProcess:
    if args.engine == "sim":
        cost = EngineCost(prefix_cache_tokens=args.cache_tokens if cache else 0)
        return SimEngineProcess(str(model), cost=cost)
    if args.engine == "sglang":
        return InferenceServerProcess(
            model, engine="sglang", sglang_python=args.router_python, ready_timeout_s=300
        )
    return InferenceServerProcess(model, env={CACHE_TOKENS: str(args.cache_tokens if cache else 0)})


def single(model: Path, args: argparse.Namespace) -> dict[str, float]:
    """One engine with vs without its cache: prefill computed per sample, turn latency."""
    out: dict[str, float] = {}
    samples = args.groups * args.group_size
    for cache in (False, True):
        with engine(model, args, cache) as server:
            stats = asyncio.run(run_route("pool", [server.url], args, seed=1))
            name = "on" if cache else "off"
            out[f"single_{name}_prefill_per_sample"] = round(
                computed_prefill_tokens(server.url, args.engine) / samples
            )
            out[f"single_{name}_turn_ms_later"] = round(1000 * stats.median_latency_s("later"), 1)
            out[f"single_{name}_wall_s"] = round(stats.wall_s, 2)
            print(f"single engine, cache {name}: {stats.pairs()}", flush=True)
    out["single_prefill_saved"] = round(
        1 - out["single_on_prefill_per_sample"] / max(out["single_off_prefill_per_sample"], 1), 3
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", choices=["torch", "sglang", "sim"], default="torch")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=5)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--observation-tokens", type=int, default=300)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=40)
    ap.add_argument("--cache-tokens", type=int, default=65536)
    ap.add_argument("--routes", default="pool,pool-none,manual,round_robin,cache_aware")
    ap.add_argument("--router-python", default=str(ROOT / ".venv-sglang" / "bin" / "python"))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the engines' (children inherit it)
    routes = [r for r in args.routes.split(",") if r]
    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="bench-prefix-")))
    result: dict[str, float | str] = {"engine": args.engine, "engines": args.engines}
    if args.engine in ("torch", "sim"):
        result |= single(model, args)
    servers = [engine(model, args, cache=True) for _ in range(args.engines)]
    try:
        for server in servers:
            server.start()
        urls = [s.url for s in servers]
        for seed, route in enumerate(routes, start=2):
            stats = asyncio.run(run_route(route, urls, args, seed))
            print(f"{route}: {stats.pairs()}", flush=True)
            result |= stats.pairs(prefix=f"{route.replace('-', '_')}_")
    finally:
        for server in servers:
            server.stop()
    print(" ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
