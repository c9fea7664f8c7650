"""`searchr1 local scale`: the launcher's control endpoint adds engines and retires the ones it
added (never the ones the run started with), behind a token; the supervisor follows added
children and removes retired ones without counting them as deaths. Engines here are sleeping
processes (the join itself: tests/integration/test_engine_join.py)."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from searchr1.supervisor import ServiceSpec, Supervisor
from stack.config import load_config
from stack.launcher import build_specs, engine_spec
from stack.scale import ControlServer, EngineScaler, request_scale


def sleeper(name: str) -> ServiceSpec:
    return ServiceSpec(name, [sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[Supervisor, Path]]:
    sup = Supervisor([sleeper("inference")], tmp_path / "logs", grace_s=2)
    sup.start()
    scaler = EngineScaler(sup, lambda i: sleeper(f"inference-{i}"), floor=1, port=30000)
    control = ControlServer(scaler, 0, "tok", tmp_path / "control.json").start()
    stop = threading.Event()

    def loop() -> None:  # the launcher's tick
        while not stop.is_set():
            scaler.apply_pending()
            sup.check()
            time.sleep(0.05)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield sup, tmp_path / "control.json"
    finally:
        stop.set()
        thread.join()
        control.stop()
        sup.stop()


def names(answer: dict) -> list[str]:
    return [e["name"] for e in answer["engines"]]


def test_scale_up_and_down_through_the_control_endpoint(running: tuple[Supervisor, Path]) -> None:
    sup, file = running
    assert (file.stat().st_mode & 0o777) == 0o600
    up = request_scale(file, 3)
    assert names(up) == ["inference", "inference-1", "inference-2"]
    assert up["engines"][2]["url"] == "http://127.0.0.1:30002"
    down = request_scale(file, 2)
    assert names(down) == ["inference", "inference-1"]
    deadline = time.monotonic() + 10
    while len(sup.children) != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [c.spec.name for c in sup.children] == ["inference", "inference-1"]  # reaped
    assert all(c.status != "failed" for c in sup.children)
    assert names(request_scale(file, None)) == ["inference", "inference-1"]
    with pytest.raises(ValueError, match=r"between 1 \(local.inference_replicas"):
        request_scale(file, 0)


def test_the_endpoint_needs_the_token(running: tuple[Supervisor, Path]) -> None:
    _, file = running
    url = json.loads(file.read_text())["url"]
    assert httpx.post(f"{url}/scale", json={"engines": 2}).status_code == 401
    bad = httpx.post(f"{url}/scale", json={"engines": "2"}, headers={"Authorization": "Bearer tok"})
    assert bad.status_code == 400 and "integer" in bad.json()["error"]


def test_scaling_needs_the_weight_store_and_turns_discovery_on(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"needs trainer\.weight_push\.store_dir"):
        load_config(None, local={"control_port": 0})
    cfg = load_config(
        None,
        local={"control_port": 0},
        trainer={"weight_push": {"mode": "distributed", "store_dir": str(tmp_path)}},
    )
    specs = {s.name: s for s in build_specs(cfg, tmp_path / "c.yaml", "redis://x")}
    assert specs["inference"].env["SEARCHR1_INFERENCE__JOIN__STORE_DIR"] == str(tmp_path)
    assert "SEARCHR1_INFERENCE__JOIN__ANNOUNCE" not in specs["inference"].env
    assert specs["trainer"].env["SEARCHR1_ENGINES__DISCOVER"] == "true"
    assert specs["orchestrator"].env["SEARCHR1_ENGINES__DISCOVER"] == "true"
    added = engine_spec(cfg, tmp_path / "c.yaml", "redis://x", 2)
    assert added.name == "inference-2" and added.ready_url == "http://127.0.0.1:30002/ready"
    assert added.env["SEARCHR1_INFERENCE__JOIN__ANNOUNCE"] == "true"
    assert added.env["SEARCHR1_INFERENCE__JOIN__ADVERTISE_URL"] == "http://127.0.0.1:30002"


def test_an_added_engine_that_fails_is_removed_and_the_run_goes_on(tmp_path: Path) -> None:
    sup = Supervisor([sleeper("inference")], tmp_path / "logs", grace_s=2)
    sup.start()
    try:
        spec = ServiceSpec("inference-1", [sys.executable, "-c", "raise SystemExit(3)"])
        spec.optional = True
        sup.add(spec)
        deadline = time.monotonic() + 10
        while len(sup.children) > 1 and time.monotonic() < deadline:
            assert sup.check()  # no ChildFailed
            time.sleep(0.05)
        assert [c.spec.name for c in sup.children] == ["inference"]
    finally:
        sup.stop()
