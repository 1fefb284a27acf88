"""W-TinyLFU (Einziger, Friedman, Manes, "TinyLFU: A Highly Efficient Cache Admission Policy", 2017; the
layout of Caffeine) with a capacity in bytes, its state in numpy arrays:

- a window LRU (`window` of the bytes, default 1%) that every new entry enters;
- a segmented LRU main space: probation, and protected (`protected` of the main bytes, default 80%); a
  hit in probation promotes to protected, protected overflow is demoted to probation's MRU end;
- admission: when the window overflows, its LRU entries become candidates for the main space; while the
  cache is over capacity, a candidate evicts probation's LRU entry (the victim) only if the frequency
  sketch counts the candidate more often than the victim, else the candidate is dropped. Ties keep the
  victim. No random admission (Caffeine admits warm candidates at random against hash flooding): a
  replay of the same calls gives the same evictions.
- the frequency sketch: a count-min sketch of 4-bit saturating counters (4 hashes), two to a byte (counter
  j in the low nibble of byte j // 2 for even j, the high one for odd j), halved every 10 x width
  increments (aging); its width follows the number of entries held (a power of two >= 2x the
  entries, reset when it grows), not the configured capacity, so a small cache in a large budget stays
  small. It counts an entry's `ident`: bound to an entry table (`bind_idents`, what the L1 does), the
  ident is derived from the slot's row when needed, `request_ident` of its code and tenant (so a request
  stored again is known), and nothing is held per entry for it; unbound, the ident given to `insert` is
  held (8 B per entry), or the key when none is given.

Per entry: two int32 links, a segment byte and its size (uint16 while entries are under 64 KiB), ~11 B
(+ 8 B of ident when unbound), plus 1-2 B of sketch.
Entries of any size up to the capacity are stored.
"""

from __future__ import annotations

import numpy as np
from ushash.core.jit import njit

from ushash.serving.cache import heap
from ushash.serving.cache.policies import POLICIES, Policy

_NONE, _WINDOW, _PROBATION, _PROTECTED = 0, 1, 2, 3
_MASK = (1 << 64) - 1
_M1, _M2, _M3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0x632BE59BD9B4E019), np.uint64(0xBF58476D1CE4E5B9)
_K = 0x9E3779B97F4A7C15


def request_ident(code: bytes, tenant: int) -> int:
    """A request's identity for the sketch: its code (only its first 8 bytes matter, little-endian) and
    tenant id."""
    return (int.from_bytes(code, "little") * _K + int(tenant)) & _MASK


@njit(cache=True, nogil=True, inline="always")
def _nb_ident(ident, codes, tenant, bound, k):
    """Key k's ident: held (`ident[k]`), or bound: `request_ident` of row k of codes and tenant."""
    if not bound:
        return ident[k]
    c = np.uint64(0)
    for b in range(min(8, codes.shape[1])):
        c |= np.uint64(codes[k, b]) << np.uint64(8 * b)
    return c * _M1 + np.uint64(tenant[k])


# A hit (`access`) is the hot path of every lookup: compiled, on the same arrays and with the same
# arithmetic as the Python methods below (uint64 wraps as the masked Python ints do).
@njit(cache=True, nogil=True)
def _nb_increment(table, ident, additions):
    """`_Sketch.increment`: the same counters (two to a byte) and the same aging, compiled."""
    width = np.uint64(2 * len(table))
    h = ident * _M1 + _M2
    h ^= h >> np.uint64(29)
    h = h * _M3
    h ^= h >> np.uint64(32)
    step = (h >> np.uint64(17)) | np.uint64(1)
    w = width - np.uint64(1)
    for i in range(4):
        j = (h + np.uint64(i) * step) & w
        b = j >> np.uint64(1)
        sh = np.uint8(4 * (j & np.uint64(1)))
        if (table[b] >> sh) & np.uint8(15) < 15:
            table[b] += np.uint8(1) << sh
    additions += 1
    if additions >= 10 * 2 * len(table):
        for b in range(len(table)):
            table[b] = (table[b] >> np.uint8(1)) & np.uint8(0x77)   # each nibble halved
        additions //= 2
    return additions


@njit(cache=True, nogil=True, inline="always")
def _nb_link(prev, nxt, segs, size, head, tail, nbytes, seg, k):
    t = tail[seg]
    prev[k], nxt[k], segs[k] = t, -1, seg
    if t >= 0:
        nxt[t] = k
    else:
        head[seg] = k
    tail[seg] = k
    nbytes[seg] += size[k]


@njit(cache=True, nogil=True, inline="always")
def _nb_unlink(prev, nxt, segs, size, head, tail, nbytes, k):
    seg = segs[k]
    p, n = prev[k], nxt[k]
    if p >= 0:
        nxt[p] = n
    else:
        head[seg] = n
    if n >= 0:
        prev[n] = p
    else:
        tail[seg] = p
    segs[k] = _NONE
    nbytes[seg] -= size[k]
    return seg


