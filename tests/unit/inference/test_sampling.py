"""Sampling parameters and the sampler, with hand-computed distributions."""

from __future__ import annotations

import math

import pytest
import torch

from inference.sampling import SamplingParams, make_generator, sample_token

# probabilities 0.5, 0.3, 0.2 (log of them are valid logits: softmax gives them back)
LOGITS = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.2)])


def test_greedy_picks_argmax_and_reports_unmodified_logprob() -> None:
    tok, lp = sample_token(LOGITS, SamplingParams(temperature=0), make_generator(0))
    assert tok == 0
    assert lp == pytest.approx(math.log(0.5), abs=1e-6)


def test_logprob_is_of_the_temperature_scaled_distribution_before_top_k() -> None:
    # As SGLang's sampler: log_softmax(logits / T), not renormalised over top-k / top-p.
    params = SamplingParams(temperature=5.0, top_k=2)
    scaled = [p ** (1 / 5) for p in (0.5, 0.3, 0.2)]
    expected = [math.log(q / sum(scaled)) for q in scaled]
    for seed in range(20):
        tok, lp = sample_token(LOGITS, params, make_generator(seed))
        assert tok in (0, 1)  # top_k=2 never draws the 0.2 token
        assert lp == pytest.approx(expected[tok], abs=1e-6)


def test_temperature_below_sglang_epsilon_is_greedy_with_unscaled_logprob() -> None:
    # SGLang turns temperature < 1e-6 into greedy (top_k 1, temperature 1).
    tok, lp = sample_token(LOGITS, SamplingParams(temperature=1e-7), make_generator(0))
    assert tok == 0
    assert lp == pytest.approx(math.log(0.5), abs=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_mass() -> None:
    # top_p=0.6: 0.5 < 0.6 so the 0.3 token is needed too; 0.2 is dropped.
    seen = {
        sample_token(LOGITS, SamplingParams(top_p=0.6), make_generator(s))[0] for s in range(200)
    }
    assert seen == {0, 1}
    # top_p=0.5: the first token alone reaches it.
    seen = {
        sample_token(LOGITS, SamplingParams(top_p=0.5), make_generator(s))[0] for s in range(50)
    }
    assert seen == {0}


def test_sampling_frequencies_follow_distribution() -> None:
    g = make_generator(123)
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[sample_token(LOGITS, SamplingParams(), g)[0]] += 1
    assert [c / 3000 for c in counts] == pytest.approx([0.5, 0.3, 0.2], abs=0.04)


def test_seed_reproducible() -> None:
    a = [sample_token(LOGITS, SamplingParams(), make_generator(7))[0] for _ in range(5)]
    b = [sample_token(LOGITS, SamplingParams(), make_generator(7))[0] for _ in range(5)]
    assert a == b


def test_from_dict_sglang_names() -> None:
    p = SamplingParams.from_dict(
        {"max_new_tokens": 4, "stop": "</search>", "sampling_seed": 3, "min_p": 0.0}
    )
    assert p.stop == ["</search>"] and p.seed == 3 and p.max_new_tokens == 4


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"seed": 3}, "seed"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"bogus": 1}, "bogus"),
        ({"max_new_tokens": "many"}, "sampling_params.max_new_tokens"),
        ({"max_new_tokens": float("inf")}, "sampling_params.max_new_tokens"),
        ({"top_k": float("-inf")}, "sampling_params.top_k"),
        ({"temperature": float("nan")}, "sampling_params.temperature"),
        ({"sampling_seed": 2**64}, "sampling_params.sampling_seed"),
        ({"stop": ["a"] * 33}, "sampling_params.stop"),
        ({"no_stop_trim": "yes"}, "sampling_params.no_stop_trim"),
    ],
)
def test_from_dict_rejects_bad_fields(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(fields)
