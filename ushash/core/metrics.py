"""Retrieval metrics with a named protocol (docs/design.md, docs/baselines.md).

Relevance
- "paired": a database item is relevant to a query when it has the same group id (COCO 5k,
  Flickr30k, Clotho: an image and its captions share a group). Groups are int or str arrays.
- "label": relevant when query and item share at least one class label (multi-hot bool [N, L]).
- An index of -1 in the result list means "no result" and is never relevant.
- n_rel[q] is the number of relevant items in the whole database, not just in the top k.

AP@k = (1/Z) * sum_{i<=k} P@i * rel_i, where P@i = (relevant in top i) / i, and Z is named:
- "min":   Z = min(k, n_rel)  -- the ushash default (LAION-CLAP, DCASE: one relevant item gives 1/rank)
- "found": Z = relevant items found in the top k  -- HashNet / DeepHash toolboxes
- "all":   Z = n_rel  -- with k = database size this is mAP@all (UCCH, MITH)
Queries with n_rel == 0 (or, for "found", no hit in the top k) score 0 and stay in the mean;
`retrieval_report` says how many queries had no relevant item at all.

R@K (`recall_at_k`) is the CLIP-style retrieval recall: the fraction of queries with at least one
relevant item among the top K (not the fraction of relevant items retrieved). P@K is the mean over
queries of (relevant in top K) / K.
"""

from __future__ import annotations

import numpy as np

PROTOCOLS = ("paired", "label")
DENOMINATORS = ("min", "found", "all")

# Bound on query-by-database cells per block when counting label relevance.
_BLOCK_CELLS = 1 << 22


def _check_I(I) -> np.ndarray:
    if not isinstance(I, np.ndarray) or I.ndim != 2 or not np.issubdtype(I.dtype, np.integer):
        shape = getattr(I, "shape", type(I).__name__)
        raise ValueError(f"I must be an int array [M, k] of database indices (-1 = no result); got {shape}")
    return I.astype(np.int64, copy=False)


def _check_groups(g, name: str, n: int | None) -> np.ndarray:
    g = np.asarray(g)
    if g.ndim != 1 or (n is not None and len(g) != n):
        raise ValueError(f"{name} must be a 1-D int or str array [{n if n is not None else 'N'}]; got shape {g.shape}")
    if not (np.issubdtype(g.dtype, np.integer) or g.dtype.kind in "US"):
        raise ValueError(f"{name} must be a 1-D int or str array; got dtype {g.dtype}")
    return g


def _check_labels(x, name: str, n: int, num_labels: int | None = None) -> np.ndarray:
    if x is None:
        raise ValueError(f"{name} is required for protocol='label' (multi-hot bool [{n}, L])")
    x = np.asarray(x)
    expect = f"multi-hot bool [{n}, {num_labels if num_labels is not None else 'L'}]"
    if x.ndim != 2 or x.shape[0] != n or (num_labels is not None and x.shape[1] != num_labels):
        raise ValueError(f"{name} must be {expect}; got shape {x.shape}")
    if x.dtype != np.bool_:
        if not np.issubdtype(x.dtype, np.integer) or not np.isin(x, (0, 1)).all():
            raise ValueError(f"{name} must be {expect}; got dtype {x.dtype}")
        x = x.astype(bool)
    return x


def _check_rel(rel, n_rel, k: int | None = None, kname: str = "k"):
    if not isinstance(rel, np.ndarray) or rel.ndim != 2 or rel.dtype != np.bool_:
        shape = getattr(rel, "shape", type(rel).__name__)
        raise ValueError(f"rel must be a bool array [M, k]; got {shape} {getattr(rel, 'dtype', '')}")
    if k is not None and rel.shape[1] < k:
        raise ValueError(f"rel must have at least {kname}={k} columns [M, >= {k}]; got shape {rel.shape}")
    if n_rel is None:
        return rel, None
    n_rel = np.asarray(n_rel)
    if n_rel.shape != (rel.shape[0],) or not np.issubdtype(n_rel.dtype, np.integer):
        raise ValueError(f"n_rel must be an int array [M] = [{rel.shape[0]}]; got shape {n_rel.shape} {n_rel.dtype}")
    n_rel = n_rel.astype(np.int64, copy=False)
    if (rel.sum(axis=1) > n_rel).any():
        raise ValueError("n_rel is smaller than the number of relevant items in rel for some query")
    return rel, n_rel


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive int; got {k!r}")
    return int(k)


def _check_ks(ks) -> tuple[int, ...]:
    ks = (ks,) if isinstance(ks, (int, np.integer)) else tuple(ks)
    if not ks or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1 for x in ks):
        raise ValueError(f"ks must be positive ints; got {ks!r}")
    return tuple(int(x) for x in ks)


