"""The demo's supervised warm start: a tiny model learns the think/search/answer format.

Demonstrations are token-exact copies of what the orchestrator builds at RL time (the same
prompt rendering, the same observation text and tokenization, loss mask 0 on observations).
A fraction `search_rate` of them search and copy the answer from the retrieved passage; the
rest answer at once with a guess. The warm-started policy therefore follows the format but
mostly answers without searching, and is mostly wrong: RL has to discover that searching pays.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from orchestrator.observation import format_docs, tokenize_observation
from orchestrator.prompt import make_prompt_text, prompt_token_ids
from searchr1.demo.world import Question, World

log = logging.getLogger(__name__)

# query -> top-k documents (objects with `.id` and `.contents`)
SearchFn = Callable[[str], Sequence[object]]


@dataclass(frozen=True)
class Demo:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]  # per response token: 1 model, 0 observation
    searched: bool


@dataclass(frozen=True)
class WarmStartConfig:
    search_rate: float = 0.3
    steps: int = 300
    batch_size: int = 16
    lr: float = 2e-3
    weight_decay: float = 0.0
    seed: int = 0
    max_observation_tokens: int = 256


def _person(q: Question) -> str:
    return q.question.split(" was ", 1)[1].removesuffix(" born?")


def _turns(q: Question, world: World, search: bool, rng: random.Random) -> list[str | tuple]:
    """Model turns (str) interleaved with searches (("search", query))."""
    person = _person(q)
    if not search:
        pool = world.countries if q.hops == 2 else [t.name for t in world.towns]
        return [f"<think> I remember this. </think>\n<answer> {rng.choice(pool)} </answer>"]
    town = next(p.town for p in world.people if p.name == person)
    first = f"<think> I need to find where {person} was born. </think>\n<search> {person} </search>"
    if q.hops == 1:
        final = f"<think> {person} was born in {town}. </think>\n<answer> {town} </answer>"
        return [first, ("search", person), final]
    hop = f"<think> {person} was born in {town}. </think>\n<search> {town} </search>"
    final = f"<think> {town} is in {q.answers[0]}. </think>\n<answer> {q.answers[0]} </answer>"
    return [first, ("search", person), hop, ("search", town), final]


def build_demos(
    world: World,
    tokenizer: object,
    search: SearchFn,
    cfg: WarmStartConfig,
    split: str = "train",
) -> list[Demo]:
    rng = random.Random(cfg.seed)
    demos = []
    for q in world.split(split):
        searched = rng.random() < cfg.search_rate
        messages = [{"role": "user", "content": make_prompt_text(q.question)}]
        prompt = prompt_token_ids(tokenizer, messages)
        ids: list[int] = []
        mask: list[int] = []
        for part in _turns(q, world, searched, rng):
            if isinstance(part, tuple):
                obs = tokenize_observation(
                    tokenizer, format_docs(search(part[1])), cfg.max_observation_tokens
                )
                ids += obs.ids
                mask += [0] * len(obs.ids)
            else:
                turn = tokenizer.encode(part, add_special_tokens=False)  # type: ignore[attr-defined]
                ids += turn
                mask += [1] * len(turn)
        demos.append(Demo(prompt, ids, mask, searched))
    return demos


def sft(model: torch.nn.Module, demos: list[Demo], cfg: WarmStartConfig) -> list[float]:
    """Train on the demos' model tokens only (prompt and observations masked); returns losses."""
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    model.train()
    losses = []
    for step in range(cfg.steps):
        idx = torch.randint(len(demos), (cfg.batch_size,), generator=gen).tolist()
        batch = [demos[i] for i in idx]
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
        out = model(input_ids=input_ids, attention_mask=attn, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(out.loss.detach()))
        if step % 50 == 0 or step == cfg.steps - 1:
            log.info("warm start", extra={"step": step, "loss": round(losses[-1], 4)})
    model.eval()
    return losses
