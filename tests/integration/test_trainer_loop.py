"""The trainer as a real process on loopback, fed through a real Redis bus.

One scenario (each trainer start costs seconds): train groups from the bus while serving
/ready /status /metrics and writing the JSONL log; SIGKILL after a step that was trained but not
yet checkpointed; `--resume`: every trajectory is trained exactly once in the final lineage;
SIGTERM checkpoints the last (off-schedule) step, acknowledges everything and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from protos.trajectory import SCHEMA_VERSION, Trajectory
from searchr1.bus import TrajectoryBus
from searchr1.redis_server import RedisServer, free_port
from searchr1.sections import BusConfig
from searchr1.supervisor import EXIT_NO_RESTART

GROUP = 4
CONSUMER = "trainer-test"


def trajectories(groups: range, vocab: int = 2000) -> list[Trajectory]:
    out = []
    for g in groups:
        rng = random.Random(g)
        for k in range(GROUP):
            n = rng.randint(4, 16)
            t = Trajectory(
                schema_version=SCHEMA_VERSION,
                trajectory_id=f"g{g}-s{k}",
                group_id=f"g{g}",
                sample_index=k,
                group_size=GROUP,
                prompt_token_ids=[rng.randrange(vocab) for _ in range(rng.randint(3, 8))],
                response_token_ids=[rng.randrange(vocab) for _ in range(n)],
                loss_mask=bytes([1] * (n - 2) + [0, 0]),
                rollout_logprobs=[-2.0] * (n - 2) + [0.0, 0.0],
                has_rollout_logprobs=True,
            )
            t.reward.total = float(k % 2)
            t.reward.components["em"] = float(k % 2)
            out.append(t)
    return out


def publish(url: str, trajs: list[Trajectory]) -> None:
    async def go() -> None:
        bus = TrajectoryBus.from_url(url, BusConfig())
        try:
            await bus.publish(trajs)
        finally:
            await bus.close()

    asyncio.run(go())


def bus_counts(url: str) -> tuple[int, int]:
    async def go() -> tuple[int, int]:
        bus = TrajectoryBus.from_url(url, BusConfig())
        try:
            return await bus.backlog(), await bus.pending_count()
        finally:
            await bus.close()

    return asyncio.run(go())


class Trainer:
    def __init__(self, workdir: Path, redis_url: str, model_dir: Path, every: int) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.jsonl = workdir / "steps.jsonl"
        self.ckpt = workdir / "ckpt"
        cfg = {
            "redis": {"url": redis_url},
            "bus": {"consumer": CONSUMER, "reclaim_idle_s": 600},
            "logging": {"level": "INFO"},
            "run": {"groups_per_step": 1, "group_size": GROUP},
            "trainer": {
                "http": {"port": self.port},
                "model": {"path": str(model_dir)},
                "batch": {"consume_block_s": 0.2},
                "optim": {"lr": 1e-4},
                "loss": {"kl_coef": 0.001},
                "checkpoint": {"dir": str(self.ckpt), "every_steps": every},
                "metrics_jsonl": str(self.jsonl),
                # A restart after SIGKILL waits for the dead trainer's lease: keep it short.
                "lease_ttl_s": 2.0,
            },
        }
        self.config = workdir / "config.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, *extra: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(self.workdir / "trainer.log", "ab") as log:  # the child keeps its own fd
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "stack.cli", "trainer", "run",
                 "--config", str(self.config), *extra],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        self.wait(lambda s: True, timeout=90)

    def status(self) -> dict | None:  # type: ignore[type-arg]
        try:
            return httpx.get(f"{self.url}/status", timeout=2).json()
        except httpx.HTTPError:
            return None

    def wait(self, pred, timeout: float = 60):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc and self.proc.poll() is None, self.log_tail()
            s = self.status()
            if s is not None and pred(s):
                return s
            time.sleep(0.05)
        raise TimeoutError(self.log_tail())

    def log_tail(self) -> str:
        return (self.workdir / "trainer.log").read_text()[-3000:]

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(60)

    def records(self) -> list[dict]:  # type: ignore[type-arg]
        return [json.loads(line) for line in self.jsonl.read_text().splitlines()]


@pytest.fixture
def redis_url(tmp_path) -> Iterator[str]:  # type: ignore[no-untyped-def]
    with RedisServer(data_dir=tmp_path / "redis") as server:
        yield server.url


def test_trains_then_survives_sigkill_and_stops_cleanly(
    tmp_path, redis_url, tiny_model_dir
) -> None:  # type: ignore[no-untyped-def]
    all_ids = sorted(t.trajectory_id for t in trajectories(range(7)))
    publish(redis_url, trajectories(range(4)))
    trainer = Trainer(tmp_path, redis_url, tiny_model_dir, every=3)
    trainer.start()
    # Four steps: the checkpoint holds step 3; step 4 is trained but not durable.
    s = trainer.wait(lambda s: s["step"] >= 4)
    assert httpx.get(f"{trainer.url}/ready").status_code == 200
    metrics = httpx.get(f"{trainer.url}/metrics").text
    assert "searchr1_trainer_steps_total 4.0" in metrics
    assert 'searchr1_trainer_metric{name="loss_mask/observation_fraction"}' in metrics
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "reward/em",
                "clip_fraction_high", "logprob_diff/trainer_vs_rollout_abs_mean",
                "throughput/tokens_per_s", "time/forward_backward_s"):  # fmt: skip
        assert key in s["metrics"], key

    assert trainer.stop(signal.SIGKILL) == -signal.SIGKILL
    assert (trainer.ckpt / "latest").read_text() == "step_00000003"
    crashed_step4 = trainer.records()[-1]
    assert crashed_step4["step"] == 4
    # The 4 trajectories of step 4 are still pending on the bus, not lost.
    assert bus_counts(redis_url) == (GROUP, GROUP)

    publish(redis_url, trajectories(range(4, 7)))
    trainer.start("--resume")
    try:
        trainer.wait(lambda s: s["step"] >= 7)
    finally:
        assert trainer.stop() == 0, trainer.log_tail()
    # Step 7 is off the every-3 schedule: SIGTERM checkpointed it, then acked everything.
    assert (trainer.ckpt / "latest").read_text() == "step_00000007"
    assert bus_counts(redis_url) == (0, 0)
    records = trainer.records()
    assert [r["step"] for r in records] == [1, 2, 3, 4, 4, 5, 6, 7]  # step 4 redone
    lineage = {r["step"]: r for r in records}  # the last record of each step wins
    trained = sorted(i for r in lineage.values() for i in r["trajectory_ids"])
    assert trained == all_ids  # each exactly once: no loss, no duplicate
    assert lineage[4]["trajectory_ids"] == crashed_step4["trajectory_ids"]


def test_a_resume_that_fails_exits_non_zero(tmp_path: Path, tiny_model_dir: Path) -> None:
    """compose's on-failure and the Kubernetes Job took exit 0 as "finished" when loading the
    checkpoint failed inside the server's start-up."""
    redis = RedisServer(data_dir=tmp_path / "redis").start()
    try:
        trainer = Trainer(tmp_path, redis.url, tiny_model_dir, every=1)
        broken = trainer.ckpt / "step_00000003"
        broken.mkdir(parents=True)
        (broken / "trainer.json").write_text('{"step": 3}')
        (broken / "state.pt").write_bytes(b"not a checkpoint")
        (trainer.ckpt / "latest").write_text(broken.name)
        done = subprocess.run(
            [sys.executable, "-m", "stack.cli", "trainer", "run",
             "--config", str(trainer.config), "--resume"],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "resume failed" in done.stdout + done.stderr
    finally:
        redis.close()


@pytest.mark.slow  # over 10 s: CI's slow phase (issue 45)
def test_a_second_trainer_on_the_same_run_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two trainers on one stream would train the same entries twice (or ack what the other
    did not checkpoint)."""
    redis = RedisServer(data_dir=tmp_path / "redis").start()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = Trainer(tmp_path / "a", redis.url, tiny_model_dir, every=1)
    second = Trainer(tmp_path / "b", redis.url, tiny_model_dir, every=1)
    try:
        first.start()
        done = subprocess.run(
            [sys.executable, "-m", "stack.cli", "trainer", "run",
             "--config", str(second.config)],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert done.returncode != 0
        assert "another trainer is training this run" in done.stdout + done.stderr
        assert first.proc is not None and first.proc.poll() is None  # the first one goes on
        assert first.stop() == 0
    finally:
        redis.close()


def test_a_trainer_waiting_for_data_stops_when_the_producer_has_ended(
    tmp_path: Path, redis_url: str, tiny_model_dir: Path
) -> None:
    """The orchestrator's data ran out (a group filter rejected too much): the trainer used to
    wait for groups that never come; it now exits with the producer's reason, after
    checkpointing what it trained, and with EXIT_NO_RESTART: a supervisor restarting it on
    failure would only see the same end again (a crash loop under `restart: on-failure`)."""
    publish(redis_url, trajectories(range(1)))
    trainer = Trainer(tmp_path, redis_url, tiny_model_dir, every=5)
    trainer.start()
    trainer.wait(lambda s: s["step"] >= 1)

    async def end() -> None:
        bus = TrajectoryBus.from_url(redis_url, BusConfig())
        try:
            await bus.end("the orchestrator's data ran out after 1 of 3 groups")
        finally:
            await bus.close()

    asyncio.run(end())
    assert trainer.proc is not None
    assert trainer.proc.wait(60) == EXIT_NO_RESTART, trainer.log_tail()
    assert "data ran out after 1 of 3 groups" in trainer.log_tail()
    assert (trainer.ckpt / "latest").read_text() == "step_00000001"  # step 1 kept
