"""`searchr1 local`'s view: progress shows what is known (`11`, or `11/200` with max steps, not
`11/None`), and a clean finish does not warn "metrics unreadable ... Connection refused"."""

from __future__ import annotations

import logging
import re

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


def test_a_log_line_during_the_live_view_gets_a_line_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import io
    import sys

    from stack.launcher import live_view

    screen = io.StringIO()  # stdout and stderr on one terminal, as a user sees them
    monkeypatch.setattr(sys, "stderr", screen)
    handler = logging.StreamHandler(sys.stderr)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [handler])
    console = Console(file=screen, force_terminal=True, width=40)
    with live_view(console) as live:
        live.update("training 11/200", refresh=True)
        logging.getLogger("stack.launcher").warning("trainer finished")
    assert handler.stream is screen  # restored
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())  # colours, cursor moves
    lines = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    assert any(line.strip().endswith("trainer finished") and "11/200" not in line for line in lines)
    assert not any("11/200" in line and "trainer finished" in line for line in lines)


def test_on_a_pipe_the_live_views_last_line_is_ended() -> None:
    import io

    from stack.launcher import live_view

    screen = io.StringIO()  # `searchr1 demo > log`: no terminal
    with live_view(Console(file=screen, width=40)) as live:
        live.update("training 11/200", refresh=True)
    screen.write("next log line\n")
    assert screen.getvalue().endswith("training 11/200\nnext log line\n")
