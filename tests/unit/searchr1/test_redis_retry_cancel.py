"""A cancelled Redis call stays cancelled.

redis-py 8.1's asyncio client swallows a task's cancellation when it lands as a socket
operation completes (Python 3.11's `asyncio.wait_for`; the command then returns normally): a
SIGTERM'd orchestrator step went on claiming groups, and
`test_a_stopped_worker_hands_its_groups_back_at_once` flaked. The client of `connect()` (every
service's) raises it after each command, `RedisRetry.call` after each call (pipelines too).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from searchr1.redis_retry import RedisRetry, connect


async def cancelled_at_every_point(
    call: Callable[[], Awaitable[object]], points: int = 40
) -> list[int]:
    """The loop iterations after its start at which cancelling `call` did not cancel it."""
    lost = []
    for k in range(points):
        task = asyncio.create_task(call())
        for _ in range(k):
            await asyncio.sleep(0)
        if not task.cancel():
            continue  # already done: nothing to cancel
        try:
            await task
            lost.append(k)
        except asyncio.CancelledError:
            pass
    return lost


async def test_a_cancelled_call_raises_cancelled_error(redis_server) -> None:  # type: ignore[no-untyped-def]
    r = connect(redis_server.url)
    retry = RedisRetry("test", 5.0)
    try:
        await r.ping()
        lost = await cancelled_at_every_point(lambda: retry.call("set", lambda: r.set("k", "v")))
        assert not lost, f"cancellation swallowed at loop iterations {lost}"
        assert await r.get("k") == b"v"  # the connection is still usable
    finally:
        await r.aclose()


async def test_a_cancelled_command_raises_cancelled_error(redis_server) -> None:  # type: ignore[no-untyped-def]
    r = connect(redis_server.url)
    try:
        await r.ping()
        lost = await cancelled_at_every_point(lambda: r.set("k", "v"))
        assert not lost, f"cancellation swallowed at loop iterations {lost}"
    finally:
        await r.aclose()


async def test_a_call_inside_cleanup_after_a_cancel_still_runs(redis_server) -> None:  # type: ignore[no-untyped-def]
    """`finally: await release()` after a cancel: the cancellation already on its way is not
    raised again inside the cleanup's own Redis calls."""
    r = connect(redis_server.url)
    retry = RedisRetry("test", 5.0)
    released = asyncio.Event()

    async def step() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await retry.call("release", lambda: r.set("released", "1"))
            released.set()

    try:
        task = asyncio.create_task(step())
        await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert released.is_set()
        assert await r.get("released") == b"1"
    finally:
        await r.aclose()
