"""Hypothesis over the shared HTTP plumbing: whatever a client puts in X-Request-ID, the answer
is a 2xx with a short, plain request id (it is echoed in the answer and on every log line)."""

from __future__ import annotations

import re

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from searchr1.service import create_service_app

SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# What an HTTP client can put in a header value: visible latin-1 and spaces, any length.
header_values = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
    max_size=4000,
)


@settings(max_examples=200, deadline=None)
@given(rid=header_values)
async def test_any_request_id_comes_back_short_and_plain(rid: str) -> None:
    app = create_service_app("props")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://svc") as client:
        r = await client.get("/health", headers={"X-Request-ID": rid.encode("latin-1")})
    assert r.status_code == 200
    echoed = r.headers["x-request-id"]
    assert SAFE_ID.match(echoed), echoed
    if SAFE_ID.match(rid):
        assert echoed == rid  # a well-formed id is kept: it ties the services' logs together


def test_every_operation_documents_the_request_id_header() -> None:
    schema = create_service_app("props").openapi()
    for path, ops in schema["paths"].items():
        for op in ops.values():
            names = {p["name"].lower() for p in op.get("parameters", []) if p["in"] == "header"}
            assert "x-request-id" in names, path
