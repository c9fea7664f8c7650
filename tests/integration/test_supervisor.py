"""The process supervisor behind `searchr1 local`, with real child processes."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from searchr1.redis_server import free_port
from searchr1.supervisor import (
    EXIT_NO_RESTART,
    ChildFailed,
    RestartPolicy,
    ServiceSpec,
    Supervisor,
)
from tests.support.processes import alive

PY = sys.executable
ENV = {"PYTHONPATH": os.getcwd()}


def http_service(name: str) -> ServiceSpec:
    port = free_port()
    return ServiceSpec(
        name=name,
        command=[PY, "-m", "tests.integration.slow_service", str(port)],
        ready_url=f"http://127.0.0.1:{port}/ready",
        env=ENV,
        ready_timeout_s=30,
    )


def test_starts_in_order_waits_ready_and_stops_gracefully(tmp_path: Path) -> None:
    sup = Supervisor([http_service("a"), http_service("b")], tmp_path, grace_s=10)
    sup.start()
    try:
        assert [c.status for c in sup.children] == ["ready", "ready"]
        assert sup.check() is True
    finally:
        sup.stop()
    assert [c.proc.returncode for c in sup.children] == [0, 0]  # SIGTERM -> graceful exit 0
    assert "handed back in-flight work" in (tmp_path / "a.log").read_text()


def test_children_start_once_those_they_come_after_are_ready(tmp_path: Path) -> None:
    """`after=()` starts beside the others; `after=("a",)` waits for a alone; the default
    (None) waits for every child before it in the list."""
    a, b, c, d = (http_service(n) for n in "abcd")
    b.after, c.after = (), ("a",)
    sup = Supervisor([a, b, c, d], tmp_path, grace_s=10)
    sup.start()
    try:
        ca, cb, cc, cd = sup.children
        assert all(x.ready_at is not None for x in sup.children)
        assert cb.started_at < ca.ready_at  # type: ignore[operator]
        assert cc.started_at >= ca.ready_at  # type: ignore[operator]
        assert cd.started_at >= max(ca.ready_at, cb.ready_at, cc.ready_at)  # type: ignore[type-var]
    finally:
        sup.stop()


def test_after_may_name_only_children_listed_before() -> None:
    """A child after a later one (or after one that is not there) could wait forever."""
    a, b = http_service("a"), http_service("b")
    a.after = ("b",)
    with pytest.raises(ValueError, match=r"a: after=\['b'\] must name children listed before"):
        Supervisor([a, b], None)


def test_a_dead_child_is_named_with_its_last_log_lines(tmp_path: Path) -> None:
    crasher = ServiceSpec(
        name="retriever",
        command=[PY, "-c", "import time,sys; time.sleep(0.5); print('fatal: index missing');"
                 " sys.exit(3)"],
    )  # fmt: skip
    sup = Supervisor([http_service("redis-ish"), crasher], tmp_path, poll_s=0.05)
    sup.start()
    with pytest.raises(ChildFailed) as info:
        sup.run()
    err = info.value
    assert err.name == "retriever"
    assert "exited with status 3" in str(err)
    assert "fatal: index missing" in str(err)
    assert all(c.proc.poll() is not None for c in sup.children)  # the rest was stopped


def test_never_ready_fails_start_and_cleans_up(tmp_path: Path) -> None:
    first = http_service("ok")
    broken = ServiceSpec(
        name="broken",
        command=[PY, "-c", "print('cannot load model'); raise SystemExit(2)"],
        ready_url="http://127.0.0.1:9/ready",
    )
    sup = Supervisor([first, broken], tmp_path)
    with pytest.raises(ChildFailed, match="broken exited with status 2 before it was ready"):
        sup.start()
    assert sup.children[0].proc.poll() is not None


def test_on_failure_restarts_up_to_the_limit(tmp_path: Path) -> None:
    flaky = ServiceSpec(
        name="flaky",
        command=[PY, "-c", "import time; time.sleep(0.2); raise SystemExit(1)"],
        restart=RestartPolicy.ON_FAILURE,
        max_restarts=2,
    )
    sup = Supervisor([flaky], tmp_path, poll_s=0.05)
    sup.start()
    with pytest.raises(ChildFailed, match="flaky exited with status 1"):
        sup.run()
    assert sup.children[0].restarts == 2


def test_a_child_that_says_a_restart_cannot_help_is_not_restarted(tmp_path: Path) -> None:
    """The trainer whose data ran out exits EXIT_NO_RESTART: restarted, it would read the same
    end of the bus and exit again, a crash loop that ends only at max_restarts."""
    done_for = ServiceSpec(
        name="trainer",
        command=[PY, "-c", "print('no more data after step 1');"
                 f" raise SystemExit({EXIT_NO_RESTART})"],
        restart=RestartPolicy.ON_FAILURE,
        max_restarts=3,
    )  # fmt: skip
    sup = Supervisor([done_for], tmp_path, poll_s=0.05)
    sup.start()
    with pytest.raises(ChildFailed, match="a restart cannot help") as info:
        sup.run()
    assert sup.children[0].restarts == 0
    assert "no more data after step 1" in str(info.value)


def test_a_crash_loop_backs_off_instead_of_burning_its_restarts(tmp_path: Path) -> None:
    """Redis on a full disk exits at its first AOF write, every restart (issue 32): restarted
    at once, it used up `max_restarts` within a second of the disk filling. Restarts now wait
    0.1 s, doubled per quick death (docker's restart policy): 5 restarts take >= 3.1 s."""
    crasher = ServiceSpec(
        name="redis-on-a-full-disk",
        command=[PY, "-c", "raise SystemExit(1)"],
        restart=RestartPolicy.ON_FAILURE,
        max_restarts=5,
    )
    sup = Supervisor([crasher], tmp_path, poll_s=0.02)
    sup.start()
    start = time.monotonic()
    with pytest.raises(ChildFailed):
        sup.run()
    assert sup.children[0].restarts == 5
    assert time.monotonic() - start >= 0.1 + 0.2 + 0.4 + 0.8 + 1.6


def test_a_finishing_child_ends_the_stack_successfully(tmp_path: Path) -> None:
    job = ServiceSpec(name="trainer", command=[PY, "-c", "print('done')"], exit_ends_stack=True)
    sup = Supervisor([http_service("server"), job], tmp_path, poll_s=0.05)
    sup.start()
    sup.run()  # returns instead of raising
    assert sup.children[1].status == "exited"
    assert sup.children[0].proc.returncode == 0


def test_stop_leaves_no_orphans(tmp_path: Path) -> None:
    # The child starts a grandchild that ignores SIGTERM; both must be gone after stop().
    script = (
        "import subprocess, time\n"
        "p = subprocess.Popen(['sh', '-c', 'trap \"\" TERM; sleep 1000'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(1000)\n"
    )
    sup = Supervisor([ServiceSpec(name="parent", command=[PY, "-c", script])], tmp_path, grace_s=2)
    sup.start()
    log_path = tmp_path / "parent.log"
    deadline = time.monotonic() + 10
    while not log_path.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(log_path.read_text().split()[0])
    assert alive(grandchild)
    sup.stop()
    time.sleep(0.2)
    assert not alive(grandchild)


def test_a_job_that_completes_is_not_a_death(tmp_path: Path) -> None:
    rollouts = ServiceSpec(name="orchestrator", command=[PY, "-c", "pass"], may_finish=True)
    trainer = ServiceSpec(
        name="trainer",
        command=[PY, "-c", "import time; time.sleep(1.0)"],
        exit_ends_stack=True,
    )
    sup = Supervisor([rollouts, trainer], tmp_path, poll_s=0.05)
    sup.start()
    sup.run()
    assert [c.status for c in sup.children] == ["exited", "exited"]


# -- a child that fails before it is ready (issue 46) ----------------------------------------


def flaky(name: str, tmp_path: Path, plan: str, **kw: object) -> ServiceSpec:
    """A child that follows `plan`, one entry per start (tests/integration/flaky_start_service)."""
    port = free_port()
    counter = tmp_path / f"{name}.starts"
    return ServiceSpec(
        name=name,
        command=[PY, "-m", "tests.integration.flaky_start_service", str(port), str(counter), plan],
        ready_url=f"http://127.0.0.1:{port}/ready",
        env=ENV,
        **kw,  # type: ignore[arg-type]
    )


def supervise_until(sup: Supervisor, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, [(c.spec.name, c.status) for c in sup.children]
        assert sup.check()
        time.sleep(sup.poll_s)


def test_a_restart_that_fails_before_it_is_ready_is_retried_with_backoff(tmp_path: Path) -> None:
    """bench/chaos.py's freeze:redis: the trainer lost its lease (correct), its restart's first
    Redis call timed out while Redis was still frozen, it exited 1 before it was ready, and the
    supervisor ended the run (ChildFailed). It is a crash loop like any other: retried with the
    same backoff, bounded by max_restarts."""
    spec = flaky(
        "trainer",
        tmp_path,
        "ready-die:0.5,exit:0,exit:0,ready",
        restart=RestartPolicy.ON_FAILURE,
        max_restarts=5,
    )
    sup = Supervisor([spec], tmp_path, poll_s=0.05)
    sup.start()
    try:
        died = time.monotonic()
        supervise_until(
            sup, lambda: sup.children[0].restarts == 3 and sup.children[0].status == "ready"
        )
        # Three restarts, the last two after quick deaths before ready: 0.1 + 0.2 + 0.4 s.
        assert time.monotonic() - died >= 0.7
        log = (tmp_path / "trainer.log").read_text()
        assert log.count("redis unreachable for the start-up deadline") == 2
    finally:
        sup.stop()


def test_a_restart_that_keeps_failing_before_ready_ends_at_max_restarts(tmp_path: Path) -> None:
    spec = flaky(
        "trainer",
        tmp_path,
        "ready-die:0.3,exit:0",
        restart=RestartPolicy.ON_FAILURE,
        max_restarts=2,
    )
    sup = Supervisor([spec], tmp_path, poll_s=0.05)
    sup.start()
    with pytest.raises(ChildFailed, match="exited with status 1 before it was ready") as info:
        sup.run()
    assert sup.children[0].restarts == 2
    assert "redis unreachable for the start-up deadline" in str(info.value)


def test_a_first_start_that_fails_before_ready_is_retried_under_on_failure(
    tmp_path: Path,
) -> None:
    """Started while a dependency is down (compose's Redis still loading): under on-failure
    the first start is retried too, as docker and Kubernetes would; under `never` it is fatal
    (test_never_ready_fails_start_and_cleans_up)."""
    spec = flaky(
        "orchestrator", tmp_path, "exit:0,ready", restart=RestartPolicy.ON_FAILURE, max_restarts=2
    )
    sup = Supervisor([spec], tmp_path, poll_s=0.05)
    sup.start()
    try:
        assert sup.children[0].status == "ready"
        assert sup.children[0].restarts == 1
    finally:
        sup.stop()


def test_a_restart_not_ready_in_time_is_killed_and_retried(tmp_path: Path) -> None:
    spec = flaky(
        "engine",
        tmp_path,
        "ready-die:0.3,hang,ready",
        restart=RestartPolicy.ON_FAILURE,
        max_restarts=3,
        ready_timeout_s=2.0,
    )
    sup = Supervisor([spec], tmp_path, poll_s=0.05)
    sup.start()
    try:
        supervise_until(
            sup, lambda: sup.children[0].restarts == 2 and sup.children[0].status == "ready"
        )
    finally:
        sup.stop()


def test_a_death_while_another_restart_is_not_ready_yet_is_handled(tmp_path: Path) -> None:
    """The supervisor used to wait for a restarted child's readiness inside its round: a second
    death meanwhile (Redis frozen: the trainer and the orchestrator both give up) waited for
    the first child to be ready, up to its ready_timeout_s."""
    slow = flaky(
        "trainer",
        tmp_path,
        "ready-die:0.3,hang",
        restart=RestartPolicy.ON_FAILURE,
        max_restarts=1,
        ready_timeout_s=60.0,
    )
    other = flaky(
        "orchestrator",
        tmp_path,
        "ready-die:1.5,ready",
        restart=RestartPolicy.ON_FAILURE,
        max_restarts=1,
    )
    sup = Supervisor([slow, other], tmp_path, poll_s=0.05)
    sup.start()
    try:
        supervise_until(
            sup, lambda: sup.children[1].restarts == 1 and sup.children[1].status == "ready"
        )
        assert sup.children[0].status == "starting"  # still waited for, not blocking the round
    finally:
        sup.stop()


def test_a_child_that_ran_healthy_long_enough_starts_its_count_of_restarts_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`max_restarts` counts deaths in a row: a run of days is not ended by its fourth fault.
    It counted every restart of the run before (the 2-hour soak restarted its trainer 4 times)."""
    monkeypatch.setattr("searchr1.supervisor.HEALTHY_RUN_S", 0.3)
    dies_later = ServiceSpec(
        name="trainer",
        command=[PY, "-c", "import time,sys; time.sleep(0.8); sys.exit(1)"],
        restart=RestartPolicy.ON_FAILURE,
        max_restarts=1,
    )
    sup = Supervisor([dies_later], tmp_path, poll_s=0.05)
    sup.start()
    try:
        deadline = time.monotonic() + 30
        while sup.children[0].restarts < 3 and time.monotonic() < deadline:
            assert sup.check()  # no ChildFailed: each death is the first in a row
            time.sleep(0.05)
        assert sup.children[0].restarts == 3
    finally:
        sup.stop()


def test_without_a_log_directory_children_write_to_our_own_output(capfd) -> None:  # type: ignore[no-untyped-def]
    """The SGLang launcher's children: their output is the container's log."""
    spec = ServiceSpec("talker", [PY, "-c", "print('hello from the child')"], may_finish=True)
    sup = Supervisor([spec], None, poll_s=0.05)
    sup.start()
    try:
        deadline = time.monotonic() + 10
        while sup.children[0].status != "exited" and time.monotonic() < deadline:
            sup.check()
            time.sleep(0.05)
    finally:
        sup.stop()
    assert "hello from the child" in capfd.readouterr().out
