"""The /retrieve request model: its OpenAPI schema states the configured limits (so a fuzzer
generates requests near them), and it agrees with the engine's own checks (used by gRPC too)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from retriever.config import RetrieverConfig
from retriever.engine import BadRequest, RetrieverEngine
from retriever.server import create_app, retrieve_request_model

CFG = RetrieverConfig.model_validate(
    {"limits": {"max_queries": 4, "max_query_chars": 12, "max_topk": 5}, "grpc_port": None}
)
Model = retrieve_request_model(CFG.limits)


class NoBackend:
    name = "none"

    def search_batch(self, queries: list[str], topk: int) -> list[Any]:
        raise AssertionError("never searched here")

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def engine() -> RetrieverEngine:
    return RetrieverEngine(NoBackend(), CFG)


def test_openapi_states_the_limits() -> None:
    schema = create_app(CFG).openapi()
    ref = schema["paths"]["/retrieve"]["post"]["requestBody"]["content"]["application/json"]
    name = ref["schema"]["$ref"].rsplit("/", 1)[-1]
    props = schema["components"]["schemas"][name]["properties"]
    assert props["queries"]["minItems"] == 1 and props["queries"]["maxItems"] == 4
    assert props["queries"]["items"]["maxLength"] == 12
    topk = next(s for s in props["topk"]["anyOf"] if s.get("type") == "integer")
    assert topk["minimum"] == 0 and topk["maximum"] == 5
    assert schema["components"]["schemas"][name]["required"] == ["queries"]


# Any JSON value: what a client may send in each field.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=12,
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "queries": st.lists(st.text(max_size=16), max_size=6) | json_values,
        "topk": st.integers(-3, 8) | json_values,
        "return_scores": st.booleans() | json_values,
    },
)


@settings(max_examples=400, deadline=None)
@given(body=bodies)
def test_the_model_and_the_engine_agree(engine: RetrieverEngine, body: dict[str, Any]) -> None:
    try:
        req = Model.model_validate(body)
    except ValidationError:
        return  # refused at the edge with a 422 naming the field
    # What the model lets through, the engine accepts: no second, different answer.
    try:
        topk = engine.validate(req.queries, req.topk)
    except BadRequest as e:
        raise AssertionError(f"model accepted {body!r}, engine refused: {e}") from None
    assert 1 <= topk <= CFG.limits.max_topk


@settings(max_examples=200, deadline=None)
@given(queries=st.lists(st.text(max_size=16), min_size=1, max_size=6), topk=st.integers(-3, 8))
def test_what_the_engine_refuses_the_model_refuses(
    engine: RetrieverEngine, queries: list[str], topk: int
) -> None:
    try:
        engine.validate(queries, topk)
    except BadRequest:
        with pytest.raises(ValidationError):
            Model.model_validate({"queries": queries, "topk": topk})


def test_a_lone_surrogate_is_refused_by_the_model() -> None:
    with pytest.raises(ValidationError, match=r"queries\.0"):
        Model.model_validate({"queries": ["ok \ud800"]})
