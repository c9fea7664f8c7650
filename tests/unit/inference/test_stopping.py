"""inference/stopping.py and inference/prompts.py without a model: finish reasons, the answer's
text, and the prompt checks, against hand-written cases (a character per token)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from inference.prompts import check_prompt, check_prompt_text, eos_token_ids
from inference.requests import Request
from inference.sampling import SamplingParams
from inference.stopping import final_output, finish_reason

ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
    return "".join(ALPHABET[i] for i in ids if not (skip_special_tokens and i == 25))


def request(output: str, **params: object) -> Request:
    loop = asyncio.new_event_loop()
    req = Request(
        rid="r",
        input_ids=[0, 1, 2],
        params=SamplingParams(**params),  # type: ignore[arg-type]
        loop=loop,
        future=loop.create_future(),
        generator=torch.Generator(),
    )
    req.output_ids = [ALPHABET.index(c) for c in output]
    return req


def reason(req: Request, context: int = 100) -> dict[str, object] | None:
    token = req.output_ids[-1]
    return finish_reason(req, token, eos_ids={25}, context_length=context, decode=decode)


def test_finish_reasons() -> None:
    assert reason(request("ab", max_new_tokens=5)) is None
    assert reason(request("abz", max_new_tokens=5)) == {"type": "stop", "matched": 25}
    assert reason(request("abz", max_new_tokens=5, ignore_eos=True)) is None
    assert reason(request("abc", max_new_tokens=5, stop_token_ids=[2])) == {
        "type": "stop",
        "matched": 2,
    }
    assert reason(request("xxend", max_new_tokens=9, stop=["end"])) == {
        "type": "stop",
        "matched": "end",
    }
    assert reason(request("abcde", max_new_tokens=5)) == {"type": "length", "length": 5}
    # 3 prompt tokens + 4 output tokens reach a context of 7
    assert reason(request("abcd", max_new_tokens=50), context=7) == {"type": "length", "length": 4}


def test_final_output_trims_a_matched_stop_string_unless_asked_not_to() -> None:
    req = request("xxendyy", stop=["end"])
    out = final_output(req, {"type": "stop", "matched": "end"}, decode=decode, weight_version=3)
    assert out.text == "xx" and out.output_ids == req.output_ids and out.weight_version == 3
    assert out.prompt_tokens == 3
    req = request("xxend", stop=["end"], no_stop_trim=True)
    out = final_output(req, {"type": "stop", "matched": "end"}, decode=decode, weight_version=0)
    assert out.text == "xxend"
    out = final_output(
        request("abz"), {"type": "stop", "matched": 25}, decode=decode, weight_version=0
    )
    assert out.text == "ab"  # the special token skipped by default


def test_prompt_checks_name_the_field() -> None:
    params = SamplingParams(max_new_tokens=4)
    check_prompt([1, 2], params, context_length=8, vocab_size=10)
    cases = [
        ([], "input_ids is empty"),
        ([1] * 8, "leaves no room"),
        ([1] * 5, "exceeds the context length"),
        ([1, 10], "out of range"),
    ]
    for ids, message in cases:
        with pytest.raises(ValueError, match=message):
            check_prompt(ids, params, context_length=8, vocab_size=10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        check_prompt([1], SamplingParams(stop_token_ids=[12]), context_length=999, vocab_size=10)
    with pytest.raises(ValueError, match="at most 32"):
        check_prompt_text("x" * 33, context_length=2)


def test_eos_ids_from_the_generation_config_and_the_tokenizer() -> None:
    class Gen:
        eos_token_id = [5, 6]

    class Model:
        generation_config = Gen()

    class Tokenizer:
        eos_token_id = 7

    assert eos_token_ids(Model(), Tokenizer()) == {5, 6, 7}
    assert eos_token_ids(object(), Tokenizer()) == {7}
