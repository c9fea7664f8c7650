"""Dense retrieval: encode queries, search a faiss index (Flat / HNSW / IVF), map ids to rows.

For a Flat inner-product index there are two exact search paths. On one CPU core faiss Flat is
memory-bound and, for a batch of queries, slower than a torch matmul + top-k (platform spec;
measured again in docs/benchmarks.md), and on a GPU faiss-cpu is not an option at all, so
`flat_search: auto` uses torch over a zero-copy view of faiss's own vectors (a copy on GPU).
Not for a handful of queries on a CPU, though: there torch takes a matrix-vector path that
scans the vectors ~2.8x slower than faiss does, once per query (`_FAISS_MAX_QUERIES`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from retriever.backends.base import Hit, InlinePath
from retriever.config import DenseConfig
from retriever.corpus import CorpusStore
from retriever.encoder import Encoder, EncoderProcess, EncoderSpec, resolve_device
from retriever.manifest import DenseManifest

log = logging.getLogger(__name__)

# Rows scored per matmul on the torch path: bounds the (queries x rows) score matrix
# (64 x 1M fp32 = 256 MB) so a 21M-row corpus never allocates tens of GB at once.
_TORCH_CHUNK_ROWS = 1 << 20

# On a CPU, `flat_search: auto` hands a batch of at most this many queries to faiss. For 1-3
# queries torch multiplies matrix by vector, once per query, at ~8.4 ms a query over 50,000 x 384
# on one core, where faiss's scan takes ~3.0 ms a query; from 4 queries torch switches to a
# matrix-matrix product (~13 ms for 4, ~19 ms for 16), which faiss's per-query scans (~11 and
# ~48 ms) lose to from 5 on (docs/benchmarks.md, retriever section, 2026-11-27). A lone query
# (concurrency 1, the inline path) is the case that matters: the reference server's faiss scan.
_FAISS_MAX_QUERIES = 4


class DenseIndex:
    """Exact or approximate nearest-neighbour search over passage vectors."""

    def __init__(self, index, cfg: DenseConfig) -> None:  # type: ignore[no-untyped-def]
        import faiss

        self.index = index  # owns the memory that the views below point into
        self.ntotal = int(index.ntotal)
        self.dim = int(index.d)
        self._torch_vectors = None
        # Batches of up to this many queries go to faiss even on the torch path (CPU, auto).
        self.faiss_max_queries = 0
        faiss.omp_set_num_threads(cfg.torch_threads)
        typed = faiss.downcast_index(index)
        if isinstance(typed, faiss.IndexHNSW):
            typed.hnsw.efSearch = cfg.hnsw_ef_search
        if isinstance(typed, faiss.IndexIVF):
            typed.nprobe = cfg.ivf_nprobe
        # The torch path computes inner products: only for a Flat inner-product index.
        use_torch = (
            isinstance(typed, faiss.IndexFlat)
            and typed.metric_type == faiss.METRIC_INNER_PRODUCT
            and cfg.flat_search != "faiss"
        )
        if use_torch:
            device = resolve_device(cfg.device)
            self._torch_vectors = self._torch_view(typed, device)
            if cfg.flat_search == "auto" and device == "cpu":
                self.faiss_max_queries = _FAISS_MAX_QUERIES
        self.search_path = "torch" if use_torch else "faiss"

    def _torch_view(self, flat, device: str):  # type: ignore[no-untyped-def]
        import faiss
        import torch

        n, d = int(flat.ntotal), int(flat.d)
        if n == 0:
            return torch.zeros((0, d), dtype=torch.float32, device=device)
        # Zero-copy view of faiss's contiguous float32 storage: no second copy of the corpus.
        xb = faiss.rev_swig_ptr(flat.get_xb(), n * d).reshape(n, d)
        vecs = torch.from_numpy(xb)
        if device.startswith("cuda"):
            vecs = vecs.to(device=device, dtype=torch.float16)
        return vecs

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), each (n_queries, k'); k' = min(k, ntotal); ids -1 where fewer found."""
        k = min(k, self.ntotal)
        if k == 0 or len(queries) == 0:
            return np.zeros((len(queries), 0), np.float32), np.zeros((len(queries), 0), np.int64)
        if self._torch_vectors is None or len(queries) <= self.faiss_max_queries:
            scores, ids = self.index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
            return scores, ids
        return self._torch_search(queries, k)

    def _torch_search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        import torch

        vecs = self._torch_vectors
        q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))
        q = q.to(device=vecs.device, dtype=vecs.dtype)
        best_s: torch.Tensor | None = None
        best_i: torch.Tensor | None = None
        with torch.inference_mode():
            for start in range(0, self.ntotal, _TORCH_CHUNK_ROWS):
                block = vecs[start : start + _TORCH_CHUNK_ROWS]
                s, i = torch.topk(q @ block.T, min(k, block.shape[0]), dim=1)
                i = i + start
                if best_s is None:
                    best_s, best_i = s, i
                else:
                    s = torch.cat([best_s, s], dim=1)
                    i = torch.cat([best_i, i], dim=1)
                    best_s, pos = torch.topk(s, k, dim=1)
                    best_i = torch.gather(i, 1, pos)
        assert best_s is not None and best_i is not None
        return best_s.float().cpu().numpy(), best_i.cpu().numpy()


