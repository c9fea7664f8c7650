"""The chaos bench's independent record of what was published: a tap on Redis itself.

`StreamTap` is a thread of the bench's own process, not part of the loop: it holds Redis's
`MONITOR` open and records the trajectory id of every `XADD` to the bus stream as Redis runs it
(inside the bus's publish script too: MONITOR shows a script's commands as `[0 lua]`). An entry
is seen when it is added, so acking it away (XACK + XDEL) or trimming it a microsecond later
changes nothing. Nothing the orchestrator, the bus or the trainer writes about itself is read.

What it cannot see, and how that is counted instead of hidden: entries added while it is not
connected (before Redis first answers it, or between a Redis restart and its reconnect). At each
(re)connect and at the end (`reconcile`) it reads the stream's `entries-added` (XINFO STREAM:
every entry ever added, deleted ones included, restored from the AOF across a restart) and the
entries still in the stream: added while disconnected = entries-added - (the count at the last
connect + the XADDs seen since); those still in the stream are read and recorded; the rest were
added and deleted unseen and are counted in `unseen` (their ids cannot be known). A republished
id (a group published again after a crash) in such a gap is counted unseen too: the count
errs towards a failure, never towards a pass. A Redis that forgot entries it had added (no AOF)
shows as entries-added going backwards (`forgotten`).

Each connect's count is taken atomically (MULTI: ECHO nonce, XINFO STREAM, XRANGE) on a second
connection; the nonce's line in the MONITOR output says which XADDs came before the count
(already in it) and which after.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from typing import Any

import redis

# XINFO STREAM's `entries-added`, the count the tap checks itself against, came with Redis 7.0.
MIN_REDIS = (7, 0)

log = logging.getLogger(__name__)

_ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"')  # one quoted argument of a MONITOR line
_ESCAPE = re.compile(rb"\\(x[0-9a-fA-F]{2}|.)", re.DOTALL)
_ESCAPES = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"a": b"\a", b"b": b"\b"}


def _unescape(raw: bytes) -> bytes:
    """Undo Redis's `sdscatrepr` quoting of one MONITOR argument."""

    def one(m: re.Match[bytes]) -> bytes:
        code = m.group(1)
        if code.startswith(b"x") and len(code) == 3:
            return bytes([int(code[1:], 16)])
        return _ESCAPES.get(code, code)

    return _ESCAPE.sub(one, raw)


def monitor_args(line: bytes) -> list[bytes]:
    """The command's arguments of a MONITOR line (`<time> [<db> <client>] "ARG" "ARG" ...`),
    unescaped."""
    _, _, command = line.partition(b"] ")
    return [_unescape(m.group(1)) for m in _ARG.finditer(command)]


def xadd_tid(args: list[bytes], stream: bytes) -> str | None:
    """The `tid` field of an `XADD <stream> ...` (None for any other command or key)."""
    if len(args) < 3 or args[0].upper() != b"XADD" or args[1] != stream:
        return None
    # XADD key [NOMKSTREAM] [MAXLEN|MINID ...] id field value ...: the pairs end the command.
    for i in range(len(args) - 2, 2, -2):
        if args[i] == b"tid":
            return args[i + 1].decode(errors="replace")
    return ""  # an entry without an id: counted, named by nothing


