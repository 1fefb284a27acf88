"""Freshness: TTL with jitter, probabilistic early refresh (XFetch), and the model-revision watermark.

TTL with jitter: an entry stored at `now` expires at now + ttl * (1 - jitter * u), u ~ U[0, 1): entries
written together do not expire together (no synchronized stampede), and `ttl_s` stays an upper bound.
Expiry is absolute, never sliding: a hit does not extend an entry's life, so a popular stale answer
cannot live forever.

XFetch (Vattani, Chierichetti, Lowenstein, "Optimal probabilistic cache stampede prevention", VLDB 2015):
a hit on an entry whose recomputation took `delta` seconds asks for an early refresh when

    now - delta * beta * ln(u) >= expiry,   u ~ U(0, 1]

so hot entries are recomputed by one caller shortly before they expire, while everyone else keeps being
served; beta > 1 favours earlier refreshes, beta = 0 disables it.

Revision watermark: every entry carries the revision (``ExportedHead.revision``) of the head that made its
code and payload. A cache serves only entries of its current revision; `RevisionWatermark` is that
revision plus, with an L2, the newest revision any replica has announced (a Redis sorted set of revision
-> its export's creation time). A replica whose revision is no longer the newest is stale: it serves and
stores nothing until it is reloaded with the new export (see docs/cache.md). A `Query` carries the revision
that encoded it, and is looked up and stored only under it, so computes in flight across a `reload()` are
never filed under the new revision with the old head's code.
"""

from __future__ import annotations

import logging
import math
import random
import time
from typing import Callable, Iterator

import numpy as np

from ushash.core.jit import njit
from ushash.serving.cache import heap

log = logging.getLogger("ushash.cache")


#: The shortest time to live an entry is stored with: a shorter one (1e-300 s) expired as it was stored, and the
#: store still said it stored it, after replacing the live entry of the same request with it.
MIN_TTL_S = 0.001


def check_ttl(ttl_s) -> None:
    """A time to live is a finite number of seconds, 0 (no expiry) or at least MIN_TTL_S (NaN would make an
    entry that never expires)."""
    if ttl_s is None:
        return
    if (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or ttl_s < 0
            or 0 < ttl_s < MIN_TTL_S):
        raise ValueError(f"ttl_s must be a finite number of seconds, 0 or None (no expiry) or at least {MIN_TTL_S} "
                         f"(an entry that expires as it is stored is not stored); got {ttl_s!r}")


class Freshness:
    def __init__(self, ttl_s: float | None = 3600.0, jitter: float = 0.1, xfetch_beta: float = 1.0,
                 rng: random.Random | None = None):
        check_ttl(ttl_s)
        if not 0.0 <= float(jitter) < 1.0:
            raise ValueError(f"jitter must be in [0, 1); got {jitter!r}")
        if float(xfetch_beta) < 0:
            raise ValueError(f"xfetch_beta must be >= 0; got {xfetch_beta!r}")
        self.ttl_s = float(ttl_s) if ttl_s else None
        self.jitter, self.xfetch_beta = float(jitter), float(xfetch_beta)
        self.rng = rng or random.Random()

    def expiry(self, now: float, ttl_s: float | None = None) -> float:
        """Absolute expiry (seconds, same clock as `now`) for an entry stored now; inf without a TTL."""
        if ttl_s is not None:
            check_ttl(ttl_s)
        ttl = self.ttl_s if ttl_s is None else (float(ttl_s) if ttl_s else None)
        if ttl is None:
            return math.inf
        return now + ttl * (1.0 - self.jitter * self.rng.random())

    def within(self, life: float | None, ttl_s: float | None = None) -> float | None:
        """The TTL for an answer its origin says stays fresh `life` more seconds (None: it says nothing, and
        `ttl_s` applies): `ttl_s` (None: this Freshness's; 0: no expiry) but no longer than `life`. An answer
        already stale (`life` < MIN_TTL_S) has no TTL to be stored with: a ValueError (0 would mean no expiry)."""
        if life is None:
            return ttl_s
        if not life >= MIN_TTL_S:
            raise ValueError(f"an answer fresh for {life!r} more seconds is stale: it is not stored")
        most = self.ttl_s if ttl_s is None else ttl_s
        return float(life) if not most else min(float(most), float(life))

    def should_refresh(self, now: float, expires: float, compute_s: float) -> bool:
        """XFetch: recompute this hit early? (False without a TTL, a compute time or beta.)"""
        if not math.isfinite(expires) or compute_s <= 0 or self.xfetch_beta <= 0:
            return False
        u = 1.0 - self.rng.random()  # (0, 1]
        return now - compute_s * self.xfetch_beta * math.log(u) >= expires


