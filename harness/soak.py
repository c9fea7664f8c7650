"""The soak bench's sampler and its leak verdict (`bench/soak.py`).

`process_tree` samples a service as its process and every descendant (psutil): RSS, open file
descriptors, threads. `redis_figures`: Redis's `used_memory`, its key count and each stream's
length. `disk_bytes`: the blocks allocated under a directory.

`growth` decides whether a figure leaks from its samples, by a regression, not by eye. After
the warm-up (start-up, first allocations, caches filling), a least-squares line is fitted to
(hours, value). The figure is a leak only when all three hold:

1. the slope is positive and significant: one-sided p < `alpha` (0.01) that it is zero, so
   noise alone flags one flat figure in a hundred at most;
2. it is large relative to the figure's level: more than `rel_per_h` (5%) of the mean value
   after warm-up per hour (the figure would double within a day; levels below 1 count as 1, so
   a stream that is empty most of the time does not leak by one entry);
3. it keeps growing: the line fits the samples better (smaller squared error) than the best
   single step does (two flat levels, the break anywhere). A cache that fills once, a thread
   pool that grows once, a restart that comes back a few MB higher are steps, flat before and
   after; a leak climbs steadily or in many steps (one per fault, per request), which a line
   fits and one step does not.

Samples are autocorrelated (a service's RSS now is its RSS ten seconds ago), so the p-value is
optimistic; rules 2 and 3 are what keep a slow wobble from being called a leak.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import redis
from scipy import stats

ALPHA = 0.01
REL_PER_H = 0.05


@dataclass(frozen=True)
class ProcessSample:
    rss_bytes: int
    fds: int
    threads: int
    processes: int


def process_tree(pid: int) -> ProcessSample | None:
    """The process `pid` and its descendants, summed; None when `pid` is gone (a fault killed
    it between the supervisor's look and this one)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    rss = fds = threads = alive = 0
    for proc in procs:
        try:
            with proc.oneshot():
                rss += proc.memory_info().rss
                fds += proc.num_fds()
                threads += proc.num_threads()
            alive += 1
        except psutil.NoSuchProcess:  # a child that exited meanwhile
            continue
    return ProcessSample(rss, fds, threads, alive) if alive else None


def disk_bytes(path: Path) -> int:
    """Bytes allocated (st_blocks) under `path` (a directory, or a file), files vanishing
    meanwhile skipped."""
    if not path.is_dir():
        try:
            return path.stat().st_blocks * 512
        except OSError:
            return 0
    total = 0
    stack = [str(path)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                else:
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
            except OSError:
                continue
    return total


def redis_figures(client: redis.Redis) -> dict[str, float]:
    """`used_memory` (bytes), the key count and each stream's length (`stream:<key>`)."""
    figures: dict[str, float] = {
        "used_memory": float(client.info("memory")["used_memory"]),  # type: ignore[index]
        "keys": float(client.dbsize()),  # type: ignore[arg-type]
    }
    for key in client.scan_iter(_type="stream", count=1000):
        name = key.decode() if isinstance(key, bytes) else str(key)
        figures[f"stream:{name}"] = float(client.xlen(name))  # type: ignore[arg-type]
    return figures


def key_families(client: redis.Redis, limit: int = 100_000) -> dict[str, tuple[int, int]]:
    """Key count and bytes (`MEMORY USAGE`) by family, each key with its digit-only parts as
    `#`: what a growing key count or `used_memory` is made of."""
    families: dict[str, tuple[int, int]] = {}
    for i, key in enumerate(client.scan_iter(count=1000)):
        if i >= limit:
            break
        name = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
        family = ":".join("#" if part.isdigit() else part for part in name.split(":"))
        count, size = families.get(family, (0, 0))
        families[family] = (count + 1, size + int(client.memory_usage(key) or 0))  # type: ignore[arg-type]
    return families


@dataclass(frozen=True)
class Growth:
    figure: str
    samples: int  # after the warm-up
    level: float  # their mean
    per_h: float  # the fitted slope, per hour
    p: float  # one-sided: that the slope is not above zero
    step_fits_better: bool
    leak: bool

    @property
    def rel_per_h(self) -> float:
        return self.per_h / max(abs(self.level), 1.0)

    @property
    def verdict(self) -> str:
        return "leak" if self.leak else "flat"


def best_step_sse(y: np.ndarray) -> float:
    """The squared error of the best fit by two flat levels (one break, each side >= 2)."""
    n = len(y)
    if n < 4:
        return math.inf
    c1, c2 = np.cumsum(y), np.cumsum(y * y)
    k = np.arange(2, n - 1)  # left side y[:k], right side y[k:]
    left = c2[k - 1] - c1[k - 1] ** 2 / k
    right_sum, right_sq = c1[-1] - c1[k - 1], c2[-1] - c2[k - 1]
    right = right_sq - right_sum**2 / (n - k)
    return float(np.min(left + right))


def growth(
    figure: str,
    times_s: list[float],
    values: list[float],
    *,
    warmup_s: float,
    alpha: float = ALPHA,
    rel_per_h: float = REL_PER_H,
    min_samples: int = 8,
) -> Growth:
    """The figure's growth per hour after `warmup_s` (from its first sample) and whether it is
    a leak by the module docstring's rule. Too few samples: flat, p = 1."""
    t = np.asarray(times_s, dtype=float)
    y = np.asarray(values, dtype=float)
    keep = t >= (t.min() + warmup_s if len(t) else 0.0)
    t, y = t[keep], y[keep]
    if len(y) < min_samples or np.ptp(t) == 0:
        level = float(y.mean()) if len(y) else 0.0
        return Growth(figure, len(y), level, 0.0, 1.0, False, False)
    level = float(y.mean())
    if np.ptp(y) == 0:  # constant: nothing to fit
        return Growth(figure, len(y), level, 0.0, 1.0, False, False)
    hours = (t - t[0]) / 3600.0
    fit = stats.linregress(hours, y)
    slope = float(fit.slope)
    p = float(fit.pvalue) / 2 if slope > 0 else 1.0 - float(fit.pvalue) / 2
    line_sse = float(np.sum((y - (fit.intercept + slope * hours)) ** 2))
    step_better = best_step_sse(y) <= line_sse
    large = slope > rel_per_h * max(abs(level), 1.0)
    leak = slope > 0 and p < alpha and large and not step_better
    return Growth(figure, len(y), level, slope, p, step_better, leak)