class StreamTap(threading.Thread):
    """Records every trajectory id added to `stream` (module docstring) until `stop`."""

    def __init__(self, redis_url: str, stream: str, retry_s: float = 0.05) -> None:
        super().__init__(daemon=True, name="chaos-tap")
        self.url = redis_url
        self.stream = stream
        self.retry_s = retry_s
        self.published: set[str] = set()
        self.adds_seen = 0  # XADDs to the stream seen in MONITOR output
        self.unseen = 0  # entries added while disconnected and deleted before a count
        self.forgotten = 0  # entries Redis had added and no longer counts (entries-added fell)
        self.sessions = 0  # connects that reached their count
        self._expected = 0  # entries-added if every add since the last count was seen
        self._uncounted: set[str] = set()  # ids seen before the count they are part of
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    # -- the count ---------------------------------------------------------------------------

    def _count(self, client: redis.Redis, marker: bytes | None = None) -> tuple[int, set[str]]:
        """(entries-added, ids in the stream now), atomically; ECHO `marker` first."""
        pipe = client.pipeline(transaction=True)
        if marker is not None:
            pipe.echo(marker)
        pipe.xinfo_stream(self.stream)
        pipe.xrange(self.stream, "-", "+")
        *_, info, entries = pipe.execute(raise_on_error=False)
        if isinstance(info, redis.ResponseError):  # no stream yet: nothing was ever added
            if "no such key" not in str(info).lower():
                raise info
            return 0, set()
        if isinstance(entries, Exception):
            raise entries
        live = {f[b"tid"].decode() for _, f in entries if b"tid" in f}
        if "entries-added" not in info:
            raise RuntimeError(
                "the stream tap needs Redis >= 7.0 (XINFO STREAM entries-added); start the bench's "
                "Redis from such a binary (searchr1.redis_server.find_redis_binary(MIN_REDIS))"
            )
        return int(info["entries-added"]), live

    def _settle_gap(self, added: int, live: set[str]) -> None:
        """Count what was added since the last count and not seen (module docstring)."""
        with self._lock:
            gap = added - self._expected
            if gap < 0:
                self.forgotten += -gap
                log.warning("redis counts fewer stream entries than were added: %d", -gap)
            fresh = (live - self.published) | self._uncounted
            self.unseen += max(0, gap - len(fresh))
            self.published |= live
            self._uncounted = set()
            self._expected = added

    def reconcile(self, client: redis.Redis) -> None:
        """The final count, after the tap stopped (Redis back up, the stack stopped): entries
        added after the last MONITOR line are read from the stream or counted unseen."""
        added, live = self._count(client)
        self._settle_gap(added, live)

    # -- the tap -----------------------------------------------------------------------------

    def run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._session()
            except (redis.RedisError, OSError) as e:  # Redis down or restarting: connect again
                if not self._stopping.is_set():
                    log.debug("stream tap reconnecting: %r", e)
            self._stopping.wait(self.retry_s)

    def _session(self) -> None:
        opts: dict[str, Any] = {"socket_timeout": 5.0, "socket_connect_timeout": 1.0}
        client = redis.Redis.from_url(self.url, **opts)
        counter = redis.Redis.from_url(self.url, **opts)
        conn = client.connection_pool.get_connection()
        try:
            conn.send_command("MONITOR")
            if conn.read_response() not in (b"OK", "OK", True):
                raise redis.RedisError("MONITOR refused")
            marker = f"chaos-tap-{secrets.token_hex(8)}".encode()
            added, live = self._count(counter, marker)
            stream = self.stream.encode()
            counted = False  # the count's marker line read: later XADDs are not in it
            drain_until = None  # once stopped: what Redis already sent, for up to 1 s more
            while drain_until is None or time.monotonic() < drain_until:
                if drain_until is None and self._stopping.is_set():
                    drain_until = time.monotonic() + 1.0
                if not conn.can_read(timeout=0.25):
                    if drain_until is not None:
                        break
                    continue
                line = conn.read_response()
                _, _, command = line.partition(b"] ")
                if not counted and command.startswith(b'"ECHO"') and marker in command:
                    self._settle_gap(added, live)
                    self.sessions += 1
                    counted = True
                    continue
                if not command.startswith(b'"XADD"'):
                    continue
                tid = xadd_tid(monitor_args(line), stream)
                if tid is None:
                    continue
                with self._lock:
                    if tid:
                        self.published.add(tid)
                    if counted:
                        self.adds_seen += 1
                        self._expected += 1
                    elif tid:
                        self._uncounted.add(tid)
        finally:
            conn.disconnect()
            counter.close()
            client.close()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self.join(timeout_s)
