"""A tiny policy that has memorised Search-R1 episodes, for end-to-end rollout tests.

A random tiny model never emits `<search>` on cue, so the integration tests first overfit the
tiny model (a few seconds on CPU) on complete episodes rendered exactly as the orchestrator
renders them: prompt ids + turn text + the real retriever's observation + the next turn. Served
by the real engine and queried greedily, it then searches, reads and answers like the real
thing, which exercises stop strings, observations and token alignment for real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator.config import INVALID_ACTION_MESSAGE
from orchestrator.observation import format_docs, observation_text
from orchestrator.prompt import prompt_token_ids
from orchestrator.sample import Prompt
from retriever.client import RetrieverClient

SEARCH_TURN = "<think> I need to search. </think>\n<search> {q} </search>"
ANSWER_TURN = "<think> found it </think>\n<answer> {a} </answer><|im_end|>"
INVALID_TURN = "<think> not sure </think> maybe<|im_end|>"
QUERY_VARIANTS = ("{q}", "{q} facts", "{q} details", "{q} history", "{q} more")


def turn_texts(question: str, answer: str, actions: list[str]) -> list[str]:
    """The turn texts of one episode: the k-th search uses the k-th query variant."""
    out, searches = [], 0
    for action in actions:
        if action == "search":
            variant = QUERY_VARIANTS[searches % len(QUERY_VARIANTS)]
            out.append(SEARCH_TURN.format(q=variant.format(q=question)))
            searches += 1
        elif action == "answer":
            out.append(ANSWER_TURN.format(a=answer))
        else:
            out.append(INVALID_TURN)
    return out


async def build_episodes(
    tokenizer: Any,
    retriever_url: str,
    prompts: list[Prompt],
    facts: list[tuple[str, str]],
    scripts: list[list[str]],
    *,
    topk: int,
) -> list[tuple[int, list[int]]]:
    """(prompt length, ids) per episode, segment by segment exactly as a rollout assembles
    its context: turn ids, then the real retriever's observation tokenized on its own."""
    client = RetrieverClient(retriever_url)

    def enc(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    episodes = []
    try:
        for (q, a), p, actions in zip(facts, prompts, scripts, strict=True):
            ids = prompt_token_ids(tokenizer, p.messages)
            n_prompt = len(ids)
            prev = ""
            for turn in turn_texts(q, a, actions):
                if prev.endswith("</search>"):
                    query = prev.rsplit("<search>", 1)[1].removesuffix("</search>").strip()
                    [hits] = await client.search([query], topk)
                    ids += enc(observation_text(format_docs(hits)))
                elif prev:
                    ids += enc(INVALID_ACTION_MESSAGE)
                ids += enc(turn)
                prev = turn
            episodes.append((n_prompt, ids))
    finally:
        await client.aclose()
    return episodes


def train_policy(
    base_dir: Path,
    out_dir: Path,
    episodes: list[tuple[int, list[int]]],
    *,
    steps: int = 400,
    lr: float = 1e-2,
    seed: int = 0,
) -> Path:
    """Fine-tune the model in `base_dir` on `(prompt_len, ids)` episodes; save to `out_dir`.

    Only the response is trained on (as in RL): far fewer steps than memorising the prompt.
    """
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    width = max(len(e) for _, e in episodes)
    pad = model.config.pad_token_id
    ids = torch.full((len(episodes), width), pad, dtype=torch.long)
    labels = torch.full((len(episodes), width), -100, dtype=torch.long)
    mask = torch.zeros((len(episodes), width), dtype=torch.long)
    for i, (n_prompt, e) in enumerate(episodes):
        ids[i, : len(e)] = torch.tensor(e)
        labels[i, n_prompt : len(e)] = torch.tensor(e[n_prompt:])
        mask[i, : len(e)] = 1
    import logging
    import time

    start = time.perf_counter()
    used = 0
    for used in range(1, steps + 1):  # noqa: B007 - reported below
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.003:
            break
    logging.getLogger(__name__).warning(
        "policy trained: %d steps, loss %.4f, %.1fs",
        used,
        loss.item(),
        time.perf_counter() - start,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in base_dir.iterdir():  # tokenizer and generation config
        skip = f.name.startswith("model") or f.name == "config.json"
        if f.is_file() and not skip:
            shutil.copy(f, out_dir / f.name)
    return out_dir
