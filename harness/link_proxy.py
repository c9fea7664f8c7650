"""A TCP proxy standing for the network link between two services, for chaos (issue 32).

These machines have no `tc netem` (the kernel lacks the qdisc), so a slow or lossy link is
made in userspace: every connection to the proxy is forwarded to the upstream, and
`impair(...)` degrades the link for a while:

- `delay_s` / `jitter_s`: each chunk is delivered that long after it arrived (uniform jitter,
  order kept): latency, not a bandwidth cap;
- `drop`: the share of new connections reset at once (a SYN lost for good, a dead route);
- `cut`: the chance, per forwarded chunk, that the connection is reset mid-stream (a request
  or an answer lost half way);
- `stall`: `"up"` (client to upstream), `"down"` or `"both"`: nothing is delivered that way
  while it lasts; connections stay open, reads just wait (a one-way or two-way partition
  whose TCP connections neither close nor answer). `"both"` is a silent cut as a client sees
  it, except that a new connection still completes its handshake with the proxy (a dropped
  SYN and the kernel's own resend timers: hosts of their own, `harness.netns`).

Runs an asyncio loop on a thread of the calling process. Counts what it did (`stats`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from searchr1.redis_server import free_port

Direction = Literal["up", "down", "both"]
CHUNK = 65536


@dataclass(frozen=True)
class Impairment:
    delay_s: float = 0.0
    jitter_s: float = 0.0
    drop: float = 0.0
    cut: float = 0.0
    stall: Direction | None = None

    def stalls(self, direction: str) -> bool:
        return self.stall is not None and self.stall in (direction, "both")


CLEAR = Impairment()


@dataclass
class LinkStats:
    connections: int = 0
    dropped: int = 0
    cut: int = 0
    chunks: int = 0


class LinkProxy:
    def __init__(self, upstream: str, port: int | None = None, seed: int = 0) -> None:
        """`upstream`: a URL (`http://`, `redis://`: its host and port) or `host:port`."""
        url = urlsplit(upstream if "://" in upstream else f"tcp://{upstream}")
        if url.hostname is None or url.port is None:
            raise ValueError(f"upstream {upstream!r}: no host and port")
        self.upstream = (url.hostname, url.port)
        self.port = port or free_port()
        self.stats = LinkStats()
        self._now = CLEAR
        self._until = 0.0
        self._rng = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._changed: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        # Each connection's task, kept until it ends: asyncio's server lets go of it once the
        # client's side is lost, and a half-open connection (the client gone, the upstream
        # frozen) was garbage collected while pending.
        self._connections: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="link")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    @property
    def current(self) -> Impairment:
        if self._now is not CLEAR and time.monotonic() >= self._until:
            self._now = CLEAR
        return self._now

    def impair(self, seconds: float, **impairment: object) -> None:
        """Degrade the link for `seconds` (then clear again)."""
        self._until = time.monotonic() + seconds
        self._now = Impairment(**impairment)  # type: ignore[arg-type]
        self._loop.call_soon_threadsafe(self._wake_later, seconds)

    def _wake_later(self, seconds: float) -> None:
        assert self._changed is not None
        self._changed.set()  # stalled writers re-check now and when the impairment ends
        self._changed = asyncio.Event()
        changed = self._changed
        self._loop.call_later(seconds + 0.01, changed.set)

    def start(self, timeout_s: float = 10.0) -> LinkProxy:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(self._listen(), self._loop)
        started.result(timeout_s)
        return self

    async def _listen(self) -> None:
        self._changed = asyncio.Event()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            # Let them finish before the loop stops: a task destroyed while pending (a stalled
            # connection's) is finalized later by the garbage collector, at any point of the
            # test process (it broke pytest's assertion rewriting once: a SystemError).
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)
        self.stats.connections += 1
        if self._rng.random() < self.current.drop:
            self.stats.dropped += 1
            client_w.transport.abort()  # a reset, as from a dead route
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.transport.abort()
            return
        ends = (client_w, up_w)
        await asyncio.gather(
            self._pipe(client_r, up_w, "up", ends),
            self._pipe(up_r, client_w, "down", ends),
            return_exceptions=True,
        )
        _reset(ends)

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        direction: str,
        ends: tuple[asyncio.StreamWriter, ...],
    ) -> None:
        """Read chunks as they come; a second task delivers each at its due time, in order.
        A reset either way resets both ends."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        deliver = asyncio.create_task(self._deliver(queue, writer, direction, ends))
        try:
            while data := await reader.read(CHUNK):
                now = self.current
                jitter = self._rng.uniform(-now.jitter_s, now.jitter_s)
                await queue.put((time.monotonic() + max(0.0, now.delay_s + jitter), data))
            await queue.put((0.0, b""))  # end of stream, after what is queued
            await deliver
        except OSError:
            _reset(ends)
        finally:
            deliver.cancel()

    async def _deliver(
        self,
        queue: asyncio.Queue[tuple[float, bytes]],
        writer: asyncio.StreamWriter,
        direction: str,
        ends: tuple[asyncio.StreamWriter, ...],
    ) -> None:
        try:
            while True:
                due, data = await queue.get()
                if not data:
                    writer.write_eof()
                    return
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                while self.current.stalls(direction):
                    assert self._changed is not None
                    await self._changed.wait()
                if self._rng.random() < self.current.cut:
                    self.stats.cut += 1
                    raise ConnectionResetError("cut by the link proxy")
                self.stats.chunks += 1
                writer.write(data)
                await writer.drain()
        except OSError:
            _reset(ends)


def _reset(ends: tuple[asyncio.StreamWriter, ...]) -> None:
    """Both ends of a proxied connection closed at once, with a reset."""
    for w in ends:
        w.transport.abort()
