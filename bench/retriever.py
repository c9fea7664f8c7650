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

Side by side with another running server over the same index (`--reference-url`), e.g. the
stand-in for the reference Search-R1 server in `bench/searchr1_reference.py`: the same load
generator (httpx by default) against both, in `--rounds` rounds of short slices alternated
between the two (the load on a shared machine moves within seconds), at `--concurrency`
1,8,32, then requests of 64 queries; hits compared first. The last line then carries ours, the
reference's and their ratio per level:

    IDX=runs/bench-cache/rows50000-words100-len32
    OMP_NUM_THREADS=1 .venv/bin/python bench/searchr1_reference.py --index_path $IDX/dense.faiss \
        --corpus_path $IDX/corpus.jsonl --retriever_model "$(.venv/bin/python -c \
        'from retriever.encoder import default_encoder_path as p; print(p())')" --port 8090 &
    OMP_NUM_THREADS=1 .venv/bin/python bench/retriever.py --reference-url http://127.0.0.1:8090
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

from bench.retriever_load import (  # noqa: E402
    CLIENTS,
    Level,
    big_requests,
    hit_ids,
    load_level,
    pooled,
    same_hits,
    summarize,
)
from harness import synthetic  # noqa: E402
from searchr1.redis_server import free_port  # noqa: E402


def build_cached(args: argparse.Namespace) -> Path:
    from retriever.build import build_index
    from retriever.config import BuildConfig

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


def stats(url: str) -> dict:
    return httpx.get(f"{url}/stats", timeout=10).json()


