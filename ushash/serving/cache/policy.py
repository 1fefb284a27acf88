"""Eviction policies with a capacity in bytes: LRU, LFU, W-TinyLFU and LRU-K with time decay.

Every policy tracks integer keys (the cache's entry slots) and their sizes in bytes:

    evicted = policy.insert(key, nbytes)   # keys to drop, oldest decision first; may contain `key`
                                           # itself when the policy refuses to admit it (W-TinyLFU)
    policy.access(key)                      # a hit
    policy.remove(key)                      # the cache dropped it (expiry, revision change, replacement)

After `insert` returns, the bytes of the keys still held never exceed `capacity_bytes`.

- "lru", "lfu": cachetools' LRUCache / LFUCache (both O(1); sizes through `getsizeof`), with their
  `popitem` captured to report what they evict. cachetools' LFU counts hits since insertion, with no aging.
- "wtinylfu": theine's Rust core (`theine_core.TlfuCore`: a 1% LRU window, a segmented-LRU main space and
  a count-min-sketch TinyLFU admission filter). It bounds a number of entries, not bytes, and exposes
  no sketch or victim hook; it does expose what it evicts on `set`, including a refused candidate. So an
  entry of `nbytes` occupies ceil(nbytes / slot_bytes) slots (its own key plus "ballast" keys, all touched
  together on a hit), the core holds capacity_bytes // slot_bytes slots, and losing any slot drops the
  whole entry. Bytes held <= slots held * slot_bytes <= capacity. Capacities beyond 2^24 slots use
  coarser slots (slot_bytes = capacity / 2^24). cachebox (the other maintained
  candidate) has LRU/LFU/TTL/RR/FIFO caches but no TinyLFU.
- "lruk": LRU-K with exponential time decay (this module). An entry's score is the decayed count of
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

import cachetools

POLICIES = ("lru", "lfu", "wtinylfu", "lruk")


class Policy:
    name = ""

    def __init__(self, capacity_bytes: int):
        if isinstance(capacity_bytes, bool) or int(capacity_bytes) <= 0:
            raise ValueError(f"capacity_bytes must be a positive int; got {capacity_bytes!r}")
        self.capacity_bytes = int(capacity_bytes)

    def insert(self, key: int, nbytes: int) -> list[int]:
        raise NotImplementedError

    def access(self, key: int) -> None:
        raise NotImplementedError

    def remove(self, key: int) -> None:
        raise NotImplementedError

    @property
    def used_bytes(self) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, key: int) -> bool:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------ cachetools
class _Capturing:
    """Mixin for a cachetools cache: records the keys its `popitem` evicts."""

    def popitem(self):
        key, value = super().popitem()
        self.evicted.append(key)
        return key, value


class _LRU(_Capturing, cachetools.LRUCache):
    pass


class _LFU(_Capturing, cachetools.LFUCache):
    pass


class _CachetoolsPolicy(Policy):
    impl: type

    def __init__(self, capacity_bytes: int):
        super().__init__(capacity_bytes)
        self._c = self.impl(maxsize=self.capacity_bytes, getsizeof=lambda nbytes: nbytes)
        self._c.evicted = []

    def insert(self, key: int, nbytes: int) -> list[int]:
        if nbytes > self.capacity_bytes:
            return [key]
        self._c.evicted = []
        self._c[key] = int(nbytes)
        return self._c.evicted

    def access(self, key: int) -> None:
        if key in self._c:
            self._c[key]  # noqa: B018  (a read is what counts as a reference in cachetools)

    def remove(self, key: int) -> None:
        self._c.pop(key, None)

    @property
    def used_bytes(self) -> int:
        return int(self._c.currsize)

    def __len__(self) -> int:
        return len(self._c)

    def __contains__(self, key: int) -> bool:
        return key in self._c


class LRU(_CachetoolsPolicy):
    name, impl = "lru", _LRU


class LFU(_CachetoolsPolicy):
    name, impl = "lfu", _LFU


# ------------------------------------------------------------------------------------------ W-TinyLFU
class WTinyLFU(Policy):
    """theine_core.TlfuCore over slots of `slot_bytes` (see the module docstring)."""

    name = "wtinylfu"
    MAX_SLOTS_PER_ENTRY = 1 << 12
    MAX_SLOTS = 1 << 24

    def __init__(self, capacity_bytes: int, slot_bytes: int = 64):
        super().__init__(capacity_bytes)
        from theine_core import TlfuCore, spread

        if int(slot_bytes) <= 0:
            raise ValueError(f"slot_bytes must be positive; got {slot_bytes!r}")
        # theine's core grows with its size (about 100 B per slot once used, and a 2^28-slot core fails
        # to allocate), so very large capacities get coarser slots rather than more of them.
        self.slot_bytes = max(int(slot_bytes), -(-self.capacity_bytes // self.MAX_SLOTS))
        self.slots = max(1, self.capacity_bytes // self.slot_bytes)
        self._core = TlfuCore(self.slots)
        self._spread = spread
        self._owner: dict[int, int] = {}          # slot hash -> key
        self._hashes: dict[int, list[int]] = {}   # key -> its slot hashes
        self._bytes: dict[int, int] = {}
        self._used = 0

    def _slot_hashes(self, key: int, nbytes: int) -> list[int]:
        n = max(1, -(-int(nbytes) // self.slot_bytes))
        base = key * self.MAX_SLOTS_PER_ENTRY
        return [self._spread(base + j) for j in range(n)]

    def insert(self, key: int, nbytes: int) -> list[int]:
        n_slots = max(1, -(-int(nbytes) // self.slot_bytes))
        if n_slots > min(self.slots, self.MAX_SLOTS_PER_ENTRY):
            return [key]
        if key in self._hashes:
            self.remove(key)
        hs = self._slot_hashes(key, nbytes)
        for h in hs:
            self._owner[h] = key
        self._hashes[key], self._bytes[key] = hs, int(nbytes)
        self._used += int(nbytes)
        dropped = []
        for h in self._core.set([(h, 0) for h in hs]):
            k = self._owner.get(h)
            if k is not None and k in self._hashes and k not in dropped:
                dropped.append(k)
        for k in dropped:
            self.remove(k)
        return dropped

    def access(self, key: int) -> None:
        hs = self._hashes.get(key)
        if hs:
            self._core.access(hs)

    def remove(self, key: int) -> None:
        hs = self._hashes.pop(key, None)
        if hs is None:
            return
        for h in hs:
            self._core.remove(h)
            self._owner.pop(h, None)
        self._used -= self._bytes.pop(key)

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, key: int) -> bool:
        return key in self._hashes


# ------------------------------------------------------------------------------------------ LRU-K decay
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

    def insert(self, key: int, nbytes: int) -> list[int]:
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


def make_policy(name: str, capacity_bytes: int, clock: Callable[[], float] = time.monotonic, **kw) -> Policy:
    """Build a policy by name ("lru", "lfu", "wtinylfu", "lruk") with its options (slot_bytes, k, half_life_s)."""
    name = str(name).lower()
    if name == "lru":
        _no_options(name, kw)
        return LRU(capacity_bytes)
    if name == "lfu":
        _no_options(name, kw)
        return LFU(capacity_bytes)
    if name == "wtinylfu":
        return WTinyLFU(capacity_bytes, **kw)
    if name == "lruk":
        return LRUKDecay(capacity_bytes, clock=clock, **kw)
    raise ValueError(f"unknown eviction policy {name!r}; choose one of {POLICIES}")


def _no_options(name: str, kw: dict) -> None:
    if kw:
        raise ValueError(f"eviction policy {name!r} takes no options; got {sorted(kw)}")
