"""Cross-encoder rerank over BM25 candidates, with a tiny random cross-encoder built offline."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

from harness import synthetic
from retriever.backends.registry import load_backend
from retriever.build import build_index
from retriever.config import BuildConfig, RetrieverConfig
from retriever.encoder import default_encoder_path

ROWS = 60


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("xenc")
    tok = AutoTokenizer.from_pretrained(default_encoder_path())
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=1,
    )
    BertForSequenceClassification(cfg).eval().save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def bm25_index(tmp_path_factory):
    d = tmp_path_factory.mktemp("rr")
    corpus = synthetic.write_corpus(d / "c.jsonl", ROWS, words=12)
    build_index(corpus, d / "idx", BuildConfig(backend="bm25", progress=False))
    return d / "idx"


def direct_scores(model_dir, query: str, passages: list[str]) -> np.ndarray:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = BertForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        batch = tok([query] * len(passages), passages, padding=True, return_tensors="pt")
        return model(**batch).logits[:, 0].numpy()


def test_rerank_orders_candidates_by_the_cross_encoder(bm25_index, cross_encoder_dir):
    cfg = RetrieverConfig.model_validate(
        {
            "index_dir": str(bm25_index),
            "rerank": {"model_path": str(cross_encoder_dir), "candidates": 6, "batch_size": 4},
        }
    )
    backend = load_backend(cfg)
    try:
        assert backend.name == "bm25+rerank"
        query = "castle harbor library museum"
        candidates = backend.inner.search_batch([query], 6)[0]
        got = backend.search_batch([query, "railway"], 3)
    finally:
        backend.close()
    expected = direct_scores(cross_encoder_dir, query, [d["contents"] for d, _ in candidates])
    order = np.argsort(-expected, kind="stable")[:3]
    assert order.tolist() != [0, 1, 2]  # the rerank really changes BM25's order here
    assert [d["id"] for d, _ in got[0]] == [candidates[i][0]["id"] for i in order]
    assert [s for _, s in got[0]] == pytest.approx(expected[order].tolist(), abs=1e-4)
    assert len(got[1]) <= 3
