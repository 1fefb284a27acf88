"""A compact multi-index Hamming range search in numpy + numba: the L1's default CPU index ("mindex").

Codes are cut into m = ceil(bits / 16) chunks of (at most) 16 bits. A code within distance r of a query
agrees with it to within f = r // m bits in at least one chunk (pigeonhole), so a search probes, in each
chunk's table, every chunk value within f bits of the query's, and checks the full distance of the codes
found there. A table is the positions of the indexed codes sorted by that chunk's value (int32 [n]), 32 more
bits of their codes' first 64 beside them (uint32 [n]: the low 32 of the other 48, `_rest`), and the start
of each value's run (int32 [2^16 + 1]): 8 B per code and chunk, 32 B per 64-bit code, against faiss
IndexBinaryMultiHash's ~200 B of hash tables. A probe reads contiguous runs, and the 48 bits it knows there
(the chunk is the run's value) bound each code's distance from below, so only the codes that pass that
bound are read in full (a random access each; on benchmarks/cache_lookup.py's clustered codes at radius 3,
about a third of the run entries a query near stored codes probes, half of those within the radius, and
none of a random query's). A code found through an earlier chunk is skipped in
the later ones (its earlier chunk is within f bits too), so each result is reported once; chunks 0 and 1
are among the 32 bits a run holds for the later chunks, so most of those repeats are skipped unread.

The codes themselves are either the index's own (by position) or, given a `codes` source, the caller's
array of codes by slot (the cache's entry table: one copy of each code in the process, 8 B per 64-bit
code less), read through the position's slot; the tail's codes are then copied into a small array of
their own, so that a scan of the tail reads contiguous rows either way.

The tables are built for the codes at positions [0, nbase); codes added since (the tail, at most
`tail_max` of them) are scanned; when the tail is full it is merged into the tables in place, one
backward pass per chunk moving each entry at most once (the tables grow by doubling, so the heap is not
left fragmented by a fresh copy per merge). Removals are tombstones
(position -> slot -1, checked for the codes within the radius only), and the positions are renumbered
and the tables rebuilt once tombstones outnumber live codes: amortised O(1) per add and per removal. Below `min_entries` codes, and whenever the probes would cost more than a scan (wide
radii), a query is a popcount scan of every code instead.

Results come sorted by (distance, slot) per query, from one compiled call for a whole batch (no Python
per query or per candidate); the popcount is LLVM's ctpop (one instruction on x86-64 with POPCNT).
"""

from __future__ import annotations

from itertools import combinations

import numpy as np
from numba import types
from numba.extending import intrinsic

from ushash.core.jit import njit
from ushash.serving.cache import heap

CHUNK_BITS = 16
NVALUES = 1 << CHUNK_BITS


@intrinsic
def _ctpop(typingctx, x):
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return x(x), codegen


@njit(cache=True, nogil=True, inline="always")
def _dist(codes, pos, q, qi, nwords):
    d = np.int64(0)
    for w in range(nwords):
        d += np.int64(_ctpop(codes[pos, w] ^ q[qi, w]))
    return d


@njit(cache=True, nogil=True, inline="always")
def _chunk(row, arr, j):
    """Chunk j (16 bits) of the code in row `row` of uint64 array `arr`."""
    return np.int64((arr[row, j >> 2] >> np.uint64(16 * (j & 3))) & np.uint64(0xFFFF))


@njit(cache=True, nogil=True, inline="always")
def _rest(w, c):
    """The 48 bits of uint64 word w other than its 16-bit chunk c (0-3), in order (a table stores the low 32
    of them beside a position; the chunk is the run's value)."""
    if c == 3:
        return w & np.uint64(0xFFFFFFFFFFFF)
    lo = w & ((np.uint64(1) << np.uint64(16 * c)) - np.uint64(1))
    return lo | ((w >> np.uint64(16 * (c + 1))) << np.uint64(16 * c))


@njit(cache=True, nogil=True, inline="always")
def _rest32(w, j):
    """What chunk j's table keeps of word w: the low 32 of its other 48 bits (`_rest`)."""
    return _rest(w, j & 3) & np.uint64(0xFFFFFFFF)


@njit(cache=True, nogil=True, inline="always")
def _put_rest(tc, j, at, w):
    """Table entry `at` of chunk j's tables: `_rest32` of word w."""
    tc[j, at] = np.uint32(_rest32(w, j))


