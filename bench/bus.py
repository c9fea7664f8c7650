"""Trajectory bus throughput vs raw Redis streams on the same server.

    python bench/bus.py [--n 10000] [--tokens 2048] [--batch 64] [--fsync always|everysec|no]
    python bench/bus.py --hold --n 2560 --tokens 8192   # Redis memory of an unacked window

Publishes and consumes N trajectories of `--tokens` response tokens through `TrajectoryBus`
(validation, protobuf, Lua back-pressure check, dedup, ack+delete), with producer and consumer
running concurrently. Then, against the same redis-server, the ceiling: raw XADD pipelines and
XREADGROUP of opaque payloads of the same byte sizes (no validation, no ack). Prints both
rates and their ratio; the last line is key=value pairs.

`--hold` measures what the trainer's unacked checkpoint window costs Redis instead: N
trajectories published and consumed but not acked (as a trainer holds them until its next
checkpoint), then Redis's `used_memory` and AOF size per trajectory, and the publish and
consume rates; then everything is acked and the memory read again.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis.asyncio as aioredis

from protos.trajectory import SCHEMA_VERSION, Trajectory
from searchr1.bus import TrajectoryBus
from searchr1.redis_server import RedisServer
from searchr1.sections import BusConfig


def build(n: int, tokens: int, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    mask = [0 if (i // 256) % 4 == 1 else 1 for i in range(tokens)]  # 25% observation spans
    logprobs = [-rng.random() * 3 if m else 0.0 for m in mask]
    out = []
    for i in range(n):
        t = Trajectory(
            schema_version=SCHEMA_VERSION,
            trajectory_id=f"bench-{i}",
            group_id=f"g-{i // 8}",
            sample_index=i % 8,
            group_size=8,
            data_source="nq",
            prompt_token_ids=[rng.randrange(151_000) for _ in range(256)],
            response_token_ids=[rng.randrange(151_000) for _ in range(tokens)],
            loss_mask=bytes(mask),
            rollout_logprobs=logprobs,
            has_rollout_logprobs=True,
            weight_version=3,
        )
        t.reward.total = float(i % 2)
        t.reward.components["em"] = float(i % 2)
        out.append(t)
    return out


async def run_bus(url: str, trajs: list[Trajectory], batch: int) -> float:
    cfg = BusConfig(stream="bench:bus", consumer="bench-consumer", max_backlog=4096)
    producer, consumer = TrajectoryBus.from_url(url, cfg), TrajectoryBus.from_url(url, cfg)
    await producer.ensure_group()

    async def produce() -> None:
        for i in range(0, len(trajs), batch):
            await producer.publish(trajs[i : i + batch])

    async def consume() -> None:
        seen = 0
        while seen < len(trajs):
            got = await consumer.consume(batch, block=1.0)
            await consumer.ack(got)
            seen += len(got)

    start = time.perf_counter()
    await asyncio.gather(produce(), consume())
    elapsed = time.perf_counter() - start
    await producer.close()
    await consumer.close()
    return elapsed


async def run_raw(url: str, payloads: list[bytes], batch: int) -> float:
    stream, group = "bench:raw", "raw"
    prod, cons = aioredis.Redis.from_url(url), aioredis.Redis.from_url(url)
    await prod.xgroup_create(stream, group, id="0", mkstream=True)

    async def produce() -> None:
        for i in range(0, len(payloads), batch):
            async with prod.pipeline(transaction=False) as pipe:
                for p in payloads[i : i + batch]:
                    pipe.xadd(stream, {"data": p})
                await pipe.execute()

    async def consume() -> None:
        seen = 0
        while seen < len(payloads):
            resp = await cons.xreadgroup(group, "c", {stream: ">"}, count=batch, block=1000)
            seen += len(resp[0][1]) if resp else 0

    start = time.perf_counter()
    await asyncio.gather(produce(), consume())
    elapsed = time.perf_counter() - start
    await prod.delete(stream)
    await prod.aclose()
    await cons.aclose()
    return elapsed


async def info(url: str) -> dict[str, int]:
    r = aioredis.Redis.from_url(url)
    try:
        mem, pers = await r.info("memory"), await r.info("persistence")
    finally:
        await r.aclose()
    return {"used": int(mem["used_memory"]), "aof": int(pers.get("aof_current_size", 0))}


async def run_hold(url: str, trajs: list[Trajectory], batch: int) -> dict[str, float]:
    """Publish then consume every trajectory without acking (a trainer's checkpoint window)."""
    cfg = BusConfig(stream="bench:hold", consumer="bench-trainer", max_backlog=len(trajs))
    producer, consumer = TrajectoryBus.from_url(url, cfg), TrajectoryBus.from_url(url, cfg)
    await producer.ensure_group()
    before = await info(url)
    start = time.perf_counter()
    for i in range(0, len(trajs), batch):
        await producer.publish(trajs[i : i + batch])
    publish_s = time.perf_counter() - start
    held = []
    start = time.perf_counter()
    while len(held) < len(trajs):
        held += await consumer.consume(batch, block=1.0)
    consume_s = time.perf_counter() - start
    unacked = await info(url)
    await consumer.ack(held)
    acked = await info(url)
    await producer.close()
    await consumer.close()
    n = len(trajs)
    return {
        "publish_per_s": n / publish_s,
        "consume_per_s": n / consume_s,
        "redis_bytes_per_traj": (unacked["used"] - before["used"]) / n,
        "aof_bytes_per_traj": (unacked["aof"] - before["aof"]) / n,
        "redis_mb_unacked": (unacked["used"] - before["used"]) / 1e6,
        "redis_mb_after_ack": (acked["used"] - before["used"]) / 1e6,
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--fsync", default="always", choices=["always", "everysec", "no"])
    ap.add_argument("--hold", action="store_true", help="memory of N unacked trajectories")
    args = ap.parse_args()

    trajs = build(args.n, args.tokens)
    payloads = [t.SerializeToString() for t in trajs]
    mb = sum(map(len, payloads)) / 1e6
    print(f"{args.n} trajectories x {args.tokens} tokens: {mb:.1f} MB, "
          f"{mb * 1e3 / args.n:.1f} KB each; appendfsync={args.fsync}")  # fmt: skip
    if args.hold:
        with RedisServer(appendfsync=args.fsync) as server:
            r = await run_hold(server.url, trajs, args.batch)
        payload = mb * 1e6 / args.n
        print(
            f"held {args.n} unacked: Redis +{r['redis_mb_unacked']:.1f} MB "
            f"({r['redis_bytes_per_traj'] / payload:.2f}x the payload), AOF "
            f"+{r['aof_bytes_per_traj'] * args.n / 1e6:.1f} MB; after the ack "
            f"+{r['redis_mb_after_ack']:.1f} MB; publish {r['publish_per_s']:.0f} traj/s, "
            f"consume {r['consume_per_s']:.0f} traj/s"
        )
        print(" ".join(f"{k}={v:.1f}" for k, v in r.items()) + f" payload_bytes={payload:.0f}")
        return
    with RedisServer(appendfsync=args.fsync) as server:
        raw_s = await run_raw(server.url, payloads, args.batch)
        bus_s = await run_bus(server.url, trajs, args.batch)
    bus_rate, raw_rate = args.n / bus_s, args.n / raw_s
    print(f"bus : {bus_rate:8.1f} traj/s  {mb / bus_s:7.1f} MB/s  ({bus_s:.2f} s)")
    print(f"raw : {raw_rate:8.1f} traj/s  {mb / raw_s:7.1f} MB/s  ({raw_s:.2f} s)  [ceiling]")
    print(
        f"traj_per_s={bus_rate:.1f} mb_per_s={mb / bus_s:.1f} raw_traj_per_s={raw_rate:.1f} "
        f"raw_mb_per_s={mb / raw_s:.1f} ratio_vs_raw={bus_rate / raw_rate:.2f}"
    )


if __name__ == "__main__":
    asyncio.run(main())
