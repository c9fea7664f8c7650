"""The weight-update session both senders run around their transfer (`sender.WeightSender`,
the broadcast; `handover.HandoverSender`, the hand-over): pause the engines, open a session on
each (SGLang 0.5.21's `/begin_weight_update` .. `/end_weight_update`), send, close every session
that opened and resume the engines, whatever happened; and what a push reports (`PushStats`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from searchr1.weightsync.protocol import EngineRefused, SessionEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushStats:
    bytes: int  # on the wire (delta updates: the encoded payloads)
    seconds: float  # the transfer: first bucket posted to last bucket acknowledged
    weight_version: int
    paused_seconds: float = 0.0  # generation paused: pause + transfer + resume round trips
    raw_bytes: int | None = None  # delta updates: the bytes a full push would have sent
    delta: bool = False  # encoded against the engines' weights (not only full payloads)

    @property
    def gbytes_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass
class Timing:
    """Filled in when the session ends: the transfer (sessions opened to sessions closed) and
    the whole pause (pause to resume)."""

    seconds: float = 0.0
    paused_seconds: float = 0.0


@asynccontextmanager
async def update_session(
    engines: Sequence[SessionEngine], pause_mode: str | None
) -> AsyncIterator[Timing]:
    """Pause (`pause_mode` None: no pause), open every engine's session, run the body, close
    the sessions that opened and resume. An engine that fails to pause or to open fails the
    push (after the others are closed again and every engine is resumed); after a failed body,
    a close error is only logged."""
    timing = Timing()
    paused_at = time.perf_counter()
    try:
        if pause_mode:  # all asked; one that fails fails the push, the others are resumed below
            paused = await asyncio.gather(
                *(c.pause_generation(pause_mode) for c in engines), return_exceptions=True
            )
            refused = next((r for r in paused if isinstance(r, BaseException)), None)
            if refused is not None:
                raise refused
        opened = await asyncio.gather(*(open_session(c) for c in engines), return_exceptions=True)
        in_session = [c for c, ok in zip(engines, opened, strict=True) if ok is True]
        failure = next((r for r in opened if isinstance(r, BaseException)), None)
        start = time.perf_counter()
        try:
            if failure is not None:
                raise failure
            yield timing
        except BaseException as e:
            failure = e
            raise
        finally:
            await close_sessions(in_session, failed=failure is not None)
        timing.seconds = time.perf_counter() - start  # transfer: first post to last answer
    finally:
        if pause_mode:
            await asyncio.gather(
                *(c.continue_generation() for c in engines), return_exceptions=True
            )
    timing.paused_seconds = time.perf_counter() - paused_at


async def open_session(client: SessionEngine) -> bool:
    """Open a weight-update session; False when the engine has no sessions. A session left
    open by a sender that died mid-push is closed first (the new push rewrites every tensor)."""
    try:
        return await client.begin_weight_update()
    except EngineRefused as e:
        if "already open" not in str(e):
            raise
    log.warning("closing a weight-update session left open", extra={"engine": client.base_url})
    await client.end_weight_update()
    return await client.begin_weight_update()


async def close_sessions(clients: list[SessionEngine], *, failed: bool) -> None:
    """End every open session. After a failed push a close error is only logged (the push's
    own error is the one raised); after a good one it fails the push."""
    closed = await asyncio.gather(*(c.end_weight_update() for c in clients), return_exceptions=True)
    errors = [r for r in closed if isinstance(r, BaseException)]
    if errors and not failed:
        raise errors[0]
    for e in errors:
        log.warning("closing a weight-update session failed", extra={"error": str(e)})


def with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """Each item with True for the last one (one item of look-ahead)."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True