@njit(cache=True, nogil=True, inline="always")
def _row(p2s, pos, by_slot):
    """The row of codes that holds position pos's code: its slot (by_slot; row 0 for a tombstone, whose
    slot's code may be another's by now: a tombstone is never emitted), else pos itself."""
    if by_slot:
        return max(p2s[pos], 0)
    return pos


@njit(cache=True, nogil=True, inline="always")
def _emit(out_s, out_d, m, slot, d):
    """Result m (slot, d) unless the slot is a tombstone (-1); written only while the buffers have room
    (the count goes on: the caller calls again with buffers that long). Returns the new count."""
    if slot < 0:
        return m
    if m < len(out_s):
        out_s[m] = slot
        out_d[m] = d
    return m + 1


@njit(cache=True, nogil=True)
def _sort_run(out_s, out_d, a, b):
    """Sort out_[a:b] by (distance, slot): insertion sort for short runs, else argsort of one int64 key."""
    n = b - a
    if n < 2:
        return
    if n <= 32:
        for i in range(a + 1, b):
            s, d = out_s[i], out_d[i]
            j = i - 1
            while j >= a and (out_d[j] > d or (out_d[j] == d and out_s[j] > s)):
                out_s[j + 1] = out_s[j]
                out_d[j + 1] = out_d[j]
                j -= 1
            out_s[j + 1] = s
            out_d[j + 1] = d
        return
    key = np.empty(n, np.int64)
    for i in range(n):
        key[i] = (np.int64(out_d[a + i]) << 40) | out_s[a + i]   # slots < 2^40 (checked on add)
    order = np.argsort(key)
    ts = out_s[a:b].copy()
    td = out_d[a:b].copy()
    for i in range(n):
        out_s[a + i] = ts[order[i]]
        out_d[a + i] = td[order[i]]


@njit(cache=True, nogil=True)
def _search(q, codes, by_slot, tcodes, p2s, n, nbase, offs, ids, tc, masks, nchunks, radius, use_tables, lims,
            out_s, out_d):
    """Every live code within `radius` of each query into (lims [B + 1], out_s, out_d), each query's sorted
    by (distance, slot); returns the number of results, which may exceed the buffers' length (then
    nothing is complete: call again with buffers that long). q, codes, tcodes: uint64 [*, nwords]; the
    code at position pos is row p2s[pos] of codes when by_slot, else row pos; tcodes: the tail's,
    position pos >= nbase at row pos - nbase; positions
    [0, nbase) through the tables (when use_tables), the rest scanned; masks: the chunk-value flips to
    probe (popcount <= radius // nchunks). A table run holds 32 more bits of its codes' first words inline
    (tc, `_rest`), so a probe reads contiguous runs and bounds each code's distance from below by the 48
    bits it knows; only a code within the radius by that bound is read in full (its position's columns and
    its row of codes). (The buffers are the caller's: an array reassigned inside the loop would cost
    reference counting per code.)"""
    nq, nwords = q.shape
    cap = len(out_s)
    f = radius // nchunks
    m = 0
    scan_from = nbase if use_tables else 0
    for qi in range(nq):
        start = m
        if use_tables:
            for j in range(nchunks):
                qv = _chunk(qi, q, j)
                qr = _rest32(q[qi, 0], j)
                for t in range(len(masks)):
                    v = qv ^ masks[t]
                    dm = np.int64(_ctpop(np.uint64(masks[t])))   # the distance in chunk j itself
                    for k in range(offs[j, v], offs[j, v + 1]):
                        # a lower bound: the chunk and 32 of the other bits of word 0
                        r = np.uint64(tc[j, k])
                        if dm + np.int64(_ctpop(r ^ qr)) > radius:
                            continue
                        pos = ids[j, k]
                        row = -1
                        dup = False
                        for i in range(j):   # found through an earlier chunk already
                            if j < 4 and i < 2:   # chunks 0 and 1 sit where they do in r (`_rest`)
                                ci = np.int64((r >> np.uint64(16 * i)) & np.uint64(0xFFFF))
                            else:
                                if row < 0:
                                    row = _row(p2s, pos, by_slot)
                                ci = _chunk(row, codes, i)
                            if _ctpop(ci ^ _chunk(qi, q, i)) <= f:
                                dup = True
                                break
                        if dup:
                            continue
                        if row < 0:
                            row = _row(p2s, pos, by_slot)
                        d = _dist(codes, row, q, qi, nwords)
                        if d > radius:
                            continue
                        m = _emit(out_s, out_d, m, p2s[pos], d)
        for pos in range(scan_from, nbase):   # (a scan instead of the tables: wide radii)
            slot = p2s[pos]
            if slot >= 0:
                d = _dist(codes, slot if by_slot else pos, q, qi, nwords)
                if d <= radius:
                    m = _emit(out_s, out_d, m, slot, d)
        for t in range(n - nbase):   # the tail
            d = _dist(tcodes, t, q, qi, nwords)
            if d <= radius:
                m = _emit(out_s, out_d, m, p2s[nbase + t], d)
        if m <= cap:
            _sort_run(out_s, out_d, start, m)
        lims[qi + 1] = m
    return m


