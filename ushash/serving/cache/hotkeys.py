"""Hot keys: heavy hitters over a sliding window, and the hotness-freshness score.

`HotKeys` counts requests per key in `buckets` time buckets covering the last `window_s` seconds (a
bucket older than the window is dropped whole, so the window slides by window_s / buckets). Each bucket
keeps at most `max_keys` counters (Space-Saving: a new key beyond that takes the smallest counter's place
and inherits its count, an over-estimate by at most that count), so memory is bounded whatever the key
space. `top(n)` gives the heaviest keys of the window, `share(n)` the part of the window's requests they
take.

Hotness-freshness score (the design): S = alpha * sigmoid(H) + (1 - alpha) * exp(-dt / tau), H the key's
hotness (here ln of its window count over the mean count of the keys seen in the window: 0 for an average
key, > 0 for a hot one), dt the age of its cached answer (seconds since it was computed), tau a freshness
time scale. A high S is hot and fresh: keep it (eviction drops the lowest S first) and refresh it before it
expires (the higher S of two due entries is refreshed first).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Callable, Hashable


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def hotness_freshness(h: float, age_s: float, alpha: float = 0.5, tau_s: float = 300.0) -> float:
    """S = alpha * sigmoid(H) + (1 - alpha) * exp(-dt / tau)."""
    return alpha * sigmoid(h) + (1.0 - alpha) * math.exp(-max(0.0, float(age_s)) / float(tau_s))


class HotKeys:
    def __init__(self, window_s: float = 60.0, buckets: int = 6, max_keys: int = 10_000,
                 clock: Callable[[], float] = time.monotonic):
        if buckets < 1 or window_s <= 0:
            raise ValueError("window_s must be > 0 and buckets >= 1")
        self.window_s, self.buckets, self.max_keys, self.clock = float(window_s), int(buckets), int(max_keys), clock
        self.width = self.window_s / self.buckets
        self._b: deque = deque()   # (bucket index, {key: count})
        self._lock = threading.Lock()   # lookups record from many threads while a scrape reads the counts

    def _slide(self, now: float) -> int:
        idx = int(math.floor(now / self.width))
        while self._b and self._b[0][0] <= idx - self.buckets:
            self._b.popleft()
        return idx

    def record(self, key: Hashable, n: int = 1, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        with self._lock:
            idx = self._slide(now)
            if not self._b or self._b[-1][0] != idx:
                self._b.append((idx, {}))
            c = self._b[-1][1]
            if key in c or len(c) < self.max_keys:
                c[key] = c.get(key, 0) + n
            else:  # Space-Saving: replace the smallest counter
                k_min = min(c, key=c.get)
                c[key] = c.pop(k_min) + n

    def counts(self, now: float | None = None) -> dict:
        now = self.clock() if now is None else now
        out: dict = {}
        with self._lock:
            self._slide(now)
            for _, c in self._b:
                for k, v in c.items():
                    out[k] = out.get(k, 0) + v
        return out

    def count(self, key: Hashable, now: float | None = None) -> int:
        now = self.clock() if now is None else now
        with self._lock:
            self._slide(now)
            return sum(c.get(key, 0) for _, c in self._b)

    def top(self, n: int = 10, now: float | None = None) -> list[tuple]:
        """The n heaviest keys of the window, [(key, count)], heaviest first (ties by key order of arrival)."""
        c = self.counts(now)
        return sorted(c.items(), key=lambda kv: -kv[1])[:n]

    def share(self, n: int = 10, now: float | None = None) -> float:
        c = self.counts(now)
        total = sum(c.values())
        return sum(v for _, v in sorted(c.items(), key=lambda kv: -kv[1])[:n]) / total if total else 0.0

    def hotness(self, key: Hashable, now: float | None = None) -> float:
        """H = ln(count of the key in the window / mean count of the window's keys); -inf for an unseen key."""
        c = self.counts(now)
        if not c or key not in c:
            return -math.inf
        return math.log(c[key] / (sum(c.values()) / len(c)))

    def score(self, key: Hashable, age_s: float, alpha: float = 0.5, tau_s: float = 300.0,
              now: float | None = None) -> float:
        return hotness_freshness(self.hotness(key, now), age_s, alpha, tau_s)


class HotKeysCollector:
    """Prometheus series of a HotKeys window, rendered at scrape time: cache_hot_key_requests{rank} (the
    window's request count of the n heaviest keys, rank 1 the heaviest; keys themselves are not labels:
    unbounded cardinality) and cache_hot_keys_share (the part of the window's requests they take)."""

    def __init__(self, hot: HotKeys, n: int = 10):
        self.hot, self.n = hot, int(n)

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        c = self.hot.counts()
        top = sorted(c.values(), reverse=True)[: self.n]
        total = sum(c.values())
        g = GaugeMetricFamily("cache_hot_key_requests", "Requests in the hot-key window of the n heaviest keys",
                              labels=["rank"])
        for i, v in enumerate(top):
            g.add_metric([str(i + 1)], v)
        yield g
        s = GaugeMetricFamily("cache_hot_keys_share", "Share of the window's requests taken by the n heaviest keys")
        s.add_metric([], sum(top) / total if total else 0.0)
        yield s