class DenseBackend:
    """Encoder + index + corpus: queries in, corpus rows with scores out.

    With the encoder in a child process, `inline_encoder` is a second, in-process copy for
    `inline_path` (a lone query when nothing else waits); the same model, spec and thread count,
    so the vectors, and the hits, are the same whichever encodes them.
    """

    name = "dense"

    def __init__(
        self,
        encoder: Encoder | EncoderProcess,
        index: DenseIndex,
        corpus: CorpusStore,
        cfg: DenseConfig,
        *,
        inline_encoder: Encoder | None = None,
    ):
        if index.ntotal != len(corpus):
            raise ValueError(
                f"the faiss index holds {index.ntotal} vectors but the corpus has {len(corpus)} "
                "rows; they must correspond row by row"
            )
        if index.dim != encoder.dim:
            raise ValueError(f"index dim {index.dim} != encoder dim {encoder.dim}")
        self.encoder = encoder
        self.inline_encoder = encoder if isinstance(encoder, Encoder) else inline_encoder
        self.index = index
        self.corpus = corpus
        self.cfg = cfg

    @classmethod
    def load(
        cls,
        index_dir: Path,
        m: DenseManifest,
        index_file: Path,
        corpus: CorpusStore,
        cfg: DenseConfig,
    ) -> DenseBackend:
        import faiss
        import torch

        torch.set_num_threads(cfg.torch_threads)
        spec = EncoderSpec(
            model_path=cfg.encoder_path or m.encoder_path,
            query_prefix=m.query_prefix,
            passage_prefix=m.passage_prefix,
            pooling=m.pooling,
            normalize=m.normalize,
            max_length=m.max_length,
        )
        encoder: Encoder | EncoderProcess
        inline_encoder = None
        in_child = cfg.encoder_process
        if in_child == "auto":
            in_child = resolve_device(cfg.device) == "cpu"
        if in_child:
            threads = cfg.encoder_threads or cfg.torch_threads
            # The inline copy loads here while the child loads its own (each ~5 s on a CPU):
            # a retriever is ready in the time of one load, not two.
            with ThreadPoolExecutor(1, thread_name_prefix="inline-encoder") as loader:
                inline = None
                if cfg.inline_max_queries > 0:
                    inline = loader.submit(Encoder, spec, device=cfg.device)
                encoder = EncoderProcess(spec, device=cfg.device, torch_threads=threads)
                try:
                    inline_encoder = inline.result() if inline is not None else None
                except BaseException:
                    encoder.close()
                    raise
        else:
            encoder = Encoder(spec, device=cfg.device)
        index = DenseIndex(faiss.read_index(str(index_file)), cfg)
        log.info(
            "dense index loaded",
            extra={"rows": index.ntotal, "dim": index.dim, "search_path": index.search_path},
        )
        return cls(encoder, index, corpus, cfg, inline_encoder=inline_encoder)

    def search_ids(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        vecs = self.encoder.encode(queries, is_query=True, batch_size=self.cfg.encode_batch_size)
        return self.index.search(vecs, topk)

    def search_batch(self, queries: list[str], topk: int) -> list[list[Hit]]:
        return self._search_stage(self._encode_stage((queries, topk)))

    def stages(self) -> list[Callable[[Any], Any]]:
        """Two pipeline stages for the batcher: encoding overlaps the previous batch's search."""
        return [self._encode_stage, self._search_stage]

    def inline_path(self) -> InlinePath | None:
        """Encode and search in one call on the batching thread, in this process."""
        if self.inline_encoder is None or self.cfg.inline_max_queries == 0:
            return None
        return InlinePath(self._search_inline, self.cfg.inline_max_queries)

    def _search_inline(self, queries: list[str], topk: int) -> list[list[Hit]]:
        assert self.inline_encoder is not None
        vecs = self.inline_encoder.encode(
            queries, is_query=True, batch_size=self.cfg.encode_batch_size
        )
        return self._search_stage((vecs, topk))

    def _encode_stage(self, args: tuple[list[str], int]) -> tuple[np.ndarray, int]:
        queries, topk = args
        return self.encoder.encode(
            queries, is_query=True, batch_size=self.cfg.encode_batch_size
        ), topk

    def _search_stage(self, args: tuple[np.ndarray, int]) -> list[list[Hit]]:
        vecs, topk = args
        scores, ids = self.index.search(vecs, topk)
        return [
            [(self.corpus.row(int(i)), float(s)) for s, i in zip(srow, irow, strict=True) if i >= 0]
            for srow, irow in zip(scores, ids, strict=True)
        ]

    def healthy(self) -> bool:
        return not isinstance(self.encoder, EncoderProcess) or self.encoder.alive()

    def close(self) -> None:
        if isinstance(self.encoder, EncoderProcess):
            self.encoder.close()
        self.corpus.close()
