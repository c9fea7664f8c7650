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

When the copy circuit forms varies with the seed and even with the machine (floating point
sums in another order): the multi-tool demo's four-digit years were copied after 800 steps on
one machine and not after 1,000 on another, and RL from a warm start that cannot copy has no
reward to climb (issue 42). So the copy phase can run until it can copy (`copy_until`): after
`copy_steps`, every `copy_check_every` steps it measures the share of fresh demonstrations the
model reproduces exactly (`exact_rate`) and stops at `copy_until`, or at `max_copy_steps` with
a warning.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from demos.world import PROFESSIONS, Person, Town, World, person_passage, town_passage
from orchestrator.observation import format_docs, tokenize_observation
from orchestrator.prompt import make_prompt_text, prompt_token_ids
from retriever.client import SearchHit

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
    # Copy until `exact_rate` reaches this (None: exactly `copy_steps`), checked every
    # `copy_check_every` steps on `copy_check_size` fresh demonstrations, at most `max_copy_steps`.
    copy_until: float | None = None
    copy_check_every: int = 100
    copy_check_size: int = 64
    max_copy_steps: int = 0

    def __post_init__(self) -> None:
        if self.copy_until is not None:
            if not 0 < self.copy_until <= 1:
                raise ValueError(f"copy_until must be in (0, 1], got {self.copy_until}")
            if self.max_copy_steps < self.copy_steps or self.copy_check_every < 1:
                raise ValueError(
                    "copy_until needs max_copy_steps >= copy_steps and copy_check_every >= 1 "
                    f"(got max_copy_steps={self.max_copy_steps}, copy_steps={self.copy_steps}, "
                    f"copy_check_every={self.copy_check_every})"
                )

    def phases(self) -> list[Phase]:
        return [
            Phase("copy", self.copy_steps, self.copy_batch_size, self.copy_lr, 1.0, True),
            Phase("format", self.format_steps, self.batch_size, self.lr, 1.0, False),
            Phase("mix", self.mix_steps, self.batch_size, self.lr, self.search_rate, False),
        ]


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
            body = format_docs([SearchHit(str(i), d, None) for i, d in enumerate(docs)])
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


class Sampler(Protocol):
    """What the warm start trains on: `DemoSampler`, or a task's own (`demos.multitool`)."""

    def sample(self, rng: random.Random, *, searched: bool, short_prompt: bool = False) -> Demo: ...

    def batches(self, phase: Phase, rng: random.Random) -> Iterator[list[Demo]]: ...


@torch.no_grad()
def exact_rate(model: torch.nn.Module, demos: list[Demo], *, batch_size: int = 16) -> float:
    """The share of `demos` whose every model token (loss mask 1) is the teacher-forced argmax:
    given the same observations, greedy decoding would write each of them exactly."""
    was_training = model.training
    model.eval()
    exact = 0
    for start in range(0, len(demos), batch_size):
        batch = collate(demos[start : start + batch_size])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]  # the token each position predicts
        right = (logits[:, :-1].argmax(-1) == labels) | (labels == -100)
        exact += int(right.all(dim=1).sum())
    model.train(was_training)
    return exact / max(len(demos), 1)


def sft(model: torch.nn.Module, sampler: Sampler, cfg: WarmStartConfig) -> list[float]:
    """Train through the phases on fresh demonstrations; returns the loss of every step."""
    rng = random.Random(cfg.seed)
    check_rng = random.Random(cfg.seed + 1)  # its own: checks leave the training data as it is
    torch.manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    model.train()
    losses: list[float] = []
    for phase in cfg.phases():
        for group in opt.param_groups:
            group["lr"] = phase.lr
        _train(model, opt, sampler.batches(phase, rng), phase.name, 0, phase.steps, losses)
        if phase.name == "copy" and cfg.copy_until is not None:
            _copy_until(model, opt, sampler, cfg, phase, rng, check_rng, losses)
    model.eval()
    return losses


def _copy_until(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sampler: Sampler,
    cfg: WarmStartConfig,
    phase: Phase,
    rng: random.Random,
    check_rng: random.Random,
    losses: list[float],
) -> None:
    assert cfg.copy_until is not None
    done = phase.steps
    while True:
        demos = [
            sampler.sample(check_rng, searched=True, short_prompt=phase.short_prompt)
            for _ in range(cfg.copy_check_size)
        ]
        rate = exact_rate(model, demos)
        log.info("warm start copy check", extra={"step": done, "exact": round(rate, 3)})
        if rate >= cfg.copy_until:
            return
        if done >= cfg.max_copy_steps:
            log.warning(
                "the warm start did not learn to copy: RL will have little reward to climb",
                extra={"step": done, "exact": round(rate, 3), "copy_until": cfg.copy_until},
            )
            return
        more = replace(phase, steps=min(cfg.copy_check_every, cfg.max_copy_steps - done))
        _train(model, opt, sampler.batches(more, rng), phase.name, done, more.steps, losses)
        done += more.steps


def _train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batches: Iterable[list[Demo]],
    phase: str,
    first_step: int,
    steps: int,
    losses: list[float],
) -> None:
    last = first_step + steps - 1
    for step, batch in enumerate(batches, start=first_step):
        out = model(**collate(batch))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(out.loss.detach()))
        if step % 50 == 0 or step == last:
            log.info("warm start", extra={"phase": phase, "step": step,
                                          "loss": round(losses[-1], 4)})  # fmt: skip
