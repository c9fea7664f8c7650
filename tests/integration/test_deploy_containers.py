"""The compose `cpu` profile's retriever and reference engine, run as real local processes with
the command and environment docker-compose.yml gives them (only the config path and the ports
differ), and checked the way Docker does: the image's `healthcheck.py`, then `docker stop`
(SIGTERM) must exit 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from searchr1.redis_server import free_port
from tests.unit.deploy import stack

pytestmark = pytest.mark.timeout(240)


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    env: dict[str, str]
    url: str
    health: tuple[str, str]  # (service, path) of the compose health check


def _start(name: str, replace: dict[str, str], log: Path) -> Running:
    c = stack.compose_containers()[name]
    argv = [replace.get(a, a) for a in c.argv]
    env = {k: v for k, v in c.env.items() if k.startswith(stack.env_prefix())}
    env[stack.config_file_env()] = str(stack.DOCKER / "cpu-demo.yaml")  # mounted in compose
    port = free_port()
    env[f"SEARCHR1_{c.service.upper()}__HTTP__PORT"] = str(port)
    if c.service == "retriever":
        env["SEARCHR1_RETRIEVER__GRPC_PORT"] = str(free_port())
    base = {k: v for k, v in os.environ.items() if not k.startswith(stack.env_prefix())}
    full_env = {**base, **env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stack.cli", *argv],
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    test = stack.compose_raw()["services"][name]["healthcheck"]["test"]
    health = stack.healthcheck_probe(test)
    assert health
    return Running(proc, full_env, f"http://127.0.0.1:{port}", health)


def _docker_healthcheck(r: Running) -> int:
    """What Docker runs in the container: the script with the container's environment."""
    cmd = [sys.executable, str(stack.DOCKER / "healthcheck.py"), *r.health]
    return subprocess.run(cmd, env=r.env, timeout=30).returncode


def _wait_healthy(r: Running, log: Path, timeout_s: float = 150) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert r.proc.poll() is None, log.read_text()[-3000:]
        if _docker_healthcheck(r) == 0:
            return
        time.sleep(0.5)
    raise TimeoutError(log.read_text()[-3000:])


def _stop(r: Running) -> int:
    if r.proc.poll() is None:
        r.proc.send_signal(signal.SIGTERM)  # `docker stop`
    try:
        return r.proc.wait(60)
    except subprocess.TimeoutExpired:
        r.proc.kill()
        return -9


@pytest.fixture(scope="module")
def retriever(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    from harness.synthetic import write_corpus

    tmp = tmp_path_factory.mktemp("deploy-retriever")
    corpus = write_corpus(tmp / "corpus.jsonl", 50)
    index = tmp / "index"
    build = [
        sys.executable,
        "-m",
        "stack.cli",
        "retriever",
        "build",
        "--corpus",
        str(corpus),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*build, "--out", str(index), "--backend", "bm25"], check=True, env=env)
    log = tmp / "retriever.log"
    r = _start("retriever", {"/index": str(index)}, log)
    try:
        _wait_healthy(r, log)
        yield r
    finally:
        _stop(r)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    from inference.tiny_model import make_tiny_model

    tmp = tmp_path_factory.mktemp("deploy-engine")
    model = make_tiny_model(tmp / "tiny")
    log = tmp / "inference.log"
    r = _start("inference-cpu", {"/models/warm": str(model)}, log)
    try:
        _wait_healthy(r, log)
        yield r
    finally:
        _stop(r)


def test_retriever_is_healthy_serves_and_stops_cleanly(retriever: Running) -> None:
    assert retriever.health == ("retriever", "/ready")
    r = httpx.post(f"{retriever.url}/retrieve", json={"queries": ["city river"], "topk": 2})
    assert r.status_code == 200 and len(r.json()["result"][0]) == 2
    assert httpx.get(f"{retriever.url}/metrics").status_code == 200
    # The admin token comes from the compose environment: without it, 401.
    assert httpx.post(f"{retriever.url}/flush_cache").status_code == 401
    token = {"Authorization": f"Bearer {retriever.env['SEARCHR1_ADMIN_TOKEN']}"}
    assert httpx.post(f"{retriever.url}/flush_cache", headers=token).status_code == 200
    assert _stop(retriever) == 0
    assert _docker_healthcheck(retriever) == 1  # stopped: unhealthy


def test_reference_engine_is_healthy_generates_and_stops_cleanly(engine: Running) -> None:
    assert engine.health == ("inference", "/ready")
    r = httpx.post(
        f"{engine.url}/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
        timeout=60,
    )
    assert r.status_code == 200 and len(r.json()["output_ids"]) >= 1
    assert httpx.post(f"{engine.url}/pause_generation").status_code == 401
    assert _stop(engine) == 0


def test_the_charts_torchrun_command_launches_the_trainer() -> None:
    """The chart's trainer command, as pod 0 of a one-node job runs it (master = itself)."""
    job = next(
        d
        for d in stack.render_chart("cpu")
        if d["kind"] == "Job" and d["metadata"]["name"].endswith("-trainer")
    )
    command = stack.pod_spec(job)["containers"][0]["command"]
    port = free_port()
    argv = [
        "--node-rank=0"
        if a.startswith("--node-rank=")
        else "--master-addr=127.0.0.1"
        if a.startswith("--master-addr=")
        else f"--master-port={port}"
        if a.startswith("--master-port=")
        else a
        for a in command
    ]
    assert argv[:3] == ["python", "-m", "torch.distributed.run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # --help: torchrun starts one worker, which imports the CLI and parses the command.
    r = subprocess.run(
        [sys.executable, *argv[1:], "--help"], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--model" in r.stdout and "trainer run" in r.stdout
