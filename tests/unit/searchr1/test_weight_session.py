"""The weight-update session around a push (searchr1/weightsync/session.py): whatever fails,
every engine that paused is resumed and every session that opened is closed."""

from __future__ import annotations

import pytest

from searchr1.weightsync.protocol import EngineRefused
from searchr1.weightsync.session import update_session


class Engine:
    def __init__(self, name: str, *, pause_fails: bool = False, open_fails: bool = False) -> None:
        self.base_url = f"http://{name}"
        self.pause_fails = pause_fails
        self.open_fails = open_fails
        self.calls: list[str] = []

    async def pause_generation(self, mode: str = "abort") -> None:
        self.calls.append("pause")
        if self.pause_fails:
            raise ConnectionError(f"{self.base_url}: pause refused")

    async def continue_generation(self) -> None:
        self.calls.append("continue")

    async def begin_weight_update(self) -> bool:
        self.calls.append("begin")
        if self.open_fails:
            raise EngineRefused("no")
        return True

    async def end_weight_update(self) -> None:
        self.calls.append("end")


async def test_a_failed_pause_resumes_the_engines_that_paused() -> None:
    """An engine whose pause failed used to leave the others paused (no resume) until their
    pause lease ran out: the push raised before its `try`."""
    a, b = Engine("a"), Engine("b", pause_fails=True)
    with pytest.raises(ConnectionError, match="pause refused"):
        async with update_session([a, b], "abort"):
            pytest.fail("the body must not run")
    assert a.calls == ["pause", "continue"]
    assert "begin" not in b.calls


async def test_a_failed_open_closes_the_others_and_resumes_all() -> None:
    a, b = Engine("a"), Engine("b", open_fails=True)
    with pytest.raises(EngineRefused):
        async with update_session([a, b], "abort"):
            pytest.fail("the body must not run")
    assert a.calls == ["pause", "begin", "end", "continue"]
    assert b.calls == ["pause", "begin", "continue"]


async def test_a_good_push_pauses_opens_closes_and_resumes() -> None:
    a = Engine("a")
    async with update_session([a], "abort") as timing:
        a.calls.append("send")
    assert a.calls == ["pause", "begin", "send", "end", "continue"]
    assert timing.paused_seconds >= timing.seconds >= 0
