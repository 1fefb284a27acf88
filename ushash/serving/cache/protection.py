"""Protection of the backend behind the cache: single-flight and a Bloom filter of what exists.

Single-flight: N concurrent misses on the same key compute once. The first caller (the leader) computes
and stores; the others wait for it and then look up again, so each follower's own checks (payload cosine,
tenant, revision) still decide whether it is served; a follower that still misses, or whose wait timed
out, computes for itself; a leader's error is raised in its followers too (they do not all retry at
once). `SingleFlight` is for threads, `AsyncSingleFlight` for one asyncio event loop; both hand out a
`Flight`, and the cache makes one decision for both (cache.py). A compute that asks for its own key is
refused at once (`leading`: the keys the current thread or task leads), not left waiting for itself.

Bloom filter (rbloom): "requests known to have no entry". A request can only have an entry within
Hamming radius r if, splitting codes into m chunks, one of its chunks is within floor(r / m) bits of the
entry's chunk (pigeonhole). The filter holds (tenant, chunk index, chunk value) of every stored code; a
request none of whose probes is in the filter has no entry, and the cache answers "miss" without
searching (or asking the L2, when `guard_l2`). No false negatives for codes it was told about; false
positives at `fp_rate` and from removed entries (a Bloom filter cannot delete), so the filter is rebuilt
from the live entries once as many codes were added as it was sized for.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from itertools import combinations
from typing import Iterable

#: the single-flight keys the current thread or task is computing as the leader (a compute that asks for
#: one of them would wait for itself)
leading: contextvars.ContextVar[frozenset] = contextvars.ContextVar("ushash_singleflight_leading", default=frozenset())


class Flight:
    """One computation in flight: `event` is set when the leader is done; `error` is what it raised."""
    __slots__ = ("event", "error")

    def __init__(self, event):
        self.event, self.error = event, None


class SingleFlight:
    """Per-key leader election for threads: `lead(key)` -> (is_leader, Flight)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls: dict = {}

    def lead(self, key) -> tuple[bool, Flight]:
        with self._lock:
            fl = self._calls.get(key)
            if fl is not None:
                return False, fl
            fl = self._calls[key] = Flight(threading.Event())
            return True, fl

    def done(self, key, fl: Flight, error: BaseException | None = None) -> None:
        with self._lock:
            if self._calls.get(key) is fl:
                del self._calls[key]
        fl.error = error
        fl.event.set()

    def __len__(self) -> int:
        return len(self._calls)


class AsyncSingleFlight:
    """The same for coroutines of one event loop."""

    def __init__(self):
        self._calls: dict = {}

    def lead(self, key) -> tuple[bool, Flight]:
        fl = self._calls.get(key)
        if fl is not None:
            return False, fl
        fl = self._calls[key] = Flight(asyncio.Event())
        return True, fl

    def done(self, key, fl: Flight, error: BaseException | None = None) -> None:
        if self._calls.get(key) is fl:
            del self._calls[key]
        fl.error = error
        fl.event.set()

    def __len__(self) -> int:
        return len(self._calls)


# ---------------------------------------------------------------------------------------------- pigeonhole chunks
# An entry within Hamming radius r of a request, codes cut into m chunks, has a chunk within floor(r / m)
# bits of the request's (pigeonhole). The Bloom guard and the L2's bucket keys both probe those chunk values.

def chunk_bounds(bits: int, chunks: int) -> tuple[tuple[int, int], ...]:
    """((start, width), ...) of `chunks` contiguous bit ranges covering `bits` (widths differ by at most 1)."""
    edges = [round(i * bits / chunks) for i in range(chunks + 1)]
    return tuple((a, b - a) for a, b in zip(edges[:-1], edges[1:]))


def chunk_values(code_int: int, bounds) -> list[int]:
    """The value of each chunk of a code given as an int (bit i of the code is bit i of the int: the
    LSB-first packing of ushash.core.codes read little-endian)."""
    return [(code_int >> s) & ((1 << w) - 1) for s, w in bounds]


@functools.lru_cache(maxsize=64)
def probe_masks(bounds: tuple[tuple[int, int], ...], flips: int) -> tuple[tuple[int, ...], ...]:
    """Per chunk, the XOR masks (chunk-local bits) of every way to flip up to `flips` of its bits, 0 first:
    chunk j's probes are value_j ^ mask for each of its masks."""
    out = []
    for _, width in bounds:
        masks = [0]
        for f in range(1, flips + 1):
            masks += [sum(1 << i for i in c) for c in combinations(range(width), f)]
        out.append(tuple(masks))
    return tuple(out)


def default_chunks(bits: int, radius: int) -> int:
    """radius + 1 chunks (one probe each) as long as chunks keep >= 16 bits (selective enough)."""
    return max(1, min(int(radius) + 1, bits // 16))


class BloomGuard:
    """An rbloom filter over (tenant, chunk j, chunk value) of stored codes (see the module docstring)."""

    def __init__(self, bits: int, radius: int, expected_items: int = 100_000, fp_rate: float = 0.01,
                 chunks: int | None = None):
        from rbloom import Bloom

        self._Bloom = Bloom
        self.bits = int(bits)
        self.chunks = int(chunks) if chunks else default_chunks(self.bits, radius)
        if not 1 <= self.chunks <= self.bits:
            raise ValueError(f"bloom chunks must be in [1, bits={self.bits}]; got {self.chunks}")
        self.bounds = chunk_bounds(self.bits, self.chunks)
        self.expected_items = max(16, int(expected_items))
        self.fp_rate = float(fp_rate)
        self.set_radius(radius)
        self.clear()

    def clear(self) -> None:
        self._bloom = self._Bloom(self.expected_items * self.chunks, self.fp_rate)
        self.added = 0

    def set_radius(self, radius: int) -> None:
        self.radius = int(radius)
        self.flips = self.radius // self.chunks
        self._masks = probe_masks(self.bounds, self.flips)

    def _key(self, tenant: int, j: int, chunk: int) -> int:
        return (chunk << 24) | (j << 16) | (tenant & 0xFFFF) if tenant < 0x10000 else hash((tenant, j, chunk))

    def add(self, tenant: int, code: bytes) -> None:
        for j, v in enumerate(chunk_values(int.from_bytes(code, "little"), self.bounds)):
            self._bloom.add(self._key(tenant, j, v))
        self.added += 1

    def may_contain(self, tenant: int, code: bytes) -> bool:
        """False only if no stored code of `tenant` can be within `radius` of `code`."""
        bloom = self._bloom
        for j, (v, masks) in enumerate(zip(chunk_values(int.from_bytes(code, "little"), self.bounds), self._masks)):
            for m in masks:
                if self._key(tenant, j, v ^ m) in bloom:
                    return True
        return False

    @property
    def needs_rebuild(self) -> bool:
        return self.added > self.expected_items

    def rebuild(self, items: Iterable[tuple[int, bytes]]) -> None:
        self.clear()
        for tenant, code in items:
            self.add(tenant, code)
