"""The HTTP layer: status codes, the JSON route, the CLI's refusal of a missing directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from harness.inspector_run import build_run
from inspector.cli import app as cli_app
from inspector.server import create_app


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    path = tmp_path_factory.mktemp("run")
    build_run(path, steps=3, groups=1)
    return TestClient(create_app(path))


def test_pages_answer(client: TestClient) -> None:
    for url in ("/", "/steps/0", "/trajectories", "/trajectories?kind=eval", "/compare"):
        r = client.get(url)
        assert r.status_code == 200, url
        assert r.headers["content-type"].startswith("text/html")
    assert client.get("/static/uPlot.iife.min.js").status_code == 200
    assert client.get("/ready").json()["ready"] is True


def test_missing_things_are_404_and_bad_input_422(client: TestClient) -> None:
    assert client.get("/steps/99").status_code == 404
    assert client.get("/t/train/step-000000/nope").status_code == 404
    assert client.get("/t/train/../../etc/passwd").status_code == 404
    assert client.get("/compare?a=nope").status_code == 404
    assert client.get("/trajectories?kind=other").status_code == 422
    assert client.get("/trajectories?min_reward=abc").status_code == 422
    assert client.get("/trajectories?eval_id=../x").status_code == 422


def test_api_curves(client: TestClient) -> None:
    body = client.get("/api/curves").json()
    assert body["last_step"] == 3
    assert {"title", "labels", "data"} <= set(body["panels"][0])


def test_cli_refuses_a_missing_run_dir(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli_app, [str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "is not a directory" in result.output
