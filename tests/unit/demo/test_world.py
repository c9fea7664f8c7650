"""The demo's synthetic world: deterministic, answerable only by searching, corpus format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from demos.world import generate_world, person_of, write_world


def test_same_seed_same_world_other_seed_other_world() -> None:
    assert generate_world(3) == generate_world(3)
    assert generate_world(3).people != generate_world(4).people


def test_every_answer_is_in_the_corpus_reachable_by_the_hops() -> None:
    world = generate_world(0, n_people=100)
    docs = {r["contents"].split("\n")[0].strip('"'): r["contents"] for r in world.corpus_rows()}
    for q in world.questions:
        person = person_of(q)
        person_doc = docs[person]
        town = person_doc.rsplit(" born in ", 1)[1].rstrip(".")
        if q.hops == 1:
            assert q.answers == [town]
        else:
            assert f"is a town in {q.answers[0]}." in docs[town]


def test_corpus_rows_use_the_search_r1_format() -> None:
    row = generate_world(0, n_people=5).corpus_rows()[0]
    assert set(row) == {"id", "contents"}
    title, body = row["contents"].split("\n", 1)
    assert title.startswith('"') and title.endswith('"')
    assert body.startswith(title.strip('"'))


def test_names_are_unique_and_splits_are_disjoint() -> None:
    world = generate_world(1)
    names = [p.name for p in world.people] + [t.name for t in world.towns] + world.countries
    assert len(names) == len(set(names))
    train, test = world.split("train"), world.split("test")
    assert train and test
    assert not {q.question for q in train} & {q.question for q in test}
    assert {q.hops for q in world.questions} == {1, 2}


def test_write_world_files(tmp_path: Path) -> None:
    paths = write_world(generate_world(0, n_people=20), tmp_path)
    corpus = [json.loads(line) for line in paths["corpus"].read_text().splitlines()]
    assert len(corpus) == 20 + 40 + 8
    row = json.loads(paths["train"].read_text().splitlines()[0])
    assert {"question", "golden_answers", "id"} <= set(row)


def test_bad_fractions_are_rejected() -> None:
    with pytest.raises(ValueError, match="test_fraction"):
        generate_world(0, test_fraction=1.5)


def test_the_demo_tokenizer_makes_every_name_one_token(tmp_path: Path) -> None:
    """Copying an answer from a passage is then a single token (what the tiny model can learn)."""
    from transformers import AutoTokenizer

    from demos.run import tokenizer_corpus
    from inference.tiny_model import make_tiny_model

    world = generate_world(0, n_people=50)
    texts, vocab_size = tokenizer_corpus(world)
    model_dir = make_tiny_model(tmp_path / "m", hidden_size=16, num_layers=1,
                                vocab_corpus=texts, vocab_size=vocab_size)  # fmt: skip
    tok = AutoTokenizer.from_pretrained(model_dir)
    lengths = {n: len(tok.encode(" " + n, add_special_tokens=False)) for n in world.entity_names()}
    assert set(lengths.values()) == {1}, {n: k for n, k in lengths.items() if k != 1}
