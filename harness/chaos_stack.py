"""The chaos bench's stack under one supervisor, and what watches it (`bench/chaos.py`).

`Stack` runs Redis and the services (on hosts of their own with `harness/chaos_hosts.py`) under
`searchr1.supervisor` on a thread, so faults are injected from outside; `Monitor` polls the
trainer's step lines, its checkpoints (`CheckpointWatch`: the ledger's trained ids) and the
trainer lease's holder. The published ids come from the tap (`harness/chaos_tap.py`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import redis

from harness.chaos_hosts import HostedStack
from harness.chaos_ledger import CheckpointWatch
from searchr1.redis_server import RedisServer
from searchr1.supervisor import RestartPolicy, ServiceSpec, Supervisor
from stack.config import load_config
from stack.launcher import build_specs
from trainer.wiring import trainer_lease_key


class Monitor(threading.Thread):
    """Polls the trainer's step lines, its checkpoints and the trainer lease's holder until
    stopped."""

    def __init__(
        self, redis_url: str, stream: str, metrics_jsonl: Path, checkpoint_dir: Path | None = None
    ) -> None:
        """`checkpoint_dir`: the trainer's, for the ledger's trained ids (None: not read)."""
        super().__init__(daemon=True, name="chaos-monitor")
        self.client = redis.Redis.from_url(
            redis_url, socket_timeout=1.0, socket_connect_timeout=1.0
        )
        self.jsonl = metrics_jsonl
        self.checkpoints = CheckpointWatch(checkpoint_dir) if checkpoint_dir else None
        self.step_times: list[float] = []  # when each step line appeared (monotonic)
        self.steps_done = 0  # the highest step number logged
        self.lease_key = trainer_lease_key(stream)
        self.holders: list[tuple[float, str | None]] = []  # (Unix time, "host:pid" or None)
        self.stop_event = threading.Event()
        self._offset = 0

    def run(self) -> None:
        while not self.stop_event.wait(0.25):
            self.poll()

    def poll(self) -> None:
        with contextlib.suppress(OSError):
            with self.jsonl.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
            whole = chunk[: chunk.rfind(b"\n") + 1]
            self._offset += len(whole)
            for line in whole.splitlines():
                with contextlib.suppress(ValueError):
                    self.steps_done = max(self.steps_done, int(json.loads(line)["step"]))
                    self.step_times.append(time.monotonic())
        if self.checkpoints is not None:
            self.checkpoints.poll()
        with contextlib.suppress(redis.RedisError):  # Redis down (a fault): read it next time
            raw = self.client.get(self.lease_key)
            holder = json.loads(raw) if raw else None
            who = f"{holder['host']}:{holder['pid']}" if holder else None
            self.holders.append((time.time(), who))

    def typical_step_s(self) -> float:
        gaps = [b - a for a, b in itertools.pairwise(self.step_times)]
        if len(gaps) < 5:  # one gap may be a fault's stall
            return min(gaps, default=2.0)
        return statistics.median(gaps)

    def step_after(self, t: float) -> bool:
        return any(s > t for s in self.step_times)

    def holder_pid(self) -> int | None:
        """The pid of the trainer that held the lease at the last poll."""
        who = next((w for _, w in reversed(self.holders[-8:]) if w), None)
        return int(who.rpartition(":")[2]) if who else None


class Stack:
    """Redis and the services under one supervisor on a thread; faults injected from outside."""

    def __init__(
        self,
        stack_path: Path,
        data: dict[str, Any],
        redis: RedisServer,
        hosts: HostedStack | None = None,
    ) -> None:
        self.cfg = load_config(stack_path)
        self.redis = redis
        redis_spec = ServiceSpec(
            "redis",
            redis.command(),  # on its host already (RedisServer's prefix)
            restart=RestartPolicy.ON_FAILURE,
            max_restarts=data["local"]["max_restarts"],
        )
        services = build_specs(self.cfg, stack_path, redis.url)
        for spec in services:  # each also after Redis, which this supervisor runs too
            spec.after = None if spec.after is None else ("redis", *spec.after)
        if hosts is not None:
            services = hosts.place_specs(services)
        specs = [redis_spec, *services]
        self.sup = Supervisor(specs, Path(self.cfg.local.log_dir), grace_s=self.cfg.local.grace_s)
        self.stop_event = threading.Event()
        self.ready_at: float | None = None
        self.finished_at: float | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._supervise, daemon=True, name="chaos-stack")

    def _supervise(self) -> None:
        try:
            self.sup.start()
            self.ready_at = time.monotonic()
            while not self.stop_event.is_set() and self.sup.check():
                time.sleep(self.sup.poll_s)
            if not self.stop_event.is_set():
                self.finished_at = time.monotonic()
        except BaseException as e:  # reported by the bench, never swallowed
            self.error = e
        finally:
            self.sup.stop()

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()

    def child(self, name: str) -> Any:
        return next(c for c in self.sup.children if c.spec.name == name)

    def trainer_holding(self, pid: int | None) -> str:
        """Which trainer (with a standby, `trainer` or `trainer-b`) runs as `pid`."""
        held = [c.spec.name for c in self.sup.children if pid is not None and c.pid == pid]
        return held[0] if held else "trainer"

    def signal(self, name: str, sig: signal.Signals) -> int | None:
        pid = self.child(name).pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)
        return pid

    def ready_again(self, name: str, old_pid: int | None) -> bool:
        child = self.child(name)
        return child.pid != old_pid and child.status in ("ready", "exited")

    def stop(self) -> None:
        self.stop_event.set()
        self.sup.stop()
        self.thread.join(60)
