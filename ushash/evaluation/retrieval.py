"""Cross-modal retrieval over one feature split: every direction the data has, codes or floats.

A *method* maps (modality, features) to either packed binary codes (ranked by Hamming distance with a
faiss binary index) or float embeddings (ranked by cosine). Both use the same tie rule: equal scores are
ordered by ascending database row (the feature-store table order). Every result row names its protocol
and its mAP denominator.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

import ushash
from ushash.core import codes as codes_lib
from ushash.core import metrics
from ushash.core.groups import vocabulary
from ushash.data.store import FeatureSplit
from ushash.core.index import HammingIndex, _l2_normalise, cosine_scores, cosine_search, distinct_rows

log = logging.getLogger(__name__)

LETTER = {"image": "I", "text": "T", "audio": "A"}
KINDS = ("codes", "float")
DENOMINATOR_DOC = {"min": "Z=min(k, #relevant)", "found": "Z=#relevant in top k", "all": "Z=#relevant"}

# A method returns ("codes", uint8 [N, bits/8]) or ("float", float32 [N, d]).
Method = Callable[[str, np.ndarray], tuple[str, np.ndarray]]


def directions(modalities) -> list[tuple[str, str]]:
    ms = list(modalities)
    return [(a, b) for a in ms for b in ms if a != b]


def direction_name(q: str, d: str) -> str:
    return f"{LETTER[q]}→{LETTER[d]}"


def _group_ids(split: FeatureSplit) -> dict[str, np.ndarray]:
    """modality -> int64 group id per row (one vocabulary across the split's modalities)."""
    return _joint_group_ids([split])[0]


def _label_matrix(split: FeatureSplit) -> dict[str, np.ndarray] | None:
    """modality -> multi-hot bool [N, L] over the split's label names; None when it has no labels."""
    out = _joint_label_matrix([split])
    return None if out is None else out[0]


def _joint_group_ids(splits: list[FeatureSplit]) -> list[dict[str, np.ndarray]]:
    """One vocabulary (ushash.core.groups) over the modalities of every split: modality -> int64 per row."""
    _, index = vocabulary({(i, m): t.groups for i, s in enumerate(splits) for m, t in s.tables.items()})
    return [{m: index[(i, m)] for m in s.tables} for i, s in enumerate(splits)]


def _joint_label_matrix(splits: list[FeatureSplit]) -> list[dict[str, np.ndarray]] | None:
    names = sorted(set(l for s in splits for t in s.tables.values() for labs in t.labels for l in labs))
    if not names:
        return None
    col = {n: i for i, n in enumerate(names)}
    out = []
    for s in splits:
        per = {}
        for m, t in s.tables.items():
            mh = np.zeros((len(t), len(names)), dtype=bool)
            for i, labs in enumerate(t.labels):
                if isinstance(labs, str):  # "cat" would be the labels c, a and t
                    raise ValueError(f"the labels of {m} row {i} must be a tuple of names; got the str {labs!r}")
                mh[i, [col[l] for l in labs]] = True
            per[m] = mh
        out.append(per)
    return out


def represent(split: FeatureSplit, method: Method) -> dict:
    """modality -> method(modality, features) for every table of the split the method can encode."""
    reps = {}
    for m, t in split.tables.items():
        try:
            reps[m] = method(m, np.asarray(t.x))
        except KeyError as e:
            if e.args != (m,):
                raise  # a bug inside the method, not "no encoder": its directions must not vanish silently
            continue  # the method has no encoder for this modality (it raised KeyError(modality))
    return reps


def check_rep(rep, name: str, modality: str, n_rows: int, where: str) -> tuple[str, np.ndarray]:
    """A method's output for one table: ("codes", packed uint8 [n_rows, bits/8]) or ("float", finite [n_rows, d])."""
    what = f"method {name!r} on the {where} {modality} table"
    if not (isinstance(rep, tuple) and len(rep) == 2 and rep[0] in KINDS and isinstance(rep[1], np.ndarray)):
        got = f"({rep[0]!r}, {type(rep[1]).__name__})" if isinstance(rep, tuple) and len(rep) == 2 else type(rep).__name__
        raise ValueError(f"{what} must return ('codes', uint8 array) or ('float', float array); got {got}")
    kind, x = rep
    if x.ndim != 2 or len(x) != n_rows:
        raise ValueError(f"{what} must return one row per table row [{n_rows}, ...]; got shape {x.shape}")
    if kind == "codes" and x.dtype != np.uint8:
        raise ValueError(f"{what} must return packed uint8 codes (ushash.core.codes.pack); got dtype {x.dtype}")
    if kind == "float" and np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
        raise ValueError(f"{what} returned NaN or inf; check the features and the method's weights")
    return kind, x


#: K of the P@K curves (`evaluate(..., curves=True)`); capped at the database size.
P_AT_K = (1, 5, 10, 20, 50, 100)


def evaluate(split: FeatureSplit, methods: dict[str, Method] | None = None, k: int = 10, ks=(1, 5, 10),
             protocols=("paired", "label"), denominator: str = "min", database: FeatureSplit | None = None,
             reps: dict[str, dict] | None = None, curves: bool = False,
             skipped: list | None = None) -> list[dict]:
    """One row per (method, direction, protocol). The label protocol runs only if the split has labels.

    Queries come from `split`; the database is `database` when given (the hashing protocol's query set
    against its retrieval set), else `split` itself. A direction runs when its query table and its database
    table both have rows (no queries: no mean to take). With a separate database, a direction between the
    modalities the two splits have that one side lacks (e.g. I→A against a database with no audio rows) is
    not in the rows: it is logged as a warning and, when `skipped` is a list, appended to it as
    {"method", "direction", "reason"} (`plan_directions`). A database smaller than k pads the ranking with
    "no result" (-1), which is never relevant. Methods are functions (`methods`) or representations already
    computed by `represent` (`reps`: name -> modality -> (kind, array)), for queries and database alike
    when there is no separate database.

    Each row has the tie-broken metrics (ties by ascending database index: map@k, R@K) and the tie-aware ones
    (metrics.TIE_DOC: tie_map@k, tie_R@K, tie_P@K). curves=True adds "p_at_k" (tie-aware P@K for P_AT_K) and,
    for codes, the Hamming-radius curves "pr", "p_h2", "p_h2_retrieved" (metrics.CURVES_DOC).
    """
    db_split = database if database is not None else split
    both = [split, db_split]
    (q_groups, d_groups) = _joint_group_ids(both) if database is not None else _joint_group_ids([split]) * 2
    labels = _joint_label_matrix(both) if "label" in protocols else None
    sources = {name: (represent(split, fn), represent(db_split, fn) if database is not None else None)
               for name, fn in (methods or {}).items()}
    for name, r in (reps or {}).items():
        if database is not None:
            raise ValueError("precomputed reps hold one split; pass methods to rank against another database")
        sources[name] = (r, None)
    rows, missed = [], []
    for name, (q_reps, d_reps) in sources.items():
        d_reps = d_reps if d_reps is not None else q_reps
        q_reps = {m: check_rep(q_reps[m], name, m, len(split.tables[m]), "query")
                  for m in split.modalities if m in q_reps}
        d_reps = {m: check_rep(d_reps[m], name, m, len(db_split.tables[m]), "database")
                  for m in db_split.modalities if m in d_reps}
        runs, lacking = plan_directions(split, db_split, q_reps, d_reps, name)
        missed += lacking
        for q, d in runs:
            kind, qx = q_reps[q]
            dkind, dx = d_reps[d]
            if dkind != kind:
                raise ValueError(f"method {name!r} returned {kind} for {q} but {dkind} for {d}; one kind per method")
            I, bits = rank(kind, qx, dx, max(k, *ks))  # R@K for every K of ks, whatever k is
            here = [p for p in protocols if p != "label" or labels is not None]
            rel_args = {p: (q_groups[q], d_groups[d], p, labels[0][q] if p == "label" else None,
                            labels[1][d] if p == "label" else None) for p in here}
            p_ks = tuple(K for K in P_AT_K if K <= len(dx)) or (max(1, len(dx)),)
            full = full_ranking(kind, qx, dx, rel_args, k=k, ks=tuple(sorted(set(ks) | (set(p_ks) if curves else set()))),
                                denominator=denominator, radius=curves and kind == "codes")
            for protocol in here:
                rep = metrics.retrieval_report(
                    I, q_groups[q], d_groups[d], protocol=protocol, k=k, ks=ks, denominator=denominator,
                    q_labels=labels[0][q] if protocol == "label" else None,
                    db_labels=labels[1][d] if protocol == "label" else None)
                extra = full.get(protocol, {})
                shown = [f"tie_map@{k}"] + [f"tie_{x}@{K}" for x in ("R", "P") for K in ks]
                row = {"method": name, "kind": kind, "bits": bits, "direction": direction_name(q, d),
                       "n_database": int(len(dx)), **rep, **{key: extra[key] for key in shown if key in extra}}
                if curves:
                    row["p_at_k"] = {str(K): extra[f"tie_P@{K}"] for K in p_ks if f"tie_P@{K}" in extra}
                    if "radius" in extra:
                        c = extra["radius"]
                        row.update({"pr": {key: c[key] for key in ("precision", "recall", "retrieved")},
                                    "p_h2": c["p_h2"], "p_h2_retrieved": c["p_h2_retrieved"]})
                rows.append(row)
    if missed:
        log.warning("%s", skipped_summary(missed))
        if skipped is not None:
            skipped.extend(missed)
    return rows


def _split_name(split: FeatureSplit, role: str) -> str:
    name = (split.meta or {}).get("split") or (split.path.name if split.path is not None else None)
    return f"the {role} split {name!r}" if name else f"the {role} split"


def plan_directions(split: FeatureSplit, db_split: FeatureSplit, q_reps: dict, d_reps: dict,
                    method: str) -> tuple[list[tuple[str, str]], list[dict]]:
    """The directions one method runs, and those it cannot: every direction between the modalities with rows
    on either side (the query split's, the database's) runs when its query modality has rows in the query
    split and its database modality has rows in the database. With no separate database the two sides are
    one split, so nothing is ever lacking; with one, a direction a side lacks is returned as
    {"method", "direction", "reason"}. A modality the method cannot encode on either side (it raised
    KeyError(modality)) is no direction of the method's at all."""
    q_has = {m for m, (_, x) in q_reps.items() if len(x)}
    d_has = {m for m, (_, x) in d_reps.items() if len(x)}

    def lack(m, s, reps, role):
        if m in s.tables and len(s.tables[m]) and m not in reps:
            return f"method {method!r} cannot encode the {m} rows of {_split_name(s, role)}"
        return f"{_split_name(s, role)} has no {m} rows"

    runs, lacking = [], []
    for q, d in directions(m for m in ushash.MODALITIES if m in q_has or m in d_has):
        if q in q_has and d in d_has:
            runs.append((q, d))
        else:
            reason = lack(q, split, q_reps, "query") if q not in q_has else lack(d, db_split, d_reps, "database")
            lacking.append({"method": method, "direction": direction_name(q, d), "reason": reason})
    return runs, lacking


def skipped_summary(skipped: list[dict]) -> str:
    """One line for the directions `evaluate` could not run: each reason once, with its directions."""
    by_reason: dict[str, dict] = {}
    for s in skipped:
        by_reason.setdefault(s["reason"], {})[s["direction"]] = None
    parts = [f"{', '.join(dirs)} ({reason})" for reason, dirs in by_reason.items()]
    return "not evaluated, so not in the tables: " + "; ".join(parts)


def full_ranking(kind: str, qx: np.ndarray, dx: np.ndarray, rel_args: dict, k: int = 10, ks=(1, 5, 10),
                 denominator: str = "min", radius: bool = False) -> dict[str, dict]:
    """What needs every database item's score, in one pass over blocks of queries: per protocol the tie-aware
    metrics (metrics.expected_report; not for denominator "found") and, with `radius` (codes), the
    Hamming-radius curves (metrics.radius_curves). Scores are Hamming distances (codes) or cosines (floats).
    rel_args: protocol -> the arguments of metrics.relevance_matrix for these queries."""
    tie = denominator in ("min", "all")
    if not len(qx) or not len(dx) or not (tie or radius):
        return {}
    n, m = len(dx), len(qx)
    depth = max(int(k), *ks)
    sums: dict[str, dict] = {p: {} for p in rel_args}
    counts = {p: [] for p in rel_args}
    if kind == "codes":
        wq, wd = codes_lib.words(np.ascontiguousarray(qx)), codes_lib.words(np.ascontiguousarray(dx))
        bits = int(qx.shape[1] * 8)
    else:
        qn, rows = _l2_normalise(np.asarray(qx, np.float32)), distinct_rows(_l2_normalise(np.asarray(dx, np.float32)))
    step = max(1, (1 << 21) // n)
    for s in range(0, m, step):
        sl = slice(s, s + step)
        score = codes_lib.hamming_words(wq[sl], wd) if kind == "codes" else cosine_scores(qn[sl], rows)
        for p, (qg, dg, proto, ql, dl) in rel_args.items():
            rel = metrics.relevance_matrix(qg[sl], dg, proto, ql[sl] if ql is not None else None, dl)
            blocks = (metrics.hamming_blocks(score, rel, bits) if kind == "codes"
                      else metrics.tie_blocks(score, rel, depth, descending=True))
            if tie:
                rep = metrics.expected_report(*blocks, rel.sum(axis=1), k=k, ks=ks, denominator=denominator)
                for key, v in rep.items():
                    sums[p][key] = sums[p].get(key, 0.0) + v * len(rel)
            if radius:
                counts[p].append(metrics.radius_counts(*blocks))
    out = {p: {key: v / m for key, v in acc.items()} for p, acc in sums.items()}
    if radius:
        for p, parts in counts.items():
            within = np.concatenate([w for w, _ in parts])
            rel_within = np.concatenate([r for _, r in parts])
            out[p]["radius"] = metrics.radius_curves(within, rel_within)
    return out


def rank(kind: str, qx: np.ndarray, dx: np.ndarray, k: int) -> tuple[np.ndarray, int | None]:
    """Top-k database rows per query (ties by ascending index) and the code length (None for floats)."""
    if kind == "codes":
        return HammingIndex(dx).search(qx, k)[1], int(qx.shape[1] * 8)
    return cosine_search(qx, dx, k)[1], None


SELECTION_DOC = ("mean tie-broken mAP@10 (ties by ascending database index) over every direction and over the "
                 "protocols the split has (paired, and label when it has labels)")
# The tables rank methods by the tie-aware mAP@10; selection uses the tie-broken value. Selecting by the tie-aware
# one instead was tried (US-HASH at 16 and 64 bits, 3 seeds, both real sets): test scores moved within the seeds'
# spread, up and down, so the rule that chose every published checkpoint stays.


def selection_score(split: FeatureSplit, method: Method) -> float:
    """What every choice on the validation split maximises (checkpoints, epochs, the shared space's settings):
    see SELECTION_DOC. One number, so that all methods are chosen by the same rule."""
    return selection(evaluate(split, {"m": method}, protocols=("paired", "label")))  # label only where there are labels


def selection(rows: list[dict]) -> float:
    """The selection score of one method's `evaluate` rows (SELECTION_DOC)."""
    if not rows:
        raise ValueError("selection needs the rows of at least one direction; got none (the method encoded fewer "
                         "than two modalities with rows)")
    return float(np.mean([mean_map(rows, p) for p in sorted({r["protocol"] for r in rows})]))


def mean_map(rows: list[dict], protocol: str = "paired", k: int = 10, key: str | None = None) -> float:
    """Mean over directions of mAP@k (`key`: another row field, e.g. "tie_map@10")."""
    vals = [r[key or f"map@{k}"] for r in rows if r["protocol"] == protocol]
    return float(np.mean(vals)) if vals else 0.0


def headline_map(rows: list[dict], k: int = 10) -> float:
    """Mean over directions of the paired tie-aware mAP@k; the tie-broken one where the rows have no tie-aware
    value (denominator "found", whose Z depends on the order)."""
    key = f"tie_map@{k}" if any(f"tie_map@{k}" in r for r in rows) else f"map@{k}"
    return mean_map(rows, "paired", key=key)
