"""Hand-written cases for the rule rewards (spec section 4)."""

from __future__ import annotations

import re

import pytest

from orchestrator import rewards as R
from orchestrator.config import ShapedScores
from orchestrator.prompt import make_prompt_text

VALID_ONE_SEARCH = (
    "<think> need to look it up </think>\n<search> capital of france </search>\n\n"
    '<information>Doc 1(Title: "Paris") Paris is the capital of France.\n</information>\n\n'
    "<think> it is paris </think>\n<answer> Paris </answer>"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Beatles!", "beatles"),
        ("  A   Tale of Two Cities ", "tale of two cities"),
        ("an apple, the pear", "apple pear"),
        ("Theatre", "theatre"),  # articles only as whole words
        ("U.S.A.", "usa"),
        ("", ""),
        ("\tNew\nYork ", "new york"),
    ],
)
def test_normalize(text: str, expected: str) -> None:
    assert R.normalize(text) == expected


def test_exact_match_articles_punctuation_case() -> None:
    assert R.exact_match("the Beatles.", ["Beatles"]) == 1.0
    assert R.exact_match("Beatles band", ["Beatles"]) == 0.0
    assert R.exact_match(None, ["x"]) == 0.0


def test_exact_match_multiple_golds() -> None:
    golds = ["Barack Obama", "Obama", "Barack Hussein Obama II"]
    assert R.exact_match("obama", golds) == 1.0
    assert R.exact_match("Barack Hussein Obama II", golds) == 1.0
    assert R.exact_match("Michelle Obama", golds) == 0.0


def test_sub_exact_match() -> None:
    assert R.sub_exact_match("It was Barack Obama, surely", ["Obama"]) == 1.0
    assert R.sub_exact_match("Biden", ["Obama"]) == 0.0
    # An empty normalised gold ("The") must not match everything.
    assert R.sub_exact_match("anything", ["The"]) == 0.0


def test_f1_hand_computed() -> None:
    # pred tokens [new, york, city], gold [new, york]: P=2/3 R=1 F1=0.8
    assert R.f1_score("New York City", ["New York"]) == pytest.approx(0.8)
    # best over golds: vs "york" P=1/3 R=1 -> 0.5; vs "new york city" -> 1.0
    assert R.f1_score("New York City", ["york", "new york city"]) == pytest.approx(1.0)
    assert R.f1_score("paris", ["london"]) == 0.0
    # repeated tokens count with multiplicity: pred [a1 a1 b] vs gold [a1 b b]
    # common = {a1:1, b:1} = 2, P = 2/3, R = 2/3, F1 = 2/3
    assert R.f1_score("x x y", ["x y y"]) == pytest.approx(2 / 3)


def test_extract_answer_last_wins() -> None:
    text = "<answer> first </answer> more <answer>second</answer>"
    assert R.extract_answer(text) == "second"
    assert R.extract_answer("no answer here") is None
    assert R.extract_answer("<answer>\nmulti\nline\n</answer>") == "multi\nline"
    # an unclosed answer is no answer
    assert R.extract_answer("<answer> Paris") is None


def test_answer_in_prompt_example_is_ignored() -> None:
    # The prompt holds "<answer> Beijing </answer>"; only the response is scored.
    response = "<think> hm </think> I do not know."
    c = R.components(response, ["Beijing"])
    assert c["em"] == 0.0 and c["has_answer"] == 0.0


def test_valid_format_cases() -> None:
    assert R.is_valid_format(VALID_ONE_SEARCH) == (True, "ok")
    assert R.is_valid_format("<think>x</think><answer>y</answer>")[0]
    assert R.is_valid_format("  <think>x</think>\n\n<answer>y</answer>\n")[0]


