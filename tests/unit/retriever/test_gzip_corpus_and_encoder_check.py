"""Search-R1 ships `wiki-18.jsonl.gz`: the build reads a gzip corpus (dense, BM25, and a faiss
import) as it reads the JSONL; and an imported index is checked against the encoder settings
by re-encoding a sample of rows: a wrong pooling or passage prefix is refused, named."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from harness import synthetic
from retriever.backends.registry import load_index_backend
from retriever.build import build_index
from retriever.config import BuildConfig, RetrieverConfig
from retriever.corpus import CorpusStore, iter_jsonl

ROWS = 24


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("gz")
    plain = synthetic.write_corpus(d / "wiki.jsonl", ROWS, seed=3, words=12)
    gz = d / "wiki.jsonl.gz"
    with open(plain, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return plain, gz


@pytest.fixture(scope="module")
def dense_index(corpora: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Flat index encoded the e5 way (passage prefix, mean pooling): our e5_Flat.index."""
    plain, _ = corpora
    out = tmp_path_factory.mktemp("dense") / "idx"
    build_index(plain, out, BuildConfig(progress=False))
    return out / "dense.faiss"


def _first_hit(index_dir: Path, query: str) -> dict:
    backend = load_index_backend(index_dir, RetrieverConfig())
    try:
        return backend.search_batch([query], 1)[0][0][0]
    finally:
        backend.close()


def test_iter_jsonl_reads_gzip(corpora: tuple[Path, Path]) -> None:
    plain, gz = corpora
    assert list(iter_jsonl(gz)) == list(iter_jsonl(plain))


def test_corpus_store_refuses_gzip_naming_the_fix(corpora: tuple[Path, Path]) -> None:
    _, gz = corpora
    with pytest.raises(ValueError, match=r"gzip.*retriever build"):
        CorpusStore.open(gz)


@pytest.mark.parametrize("backend", ["bm25", "dense"])
def test_build_from_gzip(corpora: tuple[Path, Path], tmp_path: Path, backend: str) -> None:
    _, gz = corpora
    m = build_index(gz, tmp_path / "idx", BuildConfig(backend=backend, progress=False))
    assert m.rows == ROWS and m.corpus_path == "corpus.jsonl"
    rows = list(synthetic.passages(ROWS, seed=3, words=12))
    assert _first_hit(tmp_path / "idx", rows[5]["contents"]) == rows[5]


def test_faiss_import_with_a_gzip_corpus(
    corpora: tuple[Path, Path], dense_index: Path, tmp_path: Path
) -> None:
    _, gz = corpora
    cfg = BuildConfig(faiss_index=str(dense_index), copy_corpus=False, progress=False)
    m = build_index(gz, tmp_path / "idx", cfg)
    # The gzip cannot be memory-mapped: decompressed into the index directory.
    assert m.rows == ROWS and m.corpus_path == "corpus.jsonl"
    rows = list(synthetic.passages(ROWS, seed=3, words=12))
    assert _first_hit(tmp_path / "idx", rows[7]["contents"]) == rows[7]


@pytest.mark.parametrize(
    ("setting", "wrong", "named"),
    [
        ("pooling", "cls", r"pooling='mean'"),
        ("passage_prefix", "", r"passage_prefix='passage: '"),
    ],
)
def test_import_refuses_an_encoder_that_does_not_reproduce_the_index(
    corpora: tuple[Path, Path],
    dense_index: Path,
    tmp_path: Path,
    setting: str,
    wrong: str,
    named: str,
) -> None:
    plain, _ = corpora
    cfg = BuildConfig(faiss_index=str(dense_index), progress=False, **{setting: wrong})
    with pytest.raises(ValueError, match=named) as e:
        build_index(plain, tmp_path / "idx", cfg)
    assert "do not match" in str(e.value) and setting in str(e.value)
    assert not (tmp_path / "idx" / "manifest.json").exists()


def test_import_accepts_the_right_encoder(
    corpora: tuple[Path, Path], dense_index: Path, tmp_path: Path
) -> None:
    plain, _ = corpora
    cfg = BuildConfig(faiss_index=str(dense_index), progress=False)
    assert build_index(plain, tmp_path / "idx", cfg).rows == ROWS
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["dense"]["pooling"] == "mean"
