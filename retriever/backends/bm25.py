"""Sparse retrieval with bm25s (Lucene-style BM25, optional stemming and stop words)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from retriever.backends.base import Hit
from retriever.config import Bm25Manifest
from retriever.corpus import CorpusStore


def _stemmer(name: str | None):  # type: ignore[no-untyped-def]
    if name is None:
        return None
    import Stemmer

    return Stemmer.Stemmer(name)


class Bm25Index:
    def __init__(self, model, m: Bm25Manifest) -> None:  # type: ignore[no-untyped-def]
        self.model = model
        self.m = m
        self.stemmer = _stemmer(m.stemmer)
        self.ntotal = int(model.scores["num_docs"])

    @classmethod
    def build(cls, texts: list[str], out_dir: Path, m: Bm25Manifest) -> Bm25Index:
        import bm25s

        stemmer = _stemmer(m.stemmer)
        tokens = bm25s.tokenize(texts, stopwords=m.stopwords, stemmer=stemmer, show_progress=False)
        model = bm25s.BM25(k1=m.k1, b=m.b, method=m.method)
        model.index(tokens, show_progress=False)
        model.save(str(out_dir))
        return cls(model, m)

    @classmethod
    def load(cls, path: Path, m: Bm25Manifest) -> Bm25Index:
        import bm25s

        return cls(bm25s.BM25.load(str(path), mmap=True), m)

    def search(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids); ids are -1 where a document does not match any query term."""
        import bm25s

        k = min(k, self.ntotal)
        if k == 0 or not queries:
            return np.zeros((len(queries), 0), np.float32), np.zeros((len(queries), 0), np.int64)
        tokens = bm25s.tokenize(
            queries,
            stopwords=self.m.stopwords,
            stemmer=self.stemmer,
            return_ids=False,
            show_progress=False,
        )
        ids, scores = self.model.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        ids = np.asarray(ids, dtype=np.int64)
        scores = np.asarray(scores, dtype=np.float32)
        # Like Lucene, a document sharing no term with the query is not a hit.
        ids[scores <= 0] = -1
        return scores, ids


class Bm25Backend:
    name = "bm25"

    def __init__(self, index: Bm25Index, corpus: CorpusStore) -> None:
        if index.ntotal != len(corpus):
            raise ValueError(f"bm25 index has {index.ntotal} docs, corpus {len(corpus)} rows")
        self.index = index
        self.corpus = corpus

    def search_ids(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        return self.index.search(queries, topk)

    def search_batch(self, queries: list[str], topk: int) -> list[list[Hit]]:
        scores, ids = self.search_ids(queries, topk)
        return [
            [(self.corpus.row(int(i)), float(s)) for s, i in zip(srow, irow, strict=True) if i >= 0]
            for srow, irow in zip(scores, ids, strict=True)
        ]

    def close(self) -> None:
        self.corpus.close()
