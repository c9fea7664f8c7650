"""The compose `gateway` service as a real local process with the command and environment
docker-compose.yml gives it (only the config path, the port and the hosts of Redis and the
engine differ): behind a password-protected Redis and the `cpu` profile's reference engine,
checked the way Docker does (the image's `healthcheck.py`, then SIGTERM must exit 0), with the
admin token from the compose environment enforced and one session reaching the bus."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from openai import OpenAI

from searchr1.bus import TrajectoryBus
from searchr1.redis_server import RedisServer, free_port
from tests.integration.test_deploy_containers import (
    Running,
    _docker_healthcheck,
    _start,
    _stop,
    _wait_healthy,
)
from tests.unit.deploy import stack

pytestmark = pytest.mark.timeout(480)  # two services start; the shared machine may be loaded
CONFIG = stack.DOCKER / "cpu-demo.yaml"  # what compose mounts in the cpu profile


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    from inference.tiny_model import make_tiny_model

    tmp = tmp_path_factory.mktemp("deploy-gateway-engine")
    model = make_tiny_model(tmp / "tiny")
    log = tmp / "inference.log"
    r = _start("inference-cpu", {"/models/warm": str(model)}, log)
    try:
        _wait_healthy(r, log)
        yield r
    finally:
        _stop(r)


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """Redis with the password compose gives it (REDIS_PASSWORD, here the tests' stand-in)."""
    server = RedisServer(data_dir=tmp_path_factory.mktemp("redis"), password=stack.FAKE_SECRET)
    server.start()
    try:
        yield server
    finally:
        server.close()


def _start_gateway(engine: Running, redis: RedisServer, log: Path) -> Running:
    c = stack.compose_containers()["gateway"]
    env = {k: v for k, v in c.env.items() if k.startswith(stack.env_prefix())}
    # Only the hosts change: compose's service names become this machine's processes.
    redis_url = urlparse(env["SEARCHR1_REDIS__URL"])
    env["SEARCHR1_REDIS__URL"] = redis_url._replace(
        netloc=f":{redis_url.password}@127.0.0.1:{redis.port}"
    ).geturl()
    assert env["SEARCHR1_REDIS__URL"] == redis.url  # the compose password is the server's
    assert urlparse(env["SEARCHR1_GATEWAY__ENGINE_URL"]).hostname == "engine"
    env["SEARCHR1_GATEWAY__ENGINE_URL"] = engine.url
    env[stack.config_file_env()] = str(CONFIG)
    port = free_port()
    env["SEARCHR1_GATEWAY__HTTP__PORT"] = str(port)
    base = {k: v for k, v in os.environ.items() if not k.startswith(stack.env_prefix())}
    root = str(stack.ROOT)
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    full_env = {**base, **env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stack.cli", *c.argv],
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    test = stack.compose_raw()["services"]["gateway"]["healthcheck"]["test"]
    health = stack.healthcheck_probe(test)
    assert health
    return Running(proc, full_env, f"http://127.0.0.1:{port}", health)


@pytest.fixture
def gateway(engine: Running, redis: RedisServer, tmp_path: Path) -> Iterator[Running]:
    log = tmp_path / "gateway.log"
    r = _start_gateway(engine, redis, log)
    try:
        _wait_healthy(r, log)
        yield r
    finally:
        _stop(r)


async def _one_trajectory(redis_url: str) -> tuple[list[int], bytes]:
    cfg = stack.load_with_env({}, CONFIG)
    bus = TrajectoryBus.from_url(redis_url, cfg.bus.model_copy(update={"consumer": "t"}))
    try:
        await bus.ensure_group()
        for _ in range(40):
            got = await bus.consume(1, block=0.5)
            if got:
                t = got[0].trajectory
                return list(t.response_token_ids), bytes(t.loss_mask)
        raise AssertionError("no trajectory on the bus")
    finally:
        await bus.close()


def test_gateway_is_healthy_guarded_serves_and_stops_cleanly(
    gateway: Running, redis: RedisServer
) -> None:
    assert gateway.health == ("gateway", "/ready")
    token = gateway.env["SEARCHR1_ADMIN_TOKEN"]
    # The admin token from the compose environment guards the OpenAI routes.
    assert httpx.get(f"{gateway.url}/v1/models").status_code == 401
    assert httpx.get(f"{gateway.url}/metrics").status_code == 200
    headers = {"X-Session-Id": "deploy-1", "X-Group-Id": "g", "X-Group-Size": "1"}
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=token, default_headers=headers)
    assert client.models.list().data
    answer = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert answer.choices[0].message is not None
    ended = httpx.post(
        f"{gateway.url}/v1/sessions/deploy-1/end",
        json={"reward": 1.0},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert ended.status_code == 200, ended.text
    # The session reaches the bus through the password-protected Redis compose wires.
    response, mask = asyncio.run(_one_trajectory(redis.url))
    assert response and mask and mask[0] == 1
    assert _stop(gateway) == 0  # `docker stop`: SIGTERM, a clean exit
    assert _docker_healthcheck(gateway) == 1
