"""The exact Search-R1 prompt and row format (spec section 1).

The instruction text is copied verbatim from the original repository's
`scripts/data_process/qa_search_train_merge.py` (`make_prefix`, template `base`), including its
typo "as many times as your want": trained checkpoints were conditioned on these exact tokens.
"""

from __future__ import annotations

from typing import Any

SEARCH_R1_INSTRUCTION = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new "
    "information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between "
    "<information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer "
    "inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. "
)


def preprocess_question(question: str) -> str:
    """Strip; append `?` when the question does not end with one (as the original does)."""
    q = question.strip()
    if not q:
        raise ValueError("empty question")
    return q if q.endswith("?") else q + "?"


def make_prompt_text(question: str) -> str:
    return f"{SEARCH_R1_INSTRUCTION}Question: {preprocess_question(question)}\n"


def make_row(
    question: str, golden_answers: list[str], *, data_source: str, split: str, index: int
) -> dict[str, Any]:
    """One Search-R1 parquet row."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": make_prompt_text(question)}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": list(golden_answers)}},
        "extra_info": {"split": split, "index": index},
    }


def prompt_token_ids(
    tokenizer: Any, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Render with the chat template (`add_generation_prompt=True`) and tokenize once.

    The rendered text already holds the template's special tokens, so no others are added.
    `tools` (function schemas) are passed to the template for the function-calling format.
    """
    kwargs: dict[str, Any] = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **kwargs
    )
    return list(tokenizer.encode(text, add_special_tokens=False))
