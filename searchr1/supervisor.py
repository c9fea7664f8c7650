"""Supervise a set of service processes on one machine (the engine of `searchr1 local`).

Each child runs in its own session (process group), so stopping it also stops anything it
spawned: no orphans. Children start in order; each must pass its readiness probe (`/ready`
answering 200) before the next starts. While running, a child that exits is reported by name
with its exit status and the last lines of its log, then restarted or the whole stack stopped,
by its policy (never restarted: one that exits EXIT_NO_RESTART). Restarts back off as docker's
do: 0.1 s, doubled for each death that comes quickly (a crash loop, e.g. Redis on a full disk,
must not use up `max_restarts` in a second), back to 0.1 s after a child ran 10 s. Stopping is
SIGTERM to every group (in reverse start order), then SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Self

import httpx

log = logging.getLogger(__name__)

RESTART_DELAY_S = 0.1  # the first restart's delay; doubled for each quick death
RESTART_DELAY_MAX_S = 10.0
RAN_LONG_S = 10.0  # a child that ran this long before dying starts again from the first delay
# A child's way to say that a restart cannot help (the trainer's data ran out: restarted, it
# reads the same end of the bus): never restarted, whatever its policy. Docker's restart
# policies cannot tell exit statuses apart, and torchrun reports any failed worker as 1.
EXIT_NO_RESTART = 3


class RestartPolicy(StrEnum):
    NEVER = "never"  # a death stops the whole stack (the default: fail loudly)
    ON_FAILURE = "on-failure"  # restart after a non-zero exit, up to max_restarts


class ChildFailed(RuntimeError):
    """A child died (or never became ready) and its policy says stop."""

    def __init__(self, name: str, reason: str, log_tail: list[str]) -> None:
        self.name, self.reason, self.log_tail = name, reason, log_tail
        tail = "\n".join(f"    {line}" for line in log_tail) or "    (empty log)"
        super().__init__(f"{name} {reason}; last log lines:\n{tail}")


@dataclass
class ServiceSpec:
    name: str
    command: list[str]
    ready_url: str | None = None  # GET -> 200 means ready; None: started = ready
    env: dict[str, str] = field(default_factory=dict)
    restart: RestartPolicy = RestartPolicy.NEVER
    max_restarts: int = 3
    ready_timeout_s: float = 300.0
    # A child that finishes its job (exit 0) ends the stack successfully (e.g. the trainer).
    exit_ends_stack: bool = False
    # Exit 0 is a normal completion, not a death (e.g. the orchestrator after max_steps).
    may_finish: bool = False


@dataclass
class ChildState:
    spec: ServiceSpec
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    status: str = "pending"  # pending | starting | ready | restarting | exited | failed | stopped
    started_at: float = 0.0
    restart_delay_s: float = 0.0  # the last restart's delay (0: none yet)
    restart_at: float = 0.0  # while restarting: when it starts again

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


def tail_lines(path: Path, n: int = 20) -> list[str]:
    try:
        with path.open("rb") as f:
            return [b.decode(errors="replace").rstrip() for b in deque(f, maxlen=n)]
    except OSError:
        return []


class Supervisor:
    def __init__(
        self,
        specs: list[ServiceSpec],
        log_dir: Path,
        *,
        grace_s: float = 15.0,
        poll_s: float = 0.2,
    ) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate service names: {names}")
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children = [ChildState(s, self.log_dir / f"{s.name}.log") for s in specs]
        self.grace_s = grace_s
        self.poll_s = poll_s

    # -- starting -------------------------------------------------------------------------

    def _spawn(self, child: ChildState) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **child.spec.env}
        logf = child.log_path.open("ab")
        try:
            child.proc = subprocess.Popen(
                child.spec.command,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own process group: we can stop the whole tree
            )
        finally:
            logf.close()
        child.started_at = time.monotonic()
        child.status = "starting"
        log.info("started", extra={"service": child.spec.name, "pid": child.proc.pid})

    def _wait_ready(self, child: ChildState) -> None:
        spec = child.spec
        if spec.ready_url is None:  # started = ready; an early exit is check()'s business
            child.status = "ready"
            return
        deadline = time.monotonic() + spec.ready_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                assert child.proc is not None
                code = child.proc.poll()
                if code is not None:
                    child.status = "failed"
                    raise ChildFailed(
                        spec.name, f"exited with status {code} before it was ready",
                        tail_lines(child.log_path),
                    )  # fmt: skip
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(spec.ready_url).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    child.status = "failed"
                    raise ChildFailed(
                        spec.name, f"not ready after {spec.ready_timeout_s:.0f}s",
                        tail_lines(child.log_path),
                    )  # fmt: skip
                time.sleep(self.poll_s)
        child.status = "ready"
        log.info("ready", extra={"service": spec.name})

    def start(self) -> None:
        """Start every child in order, each ready before the next; stop all on failure."""
        try:
            for child in self.children:
                self._spawn(child)
                self._wait_ready(child)
        except BaseException:
            self.stop()
            raise

    # -- running --------------------------------------------------------------------------

    def check(self) -> bool:
        """One supervision round. Returns False when the stack has finished successfully.

        Raises ChildFailed when a child died and its policy says stop.
        """
        for child in self.children:
            proc = child.proc
            if proc is None or child.status in ("exited", "stopped"):
                continue
            if child.status == "restarting":
                if time.monotonic() >= child.restart_at:
                    self._spawn(child)
                    self._wait_ready(child)
                continue
            code = proc.poll()
            if code is None:
                continue
            spec = child.spec
            if code == 0 and (spec.exit_ends_stack or spec.may_finish):
                child.status = "exited"
                log.info("finished", extra={"service": spec.name})
                if spec.exit_ends_stack:
                    return False
                continue
            tail = tail_lines(child.log_path)
            reason = f"exited with status {code}" + (
                f" (signal {signal.Signals(-code).name})" if code < 0 else ""
            )
            if code == EXIT_NO_RESTART:
                reason += " (a restart cannot help: not restarted)"
            elif spec.restart is RestartPolicy.ON_FAILURE and child.restarts < spec.max_restarts:
                quick = time.monotonic() - child.started_at < RAN_LONG_S
                delay = child.restart_delay_s * 2 if quick and child.restart_delay_s else 0.0
                child.restart_delay_s = min(max(delay, RESTART_DELAY_S), RESTART_DELAY_MAX_S)
                child.restarts += 1
                child.status = "restarting"
                child.restart_at = time.monotonic() + child.restart_delay_s
                log.warning(
                    "child died; restarting",
                    extra={"service": spec.name, "reason": reason, "restart": child.restarts,
                           "delay_s": child.restart_delay_s, "log_tail": tail[-5:]},
                )  # fmt: skip
                continue
            child.status = "failed"
            raise ChildFailed(spec.name, reason, tail)
        return True

    def run(self, on_tick: Callable[[], None] | None = None) -> None:
        """Supervise until a finishing child exits 0; stops everything on the way out."""
        try:
            while self.check():
                if on_tick is not None:
                    on_tick()
                time.sleep(self.poll_s)
        finally:
            self.stop()

    # -- stopping -------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM every running child's process group (reverse order), SIGKILL after grace."""
        running = [c for c in reversed(self.children) if c.proc and c.proc.poll() is None]
        for child in running:
            _signal_group(child.proc, signal.SIGTERM)  # type: ignore[arg-type]
        deadline = time.monotonic() + self.grace_s
        for child in running:
            assert child.proc is not None
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("did not stop in time; killing", extra={"service": child.spec.name})
                _signal_group(child.proc, signal.SIGKILL)
                child.proc.wait()
            child.status = "stopped"
        # Grandchildren that ignored SIGTERM after their parent exited.
        for child in self.children:
            if child.proc is not None:
                _signal_group(child.proc, signal.SIGKILL)


class ServiceProcess:
    """One supervised service process as a context manager: tests, benchmarks, the demo.

        with ServiceProcess(ServiceSpec("engine", cmd, ready_url=...)) as svc:
            ...

    `start()` returns once the readiness probe passes (ChildFailed with the log tail if the
    process exits first or is not ready in time); `stop()` is the supervisor's SIGTERM-then-
    SIGKILL of the whole process group and returns the exit status. Logs go to `log_dir` (a
    temporary directory by default, removed on exit).
    """

    def __init__(self, spec: ServiceSpec, log_dir: Path | None = None, *, grace_s: float = 30.0):
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=f"searchr1-{spec.name}-")
            log_dir = Path(self._tmp.name)
        self.supervisor = Supervisor([spec], log_dir, grace_s=grace_s)

    @property
    def child(self) -> ChildState:
        return self.supervisor.children[0]

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.child.proc

    def start(self) -> Self:
        self.supervisor.start()
        return self

    def stop(self) -> int | None:
        self.supervisor.stop()
        return self.proc.returncode if self.proc else None

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(tail_lines(self.child.log_path, n))

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
