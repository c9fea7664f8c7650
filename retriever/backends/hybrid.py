"""Hybrid retrieval: dense and BM25 candidates fused by reciprocal rank (RRF).

score(doc) = sum over backends of 1 / (rrf_k + rank), rank from 1; a document found by both
backends outranks one found by a single backend at a similar rank.
"""

from __future__ import annotations

import numpy as np

from retriever.backends.base import Hit
from retriever.backends.bm25 import Bm25Backend
from retriever.backends.dense import DenseBackend
from retriever.config import HybridConfig


def rrf_fuse(
    rankings: list[tuple[np.ndarray, np.ndarray]], topk: int, rrf_k: int
) -> list[list[tuple[int, float]]]:
    """Fuse per-backend (scores, ids) rankings; returns per query [(id, fused score)]."""
    n_queries = len(rankings[0][1])
    fused: list[list[tuple[int, float]]] = []
    for q in range(n_queries):
        acc: dict[int, float] = {}
        for _, ids in rankings:
            for rank, i in enumerate(ids[q], 1):
                if i >= 0:
                    acc[int(i)] = acc.get(int(i), 0.0) + 1.0 / (rrf_k + rank)
        # Ties broken by id so the order is deterministic.
        fused.append(sorted(acc.items(), key=lambda kv: (-kv[1], kv[0]))[:topk])
    return fused


class HybridBackend:
    name = "hybrid"

    def __init__(self, dense: DenseBackend, bm25: Bm25Backend, cfg: HybridConfig) -> None:
        self.dense = dense
        self.bm25 = bm25
        self.cfg = cfg
        self.corpus = dense.corpus

    def search_batch(self, queries: list[str], topk: int) -> list[list[Hit]]:
        n = max(topk, self.cfg.candidates)
        rankings = [self.dense.search_ids(queries, n), self.bm25.search_ids(queries, n)]
        return [
            [(self.corpus.row(i), s) for i, s in per_query]
            for per_query in rrf_fuse(rankings, topk, self.cfg.rrf_k)
        ]

    def healthy(self) -> bool:
        return self.dense.healthy()

    def close(self) -> None:
        self.dense.close()  # the corpus store is shared with the bm25 backend
