"""A prompt's checks before it may queue: its token ids, their range, and room in the context.

Like SGLang, the prompt plus the whole output budget must fit in the context length (SGLang
answers 400 unless it runs with --allow-auto-truncate); the orchestrator asks for at most what
fits. Every failure is a ValueError naming the field, which the server turns into a 400.
"""

from __future__ import annotations

from typing import Any

from inference.sampling import SamplingParams, check_text

# `text` longer than this many characters per context token is refused before tokenizing: it
# cannot fit (English averages ~4 characters a token); send `input_ids` for anything exotic.
MAX_TEXT_CHARS_PER_TOKEN = 16


def check_prompt_text(text: str, context_length: int) -> None:
    """Before tokenizing: a bound on the length and no lone surrogates (the tokenizer raises
    TypeError on one)."""
    limit = context_length * MAX_TEXT_CHARS_PER_TOKEN
    if len(text) > limit:
        raise ValueError(
            f"text: {len(text)} characters, at most {limit} "
            f"({MAX_TEXT_CHARS_PER_TOKEN} per token of the context length)"
        )
    check_text("text", text)


def check_prompt(
    ids: list[int], params: SamplingParams, *, context_length: int, vocab_size: int
) -> None:
    """The prompt's token ids and the output budget against the model's vocabulary and
    context; checked cheapest first (a huge prompt would make the per-id scan long)."""
    if not ids:
        raise ValueError("input_ids is empty")
    if len(ids) >= context_length:
        raise ValueError(
            f"prompt ({len(ids)} tokens) leaves no room in the context length {context_length}"
        )
    if len(ids) + params.max_new_tokens > context_length:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + sampling_params.max_new_tokens "
            f"({params.max_new_tokens}) exceeds the context length {context_length}"
        )
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"input_ids: token ids out of range [0, {vocab_size}): {bad[:5]}")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"sampling_params.stop_token_ids out of range: {bad[:5]}")


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """End-of-sequence ids from the model's generation config and the tokenizer (either may
    give one id or a list)."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list):
            ids.update(int(x) for x in src)
    return ids
