"""Retriever benchmark: single-query /retrieve load at several concurrencies vs the encoder ceiling.

Builds (once, cached under runs/bench-cache/) a deterministic synthetic Search-R1 corpus with the
MiniLM encoder and a Flat index, starts `searchr1 retriever serve` as a process (result cache
off, so every query is encoded and searched) and load-tests it with one query per request, the
pattern of per-sample rollouts. Also measures, in this process, the encoder-only throughput at
batch 64 (the ceiling) and Flat search over 64 queries with faiss and with torch.

    OMP_NUM_THREADS=1 .venv/bin/python bench/retriever.py [--rows 50000] [--duration 15]

Passages are encoded with --max-length 32 tokens by default so the one-off build takes minutes,
not half an hour, on one core; serving cost does not depend on passage length (queries are
shorter than 32 tokens, the stored rows keep their full ~100 words).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Run as a script, bench/ is sys.path[0] and this file would shadow the `retriever` package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from searchr1.redis_server import free_port  # noqa: E402
from tests.support import synthetic  # noqa: E402

# The public Search-R1 retrieval server on this machine class, same encoder and 50,000-passage
# Flat index, one thread per process (issue #3): QPS by concurrency.
REFERENCE_QPS = {1: 46.0, 8: 64.0, 32: 47.0}


def build_cached(args: argparse.Namespace) -> Path:
    from retriever.build import BuildConfig, build_index

    key = f"rows{args.rows}-words{args.words}-len{args.max_length}"
    out = Path(args.cache_dir) / key
    if (out / "manifest.json").exists():
        print(f"index: cached {out}")
        return out
    corpus = synthetic.write_corpus(
        Path(args.cache_dir) / f"{key}.jsonl", args.rows, words=args.words
    )
    t = time.perf_counter()
    build_index(corpus, out, BuildConfig(max_length=args.max_length, progress=True))
    print(f"index: built {out} in {time.perf_counter() - t:.0f}s")
    return out


def ceilings(index_dir: Path, queries: list[str]) -> tuple[dict[str, float], Callable[[], float]]:
    """Flat search time for 64 queries (faiss vs torch), and a function measuring the
    encoder-only q/s at batch 64 (called next to each load level: on a shared machine the
    ceiling moves with the other load, so the ratio compares numbers taken together)."""
    import faiss
    import torch

    from retriever.backends.dense import DenseIndex
    from retriever.config import DenseConfig
    from retriever.encoder import Encoder, EncoderSpec
    from retriever.manifest import read_manifest

    torch.set_num_threads(1)
    m = read_manifest(index_dir).dense
    assert m is not None
    spec = EncoderSpec(
        model_path=m.encoder_path,
        query_prefix=m.query_prefix,
        passage_prefix=m.passage_prefix,
        pooling=m.pooling,
        normalize=m.normalize,
        max_length=m.max_length,
    )
    enc = Encoder(spec, device="cpu")
    vecs = enc.encode(queries[:64], is_query=True)  # also the warm-up

    def encoder_qps(n: int = 640) -> float:
        t = time.perf_counter()
        enc.encode(queries[-n:], is_query=True, batch_size=64)
        return n / (time.perf_counter() - t)

    raw = faiss.read_index(str(index_dir / m.index_file))
    out: dict[str, float] = {}
    for path in ("faiss", "torch"):
        idx = DenseIndex(raw, DenseConfig(flat_search=path, device="cpu"))
        idx.search(vecs[:64], 3)
        t = time.perf_counter()
        for _ in range(5):
            idx.search(vecs[:64], 3)
        out[f"flat_{path}_ms_b64"] = (time.perf_counter() - t) / 5 * 1000
    return out, encoder_qps


class RawHttpClient:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams.

    httpx costs ~1-2 ms of CPU per request in the load generator, which on a 2-core machine
    shares the cores with the server and would be measured instead of the server.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_json(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def load_level(
    host: str, port: int, queries: list[str], conc: int, duration: float, start: int
) -> tuple[list[float], int, float, int]:
    lat: list[float] = []
    errors = 0
    counter = [start]
    stop_at = time.perf_counter() + duration

    async def worker() -> None:
        nonlocal errors
        client = RawHttpClient(host, port)
        try:
            while time.perf_counter() < stop_at:
                q = queries[counter[0] % len(queries)]
                counter[0] += 1
                body = json.dumps({"queries": [q], "topk": 3, "return_scores": False}).encode()
                t = time.perf_counter()
                status, data = await client.post_json("/retrieve", body)
                lat.append(time.perf_counter() - t)
                if status != 200 or data.count(b'"contents"') != 3:
                    errors += 1
        finally:
            await client.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return lat, errors, time.perf_counter() - t0, counter[0]


def stats(url: str) -> dict:
    return httpx.get(f"{url}/stats", timeout=10).json()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--words", type=int, default=100)
    ap.add_argument("--max-length", type=int, default=32)
    ap.add_argument("--cache-dir", default="runs/bench-cache")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--max-wait-ms", type=float, default=0.0)
    ap.add_argument(
        "--encoder-process",
        choices=["auto", "true", "false"],
        default="auto",
        help="dense.encoder_process (A/B; auto = a child process on CPU)",
    )
    args = ap.parse_args()

    index_dir = build_cached(args)
    queries = synthetic.queries(20_000, corpus_rows=args.rows, seed=7)
    ceil, encoder_qps = ceilings(index_dir, queries)
    print(
        f"Flat search of 64 queries over {args.rows} rows: faiss {ceil['flat_faiss_ms_b64']:.1f} "
        f"ms, torch {ceil['flat_torch_ms_b64']:.1f} ms"
    )

    port = free_port()
    cfg = Path(tempfile.mkdtemp()) / "retriever.yaml"
    cfg.write_text(
        json.dumps(
            {
                "retriever": {
                    "cache": {"size": 0},
                    "grpc_port": None,
                    "batching": {"max_batch": 64, "max_wait_ms": args.max_wait_ms},
                    "dense": {
                        "encoder_process": {"auto": "auto", "true": True, "false": False}[
                            args.encoder_process
                        ]
                    },
                },
                "logging": {"level": "WARNING"},
            }
        )
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "searchr1.stack.cli",
            "retriever",
            "serve",
            "--index",
            str(index_dir),
            "--port",
            str(port),
            "--config",
            str(cfg),
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    summary: dict[str, str] = {}
    try:
        deadline = time.time() + 300
        while True:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or proc.poll() is not None:
                raise SystemExit("server did not become ready")
            time.sleep(0.5)
        asyncio.run(load_level("127.0.0.1", port, queries, 8, 2.0, 10_000))  # warm-up
        nxt = 0
        for conc in (int(c) for c in args.concurrency.split(",")):
            ceiling_before = encoder_qps()
            before = stats(url)
            lat, errors, elapsed, nxt = asyncio.run(
                load_level("127.0.0.1", port, queries, conc, args.duration, nxt)
            )
            after = stats(url)
            ceiling = (ceiling_before + encoder_qps()) / 2
            n_batches = max(1, after["batches"] - before["batches"])
            qpb = (after["batched_queries"] - before["batched_queries"]) / n_batches
            busy = "/".join(
                f"{(a - b) / args.duration:.0%}"
                for a, b in zip(after["stage_busy_s"], before["stage_busy_s"], strict=True)
            )
            lat_ms = np.array(lat) * 1000
            qps = len(lat) / elapsed
            p50, p99 = float(np.percentile(lat_ms, 50)), float(np.percentile(lat_ms, 99))
            print(
                f"concurrency {conc:3d}: {qps:7.1f} QPS  p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  "
                f"mean {statistics.fmean(lat_ms):7.1f} ms  queries/batch {qpb:5.1f}  "
                f"stages busy {busy}  errors {errors}  (n={len(lat)})  encoder-only ceiling "
                f"{ceiling:.0f} q/s (ratio {qps / ceiling:.2f})"
            )
            summary |= {
                f"qps_c{conc}": f"{qps:.1f}",
                f"p50_ms_c{conc}": f"{p50:.1f}",
                f"p99_ms_c{conc}": f"{p99:.1f}",
                f"batch_c{conc}": f"{qpb:.1f}",
                f"errors_c{conc}": str(errors),
                f"encoder_qps_b64_c{conc}": f"{ceiling:.1f}",
                f"ratio_c{conc}": f"{qps / ceiling:.2f}",
            }
            if conc in REFERENCE_QPS:
                summary[f"vs_reference_c{conc}"] = f"{qps / REFERENCE_QPS[conc]:.2f}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    summary["flat_faiss_ms_b64"] = f"{ceil['flat_faiss_ms_b64']:.1f}"
    summary["flat_torch_ms_b64"] = f"{ceil['flat_torch_ms_b64']:.1f}"
    summary["rows"] = str(args.rows)
    summary["encoder_process"] = args.encoder_process
    print(" ".join(f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
