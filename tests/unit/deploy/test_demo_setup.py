"""docker/demo_setup.py: what the compose `cpu` profile puts into its volumes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.unit.deploy import stack


def _demo_setup():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("demo_setup", stack.DOCKER / "demo_setup.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_questions_are_answered_by_their_passage(tmp_path: Path) -> None:
    ds = _demo_setup()
    corpus = ds.write_corpus(tmp_path / "corpus.jsonl", 60, seed=0)
    pairs = ds.qa_pairs(corpus, 20)
    assert len(pairs) == 20
    docs = [json.loads(line)["contents"] for line in corpus.read_text().splitlines()]
    for (question, answer), doc in zip(pairs, docs, strict=False):
        title, body = doc.split("\n", 1)
        assert title.strip('"') in question
        words = body.split()
        # The answer is the passage's most frequent non-filler word: more often than any other
        # word that is not in a third of all passages.
        assert words.count(answer) >= 2 and answer not in title


def test_rows_are_search_r1_rows_and_idempotent(tmp_path: Path) -> None:
    from orchestrator.data import load_prompts

    ds = _demo_setup()
    corpus = ds.write_corpus(tmp_path / "corpus.jsonl", 40, seed=0)
    rows = ds.write_rows(corpus, tmp_path / "data" / "train.jsonl", 10)
    prompts = load_prompts(rows)
    assert len(prompts) == 10
    before = rows.read_bytes()
    ds.write_rows(corpus, rows, 5)  # exists: kept as is
    assert rows.read_bytes() == before
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.slow
def test_full_setup_builds_every_artifact(tmp_path: Path) -> None:
    ds = _demo_setup()
    dirs = {k: tmp_path / k for k in ("corpus", "index", "data", "models")}
    argv = [f"--{k}-dir" if k != "models" else "--model-dir" for k in dirs]
    args = [x for flag, d in zip(argv, dirs.values(), strict=True) for x in (flag, str(d))]
    ds.main([*args, "--passages", "50", "--questions", "10"])
    assert (dirs["index"] / "manifest.json").exists()
    assert (dirs["models"] / "config.json").exists()
    assert (dirs["data"] / "train.jsonl").exists()
