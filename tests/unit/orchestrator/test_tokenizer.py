"""RustTokenizer: the same ids and text as the transformers tokenizer it wraps."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.observation import OBS_PREFIX, OBS_SUFFIX, tokenize_observation
from orchestrator.prompt import make_prompt_text, prompt_token_ids
from orchestrator.tokenizer import RustTokenizer, rust_tokenizer

PIECES = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<search>",
    "</search>",
    "<answer> Paris </answer>",
    OBS_PREFIX,
    OBS_SUFFIX,
    'Doc 1(Title: "Paris") ',
    "\n",
    "  ",
    "héllo wörld ",
    "日本語のテキスト",
    "🙂",
    "1,234.5",
    "don't",
]
TEXTS = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=12)), max_size=12).map("".join)
SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(text=TEXTS, special=st.booleans())
def test_encode_is_transformers_encode(tokenizer, text: str, special: bool) -> None:  # type: ignore[no-untyped-def]
    fast = RustTokenizer(tokenizer)
    assert fast.encode(text, add_special_tokens=special) == tokenizer.encode(
        text, add_special_tokens=special
    )


@SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_decode_is_transformers_decode(tokenizer, data: st.DataObject, skip: bool) -> None:  # type: ignore[no-untyped-def]
    fast = RustTokenizer(tokenizer)
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=40))
    # Cut byte sequences included (a partial character decodes to U+FFFD both ways).
    assert fast.decode(ids, skip_special_tokens=skip) == tokenizer.decode(
        ids, skip_special_tokens=skip
    )


def test_truncation_set_on_the_wrapped_tokenizer_does_not_leak(tokenizer) -> None:  # type: ignore[no-untyped-def]
    fast = RustTokenizer(tokenizer)
    text = "a long enough sentence to be cut by a truncating call " * 4
    full = tokenizer.encode(text, add_special_tokens=False)
    tokenizer(text, truncation=True, max_length=3)
    assert fast.encode(text, add_special_tokens=False) == full


def test_everything_else_is_the_wrapped_tokenizer(tokenizer) -> None:  # type: ignore[no-untyped-def]
    fast = rust_tokenizer(tokenizer)
    assert isinstance(fast, RustTokenizer)
    assert len(fast) == len(tokenizer)
    assert fast.eos_token_id == tokenizer.eos_token_id
    messages = [{"role": "user", "content": make_prompt_text("capital of france")}]
    assert prompt_token_ids(fast, messages) == prompt_token_ids(tokenizer, messages)
    assert rust_tokenizer(fast.backend) is fast.backend  # not a transformers tokenizer: as is


def test_observations_are_tokenized_the_same(tokenizer) -> None:  # type: ignore[no-untyped-def]
    fast = RustTokenizer(tokenizer)
    body = 'Doc 1(Title: "Hamlet") Hamlet is a tragedy by William Shakespeare. 日本 🙂\n' * 20
    for cap in (None, 10, 64, 100_000):
        assert tokenize_observation(fast, body, cap) == tokenize_observation(tokenizer, body, cap)


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers(tokenizer) -> None:  # type: ignore[no-untyped-def]
    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    cleaning.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    ids = cleaning.encode("a , b . c ' s", add_special_tokens=False)
    assert RustTokenizer(cleaning).decode(ids) == cleaning.decode(ids) == "a, b. c's"
