"""LRU-K: LRU-K with exponential time decay (this module). An entry's score is the decayed count of
its last K references, sum_i 2^(-(now - t_i) / half_life); the lowest score is evicted. Because
every score decays by the same factor, the ranking is kept as log(sum_i 2^(t_i / half_life)), which
never changes unless the entry is referenced, so a lazy min-heap suffices. half_life -> 0 gives LRU;
half_life -> inf gives "fewest of the last K references" (LFU capped at K); entries referenced once
lose to ones referenced K times unless they are about a half-life newer (LRU-K's scan resistance).
"""

from __future__ import annotations

import heapq
import math
import time
from typing import Callable

from ushash.serving.cache.policies import POLICIES, Policy


@POLICIES.register("lruk")
class LRUKDecay(Policy):
    """LRU-K with exponential time decay (see the module docstring). `clock` returns seconds."""

    name = "lruk"

    def __init__(self, capacity_bytes: int, k: int = 2, half_life_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(capacity_bytes)
        if int(k) < 1:
            raise ValueError(f"k must be >= 1; got {k!r}")
        if not float(half_life_s) > 0:
            raise ValueError(f"half_life_s must be > 0; got {half_life_s!r}")
        self.k, self.half_life_s, self.clock = int(k), float(half_life_s), clock
        self._t0 = clock()
        self._hist: dict[int, list[float]] = {}   # key -> last k reference times (exponent units), oldest first
        self._score: dict[int, float] = {}
        self._bytes: dict[int, int] = {}
        self._heap: list[tuple[float, int]] = []
        self._used = 0

    def _exponent(self) -> float:
        return (self.clock() - self._t0) / self.half_life_s * math.log(2.0)

    @staticmethod
    def _lse(xs: list[float]) -> float:
        m = max(xs)
        return m + math.log(sum(math.exp(x - m) for x in xs))

    def score(self, key: int) -> float:
        """log2-free ranking score: log(sum_i e^(lambda t_i)); larger is more valuable."""
        return self._score[key]

    def _touch(self, key: int) -> None:
        h = self._hist[key]
        h.append(self._exponent())
        if len(h) > self.k:
            del h[0]
        s = self._lse(h)
        self._score[key] = s
        heapq.heappush(self._heap, (s, key))
        if len(self._heap) > 4 * len(self._score) + 64:
            self._heap = [(s, k) for k, s in self._score.items()]
            heapq.heapify(self._heap)

    def insert(self, key: int, nbytes: int, ident: int | None = None) -> list[int]:
        if nbytes > self.capacity_bytes:
            return [key]
        if key in self._hist:
            self.remove(key)
        self._hist[key], self._bytes[key] = [], int(nbytes)
        self._used += int(nbytes)
        self._touch(key)
        evicted = []
        while self._used > self.capacity_bytes:
            s, k = heapq.heappop(self._heap)
            if self._score.get(k) != s:
                continue  # stale heap record
            if k == key and len(self._score) > 1:
                # The newcomer is the least valuable entry: LRU-K evicts among the others first
                # (an entry referenced once is always evictable later, when it is no longer newest).
                heapq.heappush(self._heap, (s, k))
                k = self._min_other(key)
            self.remove(k)
            evicted.append(k)
        return evicted

    def _min_other(self, key: int) -> int:
        skipped, out = [], None
        while self._heap:
            s, k = heapq.heappop(self._heap)
            if self._score.get(k) != s:
                continue
            skipped.append((s, k))
            if k != key:
                out = k
                break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return out

    def access(self, key: int) -> None:
        if key in self._hist:
            self._touch(key)

    def remove(self, key: int) -> None:
        if self._hist.pop(key, None) is None:
            return
        self._score.pop(key)
        self._used -= self._bytes.pop(key)

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._hist)

    def __contains__(self, key: int) -> bool:
        return key in self._hist
