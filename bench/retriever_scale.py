"""Dense index options at Wikipedia scale: measured at N passages here, extrapolated to 21M.

Synthetic e5-like vectors (768-d, L2-normalised, clustered: a mixture of Gaussian topics, so
approximate indexes face neighbourhoods like real embeddings do, not uniform noise). For each
index: build time, bytes per passage, QPS at batch 1 and 64 through the retriever's own
`DenseIndex` (the torch or faiss Flat path, HNSW efSearch, IVF nprobe as served), and recall@3
and @10 against exact Flat. HNSW is built on `--hnsw-n` passages (its build is the slow one:
minutes per million on one core); its numbers are for that size. The extrapolation to 21M
(wiki-18) is printed with its formula.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m bench.retriever_scale [--quick] [--n N]
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from retriever.backends.dense import DenseIndex
from retriever.config import DenseConfig

WIKI = 21_000_000
D = 768


def vectors(n: int, d: int, topics: int, seed: int) -> np.ndarray:
    """`n` unit vectors around `topics` random centres (noise of the same norm as a centre)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((topics, d), dtype=np.float32)
    out = np.empty((n, d), dtype=np.float32)
    step = 100_000
    for s in range(0, n, step):
        m = min(step, n - s)
        out[s : s + m] = centres[rng.integers(0, topics, m)]
        out[s : s + m] += rng.standard_normal((m, d), dtype=np.float32)
    out /= np.linalg.norm(out, axis=1, keepdims=True)
    return out


def qps(
    search: Callable[[np.ndarray], Any], queries: np.ndarray, batch: int, budget_s: float
) -> float:
    """Queries per second at `batch` queries per call, for about `budget_s` seconds."""
    search(queries[:batch])  # warm
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget_s or done == 0:
        s = (done * batch) % (len(queries) - batch + 1)
        search(queries[s : s + batch])
        done += 1
    return done * batch / (time.perf_counter() - start)


def recall(found: np.ndarray, truth: np.ndarray, k: int) -> float:
    return float(
        np.mean([len(set(f[:k]) & set(t[:k])) / k for f, t in zip(found, truth, strict=True)])
    )


