from __future__ import annotations

import faiss
import numpy as np
import pytest

import retriever.backends.dense as dense_mod
from retriever.backends.dense import DenseIndex
from retriever.config import DenseConfig


def _flat(vecs: np.ndarray):
    index = faiss.IndexFlatIP(vecs.shape[1])
    index.add(vecs)
    return index


def test_hand_computed_inner_product_ranking():
    vecs = np.array([[1, 0], [0, 1], [0.6, 0.8]], dtype=np.float32)
    q = np.array([[0.8, 0.6]], dtype=np.float32)
    # scores: 0.8, 0.6, 0.48 + 0.48 = 0.96
    for path in ("torch", "faiss"):
        idx = DenseIndex(_flat(vecs), DenseConfig(flat_search=path, device="cpu"))
        scores, ids = idx.search(q, 2)
        assert ids.tolist() == [[2, 0]]
        assert scores[0] == pytest.approx([0.96, 0.8])
        assert idx.search_path == path


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_torch_path_equals_brute_force_also_when_chunked(monkeypatch, chunk):
    monkeypatch.setattr(dense_mod, "_TORCH_CHUNK_ROWS", chunk)
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((50, 8)).astype(np.float32)
    qs = rng.standard_normal((4, 8)).astype(np.float32)
    idx = DenseIndex(_flat(vecs), DenseConfig(flat_search="torch", device="cpu"))
    scores, ids = idx.search(qs, 5)
    expect = np.argsort(-(qs @ vecs.T), axis=1)[:, :5]
    assert ids.tolist() == expect.tolist()
    assert scores == pytest.approx(np.take_along_axis(qs @ vecs.T, expect, 1), rel=1e-5)


def test_topk_larger_than_corpus_is_clipped():
    vecs = np.eye(3, dtype=np.float32)
    idx = DenseIndex(_flat(vecs), DenseConfig(device="cpu"))
    _, ids = idx.search(np.eye(3, dtype=np.float32)[:1], 10)
    assert ids.shape == (1, 3)
    assert ids[0, 0] == 0


def test_hnsw_and_ivf_indexes_find_the_exact_match():
    rng = np.random.default_rng(1)
    vecs = rng.standard_normal((200, 16)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    hnsw = faiss.IndexHNSWFlat(16, 8, faiss.METRIC_INNER_PRODUCT)
    hnsw.add(vecs)
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(16), 16, 4, faiss.METRIC_INNER_PRODUCT)
    ivf.train(vecs)
    ivf.add(vecs)
    for raw in (hnsw, ivf):
        idx = DenseIndex(raw, DenseConfig(device="cpu", ivf_nprobe=4))
        assert idx.search_path == "faiss"
        _, ids = idx.search(vecs[[10, 20]], 1)
        assert ids[:, 0].tolist() == [10, 20]


def test_l2_flat_index_is_searched_by_faiss_not_the_inner_product_path():
    vecs = np.array([[0, 0], [3, 4]], dtype=np.float32)
    raw = faiss.IndexFlatL2(2)
    raw.add(vecs)
    idx = DenseIndex(raw, DenseConfig(device="cpu"))
    assert idx.search_path == "faiss"
    scores, ids = idx.search(np.array([[3, 3]], dtype=np.float32), 2)
    assert ids.tolist() == [[1, 0]]  # squared distances 1 and 18
    assert scores[0] == pytest.approx([1.0, 18.0])


def test_auto_on_cpu_searches_a_few_queries_with_faiss_and_batches_with_torch(monkeypatch):
    # torch's matrix-vector path scans ~2.8x slower than faiss for 1-3 queries on a CPU: a lone
    # query (concurrency 1) is searched by faiss, a batch by torch; the hits are the same.
    rng = np.random.default_rng(2)
    vecs = rng.standard_normal((300, 16)).astype(np.float32)
    qs = rng.standard_normal((9, 16)).astype(np.float32)
    auto = DenseIndex(_flat(vecs), DenseConfig(device="cpu"))
    forced = DenseIndex(_flat(vecs), DenseConfig(flat_search="torch", device="cpu"))
    assert auto.search_path == "torch"
    assert auto.faiss_max_queries == dense_mod._FAISS_MAX_QUERIES == 4
    assert forced.faiss_max_queries == 0
    torch_calls: list[int] = []
    real = DenseIndex._torch_search

    def counting(self, queries, k):
        torch_calls.append(len(queries))
        return real(self, queries, k)

    monkeypatch.setattr(DenseIndex, "_torch_search", counting)
    for n in (1, 4, 5, 9):
        scores, ids = auto.search(qs[:n], 5)
        expect = np.argsort(-(qs[:n] @ vecs.T), axis=1)[:, :5]
        assert ids.tolist() == expect.tolist()
        assert scores == pytest.approx(np.take_along_axis(qs[:n] @ vecs.T, expect, 1), rel=1e-5)
    assert torch_calls == [5, 9]
    forced.search(qs[:1], 5)  # flat_search: torch means torch, whatever the batch
    assert torch_calls == [5, 9, 1]
