"""Supervise a set of service processes on one machine (the engine of `searchr1 local`).

Each child runs in its own session (process group), so stopping it also stops anything it
spawned: no orphans. A child starts once the children it comes after have passed their
readiness probe (`/ready` answering 200): by default every child before it in the list, or the
ones its spec's `after` names, so independent children (a retriever and an engine) start side by
side. While running, a child that exits is reported by name
with its exit status and the last lines of its log, then restarted or the whole stack stopped,
by its policy (never restarted: one that exits EXIT_NO_RESTART). A child that dies before it is
ready (it exited, or was not ready within `ready_timeout_s` and is killed) is a death like any
other: under on-failure it is restarted, the first start included; a service started while a
dependency is frozen may give up before it is ready, and that must not end the run (issue 46).
A restarted child's readiness is probed once per round, never waited for inside it, so a
second death meanwhile is handled at once. Restarts back off as docker's do: 0.1 s, doubled
for each death that comes quickly (before ready, or within 10 s of it: a crash loop, e.g. Redis
on a full disk, must not use up `max_restarts` in a second), back to 0.1 s after a child was
ready 10 s (each spec may set its own first and last delay). `max_restarts` counts deaths in a
row: a child that was ready for 5 minutes starts its count again, so a week-long run is not
ended by its fourth fault. Stopping is SIGTERM to every group (in reverse start order), then
SIGKILL after a grace period. Without a log directory the children write to our own stdout and
stderr (a container's log: `searchr1 inference serve --engine sglang`).
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
RAN_LONG_S = 10.0  # a child ready this long before dying starts again from the first delay
HEALTHY_RUN_S = 300.0  # a child ready this long starts its count of restarts in a row again
# A child's way to say that a restart cannot help (the trainer's data ran out: restarted, it
# reads the same end of the bus): never restarted, whatever its policy. Docker's restart
# policies cannot tell exit statuses apart, and torchrun reports any failed worker as 1.
EXIT_NO_RESTART = 3


class RestartPolicy(StrEnum):
    NEVER = "never"  # a death stops the whole stack (the default: fail loudly)
    ON_FAILURE = "on-failure"  # restart after a non-zero exit, up to max_restarts in a row


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
    max_restarts: int = 3  # in a row (see HEALTHY_RUN_S)
    first_restart_delay_s: float = RESTART_DELAY_S
    max_restart_delay_s: float = RESTART_DELAY_MAX_S
    ready_timeout_s: float = 300.0
    # The children that must be ready before this one starts, each listed before it in the
    # supervisor's list (checked); None: every child before it.
    after: tuple[str, ...] | None = None
    # A child that finishes its job (exit 0) ends the stack successfully (e.g. the trainer).
    exit_ends_stack: bool = False
    # Exit 0 is a normal completion, not a death (e.g. the orchestrator after max_steps).
    may_finish: bool = False
    # Its death (past its restarts) removes it and the stack goes on (an engine added by
    # `searchr1 local scale`): logged with its log's tail, never ChildFailed.
    optional: bool = False


@dataclass
class ChildState:
    spec: ServiceSpec
    log_path: Path | None  # None: our own stdout and stderr
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0  # all of them, for the status table
    restarts_in_a_row: int = 0  # what `max_restarts` bounds
    # pending | starting | ready | restarting | exited | failed | stopped | retiring
    status: str = "pending"
    started_at: float = 0.0
    restart_delay_s: float = 0.0  # the last restart's delay (0: none yet)
    restart_at: float = 0.0  # while restarting: when it starts again
    ready_at: float | None = None  # when the current process passed its probe (None: not yet)
    retire_by: float = 0.0  # while retiring: SIGKILL after this (monotonic)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


def tail_lines(path: Path | None, n: int = 20) -> list[str]:
    if path is None:
        return []
    try:
        with path.open("rb") as f:
            return [b.decode(errors="replace").rstrip() for b in deque(f, maxlen=n)]
    except OSError:
        return []


class Supervisor:
    def __init__(
        self,
        specs: list[ServiceSpec],
        log_dir: Path | None,
        *,
        grace_s: float = 15.0,
        poll_s: float = 0.2,
    ) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate service names: {names}")
        for i, spec in enumerate(specs):
            # Only children before it: two children after each other would wait forever.
            later = set(spec.after or ()) - set(names[:i])
            if later:
                raise ValueError(
                    f"{spec.name}: after={sorted(later)} must name children listed before it"
                )
        self.log_dir = None if log_dir is None else Path(log_dir)
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children = [ChildState(s, self._log_path(s)) for s in specs]
        self.grace_s = grace_s
        self.poll_s = poll_s

    def _log_path(self, spec: ServiceSpec) -> Path | None:
        return None if self.log_dir is None else self.log_dir / f"{spec.name}.log"

    # -- starting -------------------------------------------------------------------------

    def _spawn(self, child: ChildState) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **child.spec.env}
        with contextlib.ExitStack() as files:
            logf = (
                None if child.log_path is None else files.enter_context(child.log_path.open("ab"))
            )
            child.proc = subprocess.Popen(
                child.spec.command,
                stdout=logf,
                stderr=None if logf is None else subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own process group: we can stop the whole tree
            )
        child.started_at = time.monotonic()
        child.ready_at = None
        child.status = "starting"
        log.info("started", extra={"service": child.spec.name, "pid": child.proc.pid})

    def _probe(self, child: ChildState) -> bool:
        """One readiness probe (no ready_url: started = ready)."""
        if child.spec.ready_url is None:
            return True
        with httpx.Client(timeout=2.0) as client, contextlib.suppress(httpx.HTTPError):
            return client.get(child.spec.ready_url).status_code == 200
        return False

    def _advance_start(self, child: ChildState) -> None:
        """One look at a starting child: ready, still starting, or a death before it was ready
        (it exited, or was not ready in `ready_timeout_s` and is killed), which `_died` handles
        by the child's policy like any other: a restart started while a dependency is frozen
        (Redis, an engine) may fail before it is ready, and that is a crash loop with backoff,
        not the end of the run (issue 46)."""
        assert child.proc is not None
        spec = child.spec
        code = child.proc.poll()
        if code is not None:
            reason = f"exited with status {code}{_signal_name(code)} before it was ready"
            self._died(child, code, reason)
        elif self._probe(child):
            child.status, child.ready_at = "ready", time.monotonic()
            log.info("ready", extra={"service": spec.name, "restarts": child.restarts})
        elif time.monotonic() - child.started_at > spec.ready_timeout_s:
            _signal_group(child.proc, signal.SIGKILL)
            code = child.proc.wait()
            self._died(child, code, f"not ready after {spec.ready_timeout_s:.0f}s (killed)")

    def _died(self, child: ChildState, code: int, reason: str) -> None:
        """Schedule the restart a dead child's policy allows, or raise ChildFailed. Each death
        that comes quickly (before ready, or within RAN_LONG_S of it) doubles the delay."""
        spec = child.spec
        tail = tail_lines(child.log_path)
        if code == EXIT_NO_RESTART:
            reason += " (a restart cannot help: not restarted)"
        elif (
            spec.restart is RestartPolicy.ON_FAILURE and child.restarts_in_a_row < spec.max_restarts
        ):
            now = time.monotonic()
            quick = child.ready_at is None or now - child.ready_at < RAN_LONG_S
            delay = child.restart_delay_s * 2 if quick and child.restart_delay_s else 0.0
            first, last = spec.first_restart_delay_s, spec.max_restart_delay_s
            child.restart_delay_s = min(max(delay, first), last)
            child.restarts += 1
            child.restarts_in_a_row += 1
            child.status = "restarting"
            child.restart_at = now + child.restart_delay_s
            log.warning(
                "child died; restarting",
                extra={"service": spec.name, "reason": reason, "restart": child.restarts,
                       "delay_s": child.restart_delay_s, "log_tail": tail[-5:]},
            )  # fmt: skip
            return
        child.status = "failed"
        if spec.optional:
            self.children.remove(child)
            log.error(
                "optional child failed; removed",
                extra={"service": spec.name, "reason": reason, "log_tail": tail[-5:]},
            )
            return
        raise ChildFailed(spec.name, reason, tail)

    def start(self) -> None:
        """Start every child once those it comes after are ready, and return when all are;
        stop all on failure. A child that fails before it is ready is restarted as its policy
        says (never: fatal)."""
        try:
            while any(c.status != "ready" for c in self.children):
                for child in list(self.children):  # an optional child that fails leaves it
                    due = child.status == "restarting" and time.monotonic() >= child.restart_at
                    if due or (child.status == "pending" and self._may_start(child)):
                        self._spawn(child)
                    if child.status == "starting":  # at once: no ready_url means started = ready
                        self._advance_start(child)
                if any(c.status != "ready" for c in self.children):
                    time.sleep(self.poll_s)
        except BaseException:
            self.stop()
            raise

    def _may_start(self, child: ChildState) -> bool:
        """Whether every child that `child` comes after is ready."""
        after = child.spec.after
        if after is None:
            before = self.children[: self.children.index(child)]
        else:
            before = [c for c in self.children if c.spec.name in after]
        return all(c.status == "ready" for c in before)

    # -- changing the set while running (`searchr1 local scale`) ---------------------------

    def add(self, spec: ServiceSpec) -> ChildState:
        """Start one more child now; `check()` follows it like the others (ready, restarts)."""
        if any(c.spec.name == spec.name for c in self.children):
            raise ValueError(f"a service named {spec.name!r} runs already")
        child = ChildState(spec, self._log_path(spec))
        self.children.append(child)
        self._spawn(child)
        return child

    def retire(self, name: str) -> None:
        """Stop one child without waiting: SIGTERM now, SIGKILL after `grace_s`; `check()`
        removes it once it has exited. Its exit is not a death (no restart, no failure)."""
        child = next((c for c in self.children if c.spec.name == name), None)
        if child is None:
            raise ValueError(f"no service named {name!r}")
        child.status, child.retire_by = "retiring", time.monotonic() + self.grace_s
        if child.proc is not None and child.proc.poll() is None:
            _signal_group(child.proc, signal.SIGTERM)
        log.info("retiring", extra={"service": name})

    def _reap_retired(self) -> None:
        for child in [c for c in self.children if c.status == "retiring"]:
            if child.proc is not None and child.proc.poll() is None:
                if time.monotonic() < child.retire_by:
                    continue
                _signal_group(child.proc, signal.SIGKILL)
                child.proc.wait()
            self.children.remove(child)
            log.info("retired", extra={"service": child.spec.name})

    # -- running --------------------------------------------------------------------------

    def check(self) -> bool:
        """One supervision round. Returns False when the stack has finished successfully.

        A restarted child is probed once per round until it is ready, never waited for inside
        the round: another child's death meanwhile is handled at once. Raises ChildFailed when
        a child died and its policy says stop.
        """
        self._reap_retired()
        for child in list(self.children):  # an optional child that fails leaves the list
            proc = child.proc
            if proc is None or child.status in ("exited", "stopped", "retiring"):
                continue
            if child.status == "restarting":
                if time.monotonic() >= child.restart_at:
                    self._spawn(child)
                continue
            spec = child.spec
            code = proc.poll()
            if code == 0 and (spec.exit_ends_stack or spec.may_finish):
                child.status = "exited"
                log.info("finished", extra={"service": spec.name})
                if spec.exit_ends_stack:
                    return False
                continue
            if child.status == "starting":
                self._advance_start(child)
            elif code is not None:
                self._died(child, code, f"exited with status {code}{_signal_name(code)}")
            elif child.ready_at is not None and time.monotonic() - child.ready_at > HEALTHY_RUN_S:
                child.restarts_in_a_row = 0
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


def _signal_name(code: int) -> str:
    return f" (signal {signal.Signals(-code).name})" if code < 0 else ""


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