@njit(cache=True, nogil=True, inline="always")
def _before(exp, slot, i, j):
    """Record i comes due before record j: (expires, slot) in lexicographic order (heapq's tuple order)."""
    return exp[i] < exp[j] or (exp[i] == exp[j] and slot[i] < slot[j])


@njit(cache=True, nogil=True)
def _push_many(exp, slot, n, new_exp, new_slot):
    """Push each record (sift-up) into the binary heap exp/slot [:n] (room checked by the caller); returns n."""
    for t in range(len(new_exp)):
        i = n
        exp[i], slot[i] = new_exp[t], new_slot[t]
        n += 1
        while i > 0:
            p = (i - 1) >> 1
            if not _before(exp, slot, i, p):
                break
            exp[i], exp[p] = exp[p], exp[i]
            slot[i], slot[p] = slot[p], slot[i]
            i = p
    return n


@njit(cache=True, nogil=True)
def _pop_due(exp, slot, n, now, out_exp, out_slot):
    """Pop the records with expires <= now, soonest first, into out_* until they are full; returns (records
    popped, new n)."""
    k = 0
    while n > 0 and k < len(out_exp) and exp[0] <= now:
        out_exp[k], out_slot[k] = exp[0], slot[0]
        k += 1
        n -= 1
        exp[0], slot[0] = exp[n], slot[n]
        i = 0
        while True:   # sift-down
            c = 2 * i + 1
            if c >= n:
                break
            if c + 1 < n and _before(exp, slot, c + 1, c):
                c += 1
            if not _before(exp, slot, c, i):
                break
            exp[i], exp[c] = exp[c], exp[i]
            slot[i], slot[c] = slot[c], slot[i]
            i = c
    return k, n


class ExpiryHeap:
    """Expiries of stored entries, soonest first: (expires, slot); `due(now)` yields the (slot, expires)
    of every record whose expiry has passed, in (expires, slot) order. A record outlives its entry when the
    entry is evicted or replaced, so the caller drops an entry only when it is alive and its own expiry is
    the record's (a later entry in the same slot with the same expiry has expired too: dropping it then is
    what its own record, popped right after, would do).

    A binary min-heap in two arrays (float64 expiries, int32 slots: 12 B a record, against ~90 B for a
    heapq list of (float, int) tuples), sifted by compiled code; the same records come due in the same
    order as from heapq."""

    DUE_BATCH = 256   # records popped per compiled call (the buffers are the heap's own, made once)

    def __init__(self):
        self._exp = np.zeros(16, np.float64)
        self._slot = np.zeros(16, np.int32)
        self._n = 0
        self._out_exp, self._out_slot = np.empty(self.DUE_BATCH, np.float64), np.empty(self.DUE_BATCH, np.int32)

    def _room(self, k: int) -> None:
        if self._n + k <= len(self._exp):
            return
        cap = max(2 * len(self._exp), self._n + k)
        exp, slot = heap.zeros(cap, np.float64), heap.zeros(cap, np.int32)
        exp[: self._n], slot[: self._n] = self._exp[: self._n], self._slot[: self._n]
        freed = self._exp.nbytes + self._slot.nbytes
        self._exp, self._slot = exp, slot
        heap.replaced(freed)

    def push_many(self, expires, slots) -> None:
        """Push a record per (expires, slot) with a finite expiry (slots in [0, 2^31))."""
        e = np.asarray(expires, np.float64).reshape(-1)
        s = np.asarray(slots, np.int64).reshape(-1)
        keep = np.isfinite(e)
        if not keep.all():
            e, s = e[keep], s[keep]
        if not len(e):
            return
        if int(s.min()) < 0 or int(s.max()) >= 1 << 31:
            raise ValueError("expiry records hold slots in [0, 2^31)")
        self._room(len(e))
        self._n = _push_many(self._exp, self._slot, self._n, e, s.astype(np.int32))

    def __len__(self) -> int:
        return self._n

    def replace(self, expires, slots) -> None:
        """Keep only these records (the live entries'): drops those of evicted or replaced entries."""
        self._exp, self._slot, self._n = np.zeros(16, np.float64), np.zeros(16, np.int32), 0
        self.push_many(expires, slots)

    def due(self, now: float) -> Iterator[tuple[int, float]]:
        while self._n and self._exp[0] <= now:
            k, self._n = _pop_due(self._exp, self._slot, self._n, float(now), self._out_exp, self._out_slot)
            yield from zip(self._out_slot[:k].tolist(), self._out_exp[:k].tolist())


