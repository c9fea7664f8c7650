"""Dense backend: where queries are encoded (inline in this process, or the child encoder) never
changes the hits."""

from __future__ import annotations

import asyncio

import pytest

from retriever.backends import load_backend
from retriever.build import BuildConfig, build_index
from retriever.config import DenseConfig, RetrieverConfig
from retriever.encoder import Encoder, EncoderProcess
from retriever.engine import RetrieverEngine
from tests.support import synthetic

ROWS = 120
QUERIES = synthetic.queries(12, corpus_rows=ROWS, seed=5)


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dense")
    corpus = synthetic.write_corpus(d / "corpus.jsonl", ROWS, words=20)
    build_index(corpus, d / "index", BuildConfig(max_length=48, progress=False))
    return d / "index"


def config(index_dir, **dense) -> RetrieverConfig:
    return RetrieverConfig(
        index_dir=str(index_dir), cache={"size": 0}, dense=DenseConfig(device="cpu", **dense)
    )


def ids_and_scores(results):
    return [[(doc["id"], round(score, 6)) for doc, score in hits] for hits in results]


def test_with_a_child_encoder_lone_queries_are_encoded_in_process_with_the_same_hits(index_dir):
    backend = load_backend(config(index_dir, encoder_process=True))
    try:
        assert isinstance(backend.encoder, EncoderProcess)
        assert isinstance(backend.inline_encoder, Encoder)
        inline = backend.inline_path()
        assert inline is not None and inline.max_queries == 1
        for q in QUERIES:
            assert ids_and_scores(inline.search([q], 5)) == ids_and_scores(
                backend.search_batch([q], 5)  # encoded by the child
            )
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
    assert [ids_and_scores(r) for r in together] == [ids_and_scores(r) for r in alone]
