"""`searchr1 local`'s view: progress shows what is known (`11`, or `11/200` with max steps, not
`11/None`), and a clean finish does not warn "metrics unreadable ... Connection refused"."""

from __future__ import annotations

import logging

import httpx
import pytest
from rich.console import Console
from rich.progress import Progress

from searchr1.redis_server import free_port
from stack.launcher import StackStatus, StepsColumn


@pytest.mark.parametrize(("total", "shown"), [(None, "11"), (200, "11/200")])
def test_progress_shows_the_steps_that_are_known(total: int | None, shown: str) -> None:
    progress = Progress(StepsColumn(), console=Console(width=40, record=True))
    task = progress.add_task("train", total=total, completed=11)
    assert str(StepsColumn().render(progress.tasks[task])) == shown


def scrape(status: StackStatus, url: str, running: bool) -> None:
    with httpx.Client(timeout=1.0) as client:
        status.scrape(client, {"trainer": url}, lambda _: running)


def test_a_finished_or_finishing_service_is_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    closed = f"http://127.0.0.1:{free_port()}/metrics"
    status = StackStatus()
    with caplog.at_level(logging.WARNING, logger="stack.launcher"):
        scrape(status, closed, running=True)  # its port closed as it shut down ...
        scrape(status, closed, running=False)  # ... and then it had exited: not scraped
    assert "metrics unreadable" not in caplog.text and not status.unreadable


def test_a_running_service_that_stays_unreadable_is_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    closed = f"http://127.0.0.1:{free_port()}/metrics"
    status = StackStatus()
    with caplog.at_level(logging.WARNING, logger="stack.launcher"):
        for _ in range(3):
            scrape(status, closed, running=True)
    assert caplog.text.count("metrics unreadable") == 1 and status.unreadable == {"trainer"}