def _paired_groups(q_groups, db_groups, m: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(q_groups, db_groups) checked and of one comparable dtype: both int or both str (a ValueError
    otherwise: an int never equals a str, so every item would be irrelevant); signed and unsigned ints brought
    to one exact type (numpy compares int64 with uint64 through float64, where ids above 2**53 collide)."""
    qg = _check_groups(q_groups, "q_groups", m)
    dg = _check_groups(db_groups, "db_groups", None)
    kind = {"i": "int", "u": "int", "U": "str", "S": "bytes"}
    if kind[qg.dtype.kind] != kind[dg.dtype.kind]:
        raise ValueError(f"q_groups and db_groups must both be int or both be str; got {qg.dtype} and {dg.dtype}")
    if {qg.dtype.kind, dg.dtype.kind} == {"i", "u"}:
        big = max((int(a.max()) for a in (qg, dg) if a.dtype.kind == "u" and a.size), default=0)
        neg = min((int(a.min()) for a in (qg, dg) if a.dtype.kind == "i" and a.size), default=0)
        if big <= np.iinfo(np.int64).max:
            qg, dg = qg.astype(np.int64), dg.astype(np.int64)
        elif neg >= 0:
            qg, dg = qg.astype(np.uint64), dg.astype(np.uint64)
        else:
            raise ValueError("q_groups and db_groups mix negative ids with unsigned ids above 2**63; give both "
                             "one integer type")
    return qg, dg


def relevance(I, q_groups, db_groups, protocol="paired", q_labels=None, db_labels=None):
    """Relevance of each returned item and the number of relevant items per query.

    I: int [M, k] database indices (-1 = no result). paired: q_groups [M], db_groups [N] (int or
    str). label: q_labels [M, L], db_labels [N, L] multi-hot bool (groups are then ignored and may
    be None). Returns (rel bool [M, k], n_rel int64 [M]).
    """
    I = _check_I(I)
    m = I.shape[0]
    if protocol == "paired":
        qg, dg = _paired_groups(q_groups, db_groups, m)
        n = len(dg)
    elif protocol == "label":
        if db_labels is None:
            raise ValueError("db_labels is required for protocol='label' (multi-hot bool [N, L])")
        n = np.asarray(db_labels).shape[0]
        dl = _check_labels(db_labels, "db_labels", n)
        ql = _check_labels(q_labels, "q_labels", m, dl.shape[1])
    else:
        raise ValueError(f"protocol must be one of {PROTOCOLS}; got {protocol!r}")
    if ((I < -1) | (I >= n)).any():
        raise ValueError(f"I must hold database indices in [0, {n}) or -1; got values in [{I.min()}, {I.max()}]")
    srt = np.sort(I, axis=1)
    if ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any():
        raise ValueError("I repeats a database index within a row; a ranking lists each item at most once")
    valid = I >= 0
    safe = np.where(valid, I, 0)
    if protocol == "paired":
        rel = valid & (qg[:, None] == dg[safe]) if n else np.zeros(I.shape, bool)
        uniq, counts = np.unique(dg, return_counts=True)
        pos = np.searchsorted(uniq, qg)
        pos_c = np.minimum(pos, max(len(uniq) - 1, 0))
        found = (pos < len(uniq)) & (uniq[pos_c] == qg) if len(uniq) else np.zeros(m, bool)
        n_rel = np.where(found, counts[pos_c] if len(uniq) else 0, 0).astype(np.int64)
    else:
        rel = np.zeros(I.shape, bool)
        n_rel = np.zeros(m, np.int64)
        if n:
            step = max(1, _BLOCK_CELLS // max(1, I.shape[1] * dl.shape[1]))
            for s in range(0, m, step):
                sl = slice(s, s + step)
                rel[sl] = valid[sl] & (ql[sl, None, :] & dl[safe[sl]]).any(axis=2)
            dlf = dl.astype(np.float32).T  # 0/1 products are exact in float32 for L < 2**24
            step = max(1, _BLOCK_CELLS // n)
            for s in range(0, m, step):
                n_rel[s : s + step] = ((ql[s : s + step].astype(np.float32) @ dlf) > 0).sum(axis=1)
    return rel, n_rel


def average_precision_at_k(rel, n_rel, k, denominator="min") -> np.ndarray:
    """AP@k per query, float64 [M] (see the module docstring for the denominators).

    rel: bool [M, >= k] relevance of the ranked results (only the first k columns are used);
    n_rel: int [M] relevant items in the whole database. Take `.mean()` for mAP@k.
    """
    k = _check_k(k)
    if denominator not in DENOMINATORS:
        raise ValueError(f"denominator must be one of {DENOMINATORS}; got {denominator!r}")
    rel, n_rel = _check_rel(rel, n_rel, int(k))
    r = rel[:, : int(k)].astype(np.float64)
    hits = np.cumsum(r, axis=1)
    num = (hits / np.arange(1, r.shape[1] + 1) * r).sum(axis=1)
    if denominator == "min":
        z = np.minimum(int(k), n_rel)
    elif denominator == "found":
        z = hits[:, -1] if r.shape[1] else np.zeros(len(r))
    else:
        z = n_rel
    z = np.asarray(z, np.float64)
    return np.divide(num, z, out=np.zeros(len(r)), where=z > 0)


def recall_at_k(rel, n_rel=None, ks=(1, 5, 10)) -> dict[int, float]:
    """R@K: fraction of queries with at least one relevant item in the top K (CLIP retrieval R@K).

    Queries with no relevant item in the database count as misses. n_rel is only validated (it may
    be None). Returns {K: float}.
    """
    ks = _check_ks(ks)
    rel, _ = _check_rel(rel, n_rel, max(ks), "max(ks)")
    if rel.shape[0] == 0:
        return {K: 0.0 for K in ks}
    return {K: float(rel[:, :K].any(axis=1).mean()) for K in ks}


def precision_at_k(rel, ks=(1, 5, 10)) -> dict[int, float]:
    """P@K: mean over queries of (relevant items in the top K) / K. Returns {K: float}."""
    ks = _check_ks(ks)
    rel, _ = _check_rel(rel, None, max(ks), "max(ks)")
    if rel.shape[0] == 0:
        return {K: 0.0 for K in ks}
    return {K: float(rel[:, :K].sum(axis=1).mean() / K) for K in ks}


def retrieval_report(I, q_groups, db_groups, protocol, k=10, ks=(1, 5, 10), denominator="min",
                     q_labels=None, db_labels=None) -> dict:
    """Self-describing summary of a ranked result list I [M, >= max(k, ks)].

    Keys: f"map@{k}", f"R@{K}" for K in ks, "n_queries", "n_no_relevant" (queries with no relevant
    item in the database; they score 0 and are included in the means), "protocol", "denominator".
    """
    ks = _check_ks(ks)
    rel, n_rel = relevance(I, q_groups, db_groups, protocol, q_labels, db_labels)
    ap = average_precision_at_k(rel, n_rel, k, denominator)
    out = {f"map@{int(k)}": float(ap.mean()) if len(ap) else 0.0}
    out.update({f"R@{K}": v for K, v in recall_at_k(rel, n_rel, ks).items()})
    out.update({
        "n_queries": int(rel.shape[0]),
        "n_no_relevant": int((n_rel == 0).sum()),
        "protocol": protocol,
        "denominator": denominator,
    })
    return out


# ---------------------------------------------------------------------------------------------- tie-aware

TIE_DOC = ("tie-aware: the expected value over every ordering of tied items (McSherry & Najork, ECIR 2008), in "
           "closed form; methods are ranked by it")


def relevance_matrix(q_groups, db_groups, protocol="paired", q_labels=None, db_labels=None) -> np.ndarray:
    """bool [M, N]: is database item j relevant to query i (the protocols of `relevance`, every item)."""
    if protocol == "paired":
        qg, dg = _paired_groups(q_groups, db_groups, None)
        return qg[:, None] == dg[None, :]
    if protocol == "label":
        if db_labels is None:
            raise ValueError("db_labels is required for protocol='label' (multi-hot bool [N, L])")
        n = np.asarray(db_labels).shape[0]
        dl = _check_labels(db_labels, "db_labels", n)
        m = np.asarray(q_labels).shape[0] if q_labels is not None else 0
        ql = _check_labels(q_labels, "q_labels", m, dl.shape[1])
        return (ql.astype(np.float32) @ dl.T.astype(np.float32)) > 0  # exact for L < 2**24
    raise ValueError(f"protocol must be one of {PROTOCOLS}; got {protocol!r}")


def tie_blocks(scores, rel, depth: int, descending: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The ranking of each query as tie blocks, down to `depth` positions.

    scores: [M, N] (distances with descending=False, similarities with True); rel: bool [M, N].
    Returns (count, relevant) int64 [M, B]: block b of query i holds count[i, b] items with one score, of
    which relevant[i, b] are relevant, blocks in rank order; only the blocks that reach the first `depth`
    positions are kept (the block straddling position `depth` whole), and rows are padded with empty blocks.
    """
    scores = np.asarray(scores)
    rel = np.asarray(rel, bool)
    if scores.ndim != 2 or rel.shape != scores.shape:
        raise ValueError(f"scores and rel must be [M, N] of one shape; got {scores.shape} and {rel.shape}")
    m, n = scores.shape
    depth = int(min(depth, n))
    if m == 0 or n == 0 or depth == 0:
        return np.zeros((m, 0), np.int64), np.zeros((m, 0), np.int64)
    key = -scores if descending else scores
    order = np.argsort(key, axis=1, kind="stable")
    ks = np.take_along_axis(key, order, axis=1)
    rs = np.take_along_axis(rel, order, axis=1)
    # the block straddling `depth`: every item tied with the item at position depth - 1
    reach = (ks <= ks[:, depth - 1 : depth]).sum(axis=1)
    width = int(reach.max())
    ks, rs = ks[:, :width], rs[:, :width]
    inside = np.arange(width)[None, :] < reach[:, None]
    new = np.ones((m, width), bool)
    new[:, 1:] = ks[:, 1:] != ks[:, :-1]
    new &= inside
    bid = np.cumsum(new, axis=1) - 1                                # block index of each position
    nb = int(bid.max()) + 1
    flat = (np.arange(m)[:, None] * nb + bid)[inside]
    count = np.bincount(flat, minlength=m * nb).reshape(m, nb)
    relevant = np.bincount(flat, weights=rs[inside], minlength=m * nb).reshape(m, nb).astype(np.int64)
    return count.astype(np.int64), relevant


def hamming_blocks(dist, rel, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """`tie_blocks` for integer Hamming distances [M, N] in [0, bits]: one block per distance value
    (empty blocks included), so no sort is needed."""
    dist = np.asarray(dist)
    rel = np.asarray(rel, bool)
    if dist.ndim != 2 or rel.shape != dist.shape or not np.issubdtype(dist.dtype, np.integer):
        raise ValueError(f"dist (int) and rel must be [M, N] of one shape; got {dist.shape} {dist.dtype} and {rel.shape}")
    if dist.size and (dist.min() < 0 or dist.max() > bits):
        raise ValueError(f"dist must be Hamming distances in [0, bits={bits}]; got values in [{dist.min()}, {dist.max()}]")
    m, n = dist.shape
    width = int(bits) + 1
    flat = (np.arange(m)[:, None] * width + dist).ravel()
    count = np.bincount(flat, minlength=m * width).reshape(m, width)
    relevant = np.bincount(flat[rel.ravel()], minlength=m * width).reshape(m, width)
    return count.astype(np.int64), relevant.astype(np.int64)


def _harmonic(n: int) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(1.0 / np.arange(1, n + 1))])


