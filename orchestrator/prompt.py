"""The exact Search-R1 prompt and row format (spec section 1).

The instruction text is copied verbatim from the original repository's
`scripts/data_process/qa_search_train_merge.py` (`make_prefix`, template `base`), including its
typo "as many times as your want": trained checkpoints were conditioned on these exact tokens.
"""

from __future__ import annotations

from typing import Any

from searchr1.chat_template import prompt_token_ids

__all__ = [
    "SEARCH_R1_INSTRUCTION",
    "make_prompt_text",
    "make_row",
    "preprocess_question",
    "prompt_token_ids",
]

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
