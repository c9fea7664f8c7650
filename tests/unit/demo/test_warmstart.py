"""Warm-start demonstrations are token-exact with what the orchestrator builds at RL time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from orchestrator.observation import format_docs, observation_text
from searchr1.demo.warmstart import WarmStartConfig, build_demos, sft
from searchr1.demo.world import generate_world


@dataclass(frozen=True)
class Doc:
    id: str
    contents: str


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def exact_search(world):  # type: ignore[no-untyped-def]
    rows = {r["contents"].split("\n")[0].strip('"'): r for r in world.corpus_rows()}

    def search(query: str) -> list[Doc]:
        row = rows[query]
        return [Doc(row["id"], row["contents"])]

    return search


def test_demos_follow_the_rollout_format_token_by_token(tokenizer) -> None:  # type: ignore[no-untyped-def]
    world = generate_world(0, n_people=30)
    demos = build_demos(world, tokenizer, exact_search(world), WarmStartConfig(search_rate=1.0))
    train = world.split("train")
    assert len(demos) == len(train)
    for demo, q in zip(demos, train, strict=True):
        assert demo.searched
        text = tokenizer.decode(demo.response_ids)
        assert text.startswith("<think>")
        assert text.endswith(f"<answer> {q.answers[0]} </answer>")
        assert text.count("<search>") == q.hops
        # Observation spans carry loss mask 0 and decode to the exact observation text.
        masked = [t for t, m in zip(demo.response_ids, demo.loss_mask, strict=True) if m == 0]
        obs = tokenizer.decode(masked)
        assert obs.startswith("\n\n<information>Doc 1(Title: ")
        assert obs.count("</information>\n\n") == q.hops
        model_text = tokenizer.decode(
            [t for t, m in zip(demo.response_ids, demo.loss_mask, strict=True) if m == 1]
        )
        assert "<information>" not in model_text


def test_observation_matches_the_orchestrator_formatting(tokenizer) -> None:  # type: ignore[no-untyped-def]
    world = generate_world(0, n_people=10)
    search = exact_search(world)
    demo = build_demos(world, tokenizer, search, WarmStartConfig(search_rate=1.0))[0]
    q = world.split("train")[0]
    person = q.question.split(" was ")[1].removesuffix(" born?")
    expected = tokenizer.encode(observation_text(format_docs(search(person))),
                                add_special_tokens=False)  # fmt: skip
    start = demo.loss_mask.index(0)
    assert demo.response_ids[start : start + len(expected)] == expected


def test_search_rate_controls_the_mix(tokenizer) -> None:  # type: ignore[no-untyped-def]
    world = generate_world(0, n_people=200)
    demos = build_demos(world, tokenizer, exact_search(world), WarmStartConfig(search_rate=0.3))
    rate = sum(d.searched for d in demos) / len(demos)
    assert 0.2 < rate < 0.4
    guessed = [d for d in demos if not d.searched]
    assert all(0 not in d.loss_mask for d in guessed)  # no observation without a search


def test_sft_lowers_the_loss(tiny_model_dir: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    world = generate_world(0, n_people=20)
    demos = build_demos(world, tokenizer, exact_search(world), WarmStartConfig())
    losses = sft(model, demos, WarmStartConfig(steps=12, batch_size=4, lr=3e-3))
    assert losses[-1] < losses[0] * 0.8