@pytest.mark.parametrize(
    ("text", "reason_part"),
    [
        ("<answer> Paris </answer>", "unexpected <answer> in state start"),  # before any think
        ("<think> a </think><answer> Paris", "unbalanced <answer>"),
        ("<think> a <answer>b</answer>", "unbalanced <think>"),
        ("<think>a</think> so <answer>b</answer>", "text outside tags in state after_think"),
        ("<think>a</think><answer>b</answer> trailing", "text outside tags in state end"),
        ("<think>a</think><search>q</search><answer>b</answer>", "<answer> in state after_search"),
        (
            "<think>a</think><search>q</search><information>d</information><answer>b</answer>",
            "unexpected <answer> in state after_information",
        ),
        ("<think>a</think>", "ended in state after_think"),
        ("<think>a</think><answer>b</answer><answer>c</answer>", "unexpected <answer>"),
    ],
)
def test_invalid_format_cases(text: str, reason_part: str) -> None:
    valid, reason = R.is_valid_format(text)
    assert not valid
    assert reason_part in reason


def test_retrieval_hit() -> None:
    assert R.retrieval_hit(VALID_ONE_SEARCH, ["paris"]) == 1.0
    assert R.retrieval_hit(VALID_ONE_SEARCH, ["London"]) == 0.0
    # the gold in the answer but not in an information block is no retrieval hit
    assert R.retrieval_hit("<answer> Paris </answer>", ["Paris"]) == 0.0


S = ShapedScores(retrieval_bonus=0.1)


@pytest.mark.parametrize(
    ("response", "golds", "expected"),
    [
        (VALID_ONE_SEARCH, ["Paris"], 1.0),  # correct and valid
        ("<answer> Paris </answer>", ["Paris"], 0.8),  # correct, invalid (no think)
        (VALID_ONE_SEARCH, ["London"], 0.2),  # valid, wrong
        ("<think>a</think><answer>Rome</answer>", ["Paris"], 0.2),
        ("blah <answer> Rome </answer>", ["Paris"], 0.1),  # invalid, wrong answer
        ("blah blah", ["Paris"], 0.0),  # invalid, no answer
        ("<think> x </think><answer> Paris", ["Paris"], 0.0),  # unclosed: no answer, invalid
    ],
)
def test_shaped_reward_table(response: str, golds: list[str], expected: float) -> None:
    c = R.components(response, golds)
    got = R.shaped_reward(
        c["em"], c["format"] > 0, c["has_answer"] > 0, c["retrieval"], ShapedScores()
    )
    assert got == pytest.approx(expected)


def test_shaped_retrieval_bonus_only_when_not_correct() -> None:
    wrong = VALID_ONE_SEARCH.replace("<answer> Paris </answer>", "<answer> Lyon </answer>")
    c = R.components(wrong, ["Paris"])
    assert c["retrieval"] == 1.0 and c["em"] == 0.0
    assert R.shaped_reward(c["em"], True, True, c["retrieval"], S) == pytest.approx(0.3)
    c = R.components(VALID_ONE_SEARCH, ["Paris"])
    assert R.shaped_reward(c["em"], True, True, c["retrieval"], S) == pytest.approx(1.0)


def test_components_all_present() -> None:
    c = R.components(VALID_ONE_SEARCH, ["Paris"])
    assert c == {
        "em": 1.0,
        "sub_em": 1.0,
        "f1": 1.0,
        "format": 1.0,
        "has_answer": 1.0,
        "retrieval": 1.0,
    }


def _reference_extract(prompt: str, response: str) -> str | None:
    """slime's `extract_solution` as it is called: the last match in prompt + response."""
    matches = re.findall(r"<answer>(.*?)</answer>", prompt + response, re.DOTALL)
    return matches[-1].strip() if matches else None


def test_extraction_versus_the_references_on_the_prompt_example() -> None:
    prompt = make_prompt_text("what is the capital of china")
    no_answer = "<think> hm </think> I do not know."
    # The references pick up the prompt's example when the response gives no answer...
    assert _reference_extract(prompt, no_answer) == "Beijing"
    # ...we score the response alone: no answer, so no EM and has_answer 0.
    assert R.extract_answer(no_answer) is None
    c = R.components(no_answer, ["Beijing"])
    assert (c["em"], c["has_answer"]) == (0.0, 0.0)
    # With an answer in the response both take the same, the response's last.
    answered = "<think> hm </think>\n<answer> Shanghai </answer>"
    assert _reference_extract(prompt, answered) == R.extract_answer(answered) == "Shanghai"