@njit(cache=True, nogil=True)
def _nb_access(keys, prev, nxt, segs, size, ident, codes, tenant, bound, head, tail, nbytes, protected_bytes, table,
               additions):
    """`WTinyLFU.access` of each key in turn; returns the sketch's additions count."""
    for key in keys:
        if key < 0 or key >= len(segs) or segs[key] == _NONE:
            continue
        additions = _nb_increment(table, _nb_ident(ident, codes, tenant, bound, key), additions)
        seg = _nb_unlink(prev, nxt, segs, size, head, tail, nbytes, key)
        if seg == _WINDOW:
            _nb_link(prev, nxt, segs, size, head, tail, nbytes, _WINDOW, key)
            continue
        _nb_link(prev, nxt, segs, size, head, tail, nbytes, _PROTECTED, key)
        while nbytes[_PROTECTED] > protected_bytes and head[_PROTECTED] != key:
            d = head[_PROTECTED]
            _nb_unlink(prev, nxt, segs, size, head, tail, nbytes, d)
            _nb_link(prev, nxt, segs, size, head, tail, nbytes, _PROBATION, d)
    return additions


_NO_IDENT, _NO_CODES, _NO_TENANT = np.zeros(1, np.uint64), np.zeros((1, 1), np.uint8), np.zeros(1, np.uint8)


