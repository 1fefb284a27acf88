"""Adaptive TTL: an entry's time to live from the service's P99 latency and the memory pressure.

The design's rule, exactly:

    ttl = base * mem_factor * lat_factor
    mem_factor = max(0.3, 1 - 0.02 * (mem% - 75))
    lat_factor = max(0.2, 1 - max(0, p99_ms - 100) / 500)
    and ttl <= 60 s while mem% >= 85

mem% is GPU memory in use where the cache lives on CUDA (`torch.cuda.mem_get_info`), the process's
resident memory against the machine's (or a given limit) otherwise; p99 the service's latency over a
recent window (`RollingP99`). As written, mem_factor exceeds 1 below 75 % (1.5 at 50 %): an idle machine
keeps entries longer than `base`; `max_factor` (default None: the rule as written) caps it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable


def mem_factor(mem_percent: float) -> float:
    return max(0.3, 1.0 - 0.02 * (float(mem_percent) - 75.0))


def lat_factor(p99_ms: float) -> float:
    return max(0.2, 1.0 - max(0.0, float(p99_ms) - 100.0) / 500.0)


def adaptive_ttl(base_s: float, mem_percent: float, p99_ms: float, cap_s: float = 60.0, cap_at_percent: float = 85.0,
                 max_factor: float | None = None) -> float:
    """The design's TTL for these readings (seconds)."""
    f = mem_factor(mem_percent) * lat_factor(p99_ms)
    if max_factor is not None:
        f = min(f, float(max_factor))
    ttl = float(base_s) * f
    if mem_percent >= cap_at_percent:
        ttl = min(ttl, float(cap_s))
    return ttl


def memory_percent(device: str = "cpu", limit_bytes: int | None = None) -> float:
    """Memory in use, in percent: of the CUDA device's memory for a cuda device, else the process's RSS of
    `limit_bytes` (default: the machine's memory)."""
    if str(device).startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return 100.0 * (total - free) / total
    import psutil

    rss = psutil.Process().memory_info().rss
    total = limit_bytes or psutil.virtual_memory().total
    return 100.0 * rss / total


class RollingP99:
    """The p99 of the latencies recorded in the last `window_s` seconds (0 when none)."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.clock = float(window_s), clock
        self._q: deque = deque()
        self._lock = threading.Lock()   # computations record from many threads while a store reads the p99

    def _drop_old(self, now: float) -> None:
        q = self._q
        while q and q[0][0] < now - self.window_s:
            q.popleft()

    def record(self, seconds: float, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        with self._lock:
            self._q.append((now, float(seconds)))
            self._drop_old(now)   # the window only: bounded even when the p99 is never read

    def p99_ms(self, now: float | None = None) -> float:
        now = self.clock() if now is None else now
        with self._lock:
            self._drop_old(now)
            xs = sorted(x for _, x in self._q)
        if not xs:
            return 0.0
        return 1e3 * xs[min(len(xs) - 1, max(0, int(round(0.99 * (len(xs) - 1)))))]


class AdaptiveTTL:
    """A TTL policy: `ttl()` is the rule's TTL from the current readings of `memory()` (percent) and
    `p99()` (ms). Readings are refreshed at most every `refresh_s` seconds (they cost a system call)."""

    def __init__(self, base_s: float, memory: Callable[[], float], p99: Callable[[], float], cap_s: float = 60.0,
                 cap_at_percent: float = 85.0, max_factor: float | None = None, refresh_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.base_s, self.memory, self.p99 = float(base_s), memory, p99
        self.cap_s, self.cap_at_percent, self.max_factor = float(cap_s), float(cap_at_percent), max_factor
        self.refresh_s, self.clock = float(refresh_s), clock
        self._at, self._ttl = -float("inf"), float(base_s)
        self.last = (0.0, 0.0)

    def ttl(self) -> float:
        now = self.clock()
        if now - self._at >= self.refresh_s:
            mem, p99 = float(self.memory()), float(self.p99())
            self._ttl = adaptive_ttl(self.base_s, mem, p99, self.cap_s, self.cap_at_percent, self.max_factor)
            self._at, self.last = now, (mem, p99)
        return self._ttl
