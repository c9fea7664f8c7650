"""Warm-start demonstrations are token-exact with what the orchestrator builds at RL time."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch

from demos.warmstart import DemoSampler, WarmStartConfig, sft
from demos.world import generate_world
from orchestrator.observation import observation_text


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _split(demo, tokenizer) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """(model text, observation text) of a demo's response."""
    pairs = list(zip(demo.response_ids, demo.loss_mask, strict=True))
    model = tokenizer.decode([t for t, m in pairs if m == 1])
    obs = tokenizer.decode([t for t, m in pairs if m == 0])
    return model, obs


def test_searching_demos_follow_the_rollout_format(tokenizer) -> None:  # type: ignore[no-untyped-def]
    world = generate_world(0, n_people=30)
    sampler = DemoSampler(world, tokenizer, WarmStartConfig(topk=3))
    rng = random.Random(0)
    hops_seen = set()
    for _ in range(40):
        demo = sampler.sample(rng, searched=True)
        text = tokenizer.decode(demo.response_ids)
        hops = text.count("<search>")
        hops_seen.add(hops)
        assert text.startswith("<think>")
        assert text.endswith(f"<answer> {demo.answer} </answer>")
        model_text, obs = _split(demo, tokenizer)
        assert "<information>" not in model_text  # observations carry loss mask 0
        assert obs.count("\n\n<information>Doc 1(Title: ") == hops
        assert obs.count("</information>\n\n") == hops
        assert obs.count("Doc 3(Title: ") == hops and "Doc 4" not in obs  # topk documents
        # The answer is in the last observation's first document, as copying needs.
        last_doc = obs.rsplit("<information>Doc 1", 1)[1].split("Doc 2", 1)[0]
        assert f" {demo.answer}." in last_doc
    assert hops_seen == {1, 2}


def test_observation_tokens_are_the_orchestrators(tokenizer) -> None:  # type: ignore[no-untyped-def]
    world = generate_world(0, n_people=10)
    demo = DemoSampler(world, tokenizer, WarmStartConfig(two_hop_fraction=0.0)).sample(
        random.Random(1), searched=True
    )
    _, obs = _split(demo, tokenizer)
    m = re.fullmatch(
        r'\n\n<information>Doc 1\(Title: "(\w+)"\) \1 is an? \w+ who was born in (\w+)\.'
        r"</information>\n\n",
        obs,
    )
    assert m is not None, obs
    assert m.group(2) == demo.answer
    body = obs.removeprefix("\n\n<information>").removesuffix("</information>\n\n")
    expected = tokenizer.encode(observation_text(body), add_special_tokens=False)
    start = demo.loss_mask.index(0)
    assert demo.response_ids[start : start + len(expected)] == expected


def test_facts_are_random_so_only_copying_helps(tokenizer) -> None:  # type: ignore[no-untyped-def]
    world = generate_world(0, n_people=5)
    sampler = DemoSampler(world, tokenizer, WarmStartConfig(two_hop_fraction=0.0))
    rng = random.Random(0)
    answers: dict[str, set[str]] = {}
    for _ in range(60):
        demo = sampler.sample(rng, searched=True)
        name = re.search(r"<search> (\w+) </search>", tokenizer.decode(demo.response_ids))
        assert name is not None
        answers.setdefault(name.group(1), set()).add(demo.answer)
    assert set(answers) <= {p.name for p in world.people}
    assert all(len(towns) > 1 for towns in answers.values())


def test_phases_and_the_search_rate(tokenizer) -> None:  # type: ignore[no-untyped-def]
    world = generate_world(0, n_people=20)
    cfg = WarmStartConfig(copy_steps=1, format_steps=1, mix_steps=4, batch_size=50)
    copy, fmt, mix = cfg.phases()
    sampler = DemoSampler(world, tokenizer, cfg)
    rng = random.Random(0)
    [copy_batch] = sampler.batches(copy, rng)
    [fmt_batch] = sampler.batches(fmt, rng)
    mixed = [d for batch in sampler.batches(mix, rng) for d in batch]
    assert all(d.searched for d in copy_batch + fmt_batch)
    # The copy phase uses a short prompt; the others the full Search-R1 instruction.
    assert "Answer the given question" not in tokenizer.decode(copy_batch[0].prompt_ids)
    assert "Answer the given question" in tokenizer.decode(fmt_batch[0].prompt_ids)
    rate = sum(d.searched for d in mixed) / len(mixed)
    assert 0.2 < rate < 0.4
    guessed = [d for d in mixed if not d.searched]
    assert all(0 not in d.loss_mask for d in guessed)  # no observation without a search


