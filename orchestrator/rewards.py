"""Rule rewards of the Search-R1 recipe: normalisation, EM / sub-EM / F1, format validity.

All functions score the *response* only (what the policy generated plus the observations the
orchestrator appended), never the prompt, which holds the `<answer> Beijing </answer>` example.
This differs from the references: slime's search-r1 `qa_em_format.py` (adapted from
Search-R1's) scores prompt + response and takes the last `<answer>` match, `None` only when
there is none at all, so a response without an answer yields the prompt's "Beijing" (EM 1
on a question whose gold is Beijing, and `has_answer` everywhere). With an answer in the
response both pick the same one.
`tests/unit/orchestrator/test_rewards.py` shows both behaviours side by side.
"""

from __future__ import annotations

import re
import string
from collections import Counter

from orchestrator.config import ShapedScores

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_INFORMATION = re.compile(r"<information>(.*?)</information>", re.DOTALL)
_FORMAT_TAGS = ("think", "search", "information", "answer")
_TAG_SPLIT = re.compile(r"(</?(?:think|search|information|answer)>)")


def normalize(s: str) -> str:
    """SQuAD normalisation: lower-case, drop punctuation, drop a/an/the, collapse white space."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def exact_match(prediction: str | None, golds: list[str]) -> float:
    if prediction is None:
        return 0.0
    pred = normalize(prediction)
    return 1.0 if any(normalize(g) == pred for g in golds) else 0.0


def sub_exact_match(prediction: str | None, golds: list[str]) -> float:
    """1 when a normalised gold answer is a substring of the normalised prediction."""
    if prediction is None:
        return 0.0
    pred = normalize(prediction)
    return 1.0 if any(normalize(g) in pred for g in golds if normalize(g)) else 0.0


def f1_score(prediction: str | None, golds: list[str]) -> float:
    """Token-overlap F1 against the best-matching gold answer."""
    if prediction is None:
        return 0.0
    pred_tokens = normalize(prediction).split()
    best = 0.0
    for gold in golds:
        gold_tokens = normalize(gold).split()
        common = Counter(pred_tokens) & Counter(gold_tokens)
        overlap = sum(common.values())
        if overlap == 0:
            continue
        precision = overlap / len(pred_tokens)
        recall = overlap / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def extract_answer(response: str) -> str | None:
    """The last `<answer>...</answer>` of the response, stripped; None when there is none."""
    matches = _ANSWER.findall(response)
    return matches[-1].strip() if matches else None


def is_valid_format(response: str) -> tuple[bool, str]:
    """The v0.3 format state machine over the response (everything after the assistant start).

    Valid: `<think>..</think>` then (`<search>..</search><information>..</information>`
    `<think>..</think>`)* then `<answer>..</answer>`, tags balanced, only white space between
    tags. Returns (valid, reason) so a failing case explains itself in tests and logs.
    """
    for tag in _FORMAT_TAGS:
        opened, closed = response.count(f"<{tag}>"), response.count(f"</{tag}>")
        if opened != closed:
            return False, f"unbalanced <{tag}>: {opened} open, {closed} close"
    # state -> {tag: next state}; states named after what was seen last.
    transitions = {
        "start": {"<think>": "in_think"},
        "in_think": {"</think>": "after_think"},
        "after_think": {"<search>": "in_search", "<answer>": "in_answer"},
        "in_search": {"</search>": "after_search"},
        "after_search": {"<information>": "in_information"},
        "in_information": {"</information>": "after_information"},
        "after_information": {"<think>": "in_think"},
        "in_answer": {"</answer>": "end"},
        "end": {},
    }
    inside = {"in_think", "in_search", "in_information", "in_answer"}
    state = "start"
    for part in _TAG_SPLIT.split(response):
        if not part.strip():
            continue
        if _TAG_SPLIT.fullmatch(part):
            nxt = transitions[state].get(part)
            if nxt is None:
                return False, f"unexpected {part} in state {state}"
            state = nxt
        elif state not in inside:
            return False, f"text outside tags in state {state}"
    if state != "end":
        return False, f"ended in state {state}"
    return True, "ok"


def retrieval_hit(response: str, golds: list[str]) -> float:
    """1 when a normalised gold answer appears inside any `<information>` block."""
    blocks = [normalize(b) for b in _INFORMATION.findall(response)]
    norm_golds = [normalize(g) for g in golds if normalize(g)]
    return 1.0 if any(g in b for b in blocks for g in norm_golds) else 0.0


def shaped_reward(em: float, valid: bool, has_answer: bool, hit: float, s: ShapedScores) -> float:
    """v0.3: correctness first, then format; the retrieval bonus only for non-correct answers.

    The bonus is paid where the policy found the answer but did not give it (the case the
    original code rewards with `format + retrieval`), so a correct answer is never above 1.0.
    """
    if em > 0:
        return s.correct_valid if valid else s.correct_invalid
    if valid:
        return s.valid_wrong + (s.retrieval_bonus if hit > 0 else 0.0)
    return s.invalid_wrong if has_answer else s.invalid_no_answer


def components(response: str, golds: list[str]) -> dict[str, float]:
    """Every rule component at once; the trajectory records all of them."""
    answer = extract_answer(response)
    valid, _ = is_valid_format(response)
    return {
        "em": exact_match(answer, golds),
        "sub_em": sub_exact_match(answer, golds),
        "f1": f1_score(answer, golds),
        "format": 1.0 if valid else 0.0,
        "has_answer": 0.0 if answer is None else 1.0,
        "retrieval": retrieval_hit(response, golds),
    }
