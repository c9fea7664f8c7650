"""A service started while Redis is frozen waits for it, within a deadline (issue 46).

bench/chaos.py's `freeze:redis` (SIGSTOP: a long fork, a stalled VM): the trainer lost its lease
(correct), was restarted, and its restart's first Redis call (taking the lease) timed out while
Redis was still frozen: the trainer exited 1 before it was ready and the run ended. Every
start-up call to Redis now goes through the shared retry policy (`searchr1.redis_retry`), for
`bus.reconnect_timeout_s`: logged once, counted in `searchr1_redis_retries_total`, and past
the deadline an error naming Redis, the call and the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from engine_client.client import InferenceClient
from orchestrator import wiring
from orchestrator.markers import RunMarkers
from searchr1 import engine_info
from searchr1.bus import BusUnavailable, TrajectoryBus
from searchr1.lease import RedisLease
from searchr1.redis_retry import RETRIES, RedisRetry, RedisUnavailable
from searchr1.redis_server import RedisServer, free_port
from searchr1.sections import BusConfig
from tests.integration.test_trainer_loop import Trainer


@contextlib.contextmanager
def frozen(server: RedisServer) -> Iterator[int]:
    """Redis stopped (SIGSTOP) inside the block; always continued on the way out."""
    assert server.proc is not None
    pid = server.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)


def retried(component: str) -> float:
    """Retries counted for `component`, all its calls together."""
    return sum(
        s.value
        for metric in RETRIES.collect()
        for s in metric.samples
        if s.name.endswith("_total") and s.labels.get("component") == component
    )


@contextlib.contextmanager
def thawed_once_retried(pid: int, component: str) -> Iterator[None]:
    """SIGCONT once `component` has retried a call (its first try timed out: redis-py's 5 s
    socket timeout), so the wait goes through the retry policy, not one slow answer."""
    before = retried(component)
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.05) and retried(component) == before:
            pass
        os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    assert retried(component) > before


async def test_taking_the_lease_waits_for_a_frozen_redis(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    bus = TrajectoryBus.from_url(redis_server.url, BusConfig())
    lease = RedisLease(bus.redis, "run:trainer-lease", ttl_s=5.0, redis_wait_s=60.0)
    try:
        with frozen(redis_server) as pid, thawed_once_retried(pid, "lease_acquire"):
            await lease.acquire(wait_s=0.0)
        # The lease's clock starts at the try that took it, not at the first: counted from
        # before the freeze (5 s and more), it would look expired at the first check.
        lease.check()
        waits = [r for r in caplog.records if r.getMessage() == "redis unreachable; retrying"]
        assert len(waits) == 1 and waits[0].component == "lease_acquire"  # type: ignore[attr-defined]
    finally:
        await bus.close()


async def test_taking_the_lease_gives_up_at_its_deadline_naming_redis(
    redis_server: RedisServer,
) -> None:
    bus = TrajectoryBus.from_url(redis_server.url, BusConfig(socket_timeout_s=1.0))
    lease = RedisLease(bus.redis, "run:trainer-lease", ttl_s=5.0, redis_wait_s=1.0)
    try:
        with frozen(redis_server), pytest.raises(RedisUnavailable) as info:
            await lease.acquire(wait_s=0.0)
        assert "redis unreachable for 1.0s during lease_acquire.take" in str(info.value)
    finally:
        await bus.close()


async def test_the_holders_wait_counts_from_redis_answering(redis_server: RedisServer) -> None:
    """`wait_s` is how long a live holder's lease is waited for, once Redis answers: a freeze
    that used it up must not turn into LeaseHeld at Redis's first answer."""
    bus = TrajectoryBus.from_url(redis_server.url, BusConfig())
    holder = RedisLease(bus.redis, "run:trainer-lease", ttl_s=9.0)  # never renewed: ends at 9 s
    await holder.acquire()
    second = RedisLease(bus.redis, "run:trainer-lease", ttl_s=9.0, redis_wait_s=60.0)
    try:
        with frozen(redis_server) as pid, thawed_once_retried(pid, "lease_acquire"):
            # Redis answers after 5 s and more, the holder's lease has up to 4 s left: waited
            # from then, 5 s outlast it; counted from the first try, they were over already.
            await asyncio.wait_for(second.acquire(wait_s=5.0), 60)
        second.check()
    finally:
        await bus.close()


async def test_the_bus_first_call_waits_for_a_frozen_redis(redis_server: RedisServer) -> None:
    """The trainer's and the orchestrator's other start-up calls (the bus, the orchestrator's
    markers and claims) share the policy; the bus's first read stands for them."""
    bus = TrajectoryBus.from_url(
        redis_server.url, BusConfig(reconnect_timeout_s=60.0, socket_timeout_s=1.0)
    )
    try:
        with frozen(redis_server) as pid, thawed_once_retried(pid, "bus"):
            assert await bus.consume(4) == []
    finally:
        await bus.close()
    short = TrajectoryBus.from_url(
        redis_server.url, BusConfig(reconnect_timeout_s=1.0, socket_timeout_s=1.0)
    )
    try:
        with (
            frozen(redis_server),
            pytest.raises(BusUnavailable, match=r"redis unreachable for 1\.0s"),
        ):
            await short.consume(4)
    finally:
        await short.close()