def test_sft_lowers_the_loss(tiny_model_dir: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    world = generate_world(0, n_people=20)
    cfg = WarmStartConfig(copy_steps=12, copy_batch_size=4, format_steps=0, mix_steps=0)
    losses = sft(model, DemoSampler(world, tokenizer, cfg), cfg)
    assert len(losses) == 12
    assert losses[-1] < losses[0] * 0.8
    assert not model.training


class _Teacher(torch.nn.Module):
    """Predicts the next token of its own input (teacher forcing made perfect), except
    `wrong_on`: what `exact_rate` counts, with no training in the way."""

    def __init__(self, vocab: int, wrong_on: int | None = None) -> None:
        super().__init__()
        self.vocab, self.wrong_on = vocab, wrong_on

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> object:
        nxt = torch.roll(input_ids, -1, dims=1)
        if self.wrong_on is not None:
            nxt = torch.where(nxt == self.wrong_on, (nxt + 1) % self.vocab, nxt)
        return type("Out", (), {"logits": torch.nn.functional.one_hot(nxt, self.vocab).float()})


def test_exact_rate_counts_demonstrations_reproduced_on_every_model_token(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from demos.warmstart import Demo, exact_rate

    # Two demonstrations: the model's tokens 5, 6 / 5, 7, and 9 in an observation (mask 0).
    demos = [Demo([1, 2], [5, 9, 6], [1, 0, 1], True, "a"), Demo([1], [5, 7], [1, 1], True, "b")]
    assert exact_rate(_Teacher(12), demos) == 1.0
    assert exact_rate(_Teacher(12, wrong_on=7), demos) == 0.5  # the second's model token 7
    assert exact_rate(_Teacher(12, wrong_on=9), demos) == 1.0  # 9 is observed, not written
    assert exact_rate(_Teacher(12, wrong_on=1), demos) == 1.0  # prompts are not scored


def test_the_copy_phase_runs_until_it_can_copy_or_its_cap(  # type: ignore[no-untyped-def]
    tiny_model_dir: Path,
    tokenizer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from transformers import AutoModelForCausalLM

    from demos import warmstart

    world = generate_world(0, n_people=20)
    cfg = WarmStartConfig(copy_steps=2, copy_batch_size=2, format_steps=1, mix_steps=0,
                          batch_size=2, copy_until=0.9, copy_check_every=3, copy_check_size=2,
                          max_copy_steps=20)  # fmt: skip
    rates = iter([0.1, 0.5, 0.95])  # two checks short of the bar, then above it
    monkeypatch.setattr(warmstart, "exact_rate", lambda model, demos: next(rates))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    losses = sft(model, DemoSampler(world, tokenizer, cfg), cfg)
    assert len(losses) == 2 + 3 + 3 + 1  # copy 2, +3, +3 (then 0.95 >= 0.9), format 1

    capped = WarmStartConfig(copy_steps=2, copy_batch_size=2, format_steps=0, mix_steps=0,
                             copy_until=0.9, copy_check_every=3, copy_check_size=2,
                             max_copy_steps=4)  # fmt: skip
    monkeypatch.setattr(warmstart, "exact_rate", lambda model, demos: 0.0)
    with caplog.at_level("WARNING", logger="demos.warmstart"):
        losses = sft(model, DemoSampler(world, tokenizer, capped), capped)
    assert len(losses) == 4  # 2, then 2 more to the cap
    assert any("did not learn to copy" in r.getMessage() for r in caplog.records)


def test_copy_until_needs_a_cap_at_least_the_copy_steps() -> None:
    with pytest.raises(ValueError, match="max_copy_steps"):
        WarmStartConfig(copy_steps=100, copy_until=0.9)
    with pytest.raises(ValueError, match="copy_until"):
        WarmStartConfig(copy_until=1.5, max_copy_steps=1000)
