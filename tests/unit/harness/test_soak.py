"""harness/soak.py (`bench/soak.py`, issue 46): the leak verdict on hand-made series, and the
sampler on this test's own process, a file tree and a real Redis."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis

from harness.soak import (
    best_step_sse,
    disk_bytes,
    growth,
    key_families,
    process_tree,
    redis_figures,
)
from searchr1.redis_server import RedisServer

HOURS = 2.0
EVERY_S = 10.0
WARMUP_S = 600.0


def series(
    shape: Callable[[np.ndarray], np.ndarray], noise: float = 3.0, seed: int = 0
) -> tuple[list[float], list[float]]:
    """Two hours sampled every 10 s: `shape(hours)` plus Gaussian noise."""
    t = np.arange(0.0, HOURS * 3600, EVERY_S)
    rng = np.random.default_rng(seed)
    y = shape(t / 3600.0) + rng.normal(0.0, noise, len(t))
    return t.tolist(), y.tolist()


@pytest.mark.parametrize("seed", range(5))
def test_flat_with_noise_is_flat(seed: int) -> None:
    t, y = series(lambda h: 300.0 + 0 * h, seed=seed)
    g = growth("rss_mb", t, y, warmup_s=WARMUP_S)
    assert not g.leak and g.verdict == "flat"
    assert abs(g.per_h) < 2.0


def test_a_steady_climb_is_a_leak() -> None:
    t, y = series(lambda h: 300.0 + 30.0 * h)  # 10% of the level an hour
    g = growth("rss_mb", t, y, warmup_s=WARMUP_S)
    assert g.leak and g.verdict == "leak"
    assert g.per_h == pytest.approx(30.0, rel=0.1)
    assert g.p < 1e-6 and not g.step_fits_better


def test_a_step_after_warm_up_is_flat() -> None:
    """A cache that fills once an hour in, then stays: a step, not a climb."""
    t, y = series(lambda h: 300.0 + 40.0 * (h > 1.0))
    g = growth("rss_mb", t, y, warmup_s=WARMUP_S)
    assert g.per_h > 0 and g.p < 0.01  # the line alone would call it growth
    assert g.step_fits_better and not g.leak


def test_a_staircase_one_step_per_fault_is_a_leak() -> None:
    """8 fds leaked at every fault (one every 5 minutes): many steps, which a line fits."""
    t, y = series(lambda h: 40.0 + 8.0 * np.floor(h * 12), noise=0.5)
    g = growth("trainer_fds", t, y, warmup_s=WARMUP_S)
    assert g.leak and g.per_h == pytest.approx(96.0, rel=0.1)


def test_growth_small_relative_to_the_level_is_flat() -> None:
    """1 MB an hour on 300 MB: significant, but 0.3% of the level an hour."""
    t, y = series(lambda h: 300.0 + 1.0 * h, noise=0.2)
    g = growth("rss_mb", t, y, warmup_s=WARMUP_S)
    assert g.p < 0.01 and not g.leak


def test_a_climb_during_the_warm_up_only_is_flat() -> None:
    t, y = series(lambda h: 300.0 + 200.0 * np.minimum(h, 0.15))
    assert not growth("rss_mb", t, y, warmup_s=WARMUP_S).leak


def test_a_shrinking_figure_and_a_constant_one_are_flat() -> None:
    t, y = series(lambda h: 300.0 - 50.0 * h)
    down = growth("rss_mb", t, y, warmup_s=WARMUP_S)
    assert down.per_h < 0 and not down.leak
    constant = growth("threads", t, [12.0] * len(t), warmup_s=WARMUP_S)
    assert (constant.per_h, constant.p, constant.leak) == (0.0, 1.0, False)


def test_too_few_samples_after_the_warm_up_are_flat() -> None:
    g = growth("rss_mb", [0.0, 10.0, 700.0, 710.0], [1.0, 2.0, 3.0, 400.0], warmup_s=WARMUP_S)
    assert (g.samples, g.leak) == (2, False)


def test_the_best_step_fits_two_levels_exactly() -> None:
    assert best_step_sse(np.array([1.0, 1.0, 1.0, 5.0, 5.0, 5.0, 5.0])) == pytest.approx(0.0)
    line = np.arange(20.0)
    assert best_step_sse(line) > 0


# -- the sampler --------------------------------------------------------------------------------


def test_the_sampler_counts_this_process_fds_threads_and_children(tmp_path: Path) -> None:
    before = process_tree(os.getpid())
    assert before is not None and before.rss_bytes > 10 * 2**20 and before.threads >= 1
    files = [(tmp_path / f"f{i}").open("w") for i in range(5)]
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        during = process_tree(os.getpid())
        assert during is not None
        assert during.fds >= before.fds + 5  # the files (and the child's own)
        assert during.threads >= before.threads + 2  # the thread, the child's main thread
        assert during.processes == before.processes + 1
        assert during.rss_bytes > before.rss_bytes  # the child's memory is summed in
    finally:
        child.kill()
        child.wait()
        stop.set()
        thread.join()
        for f in files:
            f.close()
    assert process_tree(child.pid) is None  # gone: no sample, no error


def test_disk_bytes_counts_allocated_blocks_below_a_directory(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "big").write_bytes(b"x" * 2**20)
    (tmp_path / "small").write_bytes(b"y" * 10)
    assert 2**20 <= disk_bytes(tmp_path) < 2**20 + 64 * 1024
    assert disk_bytes(tmp_path / "missing") == 0
    assert 0 < disk_bytes(tmp_path / "small") < 64 * 1024  # a file: its own blocks


def test_redis_figures_read_memory_keys_and_stream_lengths(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    try:
        for i in range(7):
            client.xadd("bus", {"i": i})
        client.xadd("bus:dead", {"i": 0})
        client.set("plain", 1)
        for step in range(4):
            client.set(f"run:seeded:{step}", 1)
        figures = redis_figures(client)
        families = key_families(client)
    finally:
        client.close()
    assert figures["keys"] == 7 and figures["used_memory"] > 0
    assert (figures["stream:bus"], figures["stream:bus:dead"]) == (7, 1)
    assert families["run:seeded:#"][0] == 4 and families["bus"][0] == 1
    assert all(size > 0 for _, size in families.values())
