"""A deterministic synthetic corpus in the Search-R1 format, for tests, benchmarks and demos.

Each passage is about one made-up entity: `"Title"\nbody` with ~`words` words mixing the
entity's own topic words and common filler, so that a query naming an entity's topic words
has a clear best passage (for both dense and BM25 retrieval).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from retriever.build import build_index
from retriever.config import BuildConfig

_SYL = ["ka", "lo", "mi", "ra", "ten", "vo", "shi", "dar", "el", "gu", "pan", "zo", "ri", "mon"]
_FILLER = [
    "the",
    "of",
    "and",
    "in",
    "to",
    "was",
    "is",
    "for",
    "on",
    "as",
    "with",
    "by",
    "at",
    "from",
    "his",
    "her",
    "their",
    "it",
    "an",
    "which",
    "were",
    "also",
    "city",
    "river",
    "king",
    "war",
    "year",
    "born",
    "known",
    "first",
    "later",
    "founded",
    "capital",
    "people",
    "church",
    "school",
    "team",
    "album",
    "film",
    "village",
    "county",
    "family",
    "member",
    "north",
    "south",
    "island",
    "mountain",
    "music",
    "party",
]
_TOPICS = [
    "bridge",
    "castle",
    "harbor",
    "library",
    "museum",
    "railway",
    "theater",
    "university",
    "cathedral",
    "festival",
    "battle",
    "treaty",
    "dynasty",
    "empire",
    "mine",
    "garden",
    "lighthouse",
    "observatory",
    "canal",
    "fortress",
    "market",
    "monastery",
    "palace",
    "stadium",
    "tower",
    "valley",
    "volcano",
    "desert",
    "forest",
    "glacier",
    "lake",
]


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYL) for _ in range(rng.randint(2, 3))).capitalize()


def _title(seed: int, i: int) -> str:
    rng = random.Random(f"title-{seed}-{i}")
    return f"{_name(rng)} {_name(rng)}"


def passages(n: int, *, seed: int = 0, words: int = 100) -> Iterator[dict[str, str]]:
    for i in range(n):
        rng = random.Random(f"body-{seed}-{i}")
        title = _title(seed, i)
        topic = rng.sample(_TOPICS, 3)
        first = title.split()[0]
        body = []
        for _ in range(words):
            r = rng.random()
            body.append(
                rng.choice(topic) if r < 0.15 else first if r < 0.2 else rng.choice(_FILLER)
            )
        yield {"id": str(i), "contents": f'"{title}"\n' + " ".join(body)}


def write_corpus(path: Path, n: int, *, seed: int = 0, words: int = 100) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in passages(n, seed=seed, words=words):
            f.write(json.dumps(row) + "\n")
    return path


def queries(n: int, *, corpus_rows: int, corpus_seed: int = 0, seed: int = 1) -> list[str]:
    """Questions naming the titles of random rows of `passages(corpus_rows, seed=corpus_seed)`."""
    rng = random.Random(seed)
    forms = [
        "who founded the {t}",
        "where is the {t} {w}",
        "when was {t} built",
        "what is the history of the {w} in {t}",
        "{t} {w} population",
    ]
    return [
        rng.choice(forms).format(
            t=_title(corpus_seed, rng.randrange(corpus_rows)), w=rng.choice(_TOPICS)
        )
        for _ in range(n)
    ]


def dense_index(directory: Path, rows: int) -> Path:
    """A small dense (MiniLM) index of `rows` synthetic passages under `directory`."""
    corpus = write_corpus(directory / "corpus.jsonl", rows, words=20)
    build_index(corpus, directory / "index", BuildConfig(max_length=48, progress=False))
    return directory / "index"