@njit(cache=True, nogil=True)
def _build(codes, by_slot, p2s, n, nchunks, cap):
    """Tables for the live codes at positions [0, n) (the code of position pos: row p2s[pos] of codes when
    by_slot, else row pos): offs int32 [nchunks, 2^16 + 1], ids int32 [nchunks, cap]
    (positions sorted by the chunk's value, the first `live` of each row used) and tc uint32 [nchunks, cap]
    (the low 32 of the other 48 bits of their codes' first words, `_rest`). Returns (offs, ids, tc, live)."""
    live = 0
    for pos in range(n):
        if p2s[pos] >= 0:
            live += 1
    cap = max(cap, live)
    offs = np.zeros((nchunks, NVALUES + 1), np.int32)
    ids = np.zeros((nchunks, cap), np.int32)    # zeros: pages not yet written cost no memory
    tc = np.zeros((nchunks, cap), np.uint32)
    fill = np.empty(NVALUES, np.int32)
    for j in range(nchunks):
        for pos in range(n):
            if p2s[pos] >= 0:
                offs[j, _chunk(p2s[pos] if by_slot else pos, codes, j) + 1] += 1
        for v in range(NVALUES):
            offs[j, v + 1] += offs[j, v]
            fill[v] = offs[j, v]
        for pos in range(n):
            if p2s[pos] >= 0:
                row = p2s[pos] if by_slot else pos
                v = _chunk(row, codes, j)
                ids[j, fill[v]] = pos
                _put_rest(tc, j, fill[v], codes[row, 0])
                fill[v] += 1
    return offs, ids, tc, live


@njit(cache=True, nogil=True)
def _merge(tcodes, p2s, nbase, n, offs, ids, tc, ntab, nchunks):
    """Merge the live codes of the tail [nbase, n) (tcodes: theirs, position pos at row pos - nbase) into
    the tables in place (ids / tc have room for them):
    per chunk one backward pass that moves each old entry at most once, so that each value's run is its
    old run, then the tail's codes of that value in position order. Tombstones already in the tables stay
    until the next rebuild (`compact`). Returns the tables' new length."""
    tail = 0
    for pos in range(nbase, n):
        if p2s[pos] >= 0:
            tail += 1
    if tail == 0:
        return ntab
    tcount = np.zeros(NVALUES + 1, np.int32)
    tpos = np.empty(tail, np.int32)
    tval = np.empty(tail, np.int64)
    fill = np.empty(NVALUES, np.int32)
    for j in range(nchunks):
        tcount[:] = 0
        for pos in range(nbase, n):
            if p2s[pos] >= 0:
                tcount[_chunk(pos - nbase, tcodes, j) + 1] += 1
        for v in range(NVALUES):
            tcount[v + 1] += tcount[v]
            fill[v] = tcount[v]
        for pos in range(nbase, n):   # the tail by value, in position order within a value
            if p2s[pos] >= 0:
                v = _chunk(pos - nbase, tcodes, j)
                tpos[fill[v]] = pos
                tval[fill[v]] = v
                fill[v] += 1
        src = ntab - 1
        dst = ntab + tail - 1
        for t in range(tail - 1, -1, -1):
            lim = offs[j, tval[t] + 1]   # old entries from here on have larger values
            while src >= lim:
                ids[j, dst] = ids[j, src]
                tc[j, dst] = tc[j, src]
                src -= 1
                dst -= 1
            ids[j, dst] = tpos[t]
            _put_rest(tc, j, dst, tcodes[tpos[t] - nbase, 0])
            dst -= 1
        for v in range(NVALUES + 1):
            offs[j, v] += tcount[v]
    return ntab + tail


