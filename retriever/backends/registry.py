"""The backend registries (name -> loader):

- `BACKENDS`, by `retriever.backend`: `index` (the built index directory) or `web` (serper.dev);
- `INDEX_BACKENDS`, by the index manifest's `backend`: `dense`, `bm25` or `hybrid`.

The names `retriever.backend` accepts are `retriever.config.BackendName` (config validation:
any other name is a ConfigError naming the field); a test keeps it and `BACKENDS` equal.
Torch, faiss and transformers are imported by the backends only when they load a model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from retriever.backends.base import AsyncBackend, BatchBackend
from retriever.backends.bm25 import Bm25Backend, Bm25Index
from retriever.backends.dense import DenseBackend
from retriever.backends.hybrid import HybridBackend
from retriever.backends.rerank import CrossEncoder, RerankBackend
from retriever.backends.web import WebBackend
from retriever.config import BackendName, RetrieverConfig
from retriever.corpus import CorpusStore
from retriever.manifest import Manifest, read_manifest

log = logging.getLogger(__name__)

# An index backend's loader: (index directory, its manifest, its corpus, the config).
IndexLoader = Callable[[Path, Manifest, CorpusStore, RetrieverConfig], BatchBackend]
BackendLoader = Callable[[RetrieverConfig], BatchBackend | AsyncBackend]


def _dense(index_dir: Path, m: Manifest, corpus: CorpusStore, cfg: RetrieverConfig) -> DenseBackend:
    assert m.dense is not None, "manifest without a dense section"
    index_file = m.resolve(index_dir, m.dense.index_file)
    return DenseBackend.load(index_dir, m.dense, index_file, corpus, cfg.dense)


def _bm25(index_dir: Path, m: Manifest, corpus: CorpusStore, cfg: RetrieverConfig) -> Bm25Backend:
    assert m.bm25 is not None, "manifest without a bm25 section"
    return Bm25Backend(Bm25Index.load(m.resolve(index_dir, m.bm25.dir), m.bm25), corpus)


def _hybrid(
    index_dir: Path, m: Manifest, corpus: CorpusStore, cfg: RetrieverConfig
) -> HybridBackend:
    dense = _dense(index_dir, m, corpus, cfg)
    return HybridBackend(dense, _bm25(index_dir, m, corpus, cfg), cfg.hybrid)


INDEX_BACKENDS: dict[str, IndexLoader] = {"dense": _dense, "bm25": _bm25, "hybrid": _hybrid}


def load_index_backend(index_dir: Path, cfg: RetrieverConfig) -> BatchBackend:
    """Load the backend an index directory was built for (blocking: seconds to minutes)."""
    m = read_manifest(index_dir)
    corpus = CorpusStore.open(
        m.resolve(index_dir, m.corpus_path), m.resolve(index_dir, m.spans_path)
    )
    if len(corpus) != m.rows:
        raise ValueError(f"corpus has {len(corpus)} rows, the manifest says {m.rows}")
    return INDEX_BACKENDS[m.backend](index_dir, m, corpus, cfg)


def _index(cfg: RetrieverConfig) -> BatchBackend:
    """`backend: index`: the index directory's backend, reranked when a reranker is set."""
    if not cfg.index_dir:
        raise ValueError("retriever.index_dir is not set (pass --index DIR)")
    backend = load_index_backend(Path(cfg.index_dir), cfg)
    if cfg.rerank.model_path is not None:
        reranker = CrossEncoder(cfg.rerank, device=cfg.dense.device)
        backend = RerankBackend(backend, reranker, cfg.rerank)
    return backend


def _web(cfg: RetrieverConfig) -> AsyncBackend:
    return WebBackend(cfg.serper)


BACKENDS: dict[BackendName, BackendLoader] = {"index": _index, "web": _web}


def load_backend(cfg: RetrieverConfig) -> BatchBackend | AsyncBackend:
    """The backend `cfg.backend` names (the config has validated the name)."""
    return BACKENDS[cfg.backend](cfg)
