"""Search backends. Built-ins are chosen by the index manifest (dense / bm25 / hybrid) or by
config (`backend: web`); see `load_backend`."""

from __future__ import annotations

import logging
from pathlib import Path

from retriever.backends.base import AsyncBackend, BackendUnavailable, BatchBackend, Hit
from retriever.config import RetrieverConfig

__all__ = ["AsyncBackend", "BackendUnavailable", "BatchBackend", "Hit", "load_backend"]

log = logging.getLogger(__name__)


def load_index_backend(index_dir: Path, cfg: RetrieverConfig) -> BatchBackend:
    """Load the backend an index directory was built for (blocking: seconds to minutes)."""
    from retriever.backends.bm25 import Bm25Backend, Bm25Index
    from retriever.backends.dense import DenseBackend
    from retriever.backends.hybrid import HybridBackend
    from retriever.corpus import CorpusStore
    from retriever.manifest import read_manifest

    m = read_manifest(index_dir)
    corpus = CorpusStore.open(
        m.resolve(index_dir, m.corpus_path), m.resolve(index_dir, m.spans_path)
    )
    if len(corpus) != m.rows:
        raise ValueError(f"corpus has {len(corpus)} rows, the manifest says {m.rows}")
    dense = bm25 = None
    if m.backend in ("dense", "hybrid"):
        assert m.dense is not None, "manifest without a dense section"
        index_file = m.resolve(index_dir, m.dense.index_file)
        dense = DenseBackend.load(index_dir, m.dense, index_file, corpus, cfg.dense)
    if m.backend in ("bm25", "hybrid"):
        assert m.bm25 is not None, "manifest without a bm25 section"
        bm25 = Bm25Backend(Bm25Index.load(m.resolve(index_dir, m.bm25.dir), m.bm25), corpus)
    if m.backend == "hybrid":
        assert dense is not None and bm25 is not None
        return HybridBackend(dense, bm25, cfg.hybrid)
    backend = dense if dense is not None else bm25
    assert backend is not None
    return backend


def load_backend(cfg: RetrieverConfig) -> BatchBackend | AsyncBackend:
    if cfg.backend == "web":
        from retriever.backends.web import WebBackend

        return WebBackend(cfg.serper)
    if not cfg.index_dir:
        raise ValueError("retriever.index_dir is not set (pass --index DIR)")
    backend = load_index_backend(Path(cfg.index_dir), cfg)
    if cfg.rerank.model_path is not None:
        from retriever.backends.rerank import CrossEncoder, RerankBackend

        reranker = CrossEncoder(cfg.rerank, device=cfg.dense.device)
        backend = RerankBackend(backend, reranker, cfg.rerank)
    return backend