def _log_factorial(n: int) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1)))])


def _check_blocks(count, relevant, n_rel):
    count, relevant, n_rel = np.asarray(count), np.asarray(relevant), np.asarray(n_rel)
    if count.ndim != 2 or relevant.shape != count.shape or n_rel.shape != count.shape[:1]:
        raise ValueError(f"count and relevant must be [M, B] of one shape and n_rel [M]; got {count.shape}, "
                         f"{relevant.shape} and {n_rel.shape}")
    count, relevant, n_rel = (x.astype(np.int64) for x in (count, relevant, n_rel))
    if ((relevant < 0) | (relevant > count)).any() or (relevant.sum(axis=1) > n_rel).any():
        raise ValueError("tie blocks must have 0 <= relevant <= count and n_rel >= the relevant items in the blocks")
    return count, relevant, n_rel


def expected_report(count, relevant, n_rel, k=10, ks=(1, 5, 10), denominator="min") -> dict:
    """Tie-aware metrics (TIE_DOC) from tie blocks (`tie_blocks` / `hamming_blocks`):
    {f"tie_map@{k}", f"tie_R@{K}", f"tie_P@{K}"}: means over queries of the expected AP@k (Z named as in
    `average_precision_at_k`; "min" or "all", whose Z does not depend on the order), R@K and P@K.

    Within a block of m items (r relevant) that starts after s items, R of them relevant, a uniformly
    random order puts a relevant item at its j-th position with probability r/m, with 1 + (j-1)(r-1)/(m-1)
    relevant items among its first j expected given that; summing P@i over the block's positions <= k is
    a difference of harmonic numbers. R@K misses only when no relevant item lands in the top K: a
    hypergeometric term for the block straddling K.
    """
    if denominator not in ("min", "all"):
        raise ValueError(f"tie-aware AP is defined here for denominator 'min' or 'all' (Z fixed); got {denominator!r}")
    k, ks = _check_k(k), _check_ks(ks)
    count, relevant, n_rel = _check_blocks(count, relevant, n_rel)
    m = count.shape[0]
    if m == 0:
        return {f"tie_map@{k}": 0.0, **{f"tie_R@{K}": 0.0 for K in ks}, **{f"tie_P@{K}": 0.0 for K in ks}}
    s = np.cumsum(count, axis=1) - count                       # items before each block
    rb = np.cumsum(relevant, axis=1) - relevant                # relevant items before each block
    c = count.astype(np.float64)
    r = relevant.astype(np.float64)
    top = int(s[:, -1].max() + count[:, -1].max()) + 1
    H = _harmonic(max(top, int(k)) + 1)
    J = np.clip(int(k) - s, 0, count)                          # positions of the block within the top k
    dH = H[s + J] - H[s]
    frac = np.divide(r, c, out=np.zeros_like(r), where=c > 0)
    b = np.divide(r - 1, c - 1, out=np.zeros_like(r), where=c > 1)
    num = (frac * ((rb + 1) * dH + b * (J - (s + 1) * dH))).sum(axis=1)
    z = np.minimum(int(k), n_rel) if denominator == "min" else n_rel
    ap = np.divide(num, z, out=np.zeros(m), where=z > 0)
    out = {f"tie_map@{int(k)}": float(ap.mean())}
    lf = _log_factorial(top + max(ks))
    for K in ks:
        jk = np.clip(K - s, 0, count)
        out[f"tie_P@{K}"] = float(((frac * jk).sum(axis=1) / K).mean())
        # P(no relevant item in the top K) = prod over blocks of C(m - r, j) / C(m, j)
        free = count - relevant
        ok = free >= jk
        logp = np.where(ok, lf[np.where(ok, free, 0)] - lf[np.where(ok, free - jk, 0)]
                        - lf[count] + lf[count - jk], 0.0)
        p_none = np.where(ok.all(axis=1), np.exp(logp.sum(axis=1)), 0.0)
        out[f"tie_R@{K}"] = float((1.0 - p_none).mean())
    return out


