"""Operations on payload records: cosine with a query, the hit check, re-ranking candidate lists.

Two paths to one computation, cos = (decoded . q) / max(|decoded|, 1e-15) with q of unit norm:

- checked (`cosine`, `verify`, `rerank`, and `scores(..., checked=True)`): every argument is validated
  (shapes, dtypes, finite queries, records of this format) and a PayloadError names what is wrong;
- unchecked (`scores(..., checked=False)`): for records the caller built itself and a query already of unit
  norm, e.g. the cache's own L1 entries on every lookup, where the checks would cost more than the decoding.

numpy only. `fmt` is a `PayloadFormat` (ushash.serving.payload.format), whose methods of the same names call
these functions.
"""

from __future__ import annotations

import numpy as np

from ushash.core.checks import float_rows, unit_rows
from ushash.serving.payload.settings import PayloadError

# Bound on float32 cells decoded at once by `rerank` (candidate rows x dim).
_BLOCK_CELLS = 1 << 22


def _as_float2d(x, name: str, dim: int) -> np.ndarray:
    return float_rows(x, name, dim, error=PayloadError, vector_ok=True)


_l2n = unit_rows


def _norms(dec: np.ndarray) -> np.ndarray:
    """L2 norms along the last axis, at least 1e-15 (an all-zero record scores 0)."""
    return np.sqrt(np.maximum(np.einsum("...d,...d->...", dec, dec), 1e-30))


def scores(fmt, q_unit: np.ndarray, records: np.ndarray, checked: bool = True) -> np.ndarray:
    """Cosines float32 [N] of one unit-norm query float32 [dim] (or one per record, [N, dim]) with the
    decoded records [N, nbytes].

    checked=False skips every argument check: records must be C-contiguous uint8 [N, fmt.nbytes] and q_unit
    float32 of unit norm (not re-normalised here)."""
    dec = fmt.decode(records) if checked else fmt.decode_unchecked(records)
    if checked:
        q_unit = check_query(fmt, q_unit, len(dec))
    dots = dec @ q_unit if q_unit.ndim == 1 else np.einsum("nd,nd->n", dec, q_unit)
    return (dots / _norms(dec)).astype(np.float32, copy=False)


def check_query(fmt, q_unit, n: int) -> np.ndarray:
    """`scores`' query, checked: finite float32 [dim], or [n, dim] (one row per record)."""
    q = np.asarray(q_unit)
    if q.ndim not in (1, 2) or q.shape[-1] != fmt.dim or (q.ndim == 2 and len(q) != n):
        raise PayloadError(f"q_unit must be float [{fmt.dim}] or [{n}, {fmt.dim}] (one row per record); "
                           f"got shape {q.shape}")
    return _as_float2d(q, "q_unit", fmt.dim).reshape(q.shape)


def cosine(fmt, query, records) -> np.ndarray:
    """Row-wise cosine float32 [N] between query [N, dim] (or one [dim] for all) and decoded records [N]."""
    dec = fmt.decode(records)
    q = _l2n(_as_float2d(query, "query", fmt.dim))
    if len(q) == 1 and len(dec) != 1:
        return ((dec @ q[0]) / _norms(dec)).astype(np.float32, copy=False)
    if len(q) != len(dec):
        raise PayloadError(f"query has {len(q)} rows but records has {len(dec)}; pass one query or one per record")
    return (np.einsum("nd,nd->n", dec, q) / _norms(dec)).astype(np.float32, copy=False)


def verify(fmt, query, records, threshold: float) -> np.ndarray:
    """bool [N]: cosine(query, decoded record) >= threshold (the cache's hit check)."""
    return cosine(fmt, query, records) >= np.float32(threshold)


def rerank(fmt, query, candidates, records, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Re-rank candidate lists by cosine with the decoded payloads; only candidate records are decoded.

    query float [M, dim]; candidates int [M, C] database indices (-1 = empty slot, e.g. the padding of
    `HammingIndex.search`); records uint8 [N, nbytes], the whole store. Returns (S float32 [M, k],
    I int64 [M, k]) by cosine descending, equal scores by ascending database index (the project's tie
    rule); empty slots come last as S=-inf, I=-1. k defaults to C.
    """
    fmt.check_ready()
    q = _l2n(_as_float2d(query, "query", fmt.dim))
    c = np.asarray(candidates)
    if c.ndim != 2 or len(c) != len(q) or not np.issubdtype(c.dtype, np.integer):
        raise PayloadError(f"candidates must be int [M={len(q)}, C]; got {getattr(c, 'shape', c)} {c.dtype}")
    r = fmt.check_records(records)
    c = c.astype(np.int64, copy=False)
    if c.size and ((c < -1) | (c >= len(r))).any():
        raise PayloadError(f"candidates must be indices in [0, {len(r)}) or -1")
    m, cc = c.shape
    k = cc if k is None else int(k)
    if k < 1:
        raise PayloadError(f"k must be a positive int; got {k}")
    S = np.full((m, k), -np.inf, np.float32)
    I = np.full((m, k), -1, np.int64)
    kk = min(k, cc)
    if m == 0 or cc == 0:
        return S, I
    step = max(1, _BLOCK_CELLS // max(1, cc * fmt.dim))
    for s in range(0, m, step):
        cs = c[s:s + step]
        b = len(cs)
        valid = cs >= 0
        dec = fmt.decode_unchecked(_gather_rows(r, np.where(valid, cs, 0).ravel()), copy=False)
        dec = dec.reshape(b, cc, fmt.dim)
        sc = (np.einsum("md,mcd->mc", q[s:s + step], dec) / _norms(dec)).astype(np.float32)
        sc += np.float32(0.0)  # -0.0 -> +0.0, so equal scores compare equal below
        sc[~valid] = -np.inf
        order = _order_desc(sc, np.where(valid, cs, 0), kk)
        S[s:s + b, :kk] = np.take_along_axis(sc, order, axis=1)
        I[s:s + b, :kk] = np.where(np.isfinite(S[s:s + b, :kk]), np.take_along_axis(cs, order, axis=1), -1)
    return S, I

# ------------------------------------------------------------------ token sets


def _gather_rows(r: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """r[idx] for uint8 records [N, nbytes]: np.take for narrow rows, one void item per row for wide ones
    (both several times faster than fancy indexing on numpy 2.4)."""
    nb = r.shape[1]
    if nb >= 128:
        return r.view(np.dtype((np.void, nb))).reshape(-1)[idx].view(np.uint8).reshape(len(idx), nb)
    return np.take(r, idx, axis=0)


def _order_desc(scores: np.ndarray, index: np.ndarray, k: int) -> np.ndarray:
    """Column order [M, k] of the k best per row: score descending, then database index ascending.

    One int64 key per cell (the float32 score's bits made monotone, negated, in the high 32 bits; the
    index, < 2^32, in the low bits), then a partial sort: exact, and cheaper than np.lexsort."""
    bits = scores.astype(np.float32).view(np.int32).astype(np.int64)
    mono = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)      # increases with the float value
    key = (-mono << 32) | index.astype(np.int64)
    n = key.shape[1]
    if k < n:
        part = np.argpartition(key, k - 1, axis=1)[:, :k]
        return np.take_along_axis(part, np.argsort(np.take_along_axis(key, part, axis=1), axis=1), axis=1)
    return np.argsort(key, axis=1)
