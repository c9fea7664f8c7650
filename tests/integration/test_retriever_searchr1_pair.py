"""Loading an existing Search-R1 `e5_Flat.index` + `wiki-18.jsonl` pair without re-encoding.

The pair is written here the way the reference index builder writes it (corpus `contents`
encoded with a `passage: ` prefix, mean pooling, L2 norm, faiss IndexFlatIP, rows in file order),
with an encoder implementation independent of ours, then imported with the CLI and served.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import faiss
import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from harness import synthetic
from harness.retriever_server import RetrieverProcess
from retriever.encoder import default_encoder_path

ROWS = 120


@functools.cache
def reference_model():  # type: ignore[no-untyped-def]
    path = default_encoder_path()
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


def reference_encode(texts: list[str], prefix: str) -> np.ndarray:
    tok, model = reference_model()
    out = []
    with torch.inference_mode():
        for s in range(0, len(texts), 32):
            batch = tok(
                [prefix + t for t in texts[s : s + 32]],
                padding=True,
                truncation=True,
                max_length=256,
                return_tensors="pt",
            )
            h = model(**batch).last_hidden_state
            m = batch["attention_mask"].unsqueeze(-1).float()
            e = (h * m).sum(1) / m.sum(1)
            out.append(torch.nn.functional.normalize(e, dim=-1).numpy())
    return np.concatenate(out).astype(np.float32)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("searchr1")
    rows = list(synthetic.passages(ROWS, seed=4, words=20))
    with open(d / "wiki-18.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    vecs = reference_encode([r["contents"] for r in rows], "passage: ")
    index = faiss.IndexFlatIP(vecs.shape[1])
    index.add(vecs)
    faiss.write_index(index, str(d / "e5_Flat.index"))
    return d, rows, vecs


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stack.cli", "retriever", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def imported(pair):
    d, _, _ = pair
    r = cli(
        "build",
        "--corpus",
        str(d / "wiki-18.jsonl"),
        "--faiss-index",
        str(d / "e5_Flat.index"),
        "--out",
        str(d / "idx"),
    )
    assert r.returncode == 0, r.stderr
    return d / "idx"


def test_import_references_the_files_and_copies_nothing(pair, imported):
    d, _, _ = pair
    manifest = json.loads((imported / "manifest.json").read_text())
    assert manifest["rows"] == ROWS
    assert manifest["corpus_path"] == str(d / "wiki-18.jsonl")
    assert manifest["dense"]["index_file"] == str(d / "e5_Flat.index")
    assert manifest["dense"]["index_type"] == "Flat"
    assert manifest["dense"]["query_prefix"] == "query: "
    assert not (imported / "corpus.jsonl").exists()
    assert not (imported / "dense.faiss").exists()


@pytest.mark.slow  # over 10 s: CI's slow phase (issue 45)
def test_served_results_match_brute_force_over_the_reference_vectors(pair, imported):
    _, rows, vecs = pair
    qs = synthetic.queries(5, corpus_rows=ROWS, corpus_seed=4, seed=9)
    expected = np.argsort(-(reference_encode(qs, "query: ") @ vecs.T), axis=1)[:, :3]
    with RetrieverProcess(imported, grpc=False) as rp:
        body = httpx.post(f"{rp.url}/retrieve", json={"queries": qs}, timeout=30).json()
    assert body["result"] == [[rows[i] for i in row] for row in expected]


def test_mismatched_pair_is_refused_naming_the_counts(pair, tmp_path):
    d, rows, _ = pair
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps(r) + "\n" for r in rows[:-1]))
    r = cli(
        "build",
        "--corpus",
        str(short),
        "--faiss-index",
        str(d / "e5_Flat.index"),
        "--out",
        str(tmp_path / "idx"),
    )
    assert r.returncode == 2
    assert f"holds {ROWS} vectors but the corpus has {ROWS - 1} rows" in r.stderr
