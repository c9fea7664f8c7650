"""The demo's supervised warm start: a tiny model learns the format and to copy from passages.

Demonstrations are token-exact copies of what the orchestrator builds at RL time (the same
prompt rendering, the same observation text and tokenization, loss mask 0 on observations).
A searching demonstration copies the answer from the retrieved passage; a guessing one answers
at once with a random name.

Every demonstration is drawn fresh with *random facts*: a name of the world, a random town,
profession and country, and the passages a search would return for those facts (rendered as
the corpus renders them). No fact repeats, so memorising is useless and copying from the
passage is the only way to lower the loss: that is what makes searching pay at RL time. The
facts of the world itself (and of its held-out questions) are never shown.

Training runs in three phases (`WarmStartConfig`):
1. copy: a short prompt ("Question: ..."), every demonstration searches. Without the 150-token
   instruction a 2-layer model learns the copy circuit in a few hundred steps; with it, the
   same model had not started to copy after 2,000 steps (docs/local.md);
2. format: the full Search-R1 prompt, every demonstration searches;
3. mix: the full prompt, a fraction `search_rate` searches. The warm-started policy follows the
   format, mostly answers at once (mostly wrong), and is right when it searches: RL has
   something to discover.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from demos.world import PROFESSIONS, Person, Town, World, person_passage, town_passage
from orchestrator.observation import format_docs, tokenize_observation
from orchestrator.prompt import make_prompt_text, prompt_token_ids

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Demo:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]  # per response token: 1 model, 0 observation
    searched: bool
    answer: str


class MaskedResponse:
    """A demonstration's response written text by text: its ids and their loss mask."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.mask: list[int] = []

    def add(self, text: str, value: int) -> None:
        """`text`'s tokens, each with loss mask `value` (1: the model's, 0: an observation)."""
        part = self.tokenizer.encode(text, add_special_tokens=False)
        self.ids.extend(part)
        self.mask.extend([value] * len(part))


@dataclass(frozen=True)
class Phase:
    name: str
    steps: int
    batch_size: int
    lr: float
    search_rate: float
    short_prompt: bool


@dataclass(frozen=True)
class WarmStartConfig:
    copy_steps: int = 350
    copy_batch_size: int = 32
    copy_lr: float = 3e-3
    format_steps: int = 100
    mix_steps: int = 100
    batch_size: int = 16
    lr: float = 2e-3
    search_rate: float = 0.3  # in the mix phase
    two_hop_fraction: float = 0.25
    topk: int = 1  # documents per observation: the answer's passage + topk-1 distractors
    seed: int = 0
    max_observation_tokens: int = 256

    def phases(self) -> list[Phase]:
        return [
            Phase("copy", self.copy_steps, self.copy_batch_size, self.copy_lr, 1.0, True),
            Phase("format", self.format_steps, self.batch_size, self.lr, 1.0, False),
            Phase("mix", self.mix_steps, self.batch_size, self.lr, self.search_rate, False),
        ]


@dataclass(frozen=True)
class _Doc:
    id: str
    contents: str


class DemoSampler:
    """Draws demonstrations with random facts over the world's names (see the module doc)."""

    def __init__(self, world: World, tokenizer: object, cfg: WarmStartConfig) -> None:
        self.world = world
        self.tok = tokenizer
        self.cfg = cfg
        self.names = [p.name for p in world.people]
        self.towns = [t.name for t in world.towns]

    def sample(self, rng: random.Random, *, searched: bool, short_prompt: bool = False) -> Demo:
        person = Person(rng.choice(self.names), rng.choice(self.towns), rng.choice(PROFESSIONS))
        town = Town(person.town, rng.choice(self.world.countries))
        hops = 2 if rng.random() < self.cfg.two_hop_fraction else 1
        kind = "country" if hops == 2 else "town"
        question = f"In which {kind} was {person.name} born?"
        answer = town.country if hops == 2 else town.name
        content = f"Question: {question}\n" if short_prompt else make_prompt_text(question)
        prompt = prompt_token_ids(self.tok, [{"role": "user", "content": content}])

        ids: list[int] = []
        mask: list[int] = []

        def say(text: str) -> None:
            turn = self.tok.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
            ids.extend(turn)
            mask.extend([1] * len(turn))

        def observe(passage: str) -> None:
            docs = [passage] + [self._distractor(rng) for _ in range(self.cfg.topk - 1)]
            body = format_docs([_Doc(str(i), d) for i, d in enumerate(docs)])
            obs = tokenize_observation(self.tok, body, self.cfg.max_observation_tokens)
            ids.extend(obs.ids)
            mask.extend([0] * len(obs.ids))

        name, town_name = person.name, town.name
        if not searched:
            pool = self.world.countries if hops == 2 else self.towns
            say(f"<think> I remember this. </think>\n<answer> {rng.choice(pool)} </answer>")
            return Demo(prompt, ids, mask, searched, answer)
        found = f"<think> {name} was born in {town_name}. </think>\n"
        say(f"<think> I need to find where {name} was born. </think>\n<search> {name} </search>")
        observe(person_passage(person))
        if hops == 2:
            say(f"{found}<search> {town_name} </search>")
            observe(town_passage(town))
            found = f"<think> {town_name} is in {answer}. </think>\n"
        say(f"{found}<answer> {answer} </answer>")
        return Demo(prompt, ids, mask, searched, answer)

    def _distractor(self, rng: random.Random) -> str:
        return person_passage(Person(rng.choice(self.names), rng.choice(self.towns),
                                     rng.choice(PROFESSIONS)))  # fmt: skip

    def batches(self, phase: Phase, rng: random.Random) -> Iterator[list[Demo]]:
        for _ in range(phase.steps):
            searched = [rng.random() < phase.search_rate for _ in range(phase.batch_size)]
            yield [self.sample(rng, searched=s, short_prompt=phase.short_prompt) for s in searched]


def collate(batch: list[Demo]) -> dict[str, torch.Tensor]:
    """Right-padded inputs; labels only on the model's own response tokens."""
    width = max(len(d.prompt_ids) + len(d.response_ids) for d in batch)
    input_ids = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attn = torch.zeros(len(batch), width, dtype=torch.long)
    for row, d in enumerate(batch):
        seq = d.prompt_ids + d.response_ids
        input_ids[row, : len(seq)] = torch.tensor(seq)
        attn[row, : len(seq)] = 1
        target = torch.tensor(d.response_ids)
        target[torch.tensor(d.loss_mask) == 0] = -100
        labels[row, len(d.prompt_ids) : len(seq)] = target
    return {"input_ids": input_ids, "attention_mask": attn, "labels": labels}


def sft(model: torch.nn.Module, sampler: DemoSampler, cfg: WarmStartConfig) -> list[float]:
    """Train through the phases on fresh demonstrations; returns the loss of every step."""
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    model.train()
    losses: list[float] = []
    for phase in cfg.phases():
        for group in opt.param_groups:
            group["lr"] = phase.lr
        for step, batch in enumerate(sampler.batches(phase, rng)):
            out = model(**collate(batch))
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(float(out.loss.detach()))
            if step % 50 == 0 or step == phase.steps - 1:
                log.info("warm start", extra={"phase": phase.name, "step": step,
                                              "loss": round(losses[-1], 4)})  # fmt: skip
    model.eval()
    return losses
