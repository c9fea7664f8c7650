"""`searchr1 local scale` on a real run (issue 44 item 2): the stack trains (Redis, the reference
engine, an orchestrator stepping a word game, the trainer pushing over gloo and publishing to
its weight store); mid-run a second engine is added. It pulls the current version from the
store, is ready, is announced; the trainer's next push reaches it (same weights, bit for bit,
as the first engine) and the orchestrator routes rollouts to it. Scaled down again, it
withdraws and the run goes on with the first engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from searchr1.redis_server import free_port
from tests.integration.test_task_local import TASK

SEARCHR1 = [str(Path(sys.executable).with_name("searchr1"))]
TOKEN = "scale-admin-token"


def steps_done(path: Path) -> int:
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else 0


def wait_for(what: str, check, timeout_s: float, proc: subprocess.Popen) -> None:  # type: ignore[no-untyped-def,type-arg]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert proc.poll() is None, f"searchr1 local exited ({proc.returncode}) waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def checksum(url: str) -> tuple[int, str]:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = httpx.get(f"{url}/weights_checksum", headers=auth, timeout=30).json()
    return int(body["weight_version"]), body["checksum"]


def requests_served(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("searchr1_inference_requests_total{")
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_engine_added_to_a_running_local_run_serves_the_current_weights(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    task_file = tmp_path / "word_task.py"
    task_file.write_text(TASK)
    port = free_port()
    while free_port() == port + 1:  # the added engine takes the next port
        port = free_port()
    ports = {"orchestrator": free_port(), "trainer": free_port()}
    first, second = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"
    cfg = {
        "run": {"id": "scale", "groups_per_step": 2, "group_size": 2, "max_steps": 4000},
        "inference": {"engine": "torch", "model_path": str(tiny_model_dir),
                      "http": {"port": port}},
        "engines": {"urls": [first]},
        "orchestrator": {
            "weight_poll_s": 0.1,
            "epochs": 1000,  # the task's 8 prompts, 2 a step: 4 steps an epoch (~0.3 s a step)
            "http": {"port": ports["orchestrator"]},
            "task": {"name": f"{task_file}:WordTask"},
            "rollout": {"max_turns": 2, "max_tokens_per_turn": 8, "max_response_tokens": 64},
        },
        "trainer": {
            "http": {"port": ports["trainer"]},
            "model": {"path": str(tiny_model_dir), "dtype": "float32"},
            "optim": {"lr": 1e-5},
            "weight_push": {"mode": "distributed", "backend": "gloo", "master_port": free_port(),
                            "store_dir": str(tmp_path / "store")},
            "metrics_jsonl": str(tmp_path / "steps.jsonl"),
        },
        "local": {"services": ["inference", "orchestrator", "trainer"], "control_port": 0,
                  "log_dir": str(tmp_path / "logs"), "redis_dir": str(tmp_path / "redis")},
    }  # fmt: skip
    config = tmp_path / "stack.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"OMP_NUM_THREADS": "1", "SEARCHR1_ADMIN_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [*SEARCHR1, "local", "--config", str(config)],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "local.err").open("w"), env=env,
        cwd=tmp_path,
    )  # fmt: skip
    scale = [*SEARCHR1, "local", "scale", "--config", str(config), "--engines"]
    try:
        wait_for("step 2", lambda: steps_done(tmp_path / "steps.jsonl") >= 2, 300, proc)
        out = subprocess.run([*scale, "2"], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0 and "inference-1" in out.stdout, out.stderr
        ready = lambda: httpx.get(f"{second}/ready", timeout=5).status_code == 200  # noqa: E731
        wait_for("the added engine", lambda: _quiet(ready), 120, proc)
        joined = (tmp_path / "logs" / "inference-1.log").read_text()
        assert "joined from the weight store" in joined
        # The trainer's next push reaches both engines: the same version, the same bits.
        wait_for(
            "a push to both",
            lambda: (a := checksum(first))[0] > 2 and a == checksum(second),
            120,
            proc,
        )
        wait_for("rollouts on the added engine", lambda: requests_served(second) > 0, 120, proc)
        out = subprocess.run([*scale, "1"], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0 and "inference-1" not in out.stdout, out.stderr
        # Withdrawn: the trainer's next push goes to the first engine only, and training goes on.
        trainer_log = tmp_path / "logs" / "trainer.log"
        wait_for(
            "the push set without it",
            lambda: trainer_log.read_text().count("engines changed") >= 2,
            120,
            proc,
        )
        step = steps_done(tmp_path / "steps.jsonl")
        wait_for("more steps", lambda: steps_done(tmp_path / "steps.jsonl") >= step + 3, 120, proc)
        assert "engine withdrawn" in (tmp_path / "logs" / "inference-1.log").read_text()
    finally:
        if proc.poll() is None:
            proc.terminate()  # Ctrl-C's path: every service stopped
            proc.wait(timeout=120)


def _quiet(check) -> bool:  # type: ignore[no-untyped-def]
    try:
        return bool(check())
    except httpx.HTTPError:
        return False