class _Sketch:
    """Count-min sketch, 4 rows folded into one table of `width` 4-bit counters (two to a byte: counter j
    in byte j // 2, the low nibble for even j), saturating at 15."""

    def __init__(self, width: int = 64):
        self.width = int(width)
        self.table = np.zeros(self.width // 2, np.uint8)
        self.additions = 0

    def _index(self, ident: int) -> list[int]:
        h = (ident * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK
        h ^= h >> 29
        h = (h * 0xBF58476D1CE4E5B9) & _MASK
        h ^= h >> 32
        step = (h >> 17) | 1
        w = self.width - 1
        return [(h + i * step) & w for i in range(4)]

    def counter(self, j: int) -> int:
        return (int(self.table[j >> 1]) >> (4 * (j & 1))) & 15

    def frequency(self, ident: int) -> int:
        return min(self.counter(i) for i in self._index(ident))

    def increment(self, ident: int) -> None:
        t = self.table
        for i in self._index(ident):
            if self.counter(i) < 15:
                t[i >> 1] += 1 << (4 * (i & 1))
        self.additions += 1
        if self.additions >= 10 * self.width:
            t >>= 1
            t &= 0x77   # each nibble halved
            self.additions //= 2

    def ensure(self, entries: int) -> None:
        if 2 * entries > self.width:
            self.width = 1 << max(6, (2 * entries - 1).bit_length())
            self.table = heap.zeros(self.width // 2, np.uint8)
            self.additions = 0


@POLICIES.register("wtinylfu")
class WTinyLFU(Policy):
    """W-TinyLFU over byte sizes (see the module docstring)."""

    name = "wtinylfu"
    #: entry sizes are held in the first of these dtypes, each until an entry's size reaches its limit
    SIZE_DTYPES = ((np.uint16, 1 << 16), (np.uint32, 1 << 32), (np.int64, None))

    def __init__(self, capacity_bytes: int, window: float = 0.01, protected: float = 0.8):
        super().__init__(capacity_bytes)
        if not 0.0 < float(window) < 1.0:
            raise ValueError(f"window must be in (0, 1); got {window!r}")
        if not 0.0 < float(protected) < 1.0:
            raise ValueError(f"protected must be in (0, 1); got {protected!r}")
        self.window_bytes = max(1, int(self.capacity_bytes * float(window)))
        self.protected_bytes = max(1, int((self.capacity_bytes - self.window_bytes) * float(protected)))
        self.sketch = _Sketch()
        cap = 64
        self._prev = np.full(cap, -1, np.int32)
        self._next = np.full(cap, -1, np.int32)
        self._seg = np.zeros(cap, np.int8)
        self._size = np.zeros(cap, self.SIZE_DTYPES[0][0])   # wider once an entry reaches its limit (insert)
        self._size_level = 0
        self._ident = np.zeros(cap, np.uint64)   # unbound only (bind_idents drops it)
        self._rows = None                         # bound: the entry table whose rows give the idents
        self._head = np.full(4, -1, np.int64)   # per segment: LRU end
        self._tail = np.full(4, -1, np.int64)   # per segment: MRU end
        self._bytes = np.zeros(4, np.int64)
        self._n = 0

    # ------------------------------------------------------------------ lists
    def _grow(self, key: int) -> None:
        cap = len(self._seg)
        if key < cap:
            return
        new = max(2 * cap, key + 1)
        freed = 0
        for name, fill in (("_prev", -1), ("_next", -1), ("_seg", 0), ("_size", 0), ("_ident", 0)):
            old = getattr(self, name)
            if old is None:
                continue
            a = heap.zeros(new, old.dtype)
            a[:cap] = old
            if fill:
                a[cap:] = fill
            setattr(self, name, a)
            freed += old.nbytes
        heap.replaced(freed)

    def _link(self, seg: int, k: int) -> None:
        """Append k at seg's MRU end."""
        t = int(self._tail[seg])
        self._prev[k], self._next[k], self._seg[k] = t, -1, seg
        if t >= 0:
            self._next[t] = k
        else:
            self._head[seg] = k
        self._tail[seg] = k
        self._bytes[seg] += int(self._size[k])

    def _unlink(self, k: int) -> int:
        seg = int(self._seg[k])
        p, n = int(self._prev[k]), int(self._next[k])
        if p >= 0:
            self._next[p] = n
        else:
            self._head[seg] = n
        if n >= 0:
            self._prev[n] = p
        else:
            self._tail[seg] = p
        self._seg[k] = _NONE
        self._bytes[seg] -= int(self._size[k])
        return seg

    def bind_idents(self, rows) -> None:
        """Derive each key's ident from row `key` of `rows` (an object with `code`, a [n, code_bytes]
        uint8 array, and `tenant`, an integer array; read afresh each time, so they may be replaced as
        they grow) instead of holding the ident given to `insert`: `request_ident(code, tenant)`. The
        caller keeps a held key's row as it was when inserted. Only on an empty policy."""
        if self._n:
            raise RuntimeError("bind_idents needs an empty policy")
        self._rows, self._ident = rows, None

    def _ident_of(self, k: int) -> int:
        r = self._rows
        if r is None:
            return int(self._ident[k])
        return request_ident(r.code[k, :8].tobytes(), int(r.tenant[k]))

    def _freq(self, k: int) -> int:
        return self.sketch.frequency(self._ident_of(k))

    # ------------------------------------------------------------------ the policy
    def insert(self, key: int, nbytes: int, ident: int | None = None) -> list[int]:
        nbytes, key = int(nbytes), int(key)
        if nbytes > self.capacity_bytes:
            return [key]
        if key in self:
            self.remove(key)
        self._grow(key)
        lim = self.SIZE_DTYPES[self._size_level][1]
        if lim is not None and nbytes >= lim:
            while self.SIZE_DTYPES[self._size_level][1] is not None and nbytes >= self.SIZE_DTYPES[self._size_level][1]:
                self._size_level += 1
            self._size = self._size.astype(self.SIZE_DTYPES[self._size_level][0])
        self._size[key] = nbytes
        if self._rows is None:
            self._ident[key] = key if ident is None else int(ident) & _MASK
        self._n += 1
        self.sketch.ensure(self._n)
        self.sketch.increment(self._ident_of(key))
        self._link(_WINDOW, key)
        # window overflow: its LRU entries move to probation as candidates for the main space
        cands = []
        while self._bytes[_WINDOW] > self.window_bytes and self._head[_WINDOW] >= 0:
            c = int(self._head[_WINDOW])
            self._unlink(c)
            self._link(_PROBATION, c)
            cands.append(c)
        return self._evict(cands)

    def _evict(self, cands: list[int]) -> list[int]:
        evicted = []
        ci = 0
        while self.used_bytes > self.capacity_bytes:
            victim = next((int(self._head[s]) for s in (_PROBATION, _PROTECTED, _WINDOW) if self._head[s] >= 0), -1)
            while ci < len(cands) and self._seg[cands[ci]] != _PROBATION:
                ci += 1
            cand = cands[ci] if ci < len(cands) else -1
            if cand < 0 or victim == cand:
                drop = victim
            elif self._freq(cand) > self._freq(victim):
                drop = victim          # admitted: the candidate stays in probation
            else:
                drop = cand
                ci += 1
            self.remove(drop)
            evicted.append(drop)
        return evicted

    def access(self, key: int) -> None:
        self.access_many(np.array([int(key)], np.int64))

    def access_many(self, keys) -> None:
        """`access` of each key in turn (one compiled call)."""
        sk, r = self.sketch, self._rows
        if r is None:
            ident, codes, tenant = self._ident, _NO_CODES, _NO_TENANT
        else:
            ident, codes, tenant = _NO_IDENT, r.code, r.tenant
        sk.additions = int(_nb_access(np.asarray(keys, np.int64), self._prev, self._next, self._seg, self._size,
                                      ident, codes, tenant, r is not None, self._head, self._tail, self._bytes,
                                      self.protected_bytes, sk.table, sk.additions))

    def _access_py(self, key: int) -> None:
        """The Python twin of the compiled access (tests check they agree)."""
        key = int(key)
        if key not in self:
            return
        self.sketch.increment(self._ident_of(key))
        seg = self._unlink(key)
        if seg == _WINDOW:
            self._link(_WINDOW, key)
            return
        self._link(_PROTECTED, key)
        while self._bytes[_PROTECTED] > self.protected_bytes and self._head[_PROTECTED] != key:
            d = int(self._head[_PROTECTED])
            self._unlink(d)
            self._link(_PROBATION, d)

    def remove(self, key: int) -> None:
        key = int(key)
        if key not in self:
            return
        self._unlink(key)
        self._n -= 1

    @property
    def used_bytes(self) -> int:
        return int(self._bytes[_WINDOW] + self._bytes[_PROBATION] + self._bytes[_PROTECTED])

    def __len__(self) -> int:
        return self._n

    def __contains__(self, key: int) -> bool:
        return 0 <= key < len(self._seg) and self._seg[key] != _NONE
