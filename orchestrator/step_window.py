"""Steps in flight: started in order, retired in order, at most `size` at once.

A step's groups finish at the pace of its slowest. With `size` 1 the next step waits for that
(the barrier sync mode needs: its next weights count every group of this step). In async mode
(`size` = max_staleness + 1: the weight gate would hold any further step anyway) the next step
starts as soon as every group of the newest step is claimed, so the engines run the next
step's groups beside the last step's slowest instead of idling; the staleness bound, not the
barrier, keeps the data near-on-policy (AReaL bounds its rollouts the same way). Steps retire
in order: the lowest step not finished is what a restart resumes, so no step is skipped after
a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any


class StepWindow:
    def __init__(self, size: int) -> None:
        self.size = size
        self._tasks: dict[int, asyncio.Task[Any]] = {}
        self._drained: dict[int, asyncio.Event] = {}  # every group of the step is claimed

    def __len__(self) -> int:
        return len(self._tasks)

    def steps(self) -> list[int]:
        """The steps in flight, lowest first."""
        return sorted(self._tasks)

    def start(self, step: int, run: Callable[[asyncio.Event], Awaitable[Any]]) -> None:
        """Start `run(drained)`; it sets `drained` once the step has no group left to claim."""
        drained = asyncio.Event()
        self._drained[step] = drained
        self._tasks[step] = asyncio.create_task(run(drained))

    def has_room(self) -> bool:
        if not self._tasks:
            return True
        return len(self._tasks) < self.size and self._drained[max(self._tasks)].is_set()

    async def wait(self) -> list[int]:
        """Wait until a step finishes or the newest is drained; returns the steps retired now
        (the finished ones at the front, in order). A failed step's error is raised at once."""
        waits: set[asyncio.Future[Any]] = set(self._tasks.values())
        newest = self._drained[max(self._tasks)]
        drained = None if newest.is_set() else asyncio.ensure_future(newest.wait())
        if drained is not None:
            waits.add(drained)
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if drained is not None:
                drained.cancel()
        for task in self._tasks.values():
            if task.done():
                task.result()  # raises the step's error (the caller cancels the rest)
        retired = []
        for step in sorted(self._tasks):
            if not self._tasks[step].done():
                break
            del self._tasks[step], self._drained[step]
            retired.append(step)
        return retired

    async def cancel(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        self._drained.clear()