def measure(
    name: str,
    index: Any,
    cfg: DenseConfig,
    queries: np.ndarray,
    truth: np.ndarray,
    build_s: float,
    nbytes: int,
    n: int,
    budget_s: float,
) -> dict[str, float]:
    dense = DenseIndex(index, cfg)
    _, ids = dense.search(queries, 10)
    row = {
        "n": n,
        "build_s": build_s,
        "bytes_per_passage": nbytes / n,
        "qps_b1": qps(lambda q: dense.search(q, 10), queries, 1, budget_s),
        "qps_b64": qps(lambda q: dense.search(q, 10), queries, 64, budget_s),
        "recall3": recall(ids, truth, 3),
        "recall10": recall(ids, truth, 10),
    }
    print(
        f"{name:12s} n={n:>9,} build {build_s:7.1f} s  {row['bytes_per_passage']:7.1f} B/passage  "
        f"QPS b1 {row['qps_b1']:8.1f}  b64 {row['qps_b64']:8.1f}  "
        f"recall@3 {row['recall3']:.3f}  @10 {row['recall10']:.3f}  (path: {dense.search_path})",
        flush=True,
    )
    return row


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=1_000_000, help="passages (1M: ~3 GB of fp32)")
    p.add_argument("--hnsw-n", type=int, default=200_000, help="passages in the HNSW index")
    p.add_argument("--queries", type=int, default=500)
    p.add_argument("--topics", type=int, default=2000)
    p.add_argument("--nlist", type=int, default=0, help="IVF lists (0: sqrt(n))")
    p.add_argument("--pq", type=int, default=96, help="PQ sub-quantizers (bytes per passage)")
    p.add_argument("--budget-s", type=float, default=3.0, help="timing per QPS figure")
    p.add_argument("--quick", action="store_true", help="200k passages, 50k in HNSW")
    args = p.parse_args()
    if args.quick:
        args.n, args.hnsw_n, args.queries, args.budget_s = 200_000, 50_000, 200, 1.5
    import faiss

    faiss.omp_set_num_threads(1)
    n = args.n
    t = time.perf_counter()
    xb = vectors(n, D, args.topics, seed=0)
    xq = vectors(args.queries, D, args.topics, seed=0)[: args.queries]  # same topics
    xq = (xq + 0.3 * vectors(args.queries, D, 1, seed=1)).astype(np.float32)
    xq /= np.linalg.norm(xq, axis=1, keepdims=True)
    print(
        f"{n:,} x {D} vectors ({xb.nbytes / 1e9:.1f} GB) and {len(xq)} queries "
        f"in {time.perf_counter() - t:.0f} s; one thread"
    )

    rows: dict[str, dict[str, float]] = {}
    t = time.perf_counter()
    flat = faiss.IndexFlatIP(D)
    flat.add(xb)
    build = time.perf_counter() - t
    truth = flat.search(xq, 10)[1]
    rows["flat_faiss"] = measure(
        "Flat faiss",
        flat,
        DenseConfig(flat_search="faiss", device="cpu"),
        xq,
        truth,
        build,
        n * D * 4,
        n,
        args.budget_s,
    )
    rows["flat_torch"] = measure(
        "Flat torch",
        flat,
        DenseConfig(flat_search="torch", device="cpu"),
        xq,
        truth,
        build,
        n * D * 4,
        n,
        args.budget_s,
    )
    del flat
    gc.collect()

    nlist = args.nlist or int(math.sqrt(n))
    t = time.perf_counter()
    ivf = faiss.index_factory(D, f"IVF{nlist},PQ{args.pq}", faiss.METRIC_INNER_PRODUCT)
    train = xb[np.random.default_rng(2).choice(n, min(n, max(40 * nlist, 10_000)), replace=False)]
    ivf.train(train)
    ivf.add(xb)
    build = time.perf_counter() - t
    ivf_bytes = n * (args.pq + 8) + nlist * D * 4  # codes + ids + centroids
    for nprobe in (16, 64):
        rows[f"ivfpq_np{nprobe}"] = measure(
            f"IVF-PQ np{nprobe}",
            ivf,
            DenseConfig(ivf_nprobe=nprobe, device="cpu"),
            xq,
            truth,
            build,
            ivf_bytes,
            n,
            args.budget_s,
        )
    del ivf
    gc.collect()

    hn = min(args.hnsw_n, n)
    sub_truth = faiss.IndexFlatIP(D)
    sub_truth.add(xb[:hn])
    truth_h = sub_truth.search(xq, 10)[1]
    del sub_truth
    t = time.perf_counter()
    hnsw = faiss.IndexHNSWFlat(D, 32, faiss.METRIC_INNER_PRODUCT)
    hnsw.hnsw.efConstruction = 40
    hnsw.add(xb[:hn])
    build = time.perf_counter() - t
    hnsw_bytes = hn * (D * 4 + 32 * 2 * 4 * 1.1)  # vectors + level-0 links (+ upper levels ~10%)
    rows["hnsw"] = measure(
        "HNSW32",
        hnsw,
        DenseConfig(hnsw_ef_search=128, device="cpu"),
        xq,
        truth_h,
        build,
        int(hnsw_bytes),
        hn,
        args.budget_s,
    )
    del hnsw, xb
    gc.collect()

    # -- extrapolation to 21M ------------------------------------------------------------------
    f = WIKI / n
    fh = WIKI / hn
    print("\n21M passages (wiki-18), from the figures above (one CPU core unless said):")
    flat_gb = WIKI * D * 4 / 1e9
    fp16_gb = WIKI * D * 2 / 1e9
    flat_b64 = rows["flat_torch"]["qps_b64"] / f
    print(
        f"Flat: memory = 21M x 768 x 4 B = {flat_gb:.1f} GB (fp32), "
        f"x 2 B = {fp16_gb:.1f} GB (fp16: one H100)"
    )
    print(
        f"  CPU scan time grows with N: QPS(21M) = QPS({n:,}) x {n:,}/21M -> "
        f"b64 {flat_b64:.2f} QPS per core (faiss {rows['flat_faiss']['qps_b64'] / f:.2f})"
    )
    # H100: the fp16 scan is memory bound; one pass over 32 GB at ~2.5 TB/s effective serves a
    # whole batch.
    gpu_batch_s = fp16_gb / 2500
    print(
        f"  H100 fp16: one pass over {fp16_gb:.1f} GB at ~2.5 TB/s = "
        f"{1000 * gpu_batch_s:.0f} ms per batch"
        f" -> batch 64: ~{64 / gpu_batch_s:,.0f} QPS (bandwidth bound, not measured here)"
    )
    hnsw_gb = rows["hnsw"]["bytes_per_passage"] * WIKI / 1e9
    hnsw_build_h = rows["hnsw"]["build_s"] * fh * math.log(WIKI) / math.log(hn) / 3600
    hnsw_b1 = rows["hnsw"]["qps_b1"] * math.log(hn) / math.log(WIKI)
    print(
        f"HNSW32: memory = 21M x {rows['hnsw']['bytes_per_passage']:.0f} B = {hnsw_gb:.1f} GB; "
        f"build ~ n log n: {rows['hnsw']['build_s']:.0f} s x {fh:.0f} x log(21M)/log({hn:,}) = "
        f"{hnsw_build_h:.1f} core-hours; search ~ log n: b1 {hnsw_b1:.0f} QPS per core"
    )
    ivf = rows["ivfpq_np16"]
    ivf_gb = (WIKI * (args.pq + 8)) / 1e9
    # nlist grows as sqrt(N): lists get sqrt(21M/n) longer, so a query scans that much more.
    grow = math.sqrt(f)
    ivf_b64 = ivf["qps_b64"] / grow
    print(
        f"IVF{int(math.sqrt(WIKI))},PQ{args.pq}: "
        f"memory = 21M x ({args.pq} + 8) B = {ivf_gb:.1f} GB; "
        f"scan per query grows sqrt(21M/n) = {grow:.1f}x -> b64 {ivf_b64:.0f} QPS per core "
        f"(nprobe 16, recall@10 {ivf['recall10']:.2f} here)"
    )
    last = {
        "n": n,
        "flat_build_s": rows["flat_faiss"]["build_s"],
        **{
            f"{k}_qps_b{b}": rows[k][f"qps_b{b}"]
            for k in ("flat_faiss", "flat_torch")
            for b in (1, 64)
        },
        "hnsw_n": hn,
        **{
            f"hnsw_{m}": rows["hnsw"][m]
            for m in ("build_s", "qps_b1", "qps_b64", "recall3", "recall10")
        },
        **{f"ivfpq_{m}": ivf[m] for m in ("build_s", "qps_b1", "qps_b64", "recall3", "recall10")},
        "ivfpq64_recall10": rows["ivfpq_np64"]["recall10"],
        "gb_21m_flat_fp16": fp16_gb,
        "gb_21m_hnsw": hnsw_gb,
        "gb_21m_ivfpq": ivf_gb,
    }
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in last.items()))


if __name__ == "__main__":
    main()