def revision_rank(head) -> float | None:
    """The rank of a head's revision in the watermark: when its export was made (ms since the epoch, from
    the manifest's `created`), so that the newest export wins whatever order replicas (re)announce in.
    None for heads without one: they are ranked by the time they are first announced."""
    created = (getattr(head, "manifest", None) or {}).get("created")
    if created:
        from datetime import datetime, timezone

        for form in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):   # to the ms; exports before it: to the second
            try:
                return float(round(datetime.strptime(str(created), form).replace(tzinfo=timezone.utc).timestamp() * 1000))
            except ValueError:
                continue
    return None


class RevisionWatermark:
    """The revision this cache serves and whether a newer one has been announced elsewhere.

    `announce`/`fetch` are callables into the L2 (None without one): announce(revision, rank) registers
    it, fetch() returns (revision, rank) of the newest announced one, (None, None) when none is, or None
    when the L2 cannot be asked. `check()` is cheap: it asks the L2 at most every `check_s` seconds (0:
    on every call).

    The watermark survives the L2 losing its keys (a restart without persistence, FLUSHALL, an
    `allkeys-lru` eviction of the revisions key): ranks are the exports' own creation times, not the
    time of announcing, and every replica remembers the newest (revision, rank) it has seen and announces
    it again whenever the L2 shows an older one or none. So an old replica that starts again first does
    not win: it serves until a replica that knows the newer revision checks (within `check_s`), or one is
    started on it; then it is stale again, whatever the order of restarts.
    """

    def __init__(self, revision: str, rank: float | None = None, check_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.revision = str(revision)
        self.rank = None if rank is None else float(rank)   # None: ranked by when it is first announced
        self.check_s = float(check_s)
        self.clock, self.wall = clock, wall
        self.newest: str | None = self.revision
        self.newest_rank = self.rank if self.rank is not None else -math.inf   # as the L2 last showed it
        self._last = -math.inf
        self._announced = False   # this cache's own revision reached the L2
        self.announce: Callable[[str, float], bool | None] | None = None
        self.fetch: Callable[[], tuple | None] | None = None

    def attach(self, announce: Callable[[str, float], bool | None], fetch: Callable[[], tuple | None]) -> None:
        """`announce` returns False when the L2 could not be told (it is tried again at each refresh: a
        reload during an L2 outage once left the new revision unannounced, and the replica that served it
        stale behind the old one for good)."""
        self.announce, self.fetch = announce, fetch
        self._announce_own()
        self.refresh(force=True)

    def _announce_own(self, below: float | None = None) -> None:
        """Announce this cache's revision: at its rank, for a head without one the time of its first announcement
        (remembered, not taken again); `below` (the rank of a newer revision this replica knows) caps it: an
        older revision announced again after the L2 lost the set must not outrank the newer one."""
        if self.rank is None:
            self.rank = float(int(self.wall() * 1000))
        rank = self.rank if below is None else min(self.rank, math.nextafter(below, -math.inf))
        self._announced = self.announce(self.revision, rank) is not False

    def refresh(self, force: bool = False) -> None:
        if self.fetch is None:
            return
        now = self.clock()
        if not force and now - self._last < self.check_s:
            return
        self._last = now
        if not self._announced:
            self._announce_own()
        top = self.fetch()
        if top is None:  # unknown (L2 down): keep the last view
            return
        rev, rank = top
        if rev is None or (rank, rev) < (self.newest_rank, self.newest):
            # the L2 lost what this replica knows: announce it again (its own revision too, if older)
            if math.isfinite(self.newest_rank):
                self.announce(self.newest, self.newest_rank)
            if self.newest != self.revision:
                self._announce_own(below=self.newest_rank if math.isfinite(self.newest_rank) else None)
            elif not math.isfinite(self.newest_rank):
                self._announce_own()
            return
        if rev != self.newest == self.revision:
            log.warning("model revision %s, newer than this replica's %s, was announced on the shared cache: this "
                        "replica serves and stores nothing until it is reloaded. If %s is another service's model, "
                        "give each service its own l2.prefix (one prefix's revisions are one model's)",
                        rev, self.revision, rev)
        self.newest, self.newest_rank = rev, rank

    @property
    def current(self) -> bool:
        """True while this cache's revision is the newest announced one (it may serve and store)."""
        self.refresh()
        return self.newest is None or self.newest == self.revision
