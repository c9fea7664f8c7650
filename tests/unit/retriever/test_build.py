from __future__ import annotations

import json

import pytest

from harness import synthetic
from retriever.backends.registry import load_index_backend
from retriever.build import build_index
from retriever.config import BuildConfig, RetrieverConfig
from retriever.encoder import DEFAULT_ENCODER, default_encoder_path, resolve_model_path

ROWS = 40


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return synthetic.write_corpus(tmp_path_factory.mktemp("b") / "c.jsonl", ROWS, words=6)


@pytest.mark.parametrize(
    ("index_type", "params"),
    [
        ("HNSW", {"index_type": "HNSW", "m": 8, "ef_construction": 200}),
        ("IVF", {"index_type": "IVF", "nlist": 4, "train_size": 100000}),
    ],
)
def test_approximate_indexes_build_and_find_each_passage(corpus, tmp_path, index_type, params):
    # No prefixes: a passage's own text as the query must come back first with score 1.
    cfg = BuildConfig(
        index_type=index_type,
        hnsw_m=8,
        ivf_nlist=4,
        query_prefix="",
        passage_prefix="",
        progress=False,
    )
    m = build_index(corpus, tmp_path / "idx", cfg)
    assert m.rows == ROWS and m.dense is not None
    assert m.dense.index_type == index_type
    assert m.dense.build_params == params
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["dense"]["dim"] == 384 and manifest["corpus_path"] == "corpus.jsonl"
    # The default encoder is recorded portably, not by this machine's install path.
    assert manifest["dense"]["encoder_path"] == DEFAULT_ENCODER
    backend = load_index_backend(
        tmp_path / "idx", RetrieverConfig.model_validate({"dense": {"ivf_nprobe": 4}})
    )
    rows = list(synthetic.passages(ROWS, words=6))
    try:
        hits = backend.search_batch([rows[3]["contents"], rows[30]["contents"]], 2)
    finally:
        backend.close()
    assert [h[0][0] for h in hits] == [rows[3], rows[30]]
    assert hits[0][0][1] == pytest.approx(1.0, abs=1e-4)


def test_build_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="corpus file not found"):
        build_index(tmp_path / "missing.jsonl", tmp_path / "idx")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="has no rows"):
        build_index(empty, tmp_path / "idx")
    with pytest.raises(ValueError, match=r"no manifest\.json"):
        load_index_backend(tmp_path, RetrieverConfig())


def test_encoder_path_resolution(tmp_path):
    assert resolve_model_path(DEFAULT_ENCODER) == default_encoder_path()
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match=r"retriever\.dense\.encoder_path"):
        resolve_model_path(str(tmp_path / "moved-away"))


def test_cpu_encoder_runs_in_a_child_process_by_default(corpus, tmp_path):
    """auto: a CPU encoder shares no GIL with the HTTP server; `false` keeps it in-process."""
    from retriever.encoder import Encoder, EncoderProcess

    build_index(corpus, tmp_path / "idx", BuildConfig(progress=False))
    query = [next(iter(synthetic.passages(ROWS, words=6)))["contents"]]
    results = {}
    for setting, kind in (("auto", EncoderProcess), (False, Encoder)):
        cfg = RetrieverConfig.model_validate({"dense": {"encoder_process": setting}})
        backend = load_index_backend(tmp_path / "idx", cfg)
        try:
            assert type(backend.encoder) is kind
            results[setting] = backend.search_batch(query, 3)
        finally:
            backend.close()
    assert [h[0]["id"] for h in results["auto"][0]] == [h[0]["id"] for h in results[False][0]]


@pytest.mark.slow  # over 10 s: CI's slow phase (issue 45)
def test_the_child_encoder_takes_its_own_thread_count(corpus, tmp_path):
    """`dense.encoder_threads` sizes the child's intra-op pool (it encodes whole queued
    batches); unset, it follows `torch_threads` like the in-process paths."""
    build_index(corpus, tmp_path / "idx", BuildConfig(progress=False))
    for dense, want in (({}, 1), ({"torch_threads": 2}, 2), ({"encoder_threads": 2}, 2)):
        cfg = RetrieverConfig.model_validate({"dense": {"encoder_process": True, **dense}})
        backend = load_index_backend(tmp_path / "idx", cfg)
        try:
            assert backend.encoder.threads == want
        finally:
            backend.close()