# ---------------------------------------------------------------------------------------------- curves

CURVES_DOC = (
    "Hamming-ranking curves: for each radius r = 0..bits, precision(r) = relevant / retrieved among database items "
    "within Hamming distance r, averaged over the queries that retrieve at least one item (`retrieved` is that "
    "share of queries); recall(r) = relevant within r / all relevant, averaged over queries with a relevant item. "
    "P@H<=2 is precision within radius 2 averaged over all queries, a query that retrieves nothing scoring 0 "
    "(the HashNet/DCH convention). A radius includes every item at that distance, so no tie rule is involved. "
    "Over directions and seeds, precision(r) and recall(r) are the mean of those where they are defined. "
    "P@K: relevant in the top K / K, tie-aware.")


def radius_counts(count, relevant) -> tuple[np.ndarray, np.ndarray]:
    """From `hamming_blocks` (items and relevant items at each distance 0..bits, per query): the items and the
    relevant items within each radius, int64 [M, bits + 1] each."""
    return np.cumsum(count, axis=1), np.cumsum(relevant, axis=1)


def radius_curves(within, rel_within, n_rel=None) -> dict:
    """The Hamming-radius curves of CURVES_DOC from `radius_counts` (all queries):
    {"precision", "recall", "retrieved": lists over radius 0..bits, "p_h2", "p_h2_retrieved"}.
    n_rel: relevant items per query in the database (default: those within the largest radius, i.e. all)."""
    within = np.asarray(within, np.int64)
    rel_within = np.asarray(rel_within, np.int64)
    m, width = within.shape
    n_rel = rel_within[:, -1] if n_rel is None else np.asarray(n_rel, np.int64)
    got = within > 0
    prec = np.divide(rel_within, within, out=np.zeros(within.shape), where=got)
    n_got = got.sum(0)
    precision = np.divide(prec.sum(0), n_got, out=np.zeros(width), where=n_got > 0)
    has_rel = n_rel > 0
    recall = (rel_within[has_rel] / n_rel[has_rel, None]).mean(0) if has_rel.any() else np.zeros(width)
    r2 = min(2, width - 1)
    return {"precision": [float(v) for v in precision], "recall": [float(v) for v in recall],
            "retrieved": [float(v) for v in got.mean(0)] if m else [0.0] * width,
            "p_h2": float(prec[:, r2].mean()) if m else 0.0, "p_h2_retrieved": float(got[:, r2].mean()) if m else 0.0}