def flip_masks(width: int, flips: int) -> np.ndarray:
    """Every value of `width` bits with at most `flips` bits set (the chunk probes), as int64."""
    out = [0]
    for k in range(1, min(flips, width) + 1):
        out += [sum(1 << b for b in c) for c in combinations(range(width), k)]
    return np.array(out, np.int64)


class MultiIndex:
    """Positions -> slots, the codes (the index's own by position, or a caller's by slot: `codes`), the
    chunk tables and the tail (module docstring). Slot bookkeeping (slot -> position) is the caller's
    (search.MIndexBackend).

    codes: None (the index keeps its own copy of each code), or a callable returning the caller's current
    uint64 [*, nwords] array of codes by slot (it may be a new array after each call that grows it). With
    one, the caller keeps the code of every slot it has appended (and not removed) at that slot."""

    def __init__(self, bits: int, min_entries: int = 4096, tail_max: int = 4096, codes=None):
        self.bits = int(bits)
        self.nwords = -(-self.bits // 64)
        self.nchunks = -(-self.bits // CHUNK_BITS)
        self.min_entries = int(min_entries)
        self.tail_max = int(tail_max)
        self._source = codes
        self.by_slot = codes is not None
        # own codes by position, or (by slot) the tail's codes, position pos >= nbase at row pos - nbase
        self._codes = np.zeros((16, self.nwords), np.uint64)
        self.p2s = np.full(16, -1, np.int32)   # slots < 2^31 (checked by the backend)
        self.n = 0          # positions used (live + tombstones)
        self.nbase = 0      # positions covered by the tables
        self.offs = self.ids = self.tc = None
        self.ntab = 0       # table entries used (ids / tc have room for more)
        self._masks: dict[int, np.ndarray] = {}

    @property
    def codes(self) -> np.ndarray:
        """The codes the search reads: by slot (the caller's) or by position (the index's own)."""
        return self._source() if self.by_slot else self._codes

    @property
    def tail_codes(self) -> np.ndarray:
        """The tail's codes, position pos >= nbase at row pos - nbase."""
        return self._codes if self.by_slot else self._codes[self.nbase:]

    def words(self, packed: np.ndarray) -> np.ndarray:
        """uint8 [N, bits / 8] -> uint64 [N, nwords] (little-endian, zero-padded)."""
        nb = 8 * self.nwords
        if packed.shape[1] != nb:
            p = np.zeros((len(packed), nb), np.uint8)
            p[:, : packed.shape[1]] = packed
            packed = p
        return np.ascontiguousarray(packed).view("<u8").astype(np.uint64, copy=False)

    def _grow(self, need: int) -> None:
        """Room for `need` positions (and, by slot, for the tail's codes up to position need)."""
        held = need - self.nbase if self.by_slot else need   # rows of _codes needed
        if held > len(self._codes):
            cap = len(self._codes)
            while cap < held:
                cap *= 2
            codes = heap.zeros((cap, self.nwords), np.uint64)   # pages not yet written cost no memory
            used = self.n - self.nbase if self.by_slot else self.n
            codes[:used] = self._codes[:used]
            freed, self._codes = self._codes.nbytes, codes
            heap.replaced(freed)
        cap = len(self.p2s)
        if need <= cap:
            return
        while cap < need:
            cap *= 2
        p2s = heap.zeros(cap, np.int32)
        p2s[: self.n] = self.p2s[: self.n]
        p2s[self.n:] = -1
        freed, self.p2s = self.p2s.nbytes, p2s
        heap.replaced(freed)

    def append(self, slots: np.ndarray, words: np.ndarray) -> np.ndarray:
        """Store codes at fresh positions; returns the positions."""
        k = len(slots)
        self._grow(self.n + k)
        pos = np.arange(self.n, self.n + k, dtype=np.int64)
        at = self.n - self.nbase if self.by_slot else self.n
        self._codes[at : at + k] = words
        self.p2s[self.n : self.n + k] = slots
        self.n += k
        if (self.n - self.nbase >= self.tail_max) if self.offs is not None else (self.n >= self.min_entries):
            self.merge()
        return pos

    def merge(self) -> None:
        if self.offs is None:   # room for a tail beyond the codes there are; more by doubling when needed
            self.offs, self.ids, self.tc, self.ntab = _build(self.codes, self.by_slot, self.p2s, self.n,
                                                                      self.nchunks, self.n + self.tail_max)
        else:
            need = self.ntab + (self.n - self.nbase)
            if need > self.ids.shape[1]:   # room by doubling: few reallocations, so little heap fragmentation
                cap = max(2 * self.ids.shape[1], need)
                ids, tc = (heap.zeros((self.nchunks, cap), dt) for dt in (np.int32, np.uint32))
                ids[:, : self.ntab] = self.ids[:, : self.ntab]
                tc[:, : self.ntab] = self.tc[:, : self.ntab]
                freed = self.ids.nbytes + self.tc.nbytes
                self.ids, self.tc = ids, tc
                heap.replaced(freed)
            self.ntab = _merge(self.tail_codes, self.p2s, self.nbase, self.n, self.offs, self.ids, self.tc,
                               self.ntab, self.nchunks)
        self.nbase = self.n

    def compact(self) -> np.ndarray:
        """Renumber the live codes to positions [0, live), rebuild; returns the live slots in their new order."""
        live = np.flatnonzero(self.p2s[: self.n] >= 0)
        slots = self.p2s[live].copy()
        if self.by_slot:   # no tables below min_entries: every position is the tail's, its codes by position
            if len(live) < self.min_entries:
                codes = heap.zeros((max(16, len(self._codes), len(live)), self.nwords), np.uint64)
                codes[: len(live)] = self._source()[slots]
                self._codes = codes
        else:
            codes = self._codes[live].copy()
            self._codes[: len(live)] = codes
        self.p2s[: len(live)] = slots
        self.p2s[len(live) : self.n] = -1
        self.n = len(live)
        self.offs = self.ids = self.tc = None
        self.nbase = self.ntab = 0
        if self.n >= self.min_entries:
            self.merge()
        return slots

    def masks(self, flips: int) -> np.ndarray:
        m = self._masks.get(flips)
        if m is None:
            m = self._masks[flips] = flip_masks(CHUNK_BITS, flips)
        return m

    def plan(self, radius: int, live: int) -> tuple[np.ndarray, bool]:
        """(probe masks, use the tables) for a search of `radius` among `live` codes."""
        use = self.offs is not None
        masks = self.masks(radius // self.nchunks) if use else self.masks(0)
        if use:
            # probes cost ~ chunks x probes x (run length + 1); a scan ~ every code: take the cheaper
            probes = self.nchunks * len(masks) * (self.nbase / NVALUES + 1.0)
            use = probes < 0.5 * live
        return masks, use

    def search(self, qwords: np.ndarray, radius: int, live: int):
        """(lims, slots, dists) for queries uint64 [B, nwords] (see _search)."""
        masks, use = self.plan(radius, live)
        args = (qwords, self.codes, self.by_slot, self.tail_codes, self.p2s, self.n, self.nbase,
                self.offs if use else _NO_OFFS,
                self.ids if use else _NO_IDS, self.tc if use else _NO_TC, masks,
                self.nchunks, int(radius), use)
        lims = np.zeros(len(qwords) + 1, np.int64)
        cap = max(64, 16 * len(qwords))
        while True:
            out_s, out_d = np.empty(cap, np.int64), np.empty(cap, np.int32)
            m = _search(*args, lims, out_s, out_d)
            if m <= cap:
                return lims, out_s[:m], out_d[:m]
            cap = m

    @property
    def nbytes(self) -> int:
        """Bytes held by the positions' columns (the own codes, or the tail's) and the tables (capacity
        included); a by-slot source's codes are the caller's."""
        t = 0 if self.offs is None else self.offs.nbytes + self.ids.nbytes + self.tc.nbytes
        return self._codes.nbytes + self.p2s.nbytes + t


_NO_OFFS = np.zeros((1, 2), np.int32)
_NO_IDS = np.zeros((1, 0), np.int32)
_NO_TC = np.zeros((1, 0), np.uint32)
