"""Exact search over packed binary codes (faiss binary indexes) and the float cosine baseline.

Ranking and ties (docs/design.md, "Search and ties"): `HammingIndex.search` ranks by Hamming
distance ascending and breaks ties by ascending database index (row order of the codes passed to
the constructor); `cosine_search` ranks by cosine similarity descending with the same tie rule.
Results never depend on how faiss's heap happens to cut ties at the k boundary. Float ties are exact
for repeated database rows (a caption that two images share): one matrix product can round the same row
differently by its column (BLAS kernels treat a block's edge apart), so `cosine_scores` scores each
distinct row once and copies its score to the repeats.

How `HammingIndex.search` stays exact and fast:
1. ask faiss `IndexBinaryFlat` for k2 = k + max(k, 16) neighbours (one multi-threaded scan);
2. for a query whose k2-th distance is larger than its k-th distance d_k, every item with distance
   <= d_k is in that list, so sorting the list by (distance, index) and keeping k is exact;
3. the rare query whose tie group at d_k overflows the list (d_k == k2-th distance) keeps its
   items strictly nearer than d_k (all in the list) and takes the lowest-index items at exactly
   d_k from a scan of the codes in index order (numpy popcount, blocks of doubling size, early
   stop), so even "every code identical" costs one small block, not a full sort.

faiss quirks handled here (faiss-cpu 1.15; see tests/test_index.py):
- binary `range_search(x, radius)` returns distances strictly *below* radius; ushash's radius is
  inclusive, so it passes ``radius + 1`` to faiss;
- binary `range_search` returns distances as float32 and `lims` as uint64; ushash returns int32
  distances and int64 lims (uint64 lims mixed with Python ints silently become float64 in numpy);
- kNN with k > ntotal pads with index -1 and distance INT32_MAX; ushash pads the same way
  (`PAD_DISTANCE`), and pads `cosine_search` with score -inf and index -1.
"""

from __future__ import annotations

import faiss
import numpy as np

from ushash.core.checks import float_rows, unit_rows
from ushash.core.codes import check_packed, hamming_words, words

#: Distance reported for padding slots when k exceeds the database size (faiss's own value).
PAD_DISTANCE = np.iinfo(np.int32).max

# Memory bound: cells of a query-by-database block (kNN query chunks, tie scan, cosine).
_BLOCK_CELLS = 1 << 22


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or int(k) < 1:
        raise ValueError(f"k must be a positive int; got {k!r}")
    return int(k)


def _check_float(x, name: str, dim: int | None = None) -> np.ndarray:
    return float_rows(x, name, dim, array_only=True)


_l2_normalise = unit_rows


