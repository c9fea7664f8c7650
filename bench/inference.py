"""Reference engine throughput (batched vs one at a time) and weight-update bandwidth.

    python bench/inference.py [--requests 64] [--new-tokens 128] [--big-hidden 1024]
                              [--big-layers 2] [--bucket-mb 256] [--skip-weights]
                              [--device cpu|cuda] [--dtype float32|bfloat16]

1. Throughput: a tiny model served by `searchr1 inference serve --engine torch` (a real
   process, HTTP); `--requests` requests of `--new-tokens` new tokens each (temperature 1,
   fixed seeds, so both runs produce the same tokens) sent all at once vs one at a time.
   Output tokens/s of each and the ratio (target >= 8x on 2 cores).
2. Weight update: an engine serving a model of >= 100 MB (`--big-hidden`/`--big-layers`)
   receives new weights from this process through `WeightSender` (gloo); compared with a raw
   `torch.distributed.broadcast` of the same tensors between two processes (the ceiling;
   target ratio >= 0.7).

The last line is key=value pairs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_client.client import InferenceClient
from harness.inference_server import InferenceServerProcess
from inference.tiny_model import make_tiny_model
from searchr1.redis_server import free_port


async def throughput(url: str, n: int, new_tokens: int, *, exact: bool) -> dict[str, float]:
    prompts = [[1, *range(100 + i, 110 + i)] for i in range(n)]
    async with InferenceClient(url, timeout_s=600) as c:
        # Warm-up, concurrent so the pool holds n keep-alive connections as in steady state
        # (a rollout client keeps them open; connection set-up is not generation speed).
        await asyncio.gather(*(c.generate(p, max_new_tokens=2) for p in prompts))

        async def one(i: int) -> int:
            out = await c.generate(prompts[i], max_new_tokens=new_tokens, seed=i)
            return out.completion_tokens

        start = time.perf_counter()
        seq_tokens = 0
        for i in range(n):
            seq_tokens += await one(i)
        seq_s = time.perf_counter() - start

        start = time.perf_counter()
        conc_tokens = sum(await asyncio.gather(*(one(i) for i in range(n))))
        conc_s = time.perf_counter() - start
    if not exact:
        # bf16 on a GPU: a batch's kernels round differently from one request's, so seeded
        # samples can part ways; token counts are compared, not asserted.
        print(f"batched and one-at-a-time token counts: {conc_tokens} vs {seq_tokens}")
    else:
        assert conc_tokens == seq_tokens, "seeded runs must produce the same tokens"
    seq_tps, conc_tps = seq_tokens / seq_s, conc_tokens / conc_s
    print(f"one at a time : {seq_tokens} tokens in {seq_s:.2f} s = {seq_tps:.0f} tok/s")
    print(f"{n} concurrent: {conc_tokens} tokens in {conc_s:.2f} s = {conc_tps:.0f} tok/s")
    print(f"ratio         : {conc_tps / seq_tps:.1f}x")
    return {"seq_tok_s": seq_tps, "batched_tok_s": conc_tps, "batch_speedup": conc_tps / seq_tps}


RAW_ROUNDS = 8
RAW_RECEIVER = """
import sys, torch
from safetensors.torch import load_file
from searchr1.weightsync.group import destroy_weight_group, new_weight_group
import torch.distributed as dist
port, path = int(sys.argv[1]), sys.argv[2]
bufs = [torch.empty_like(t) for t in load_file(path).values()]
g = new_weight_group(backend="gloo", master_address="127.0.0.1", master_port=port,
                     world_size=2, rank=1, group_name="raw")
for _ in range(ROUNDS):
    dist.broadcast(torch.zeros(1), src=0, group=g)  # start together
    for w in [dist.broadcast(b, src=0, group=g, async_op=True) for b in bufs]:
        w.wait()
