"""Hamming range search over a changing set of packed codes: the cache's L1 index (one per tenant).

    b = make_backend("auto", bits=64)        # "auto"/"mindex" (own, numba), "flat", "mih", "faiss" (faiss),
                                              # or "torch" (CUDA tensors)
    b.add(slot, code)                         # code: uint8 [bits / 8]; slot: the cache's entry id
    b.remove(slot)
    slots, dists = b.search(code, radius)     # every live entry with distance <= radius (inclusive),
                                              # sorted by (distance, slot); int64 / int32 arrays
    lims, slots, dists = b.search_many(codes, radius)   # codes uint8 [B, bits / 8], one index call:
                                              # query i's results are slots[lims[i]:lims[i + 1]], same order

faiss binary indexes cannot overwrite or cheaply delete a row, so the faiss backends are append-only
with tombstones: a removed entry stays in the index, is filtered out of results, and the index is
rebuilt from the live codes once tombstones outnumber live entries (amortised O(1) per removal).
faiss's binary `range_search` is strict (distance < radius), so radius + 1 is passed (see ushash.core.index).

- "mindex" (and "auto", the default): this package's multi-index (mindex.py): sorted chunk tables, 32 B
  per 64-bit code beside its slot (and the code, unless the caller lends its own codes by slot), searched in one numba call per batch, a popcount scan
  while small or when cheaper; exact for every radius. No faiss.
- "flat": `IndexBinaryFlat`, a scan of every code; best for small caches.
- "mih": `IndexBinaryMultiHash(bits, nhash, bits / nhash)`: exact for any radius with
  nflip = radius // nhash bit flips per substring (pigeonhole), and fast while nflip == 0, i.e.
  radius < nhash (default nhash = bits / 16: 4 tables for 64 bits, exact and fast up to radius 3); a flat
  scan where the flips would cost more than the codes held.
- "faiss": flat until `mih_min_entries` live entries, then multi-index hashing (faiss's "auto").
- "torch": codes in a uint8 tensor on `device` (CUDA, or CPU for tests), XOR + byte-popcount table;
  slots are reused in place, no tombstones. faiss-gpu has no in-place update either; this avoids it.
"""

from __future__ import annotations

import math

import numpy as np

from ushash.core import codes as codes_lib
from ushash.serving.cache import heap

BACKENDS = ("auto", "mindex", "flat", "mih", "faiss", "torch")