def start_server(index_dir: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`searchr1 retriever serve` on a free port (result cache off), once /ready answers 200."""
    port = free_port()
    cfg = Path(tempfile.mkdtemp()) / "retriever.yaml"
    encoder_process = {"auto": "auto", "true": True, "false": False}[args.encoder_process]
    cfg.write_text(
        json.dumps(
            {
                "retriever": {
                    "cache": {"size": 0},
                    "grpc_port": None,
                    "batching": {"max_batch": 64, "max_wait_ms": args.max_wait_ms},
                    "dense": {"encoder_process": encoder_process},
                },
                "logging": {"level": "WARNING"},
            }
        )
    )
    cmd = [sys.executable, "-m", "stack.cli", "retriever", "serve"]
    cmd += ["--index", str(index_dir), "--port", str(port), "--config", str(cfg)]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.time() > deadline or proc.poll() is not None:
            proc.terminate()
            raise SystemExit("server did not become ready")
        time.sleep(0.5)


def alone(args: argparse.Namespace, url: str, index_dir: Path, queries: list[str]) -> dict:
    """Our server alone, each level next to the encoder-only ceiling measured around it."""
    ceil, encoder_qps = ceilings(index_dir, queries)
    print(
        f"Flat search of 64 queries over {args.rows} rows: faiss {ceil['flat_faiss_ms_b64']:.1f} "
        f"ms, torch {ceil['flat_torch_ms_b64']:.1f} ms"
    )
    asyncio.run(load_level(url, queries, 8, 2.0, 10_000, client=args.client))  # warm-up
    summary: dict[str, str] = {}
    nxt = 0
    for conc in (int(c) for c in args.concurrency.split(",")):
        ceiling_before = encoder_qps()
        before = stats(url)
        lv = asyncio.run(load_level(url, queries, conc, args.duration, nxt, client=args.client))
        nxt = lv.next_query
        after = stats(url)
        ceiling = (ceiling_before + encoder_qps()) / 2
        n_batches = max(1, after["batches"] - before["batches"])
        qpb = (after["batched_queries"] - before["batched_queries"]) / n_batches
        busy = "/".join(
            f"{(a - b) / args.duration:.0%}"
            for a, b in zip(after["stage_busy_s"], before["stage_busy_s"], strict=True)
        )
        p50, p99 = lv.ms(50), lv.ms(99)
        print(
            f"concurrency {conc:3d}: {lv.qps:7.1f} QPS  p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  "
            f"mean {lv.mean_ms:7.1f} ms  queries/batch {qpb:5.1f}  stages busy {busy}  errors "
            f"{lv.errors}  (n={len(lv.latencies_s)})  encoder-only ceiling {ceiling:.0f} q/s "
            f"(ratio {lv.qps / ceiling:.2f})"
        )
        summary |= {
            f"qps_c{conc}": f"{lv.qps:.1f}",
            f"p50_ms_c{conc}": f"{p50:.1f}",
            f"p99_ms_c{conc}": f"{p99:.1f}",
            f"batch_c{conc}": f"{qpb:.1f}",
            f"errors_c{conc}": str(lv.errors),
            f"encoder_qps_b64_c{conc}": f"{ceiling:.1f}",
            f"ratio_c{conc}": f"{lv.qps / ceiling:.2f}",
        }
    summary["flat_faiss_ms_b64"] = f"{ceil['flat_faiss_ms_b64']:.1f}"
    summary["flat_torch_ms_b64"] = f"{ceil['flat_torch_ms_b64']:.1f}"
    return summary


def side_by_side(args: argparse.Namespace, ours: str, queries: list[str]) -> dict:
    """Ours and the server at --reference-url under the same load: in each of --rounds rounds,
    each level is cut into --slices slices run alternately on both (which goes first alternates
    too); one query per request with return_scores=true (the reference fails one-query requests
    without scores); then requests of 64 queries, alternated one by one."""
    servers = {"ours": ours, "ref": args.reference_url.rstrip("/")}
    probe = queries[-args.check_queries :]
    got = {name: hit_ids(url, probe) for name, url in servers.items()}
    same = same_hits(got["ours"], got["ref"])
    print(f"identical hits: {same}/{len(probe)} queries (ids in order, scores within 1e-4)")
    for url in servers.values():  # warm-up
        asyncio.run(
            load_level(url, queries, 8, 2.0, 10_000, client=args.client, return_scores=True)
        )
    concs = [int(c) for c in args.concurrency.split(",")]
    runs: dict[tuple[str, int], list] = {(n, c): [] for n in servers for c in concs}
    big: dict[str, list[float]] = {n: [] for n in servers}
    paired: dict[int, list[float]] = {c: [] for c in concs}  # ours / reference, slice by slice
    for r in range(args.rounds):
        order = list(servers) if r % 2 == 0 else list(servers)[::-1]
        for conc in concs:
            # Short slices, alternated: on a shared machine the load moves within seconds.
            done: dict[str, list[Level]] = {n: [] for n in servers}
            before = stats(ours)
            for sl in range(args.slices):
                for name in order if sl % 2 == 0 else order[::-1]:
                    lv = asyncio.run(
                        load_level(
                            servers[name],
                            queries,
                            conc,
                            args.duration / args.slices,
                            r * 5_000 + sl * 500,
                            client=args.client,
                            return_scores=True,
                        )
                    )
                    done[name].append(lv)
            after = stats(ours)
            n = max(1, after["batches"] - before["batches"])
            inline = after.get("inline_batches", 0) - before.get("inline_batches", 0)
            qpb = (after["batched_queries"] - before["batched_queries"]) / n
            paired[conc] += [
                o.qps / f.qps for o, f in zip(done["ours"], done["ref"], strict=True) if f.qps
            ]
            for name in order:
                runs[name, conc].append(pooled(done[name]))
                lv = runs[name, conc][-1]
                how = (
                    f"  queries/batch {qpb:4.1f}  inline {inline / n:4.0%}"
                    if name == "ours"
                    else ""
                )
                print(
                    f"round {r + 1} c={conc:3d} {name:4s}: {lv.qps:6.1f} QPS  p50 {lv.ms(50):6.1f}"
                    f" ms  p99 {lv.ms(99):6.1f} ms  errors {lv.errors}{how}  load {load_avg()}"
                )
        lat: dict[str, list[float]] = {n: [] for n in servers}
        for i in range(args.big_requests):  # one request each, alternated
            for name in order if i % 2 == 0 else order[::-1]:
                lat[name] += asyncio.run(
                    big_requests(servers[name], queries[i * 64 :], 1, 64, client=args.client)
                )
        for name in order if args.big_requests else []:
            big[name] += lat[name]
            print(
                f"round {r + 1} 64-query requests {name:4s}: median "
                f"{statistics.median(lat[name]) * 1000:6.1f} ms"
            )
    summary: dict[str, str] = {}
    print(
        "\n| concurrency | ours QPS (runs) | ours p50 / p99 ms | reference QPS (runs) | "
        "reference p50 / p99 ms | ours / reference | paired slices: median (quartiles), ours "
        "faster |\n|---|---|---|---|---|---|---|"
    )
    for conc in concs:
        o, f = summarize(runs["ours", conc]), summarize(runs["ref", conc])
        ratio = o["qps"] / f["qps"]
        print(
            f"| {conc} | {o['qps']:.1f} ({' / '.join(f'{q:.1f}' for q in o['qps_runs'])}) | "
            f"{o['p50']:.1f} / {o['p99']:.1f} | "
            f"{f['qps']:.1f} ({' / '.join(f'{q:.1f}' for q in f['qps_runs'])}) | "
            f"{f['p50']:.1f} / {f['p99']:.1f} | {ratio:.2f}x | {spread(paired[conc])} |"
        )
        summary |= {
            f"qps_c{conc}": f"{o['qps']:.1f}",
            f"ref_qps_c{conc}": f"{f['qps']:.1f}",
            f"ratio_c{conc}": f"{ratio:.2f}",
            f"p50_ms_c{conc}": f"{o['p50']:.1f}",
            f"ref_p50_ms_c{conc}": f"{f['p50']:.1f}",
            f"errors_c{conc}": str(o["errors"] + f["errors"]),
            f"faster_slices_c{conc}": f"{sum(x > 1 for x in paired[conc])}/{len(paired[conc])}",
        }
    summary["identical_hits"] = f"{same}/{len(probe)}"
    if not big["ours"]:
        return summary
    b_ours, b_ref = statistics.median(big["ours"]), statistics.median(big["ref"])
    print(
        f"| 64 queries in 1 request | {b_ours * 1000:.1f} ms median | | "
        f"{b_ref * 1000:.1f} ms median | | {b_ref / b_ours:.2f}x |"
    )
    summary |= {
        "b64_ms": f"{b_ours * 1000:.1f}",
        "ref_b64_ms": f"{b_ref * 1000:.1f}",
        "ratio_b64": f"{b_ref / b_ours:.2f}",
    }
    return summary


def spread(ratios: list[float]) -> str:
    if len(ratios) < 2:
        return "-"
    q1, med, q3 = statistics.quantiles(ratios, n=4)
    return f"{med:.2f} ({q1:.2f}-{q3:.2f}), {sum(x > 1 for x in ratios)}/{len(ratios)}"


def load_avg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--words", type=int, default=100)
    ap.add_argument("--max-length", type=int, default=32)
    ap.add_argument("--cache-dir", default="runs/bench-cache")
    ap.add_argument("--concurrency", default=None, help="default 1,8,32,64 (alone), 1,8,32")
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--max-wait-ms", type=float, default=0.0)
    ap.add_argument(
        "--encoder-process",
        choices=["auto", "true", "false"],
        default="auto",
        help="dense.encoder_process (A/B; auto = a child process on CPU)",
    )
    ap.add_argument(
        "--reference-url",
        default=None,
        help="a running /retrieve server (e.g. bench/searchr1_reference.py over the same index) "
        "to measure side by side with ours",
    )
    ap.add_argument("--rounds", type=int, default=2, help="side by side: alternated rounds")
    ap.add_argument("--slices", type=int, default=3, help="alternated slices per level and round")
    ap.add_argument("--big-requests", type=int, default=10, help="64-query requests per round")
    ap.add_argument("--check-queries", type=int, default=100, help="hits compared per server")
    ap.add_argument(
        "--client",
        choices=sorted(CLIENTS),
        default=None,
        help="default: raw alone, httpx side by side",
    )
    args = ap.parse_args()
    args.client = args.client or ("httpx" if args.reference_url else "raw")
    args.concurrency = args.concurrency or ("1,8,32" if args.reference_url else "1,8,32,64")

    index_dir = build_cached(args)
    queries = synthetic.queries(20_000, corpus_rows=args.rows, seed=7)
    summary = {"load_start": load_avg()}
    proc, url = start_server(index_dir, args)
    try:
        if args.reference_url:
            summary |= side_by_side(args, url, queries)
        else:
            summary |= alone(args, url, index_dir, queries)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    summary |= {
        "rows": str(args.rows),
        "encoder_process": args.encoder_process,
        "client": args.client,
        "load_end": load_avg(),
    }
    print(" ".join(f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