dist.broadcast(torch.zeros(1), src=0, group=g)  # done together, then tear down
destroy_weight_group(g)
"""


def raw_broadcast(path: Path) -> tuple[int, float]:
    """The ceiling: the same tensors, broadcast rank 0 -> rank 1, no HTTP, no copy-in."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from searchr1.weightsync.group import destroy_weight_group, new_weight_group

    tensors = list(load_file(str(path)).values())
    port = free_port()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            RAW_RECEIVER.replace("ROUNDS", str(RAW_ROUNDS)),
            str(port),
            str(path),
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    g = new_weight_group(
        backend="gloo",
        master_address="127.0.0.1",
        master_port=port,
        world_size=2,
        rank=0,
        group_name="raw",
    )
    best = float("inf")
    for _ in range(RAW_ROUNDS):  # the first round also pays connection set-up
        dist.broadcast(torch.zeros(1), src=0, group=g)
        start = time.perf_counter()
        for w in [dist.broadcast(t, src=0, group=g, async_op=True) for t in tensors]:
            w.wait()
        best = min(best, time.perf_counter() - start)
    dist.broadcast(torch.zeros(1), src=0, group=g)
    child.wait(60)
    destroy_weight_group(g)
    return sum(t.numel() * t.element_size() for t in tensors), best


async def weight_push(url: str, path: Path, bucket_mb: int) -> tuple[int, float]:
    from safetensors.torch import load_file

    from engine_client.client import InferenceClient
    from searchr1.weightsync.sender import WeightSender

    named = list(load_file(str(path)).items())
    sender = WeightSender(
        [InferenceClient(url)], master_port=free_port(), bucket_bytes=bucket_mb << 20
    )
    await sender.connect()
    try:
        best = None
        for _ in range(RAW_ROUNDS):
            stats = await sender.push(named)
            best = stats if best is None or stats.seconds < best.seconds else best
    finally:
        await sender.close()
    assert best is not None
    return best.bytes, best.seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--big-hidden", type=int, default=1024)
    ap.add_argument("--big-layers", type=int, default=2)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--skip-weights", action="store_true")
    ap.add_argument("--device", default="cpu", help="the throughput engine's: cpu, cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()

    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-inference-") as tmp:
        tiny = make_tiny_model(Path(tmp) / "tiny")
        # The engine's device and dtype (`--device cuda` is dev.py gpu's check of the engine).
        engine_env = {
            "SEARCHR1_INFERENCE__TORCH_ENGINE__DEVICE": args.device,
            "SEARCHR1_INFERENCE__TORCH_ENGINE__DTYPE": args.dtype,
        }
        with InferenceServerProcess(tiny, env=engine_env) as server:
            exact = args.device == "cpu" and args.dtype == "float32"
            results.update(
                asyncio.run(throughput(server.url, args.requests, args.new_tokens, exact=exact))
            )

        if not args.skip_weights:
            big = make_tiny_model(
                Path(tmp) / "big", hidden_size=args.big_hidden, num_layers=args.big_layers
            )
            ckpt = big / "model.safetensors"
            # The raw ceiling is measured before and after the update (best of both): on a
            # shared 2-core machine one measurement alone is at the mercy of the neighbours.
            raw_bytes, raw_s = raw_broadcast(ckpt)
            with InferenceServerProcess(big) as server:
                push_bytes, push_s = asyncio.run(weight_push(server.url, ckpt, args.bucket_mb))
            raw_s = min(raw_s, raw_broadcast(ckpt)[1])
            assert push_bytes == raw_bytes
            raw_bw, push_bw = raw_bytes / raw_s / 1e9, push_bytes / push_s / 1e9
            print(f"model         : {push_bytes / 1e6:.0f} MB")
            print(f"raw broadcast : {raw_s:.3f} s = {raw_bw:.2f} GB/s")
            print(f"weight update : {push_s:.3f} s = {push_bw:.2f} GB/s (HTTP + copy-in)")
            print(f"ratio         : {push_bw / raw_bw:.2f}")
            results.update(
                model_mb=push_bytes / 1e6,
                update_s=push_s,
                update_gb_s=push_bw,
                raw_gb_s=raw_bw,
                update_vs_raw=push_bw / raw_bw,
            )
    print(" ".join(f"{k}={v:.3f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