async def test_the_orchestrators_first_call_waits_for_a_frozen_redis(
    redis_server: RedisServer,
) -> None:
    """The orchestrator's first Redis call at start-up: its resume markers (`restore`)."""
    bus = TrajectoryBus.from_url(redis_server.url, BusConfig(socket_timeout_s=1.0))
    markers = RunMarkers(bus.redis, "searchr1:orchestrator:run", RedisRetry("orchestrator", 60.0))
    try:
        with frozen(redis_server) as pid, thawed_once_retried(pid, "orchestrator"):
            assert await markers.restore(0, {"seed": 0}) == (0, 0, b'{"seed": 0}')
    finally:
        await bus.close()


# -- the trainer process -----------------------------------------------------------------------


def _thaw_when_logged(pid: int, log: Path, needle: str, stop: threading.Event) -> None:
    """SIGCONT once the trainer says it waits for Redis (or when stopped)."""
    while not stop.wait(0.1):
        if log.exists() and needle in log.read_text(errors="replace"):
            break
    os.kill(pid, signal.SIGCONT)


def _short_tries(trainer: Trainer) -> None:
    """Each Redis try ends after 1 s (the default 5 s is what a frozen Redis costs per try;
    the waits tested here are the retries', not one try's)."""
    cfg = yaml.safe_load(trainer.config.read_text())
    cfg["bus"]["socket_timeout_s"] = 1.0
    trainer.config.write_text(yaml.safe_dump(cfg))


def test_a_trainer_started_while_redis_is_frozen_waits_for_it(
    tmp_path: Path, redis_server: RedisServer, tiny_model_dir: Path
) -> None:
    assert redis_server.proc is not None
    trainer = Trainer(tmp_path, redis_server.url, tiny_model_dir, every=1)
    _short_tries(trainer)
    stop = threading.Event()
    waiter = threading.Thread(
        target=_thaw_when_logged,
        args=(redis_server.proc.pid, tmp_path / "trainer.log", "redis unreachable", stop),
    )
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    waiter.start()
    try:
        trainer.start()  # ready: it took the lease once Redis answered
        assert '"component": "lease_acquire"' in trainer.log_tail()
        assert trainer.stop() == 0, trainer.log_tail()
    finally:
        stop.set()
        waiter.join()


def test_a_trainer_gives_up_on_a_frozen_redis_at_its_deadline(
    tmp_path: Path, redis_server: RedisServer, tiny_model_dir: Path
) -> None:
    trainer = Trainer(tmp_path, redis_server.url, tiny_model_dir, every=1)
    cfg = yaml.safe_load(trainer.config.read_text())
    cfg["bus"]["reconnect_timeout_s"] = 2.0
    trainer.config.write_text(yaml.safe_dump(cfg))
    _short_tries(trainer)
    with frozen(redis_server):
        done = subprocess.run(
            [sys.executable, "-m", "stack.cli", "trainer", "run", "--config", str(trainer.config)],
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "redis unreachable for 2.0s during lease_acquire.take" in out, out[-3000:]


# -- the engine ------------------------------------------------------------------------------

_FAKE_ENGINE = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"model_path": "m", "weight_version": "0"}).encode()
        ok = self.path == "/model_info"
        self.send_response(200 if ok else 404)
        self.send_header("Content-Length", str(len(body) if ok else 0))
        self.end_headers()
        if ok:
            self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture
def fake_engine() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """An HTTP server answering `/model_info` as an engine does: a real process to freeze."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _FAKE_ENGINE, str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/model_info", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "fake engine did not start"
                time.sleep(0.05)
        yield url, proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


async def test_the_orchestrator_waits_for_a_frozen_engine_and_says_so(
    fake_engine: tuple[str, subprocess.Popen[bytes]],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A frozen engine accepts connections and never answers: the first call used to hang
    silently for the client's whole timeout (600 s). Each try is now bounded, so the wait is
    logged within `ENGINE_ANSWER_S`, and it lasts until the engine answers."""
    monkeypatch.setattr(engine_info, "ENGINE_ANSWER_S", 1.0)
    url, proc = fake_engine
    engine = InferenceClient(url, deadline_s=60.0)
    logged = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage() == "waiting for the engine":
                logged.set()

    seen = Seen()
    logging.getLogger(engine_info.__name__).addHandler(seen)
    thaw = threading.Thread(
        target=lambda: (logged.wait(20), os.kill(proc.pid, signal.SIGCONT)), daemon=True
    )
    os.kill(proc.pid, signal.SIGSTOP)
    thaw.start()
    try:
        info = await wiring.wait_for_engine(engine, 60.0)
        assert info["model_path"] == "m"
        assert logged.is_set()  # said while it was frozen, not after a silent 20 s
        assert "engine answered" in caplog.text
    finally:
        logging.getLogger(engine_info.__name__).removeHandler(seen)
        thaw.join()
        await engine.aclose()


async def test_the_orchestrator_gives_up_on_a_frozen_engine_at_its_deadline(
    fake_engine: tuple[str, subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_info, "ENGINE_ANSWER_S", 1.0)
    url, proc = fake_engine
    engine = InferenceClient(url, deadline_s=60.0)
    os.kill(proc.pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"engine not reachable after 3\.0s"):
            await wiring.wait_for_engine(engine, 3.0)
        assert time.monotonic() - start < 10
    finally:
        await engine.aclose()
