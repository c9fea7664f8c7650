"""The engine's request models: /openapi.json states what /generate and the admin routes take
(so a fuzzer generates requests near the limits), and Hypothesis checks that the published
sampling_params schema and `SamplingParams.from_dict` (the enforcement, 400 naming the field)
agree, and that no JSON makes either raise anything but a validation error."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from inference import sampling
from inference.sampling import SamplingParams
from inference.server import GenerateReq, create_app

SCHEMA = create_app(SimpleNamespace()).openapi()  # type: ignore[arg-type]
MODELS = SCHEMA["components"]["schemas"]


def test_generate_documents_sampling_params() -> None:
    params = MODELS["GenerateReq"]["properties"]["sampling_params"]
    assert params["additionalProperties"] is False
    props = params["properties"]
    assert props["temperature"]["minimum"] == 0
    assert props["top_p"]["exclusiveMinimum"] == 0 and props["top_p"]["maximum"] == 1
    assert props["max_new_tokens"]["minimum"] == 0
    stop_list = next(s for s in props["stop"]["anyOf"] if s.get("type") == "array")
    assert stop_list["maxItems"] == sampling.MAX_STOP_STRINGS
    assert stop_list["items"]["maxLength"] == sampling.MAX_STOP_CHARS
    assert props["stop_token_ids"]["maxItems"] == sampling.MAX_STOP_TOKEN_IDS
    seed = next(s for s in props["sampling_seed"]["anyOf"] if s.get("type") == "integer")
    # FastAPI writes the bounds as floats (2**63 rounds): a seed generated at them gets a 400.
    assert (seed["minimum"], seed["maximum"]) == (
        float(sampling.SEED_MIN),
        float(sampling.SEED_MAX),
    )


def test_operation_ids_are_unique() -> None:
    ids = [op["operationId"] for path in SCHEMA["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids))


def test_admin_models_use_enums() -> None:
    assert MODELS["PauseReq"]["properties"]["mode"]["enum"] == ["abort", "in_place", "retract"]
    assert set(MODELS["GroupJoin"]["properties"]["backend"]["enum"]) == {"nccl", "gloo"}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=10,
)
FIELDS = sorted(sampling.KNOWN_FIELDS | sampling.IGNORED_FIELDS)


@settings(max_examples=200, deadline=None)
@given(d=st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), json_values, max_size=6))
def test_from_dict_raises_only_value_errors(d: dict[str, Any]) -> None:
    # OverflowError, TypeError, ... would be a 500 past the route's handler.
    try:
        SamplingParams.from_dict(d)
    except ValueError as e:
        assert "sampling_params" in str(e)


def _stop_string() -> st.SearchStrategy[str]:
    return st.text(min_size=1, max_size=sampling.MAX_STOP_CHARS).filter(
        lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s)
    )


# Within the published schema (the values a conforming client may send).
valid_params = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": st.integers(0, 10**6),
        "temperature": st.floats(0, 1e6, allow_nan=False),
        "top_p": st.floats(0, 1, exclude_min=True),
        "top_k": st.just(-1) | st.integers(1, 10**6),
        "stop": _stop_string() | st.lists(_stop_string(), max_size=sampling.MAX_STOP_STRINGS),
        "stop_token_ids": st.lists(st.integers(0, 10**6), max_size=50),
        "no_stop_trim": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "ignore_eos": st.booleans(),
        "sampling_seed": st.none() | st.integers(sampling.SEED_MIN, sampling.SEED_MAX),
        "min_p": st.floats(0, 1),
        "n": st.integers(1, 4),
    },
)


@settings(max_examples=150, deadline=None)
@given(d=valid_params)
def test_what_the_schema_allows_from_dict_accepts(d: dict[str, Any]) -> None:
    p = SamplingParams.from_dict(d)
    assert math.isfinite(p.temperature) and 0 < p.top_p <= 1


@settings(max_examples=150, deadline=None)
@given(body=st.dictionaries(st.sampled_from(["text", "input_ids", "rid", "stream"]), json_values))
def test_the_generate_model_raises_only_validation_errors(body: dict[str, Any]) -> None:
    with contextlib.suppress(ValidationError):
        GenerateReq.model_validate(body)


def test_a_bad_pause_mode_is_a_validation_error() -> None:
    from inference.server import PauseReq

    with pytest.raises(ValidationError, match="mode"):
        PauseReq.model_validate({"mode": "nap"})
