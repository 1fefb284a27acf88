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
from the live entries once as many codes were added as it was sized for; where a removed entry may live on
in the L2 it guards, it grows instead (`grow`), forgetting nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import math
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
    _event = threading.Event

    def __init__(self):
        self._lock = threading.Lock()
        self._calls: dict = {}

    def lead(self, key) -> tuple[bool, Flight]:
        with self._lock:
            fl = self._calls.get(key)
            if fl is not None:
                return False, fl
            fl = self._calls[key] = Flight(self._event())
            return True, fl

    def done(self, key, fl: Flight, error: BaseException | None = None) -> None:
        """The flight is over; its followers get `error` when it is an Exception (the computation failed). A
        cancelled or interrupted leader (asyncio.CancelledError, KeyboardInterrupt) is the leader's own end: its
        followers, whom no one cancelled, look up again and compute for themselves."""
        with self._lock:
            if self._calls.get(key) is fl:
                del self._calls[key]
        fl.error = error if isinstance(error, Exception) else None
        fl.event.set()

    def __len__(self) -> int:
        return len(self._calls)


class AsyncSingleFlight(SingleFlight):
    """The same for coroutines of one event loop (one thread: no lock needed)."""
    _event = asyncio.Event

    def __init__(self):
        super().__init__()
        self._lock = contextlib.nullcontext()


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


#: The most chunk values a lookup may probe: a chunk of w bits probed within f flipped bits is sum C(w, i),
#: i <= f, values (one chunk of 64 bits within 6: 83 million, built as Python ints before the first lookup)
MAX_PROBES = 1 << 16


@functools.lru_cache(maxsize=64)
def probe_masks(bounds: tuple[tuple[int, int], ...], flips: int) -> tuple[tuple[int, ...], ...]:
    """Per chunk, the XOR masks (chunk-local bits) of every way to flip up to `flips` of its bits, 0 first:
    chunk j's probes are value_j ^ mask for each of its masks. More than MAX_PROBES in all: ValueError."""
    n = sum(math.comb(w, i) for _, w in bounds for i in range(flips + 1))
    if n > MAX_PROBES:
        raise ValueError(f"a lookup within this radius probes {n:,} chunk values ({len(bounds)} code chunks, up to "
                         f"{flips} bits flipped in each), over {MAX_PROBES:,}: cut codes into more chunks "
                         f"(cache.bloom_chunks, cache.l2.chunks; the defaults probe few) or search a smaller radius")
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
        self._older: list = []   # the filters `grow` filled, still asked
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
        if self._older:
            return any(self._contains(b, tenant, code) for b in (self._bloom, *self._older))
        return self._contains(self._bloom, tenant, code)

    def _contains(self, bloom, tenant: int, code: bytes) -> bool:
        x = int.from_bytes(code, "little")
        small = tenant < 0x10000
        for j, ((s, w), masks) in enumerate(zip(self.bounds, self._masks)):   # `_key`, inlined: every miss asks
            v = (x >> s) & ((1 << w) - 1)
            for m in masks:
                c = v ^ m
                if ((c << 24) | (j << 16) | (tenant & 0xFFFF) if small else hash((tenant, j, c))) in bloom:
                    return True
        return False

    @property
    def needs_rebuild(self) -> bool:
        return self.added > self.expected_items

    def rebuild(self, items: Iterable[tuple[int, bytes]]) -> None:
        self.clear()
        for tenant, code in items:
            self.add(tenant, code)

    def grow(self) -> None:
        """Room for twice as many codes again, forgetting none added so far (a scalable Bloom filter, Almeida et
        al. 2007): a new filter beside the full ones, at half the false-positive rate of the one before, so the
        rate over them all stays under twice `fp_rate`. For codes whose entries may live on where the filter
        cannot see (the L2 behind a guarding L1), which a rebuild from the live codes would forget."""
        self._older.insert(0, self._bloom)
        self.expected_items *= 2
        self._bloom = self._Bloom(self.expected_items * self.chunks, self.fp_rate / 2 ** len(self._older))
        self.added = 0


# ---------------------------------------------------------------------------------------------- the compute path
# What protects the service behind the cache when it is slow or failing (docs/cache.md, "Failure modes"):
# a filter of the keys that can exist (penetration), serving stale entries (on error, or while one caller
# revalidates), and a circuit breaker on the compute call. The simulator's cache model (ushash.sim.failures)
# uses exactly these objects; callers of a cache can wrap their compute with them.

class KeyFilter:
    """A Bloom filter (rbloom) of the keys that can have an answer (the catalogue: item ids, registered
    prompts): a request for a key the filter has never seen cannot have one and is refused without a
    computation (cache penetration). False positives at `fp_rate`; no false negatives for added keys."""

    def __init__(self, expected_items: int = 100_000, fp_rate: float = 0.01):
        from rbloom import Bloom

        self._bloom = Bloom(max(16, int(expected_items)), float(fp_rate))
        self.added = 0

    def add(self, key) -> None:
        self._bloom.add(key)
        self.added += 1

    def update(self, keys: Iterable) -> None:
        for k in keys:
            self.add(k)

    def __contains__(self, key) -> bool:
        return key in self._bloom