def mih_tables(bits: int, nhash: int | None = None) -> int:
    """The multi-index hash tables of a `bits`-bit code (`nhash`, or bits // 16), refused (ValueError) where they
    do not divide the code, or where a table's substring is over 64 bits: faiss keeps each substring's hash in
    one 64-bit word, and a wider one missed results without an error (2,671 of 6,000 within radius 2 at 96
    bits in one table)."""
    n = int(nhash) if nhash else max(1, bits // 16)
    if bits % n:
        raise ValueError(f"mih_nhash={n} must divide bits={bits} (e.g. {bits // 16 or 1})")
    if bits // n > 64:
        fit = next(k for k in range(-(-bits // 64), bits + 1) if bits % k == 0)
        raise ValueError(f"mih_nhash={n} splits a {bits}-bit code into {bits // n}-bit substrings; faiss's "
                         f"multi-index hashing reads at most 64 bits of each (use mih_nhash={fit} or more)")
    return n


class HammingBackend:
    kind = ""

    def __init__(self, bits: int):
        self.bits = codes_lib.check_bits(bits)
        self.nbytes = self.bits // 8

    def _check_code(self, code) -> np.ndarray:
        code = np.asarray(code)
        if code.dtype != np.uint8 or code.shape != (self.nbytes,):
            raise ValueError(f"code must be uint8 [{self.nbytes}] (packed {self.bits}-bit code); "
                             f"got {code.dtype} {code.shape}")
        return code

    def add(self, slot: int, code: np.ndarray) -> None:
        self.add_many(np.array([slot], np.int64), self._check_code(code)[None])

    def add_many(self, slots: np.ndarray, codes: np.ndarray) -> None:
        """Add (or replace) entries: shared checks here, storage in the backend's `_append`. A slot given twice
        is stored once, with its last code (as adding them one by one would)."""
        slots = np.asarray(slots, np.int64)
        codes = np.ascontiguousarray(codes, dtype=np.uint8).reshape(len(slots), self.nbytes)
        if len(slots) == 0:
            return
        if len(slots) > 1:   # one put (the hot path) cannot repeat a slot
            _, last = np.unique(slots[::-1], return_index=True)
            if len(last) < len(slots):
                keep = np.sort(len(slots) - 1 - last)
                slots, codes = slots[keep], codes[keep]
        for s in slots.tolist():
            if s in self._slot2pos:
                self.remove(s)
        self._append(slots, codes)

    def _append(self, slots: np.ndarray, codes: np.ndarray) -> None:
        raise NotImplementedError

    def remove(self, slot: int) -> None:
        raise NotImplementedError

    def search(self, code: np.ndarray, radius: int) -> tuple[np.ndarray, np.ndarray]:
        _, slots, dists = self.search_many(self._check_code(code)[None], radius)
        return slots, dists

    def search_many(self, codes: np.ndarray, radius: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lims int64 [B + 1], slots int64, dists int32) for B queries in one call; each query's results
        sorted by (distance, slot)."""
        if not isinstance(codes, np.ndarray) or codes.dtype != np.uint8 or codes.ndim != 2 or codes.shape[1] != self.nbytes:
            raise ValueError(f"codes must be uint8 [B, {self.nbytes}] (packed {self.bits}-bit codes); "
                             f"got {getattr(codes, 'dtype', type(codes))} {getattr(codes, 'shape', '')}")
        if not codes.flags.c_contiguous:
            codes = np.ascontiguousarray(codes)
        b = len(codes)
        if b == 0 or len(self) == 0 or radius < 0:
            return np.zeros(b + 1, np.int64), _EMPTY[0], _EMPTY[1]
        qid, slots, dists = self._range(codes, min(int(radius), self.bits))
        return _grouped(b, qid, slots, dists)

    def _range(self, codes: np.ndarray, radius: int) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """(query index, slot int64, distance int32) of every live entry within radius of each query, any
        order; the query index is None for a single query."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class _SlotMap:
    """slot -> position. Slots are the cache's entry ids, shared by every tenant's index, so one tenant's
    slots can be sparse: a dict while they are (or while there are few), then a growable int64 array
    (-1: absent) once the slots are dense enough that the array is the smaller (a dict of a million ints
    costs ~100 B an entry, the array 8 per slot up to the largest)."""

    def __init__(self):
        self._d: dict[int, int] | None = {}
        self._a = None
        self._n = 0

    def __contains__(self, slot: int) -> bool:
        if self._d is not None:
            return slot in self._d
        return 0 <= slot < len(self._a) and self._a[slot] >= 0

    def __len__(self) -> int:
        return self._n

    def set_many(self, slots: np.ndarray, pos: np.ndarray) -> None:
        if len(slots) == 0:
            return
        top = int(slots.max()) + 1
        if self._d is not None:
            self._d.update(zip(slots.tolist(), pos.tolist()))
            self._n = len(self._d)
            if self._n >= 1024 and top <= 8 * self._n:  # dense: an array of `top` slots is the smaller
                self._a = np.full(max(top, 1024), -1, np.int32)   # positions < 2^31
                self._a[np.fromiter(self._d.keys(), np.int64, self._n)] = np.fromiter(self._d.values(), np.int64, self._n)
                self._d = None
            return
        if top > len(self._a):
            a = heap.zeros(max(top, 2 * len(self._a)), np.int32)
            a[: len(self._a)] = self._a
            a[len(self._a):] = -1
            self._a = a
        self._n += int((self._a[slots] < 0).sum())
        self._a[slots] = pos

    def pop(self, slot: int, default=None):
        if self._d is not None:
            p = self._d.pop(slot, None)
            if p is None:
                return default
            self._n -= 1
            return p
        if not (0 <= slot < len(self._a)) or self._a[slot] < 0:
            return default
        p = int(self._a[slot])
        self._a[slot] = -1
        self._n -= 1
        return p


_EMPTY = (np.zeros(0, np.int64), np.zeros(0, np.int32))


def _grouped(n_queries: int, qid, slots: np.ndarray, dists: np.ndarray):
    """(lims, slots, dists): results grouped by query, each query's sorted by (distance, slot). qid: the
    query of each result (None: one query)."""
    if n_queries == 1:
        if len(slots) > 1:
            order = np.lexsort((slots, dists))
            slots, dists = slots[order], dists[order]
        return np.array([0, len(slots)], np.int64), slots, dists
    if len(slots) > 1:
        if n_queries < (1 << 12) and int(slots.max()) < (1 << 40):
            # one int64 key: query (12 bits), distance (< 2^11), slot (< 2^40)
            order = np.argsort((qid << 51) | (dists.astype(np.int64) << 40) | slots)
        else:
            order = np.lexsort((slots, dists, qid))
        qid, slots, dists = qid[order], slots[order], dists[order]
    lims = np.zeros(n_queries + 1, np.int64)
    if len(qid):
        np.cumsum(np.bincount(qid, minlength=n_queries), out=lims[1:])
    return lims, slots, dists


class FaissBackend(HammingBackend):
    """faiss IndexBinaryFlat / IndexBinaryMultiHash, append-only with tombstones (module docstring)."""

    def __init__(self, bits: int, kind: str = "auto", mih_nhash: int | None = None, mih_min_entries: int = 20000):
        super().__init__(bits)
        if kind not in ("auto", "flat", "mih"):
            raise ValueError(f"faiss backend kind must be auto, flat or mih; got {kind!r}")
        self.kind = kind
        self.nhash = mih_tables(self.bits, mih_nhash)
        self.mih_min_entries = int(mih_min_entries)
        self._codes = np.zeros((4, self.nbytes), np.uint8)    # by index position
        self._pos2slot = np.full(4, -1, np.int64)              # -1: tombstone
        self._slot2pos = _SlotMap()
        self._n = 0          # positions used (live + tombstones)
        self._use_mih = kind == "mih"
        import faiss

        self._faiss = faiss
        self._index = self._new_index()

    @property
    def uses_mih(self) -> bool:
        return self._use_mih

    def _new_index(self):
        import faiss

        if self._use_mih:
            ix = faiss.IndexBinaryMultiHash(self.bits, self.nhash, self.bits // self.nhash)
            ix.nflip = 0
            return ix
        return faiss.IndexBinaryFlat(self.bits)

    def _grow(self, need: int) -> None:
        cap = len(self._pos2slot)
        if need <= cap:
            return
        while cap < need:
            cap *= 2
        codes = np.zeros((cap, self.nbytes), np.uint8)
        codes[: self._n] = self._codes[: self._n]
        p2s = np.full(cap, -1, np.int64)
        p2s[: self._n] = self._pos2slot[: self._n]
        self._codes, self._pos2slot = codes, p2s

    def _append(self, slots: np.ndarray, codes: np.ndarray) -> None:
        self._grow(self._n + len(slots))
        start = self._n
        self._codes[start : start + len(slots)] = codes
        self._pos2slot[start : start + len(slots)] = slots
        self._slot2pos.set_many(slots, np.arange(start, start + len(slots)))
        self._n += len(slots)
        self._index.add(codes)
        if self.kind == "auto" and not self._use_mih and len(self._slot2pos) >= self.mih_min_entries:
            self._use_mih = True
            self._rebuild()

    def remove(self, slot: int) -> None:
        pos = self._slot2pos.pop(int(slot), None)
        if pos is None:
            return
        self._pos2slot[pos] = -1
        dead = self._n - len(self._slot2pos)
        if dead > max(1024, len(self._slot2pos)):
            self._rebuild()

    def _rebuild(self) -> None:
        live = np.flatnonzero(self._pos2slot[: self._n] >= 0)
        codes, slots = self._codes[live].copy(), self._pos2slot[live].copy()
        self._pos2slot[:] = -1
        self._index = self._new_index()
        self._n = len(slots)
        self._codes[: len(slots)] = codes
        self._pos2slot[: len(slots)] = slots
        self._slot2pos = _SlotMap()
        self._slot2pos.set_many(slots, np.arange(len(slots)))
        if len(slots):
            self._index.add(codes)

    def _range(self, codes: np.ndarray, radius: int):
        index = self._index
        if self._use_mih:
            nflip = radius // self.nhash
            # nhash x sum_k<=nflip C(bits / nhash, k) probes per query (~2^64 for one 64-bit table at a wide
            # radius: a search that never ends): a flat scan of the positions instead when it is cheaper
            probes = self.nhash * sum(math.comb(self.bits // self.nhash, k) for k in range(nflip + 1))
            if probes > self._n:
                index = self._faiss.IndexBinaryFlat(self.bits)
                index.add(self._codes[: self._n])
            else:
                index.nflip = nflip
        # One query is too little work for an OpenMP team: waking threads costs ~1 ms on a busy machine
        # (measured: 1.5 ms vs 33 us for 500 codes on 2 shared cores), and a batch is served on one core
        # too. The thread count is a per-thread OpenMP setting, so this does not touch other threads' calls.
        faiss = self._faiss
        prev = faiss.omp_get_max_threads()
        if prev != 1:
            faiss.omp_set_num_threads(1)
        try:
            # faiss's own range_search wrapper, minus its copies
            b = len(codes)
            res = faiss.RangeSearchResult(b)
            index.range_search_c(b, faiss.swig_ptr(codes), radius + 1, res)
            lims = faiss.rev_swig_ptr(res.lims, b + 1)
            nd = int(lims[b])
            if nd == 0:
                return (None if b == 1 else _EMPTY[0]), _EMPTY[0], _EMPTY[1]
            D = faiss.rev_swig_ptr(res.distances, nd).astype(np.int32)
            slots = self._pos2slot[faiss.rev_swig_ptr(res.labels, nd)]
            qid = None if b == 1 else np.repeat(np.arange(b, dtype=np.int64), np.diff(lims.astype(np.int64)))
        finally:
            if prev != 1:
                faiss.omp_set_num_threads(prev)
        if slots.min() >= 0:
            return qid, slots, D
        keep = slots >= 0  # tombstones
        return (None if qid is None else qid[keep]), slots[keep], D[keep]

    def __len__(self) -> int:
        return len(self._slot2pos)


class MIndexBackend(HammingBackend):
    """This package's multi-index (ushash.serving.cache.mindex): chunk tables + a scanned tail, tombstones
    renumbered away once they outnumber live codes."""

    kind = "mindex"

    def __init__(self, bits: int, min_entries: int = 4096, tail_max: int = 4096, codes=None):
        """codes: None (the index keeps a copy of each code), or a callable returning the caller's uint64
        [*, bits / 64] codes by slot, where the caller keeps each added slot's code until it is removed
        (mindex.MultiIndex)."""
        super().__init__(bits)
        from ushash.serving.cache.mindex import MultiIndex

        self._mi = MultiIndex(self.bits, min_entries=min_entries, tail_max=tail_max, codes=codes)
        self._slot2pos = _SlotMap()

    @property
    def uses_tables(self) -> bool:
        return self._mi.offs is not None

    def _append(self, slots: np.ndarray, codes: np.ndarray) -> None:
        if int(slots.min()) < 0 or int(slots.max()) >= (1 << 31):
            raise ValueError("slots must be in [0, 2^31)")
        pos = self._mi.append(slots, self._mi.words(codes))
        self._slot2pos.set_many(slots, pos)

    def remove(self, slot: int) -> None:
        pos = self._slot2pos.pop(int(slot), None)
        if pos is None:
            return
        mi = self._mi
        mi.p2s[pos] = -1
        if mi.n - len(self._slot2pos) > max(1024, len(self._slot2pos)):
            slots = mi.compact()
            self._slot2pos = _SlotMap()
            self._slot2pos.set_many(slots, np.arange(len(slots), dtype=np.int64))

    def search_many(self, codes: np.ndarray, radius: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not isinstance(codes, np.ndarray) or codes.dtype != np.uint8 or codes.ndim != 2 or codes.shape[1] != self.nbytes:
            return super().search_many(codes, radius)   # the shared checks raise
        b = len(codes)
        if b == 0 or len(self._slot2pos) == 0 or radius < 0:
            return np.zeros(b + 1, np.int64), _EMPTY[0], _EMPTY[1]
        return self._mi.search(self._mi.words(codes), min(int(radius), self.bits), len(self._slot2pos))

    def __len__(self) -> int:
        return len(self._slot2pos)

    @property
    def index_bytes(self) -> int:
        """Bytes of the index's arrays (codes, slots, tables, slot -> position map), capacity included."""
        a = self._slot2pos._a
        return self._mi.nbytes + (a.nbytes if a is not None else 0)


class TorchBackend(HammingBackend):
    """Codes in a uint8 tensor on `device`; distances by XOR and a 256-entry popcount table."""

    kind = "torch"

    def __init__(self, bits: int, device: str = "cuda"):
        super().__init__(bits)
        import torch

        self._torch = torch
        self.device = torch.device(device)
        self._lut = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int16, device=self.device)
        self._cap = 64
        self._codes = torch.zeros((self._cap, self.nbytes), dtype=torch.uint8, device=self.device)
        self._alive = torch.zeros(self._cap, dtype=torch.bool, device=self.device)
        self._pos2slot = np.full(self._cap, -1, np.int64)
        self._slot2pos = _SlotMap()
        self._free: list[int] = []
        self._n = 0  # high-water mark of positions

    def _grow(self, need: int) -> None:
        if need <= self._cap:
            return
        torch = self._torch
        cap = self._cap
        while cap < need:
            cap *= 2
        codes = torch.zeros((cap, self.nbytes), dtype=torch.uint8, device=self.device)
        codes[: self._n] = self._codes[: self._n]
        alive = torch.zeros(cap, dtype=torch.bool, device=self.device)
        alive[: self._n] = self._alive[: self._n]
        p2s = np.full(cap, -1, np.int64)
        p2s[: self._n] = self._pos2slot[: self._n]
        self._codes, self._alive, self._pos2slot, self._cap = codes, alive, p2s, cap

    def _append(self, slots: np.ndarray, codes: np.ndarray) -> None:
        reuse = [self._free.pop() for _ in range(min(len(self._free), len(slots)))]
        fresh = len(slots) - len(reuse)
        self._grow(self._n + fresh)
        pos = np.array(reuse + list(range(self._n, self._n + fresh)), np.int64)
        self._n += fresh
        torch = self._torch
        pt = torch.as_tensor(pos, device=self.device)
        self._codes[pt] = torch.as_tensor(codes, device=self.device)
        self._alive[pt] = True
        self._pos2slot[pos] = slots
        self._slot2pos.set_many(slots, pos)

    def remove(self, slot: int) -> None:
        pos = self._slot2pos.pop(int(slot), None)
        if pos is None:
            return
        self._alive[pos] = False
        self._pos2slot[pos] = -1
        self._free.append(pos)

    def _range(self, codes: np.ndarray, radius: int):
        torch = self._torch
        q = torch.as_tensor(np.array(codes), device=self.device)
        step = max(1, (1 << 24) // max(1, self._n * self.nbytes))  # bound the [step, n, nbytes] XOR block
        qids, poss, dists = [], [], []
        for s in range(0, len(codes), step):
            x = torch.bitwise_xor(self._codes[None, : self._n], q[s:s + step, None])
            d = self._lut[x.long()].sum(dim=2, dtype=torch.int32)
            ok = (d <= int(radius)) & self._alive[None, : self._n]
            qi, pos = torch.nonzero(ok, as_tuple=True)
            qids.append(qi + s), poss.append(pos), dists.append(d[qi, pos])
        qi, pos, d = (torch.cat(v).cpu().numpy() for v in (qids, poss, dists))  # the one device -> host copy
        return (None if len(codes) == 1 else qi.astype(np.int64)), self._pos2slot[pos], d.astype(np.int32)

    def __len__(self) -> int:
        return len(self._slot2pos)


def make_backend(kind: str, bits: int, device: str = "cpu", mih_nhash: int | None = None,
                 mih_min_entries: int = 20000, codes=None) -> HammingBackend:
    """codes: for "auto" / "mindex", the caller's codes by slot (MIndexBackend); the others keep their own."""
    kind = str(kind).lower()
    if kind == "torch":
        return TorchBackend(bits, device=device)
    if kind in ("auto", "mindex", "flat", "mih", "faiss"):
        if str(device).startswith("cuda"):
            raise ValueError(f"search backend {kind!r} runs on the CPU; use backend 'torch' for device {device!r}")
        if kind in ("auto", "mindex"):
            m = min(4096, int(mih_min_entries))   # tables from this many codes; a tail of up to m / 2, <= 2048
            return MIndexBackend(bits, min_entries=m, tail_max=min(2048, max(32, m // 2)), codes=codes)
        return FaissBackend(bits, kind="auto" if kind == "faiss" else kind, mih_nhash=mih_nhash,
                            mih_min_entries=mih_min_entries)
    raise ValueError(f"unknown search backend {kind!r}; choose one of {BACKENDS}")
