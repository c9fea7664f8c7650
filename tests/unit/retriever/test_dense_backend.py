"""Dense backend: where queries are encoded (inline in this process, or the child encoder) never
changes the hits."""

from __future__ import annotations

import asyncio

import pytest

from harness import synthetic
from retriever.backends.registry import load_backend
from retriever.config import DenseConfig, RetrieverConfig
from retriever.encoder import Encoder, EncoderProcess
from retriever.engine import RetrieverEngine

ROWS = 120
QUERIES = synthetic.queries(12, corpus_rows=ROWS, seed=5)


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    return synthetic.dense_index(tmp_path_factory.mktemp("dense"), ROWS)


def config(index_dir, **dense) -> RetrieverConfig:
    return RetrieverConfig(
        index_dir=str(index_dir), cache={"size": 0}, dense=DenseConfig(device="cpu", **dense)
    )


def assert_same_hits(a, b) -> None:
    """The same ids in the same order, scores within 1e-5: a query encoded in a batch of others
    and one encoded alone differ in the last float bits (0.347799 vs 0.347798 at 6 decimals)."""
    assert [[doc["id"] for doc, _ in hits] for hits in a] == [
        [doc["id"] for doc, _ in hits] for hits in b
    ]
    for x, y in zip(a, b, strict=True):
        assert [s for _, s in x] == pytest.approx([s for _, s in y], abs=1e-5)


def test_with_a_child_encoder_lone_queries_are_encoded_in_process_with_the_same_hits(index_dir):
    backend = load_backend(config(index_dir, encoder_process=True))
    try:
        assert isinstance(backend.encoder, EncoderProcess)
        assert isinstance(backend.inline_encoder, Encoder)
        inline = backend.inline_path()
        assert inline is not None and inline.max_queries == 1
        for q in QUERIES:
            assert_same_hits(inline.search([q], 5), backend.search_batch([q], 5))  # child
    finally:
        backend.close()


def test_in_process_encoder_is_its_own_inline_encoder_and_zero_disables_it(index_dir):
    backend = load_backend(config(index_dir, encoder_process=False))
    try:
        assert backend.inline_encoder is backend.encoder
        assert backend.inline_path() is not None
    finally:
        backend.close()
    backend = load_backend(config(index_dir, encoder_process=True, inline_max_queries=0))
    try:
        assert backend.inline_encoder is None  # no second copy of the model
        assert backend.inline_path() is None
    finally:
        backend.close()


async def test_engine_answers_alike_whether_requests_come_alone_or_queue_up(index_dir):
    eng = RetrieverEngine(load_backend(config(index_dir, encoder_process=True)), config(index_dir))
    try:
        alone = [await eng.search([q], 3) for q in QUERIES]
        assert eng.batcher is not None and eng.batcher.inline_batches == len(QUERIES)
        together = await asyncio.gather(*(eng.search([q], 3) for q in QUERIES))
        # Concurrent requests queued behind the first: batched through the child encoder.
        assert eng.batcher.inline_batches < 2 * len(QUERIES)
        assert eng.batcher.batches - eng.batcher.inline_batches >= 1
    finally:
        await eng.aclose()
    for x, y in zip(together, alone, strict=True):
        assert_same_hits(x, y)
