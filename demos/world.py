"""A synthetic knowledge world for the demo: facts a model cannot know without searching.

Fictional people, towns and countries with made-up one-word names; passages in the Search-R1
corpus format (`contents` = quoted title line + body); single-hop questions (a person's
birthplace, one search) and two-hop questions (the country of a person's birthplace, two
searches). Everything is a pure function of the seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_ONSETS = ["b", "br", "d", "dr", "f", "g", "k", "kr", "l", "m", "n", "p", "qu", "r", "s", "t",
           "th", "v", "z", "zh"]  # fmt: skip
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "k", "m"]
PROFESSIONS = ["painter", "sailor", "astronomer", "baker", "poet", "engineer", "weaver",
               "botanist", "violinist", "cartographer"]  # fmt: skip


@dataclass(frozen=True)
class Person:
    name: str
    town: str
    profession: str


@dataclass(frozen=True)
class Town:
    name: str
    country: str


@dataclass(frozen=True)
class Question:
    question: str
    answers: list[str]
    hops: int
    split: str  # "train" | "test"
    data_source: str  # "synthetic_1hop" | "synthetic_2hop"


@dataclass(frozen=True)
class World:
    people: list[Person]
    towns: list[Town]
    countries: list[str]
    questions: list[Question]

    def corpus_rows(self) -> list[dict[str, str]]:
        """Search-R1 corpus rows: `{"id", "contents": "\\"Title\\"\\nbody"}`."""
        rows = [person_passage(p) for p in self.people]
        rows += [town_passage(t) for t in self.towns]
        rows += [f'"{c}"\n{c} is a country far away.' for c in self.countries]
        return [{"id": str(i), "contents": c} for i, c in enumerate(rows)]

    def entity_names(self) -> list[str]:
        """Every made-up name (people, towns, countries): the demo tokenizer's whole words."""
        return [p.name for p in self.people] + [t.name for t in self.towns] + self.countries

    def split(self, split: str) -> list[Question]:
        return [q for q in self.questions if q.split == split]


def person_passage(p: Person) -> str:
    return f'"{p.name}"\n{p.name} is a {p.profession} who was born in {p.town}.'


def town_passage(t: Town) -> str:
    return f'"{t.name}"\n{t.name} is a town in {t.country}.'


def person_of(q: Question) -> str:
    """The person a question asks about ("In which town was X born?" -> X)."""
    return q.question.split(" was ", 1)[1].removesuffix(" born?")


def _word(rng: random.Random, syllables: int) -> str:
    parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)]
    return ("".join(parts) + rng.choice(_CODAS)).capitalize()


def unique_words(rng: random.Random, n: int, syllables: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        w = _word(rng, syllables)
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


def generate_world(
    seed: int = 0,
    *,
    n_people: int = 400,
    n_towns: int = 40,
    n_countries: int = 8,
    two_hop_fraction: float = 0.25,
    test_fraction: float = 0.2,
) -> World:
    """A deterministic world; each person yields one question (1-hop or 2-hop)."""
    if not 0 <= two_hop_fraction <= 1 or not 0 < test_fraction < 1:
        raise ValueError("two_hop_fraction must be in [0, 1] and test_fraction in (0, 1)")
    rng = random.Random(seed)
    taken: set[str] = set()
    countries = unique_words(rng, n_countries, 2, taken)
    town_names = unique_words(rng, n_towns, 2, taken)
    towns = [Town(name, countries[i % n_countries]) for i, name in enumerate(town_names)]
    people = []
    # One word of three syllables per person: the demo's tokenizer makes every name a single
    # token, so answering from a passage is copying one token (see warmstart.py).
    for name in unique_words(rng, n_people, 3, taken):
        people.append(Person(name, rng.choice(towns).name, rng.choice(PROFESSIONS)))
    country_of = {t.name: t.country for t in towns}
    questions = []
    for p in people:
        split = "test" if rng.random() < test_fraction else "train"
        if rng.random() < two_hop_fraction:
            questions.append(
                Question(f"In which country was {p.name} born?", [country_of[p.town]], 2,
                         split, "synthetic_2hop")
            )  # fmt: skip
        else:
            questions.append(
                Question(f"In which town was {p.name} born?", [p.town], 1, split,
                         "synthetic_1hop")
            )  # fmt: skip
    return World(people, towns, countries, questions)


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    """`rows` as JSON lines at `path` (its folder made if missing); the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_world(world: World, out_dir: Path) -> dict[str, Path]:
    """Write `corpus.jsonl` and FlashRAG-style `train.jsonl` / `test.jsonl` question files."""
    paths = {"corpus": write_jsonl(out_dir / "corpus.jsonl", world.corpus_rows())}
    for split in ("train", "test"):
        rows = (
            {
                "id": f"{split}_{i}",
                "question": q.question,
                "golden_answers": q.answers,
                "hops": q.hops,
                "data_source": q.data_source,
            }
            for i, q in enumerate(world.split(split))
        )
        paths[split] = write_jsonl(out_dir / f"{split}.jsonl", rows)
    return paths
