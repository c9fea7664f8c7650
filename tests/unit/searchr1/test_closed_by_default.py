"""Closed by default: a service listening beyond loopback without an admin token refuses to start
(its guarded routes would be open to the whole network) unless `http.auth: none` says so."""

from __future__ import annotations

import pytest

from searchr1.sections import HttpConfig
from searchr1.service import ADMIN_TOKEN_ENV, InsecureListener, check_exposure, uvicorn_server


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.7", "retriever.svc", ""])
def test_beyond_loopback_without_a_token_refuses_naming_the_settings(host: str) -> None:
    with pytest.raises(InsecureListener) as err:
        check_exposure(HttpConfig(host=host), token_set=False)
    message = str(err.value)
    assert ADMIN_TOKEN_ENV in message and "http.auth" in message and "none" in message


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_runs_without_a_token(host: str) -> None:
    check_exposure(HttpConfig(host=host), token_set=False)


def test_a_token_opens_any_address() -> None:
    check_exposure(HttpConfig(host="0.0.0.0"), token_set=True)


def test_auth_none_is_an_explicit_opt_out(caplog: pytest.LogCaptureFixture) -> None:
    check_exposure(HttpConfig(host="0.0.0.0", auth="none"), token_set=False)
    assert "open" in caplog.text  # said out loud at start-up


def test_auth_takes_only_known_values() -> None:
    with pytest.raises(ValueError, match="auth"):
        HttpConfig(auth="off")  # type: ignore[arg-type]


def test_the_server_is_not_built_without_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi import FastAPI

    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    with pytest.raises(InsecureListener):
        uvicorn_server(FastAPI(), HttpConfig(host="0.0.0.0", port=0))
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "s3cret")
    uvicorn_server(FastAPI(), HttpConfig(host="0.0.0.0", port=0))


def test_the_sglang_launcher_refuses_too() -> None:
    # SGLang is not served by our uvicorn: its launcher makes the same check before starting.
    from inference.config import InferenceConfig
    from inference.sglang_launcher import run_sglang

    cfg = InferenceConfig.model_validate({"engine": "sglang", "http": {"host": "0.0.0.0"}})
    with pytest.raises(InsecureListener):
        run_sglang(cfg, admin_token=None)