def distinct_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(rows, inverse): the distinct rows of x [N, d] (bit for bit) and the position of each row of x among
    them; (x, None) when no row repeats. `cosine_scores` takes the pair."""
    c = np.ascontiguousarray(x)
    if len(c) < 2 or c.shape[1] == 0:
        return x, None
    _, first, inverse = np.unique(c.view(np.dtype((np.void, c.dtype.itemsize * c.shape[1]))).ravel(),
                                  return_index=True, return_inverse=True)
    return (x, None) if len(first) == len(c) else (c[first], inverse.ravel())


def cosine_scores(queries_unit: np.ndarray, rows: tuple[np.ndarray, np.ndarray | None]) -> np.ndarray:
    """float32 [M, N] scores of unit queries against `distinct_rows` of the unit database: bit-identical
    database rows get bit-identical scores (the tie rule of the module docstring)."""
    unique, inverse = rows
    sim = queries_unit @ unique.T
    return sim if inverse is None else sim[:, inverse]


class HammingIndex:
    """Exact Hamming kNN / range search over packed codes uint8 [N, nbytes] (see `ushash.core.codes`).

    ``multihash=(nhash, b)`` additionally builds a faiss ``IndexBinaryMultiHash(bits, nhash, b)``
    used by `range_search` only when it is provably exact: ``nhash * b == bits`` (the hash tables
    cover disjoint substrings) and ``radius <= nhash - 1`` (pigeonhole: some substring then matches
    exactly). Other radii, and all kNN searches, use the flat index.
    """

    def __init__(self, codes, multihash: tuple[int, int] | None = None):
        codes = check_packed(codes, "codes")
        self.nbytes = int(codes.shape[1])
        self.bits = self.nbytes * 8
        self.ntotal = int(codes.shape[0])
        self._words = words(codes.copy())  # uint64 view for the tie scan; copy: caller may mutate codes
        self._flat = faiss.IndexBinaryFlat(self.bits)
        if self.ntotal:
            self._flat.add(codes)
        self._mh = None
        self._mh_max_radius = -1
        if multihash is not None:
            try:
                nhash, b = (int(v) for v in multihash)
            except (TypeError, ValueError):
                raise ValueError(f"multihash must be a pair (nhash, b); got {multihash!r}") from None
            if nhash < 1 or b < 1 or nhash * b != self.bits:
                raise ValueError(f"multihash (nhash, b) must satisfy nhash * b == bits == {self.bits}; got {multihash!r}")
            self._mh = faiss.IndexBinaryMultiHash(self.bits, nhash, b)
            self._mh.nflip = 0
            if self.ntotal:
                self._mh.add(codes)
            self._mh_max_radius = nhash - 1

    def __len__(self) -> int:
        return self.ntotal

    # ------------------------------------------------------------------ kNN
    def search(self, queries_packed, k) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k: (D int32 [M, k], I int64 [M, k]) sorted by (distance, database index).

        If k > ntotal the trailing slots hold I = -1 and D = PAD_DISTANCE (INT32_MAX).
        """
        q = check_packed(queries_packed, "queries_packed", self.nbytes)
        k = _check_k(k)
        m, n = len(q), self.ntotal
        D = np.full((m, k), PAD_DISTANCE, np.int32)
        I = np.full((m, k), -1, np.int64)
        kk = min(k, n)
        if m == 0 or kk == 0:
            return D, I
        k2 = min(n, kk + max(kk, 16))  # margin that absorbs most tie groups at d_k
        step = max(1, _BLOCK_CELLS // k2)
        for s in range(0, m, step):
            qs = q[s : s + step]
            D2, I2 = self._flat.search(qs, k2)
            key = D2.astype(np.int64) * n + I2
            key.sort(axis=1)
            key = key[:, :kk]
            if k2 < n:
                # The tie group at d_k may extend past the k2 returned items, and then faiss chose
                # which tied items to return: keep the items strictly nearer than d_k (all present)
                # and fill the rest with the lowest-index items at exactly d_k.
                over = np.flatnonzero(D2[:, k2 - 1] == key[:, kk - 1] // n)
                if len(over):
                    dk = key[over, kk - 1] // n
                    n_less = (key[over] < (dk * n)[:, None]).sum(axis=1)
                    ties = self._fill_ties(qs[over], dk, kk - n_less)
                    cols = np.arange(kk)[None, :] - n_less[:, None]
                    tie_key = dk[:, None] * n + np.take_along_axis(ties, np.maximum(cols, 0), axis=1)
                    key[over] = np.where(cols >= 0, tie_key, key[over])
            D[s : s + len(qs), :kk] = key // n
            I[s : s + len(qs), :kk] = key % n
        return D, I

    def _fill_ties(self, q: np.ndarray, dk: np.ndarray, need: np.ndarray) -> np.ndarray:
        """For query i, the first need[i] database indices (ascending) at distance exactly dk[i].

        Scans the database in index order, in blocks that double in size, and stops as soon as every
        query has enough: big tie groups (the case that needs this) are found in the first blocks.
        Returns int64 [len(q), need.max()], -1 beyond need[i].
        """
        n = self.ntotal
        width = int(need.max())
        out = np.full((len(q), width), -1, np.int64)
        got = np.zeros(len(q), np.int64)
        qw = words(q)
        active = np.arange(len(q))
        start, block = 0, max(256, 8 * width)
        while len(active) and start < n:
            stop = min(n, start + block)
            step = max(1, _BLOCK_CELLS // (stop - start))
            for s in range(0, len(active), step):
                rows = active[s : s + step]
                h = hamming_words(qw[rows], self._words[start:stop])
                r, c = np.nonzero(h == dk[rows, None])  # row-major: c ascending within a row
                rank = np.arange(len(r)) - np.searchsorted(r, r)  # position within its row
                pos = got[rows][r] + rank
                keep = pos < need[rows][r]
                out[rows[r[keep]], pos[keep]] = start + c[keep]
                got[rows] = np.minimum(got[rows] + np.bincount(r, minlength=len(rows)), need[rows])
            active = active[got[active] < need[active]]
            start, block = stop, block * 2
        if len(active):  # cannot happen if faiss's kNN distances are right; never guess
            raise RuntimeError("HammingIndex: fewer tied items found than faiss's kNN reported")
        return out

    # ---------------------------------------------------------------- range
    def range_search(self, queries_packed, radius) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All items with Hamming distance <= radius (inclusive), like faiss: (lims, D, I).

        lims int64 [M + 1]; the results of query i are D[lims[i]:lims[i+1]] (int32) and
        I[lims[i]:lims[i+1]] (int64), sorted by (distance, database index). faiss's binary range
        search is strict (distance < radius), so faiss is called with radius + 1. The result can
        hold up to M * ntotal items for a large radius.
        """
        q = check_packed(queries_packed, "queries_packed", self.nbytes)
        if isinstance(radius, bool) or not isinstance(radius, (int, np.integer)) or int(radius) < 0:
            raise ValueError(f"radius must be a non-negative int (inclusive Hamming radius); got {radius!r}")
        radius = min(int(radius), self.bits)
        m = len(q)
        if m == 0 or self.ntotal == 0:
            return np.zeros(m + 1, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int64)
        index = self._mh if (self._mh is not None and radius <= self._mh_max_radius) else self._flat
        lims, Dr, Ir = index.range_search(q, radius + 1)
        lims = lims.astype(np.int64)
        Dr = Dr.astype(np.int32)
        qid = np.repeat(np.arange(m), np.diff(lims))
        order = np.lexsort((Ir, Dr, qid))
        return lims, Dr[order], Ir[order].astype(np.int64, copy=False)


# ------------------------------------------------------------------- cosine
def cosine_search(queries_float, db_float, k) -> tuple[np.ndarray, np.ndarray]:
    """Exact cosine top-k: (S float32 [M, k], I int64 [M, k]), similarity descending, ties by index.

    Both inputs are L2-normalised here (all-zero rows score 0 against everything). Scores are
    float32 matrix products; "ties" means bit-identical scores. Queries are processed in chunks so
    memory stays bounded. Repeated database rows score identically (`cosine_scores`). If k > len(db)
    trailing slots hold S = -inf and I = -1.
    """
    k = _check_k(k)
    q = _check_float(queries_float, "queries_float")
    db = _check_float(db_float, "db_float", q.shape[1])
    m, n = len(q), len(db)
    S = np.full((m, k), -np.inf, np.float32)
    I = np.full((m, k), -1, np.int64)
    kk = min(k, n)
    if m == 0 or kk == 0:
        return S, I
    qn, distinct = _l2_normalise(q), distinct_rows(_l2_normalise(db))
    step = max(1, _BLOCK_CELLS // n)
    for s in range(0, m, step):
        sim = cosine_scores(qn[s : s + step], distinct)  # [c, n] float32
        c = len(sim)
        if kk < n:
            thresh = np.partition(sim, n - kk, axis=1)[:, n - kk]  # k-th largest per row
            rows, cols = np.nonzero(sim >= thresh[:, None])  # row-major: cols ascending
        else:
            rows, cols = np.divmod(np.arange(c * n), n)
        vals = sim[rows, cols]
        order = np.lexsort((cols, -vals, rows))
        starts = np.searchsorted(rows, np.arange(c))  # rows is sorted (row-major nonzero)
        take = order[starts[:, None] + np.arange(kk)]
        S[s : s + c, :kk] = vals[take]
        I[s : s + c, :kk] = cols[take]
    return S, I
