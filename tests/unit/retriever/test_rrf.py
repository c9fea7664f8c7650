from __future__ import annotations

import numpy as np
import pytest

from retriever.backends.hybrid import rrf_fuse


def test_rrf_hand_computed():
    # Query 0: dense ranks [5, 7], bm25 ranks [7, 9 (missing: -1)].
    dense = (np.zeros((1, 2)), np.array([[5, 7]]))
    bm25 = (np.zeros((1, 2)), np.array([[7, -1]]))
    fused = rrf_fuse([dense, bm25], topk=3, rrf_k=60)
    # 7: 1/62 + 1/61; 5: 1/61.
    assert [i for i, _ in fused[0]] == [7, 5]
    assert fused[0][0][1] == pytest.approx(1 / 62 + 1 / 61)
    assert fused[0][1][1] == pytest.approx(1 / 61)


def test_rrf_truncates_and_breaks_ties_by_id():
    a = (np.zeros((1, 2)), np.array([[3, 1]]))
    b = (np.zeros((1, 2)), np.array([[1, 3]]))
    fused = rrf_fuse([a, b], topk=1, rrf_k=10)
    assert fused == [[(1, pytest.approx(1 / 11 + 1 / 12))]]