class StalePolicy:
    """When an expired entry may still be served.

    - stale-while-revalidate (`swr_s`): within `swr_s` seconds past its expiry the entry is served at once
      and one background recomputation is started, but only while fewer than `swr_max_inflight`
      computations of this cache are in flight (callers' and refreshes together): a stale entry found
      while the service is that busy is served without starting one, and a later request will;
    - serve-stale-on-error (`stale_if_error_s`): within that long past its expiry the entry is served when
      the computation fails, times out or the breaker is open, instead of an error.
    0 turns either off."""

    def __init__(self, swr_s: float = 0.0, swr_max_inflight: int = 4, stale_if_error_s: float = 0.0):
        if min(swr_s, stale_if_error_s) < 0 or swr_max_inflight < 0:
            raise ValueError("swr_s, swr_max_inflight and stale_if_error_s must be >= 0")
        self.swr_s, self.swr_max_inflight = float(swr_s), int(swr_max_inflight)
        self.stale_if_error_s = float(stale_if_error_s)
        self.revalidating = 0

    def serve_while_revalidating(self, now: float, expires: float) -> bool:
        """An expired entry is served at once (SWR)."""
        return self.swr_s > 0 and expires <= now < expires + self.swr_s

    def may_revalidate(self, in_flight: int = 0) -> bool:
        """A background recomputation may start now, with `in_flight` computations of this cache running
        besides the refreshes (takes one unit of the budget: `revalidated` returns it)."""
        if self.revalidating + int(in_flight) >= self.swr_max_inflight:
            return False
        self.revalidating += 1
        return True

    def revalidated(self) -> None:
        self.revalidating = max(0, self.revalidating - 1)

    def serve_on_error(self, now: float, expires: float) -> bool:
        """An expired entry is served because the computation failed."""
        return self.stale_if_error_s > 0 and now < expires + self.stale_if_error_s


class _Opened:
    """pybreaker listener: the time, on the caller's clock, at which the circuit last opened."""

    def __init__(self, clock):
        self.clock, self.at, self.opens = clock, None, 0

    def before_call(self, cb, func, *args, **kwargs):
        pass

    def success(self, cb):
        pass

    def failure(self, cb, exc):
        pass

    def state_change(self, cb, old_state, new_state):
        import pybreaker

        if new_state.name == pybreaker.STATE_OPEN:
            self.at, self.opens = self.clock(), self.opens + 1


class ComputeBreaker:
    """A circuit breaker on the compute path: pybreaker's state machine (closed -> open after `fail_max`
    consecutive failures -> half-open after `reset_s` -> closed on `success_threshold` successful trial calls,
    open again on a failed one), timed on the caller's clock (the simulator's or time.monotonic), so it
    works in simulated time too. While open, `allow()` is False and the caller takes its fallback (a stale
    entry, or a fast error) instead of loading the service; in half-open one trial call at a time is let
    through. `record(ok)` reports how an allowed call went."""

    def __init__(self, fail_max: int = 5, reset_s: float = 2.0, clock=None):
        import time

        import pybreaker

        self._pb = pybreaker
        self.clock = clock or time.monotonic
        self._opened = _Opened(self.clock)
        self.breaker = pybreaker.CircuitBreaker(fail_max=int(fail_max), reset_timeout=float(reset_s),
                                                listeners=[self._opened], throw_new_error_on_trip=False)
        self.reset_s = float(reset_s)
        self._trial = False
        self.rejected = 0

    @property
    def state(self) -> str:
        return self.breaker.current_state

    @property
    def opens(self) -> int:
        return self._opened.opens

    def allow(self) -> bool:
        pb = self._pb
        st = self.breaker.current_state
        if st == pb.STATE_OPEN:
            if self.clock() < self._opened.at + self.reset_s:
                self.rejected += 1
                return False
            self.breaker.half_open()
            self._trial = False
            st = pb.STATE_HALF_OPEN
        if st == pb.STATE_HALF_OPEN:
            if self._trial:
                self.rejected += 1
                return False
            self._trial = True
        return True

    def record(self, ok: bool) -> None:
        if self.breaker.current_state == self._pb.STATE_OPEN:
            return  # a late answer of a call made before the circuit opened changes nothing

        def outcome():
            if not ok:
                raise _ComputeFailed()

        self._trial = False
        try:
            self.breaker.call(outcome)
        except (_ComputeFailed, self._pb.CircuitBreakerError):
            pass


class _ComputeFailed(Exception):
    pass
