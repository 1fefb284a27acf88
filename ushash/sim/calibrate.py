"""Choosing a cache's per-pair operating points for a false-hit budget, and measuring them.

    cal = calibrate(head, val_pool, val_stream, target=0.01)      # ushash.serving.calibration.Calibration
    res = measure(head, test_pool, test_stream, calibration=cal)   # hit rate, false hits, headroom, per pair

`calibrate` replays a labelled stream (a split's pool, ushash/sim/pool.py) in two passes:

1. Offline, every earlier distinct request is a candidate entry. For each (request modality, entry
   modality) pair and each grid point (radius 0..`max_radius`, payload threshold `threshold_max` down to
   `threshold_min`) the entry the hit rule would serve (the nearest within the radius, ties by higher
   cosine, with payload cosine >= the threshold; the cosine read through the export's payload codec, as
   the cache reads it) is a hit, and a false hit when its class and its source input differ (a caption two
   items share is one input: any deterministic model answers it alike). A pair's path is the grid points
   with enough hits for the bound to meet the budget (`min_trials`), for same-modality pairs with a
   threshold no higher than the lowest cosine an exact repeat reaches through the codec, ordered by their
   hit counts (at most `path_points` of them): all from hit counts, never from the labels. The path ends
   before its first point whose bound fails offline.
2. The real `SemanticCache` (store on miss) replays the same stream once per step: every pair still
   walking at the next point of its path, the others at their last passing point (or off). A pair's walk
   ends at the first point whose one-sided Clopper-Pearson bound exceeds the budget (fixed-sequence
   testing: no multiplicity correction along a path fixed before the labels are read), and with
   `marginal` also where the hits a looser point adds are false more often than the budget. A pair with
   no passing point is off, with the reason.

The bound assumes independent hits; a Zipf stream repeats requests, so `count: distinct` counts each
(request, served entry) pair once instead (stricter, and it needs a larger split).

`measure` replays a stream through a cache with the points (or with one radius / threshold) and reports
the hit rate, false hits per hit and per request, the exact-key and oracle hit rates and the semantic
headroom captured, (hit - exact) / (oracle - exact), with per-pair counts and Clopper-Pearson bounds.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Optional

import numpy as np

from ushash.core.codes import hamming
from ushash.serving.calibration import (Calibration, CalibrationSettings, PairPoint, clopper_pearson_upper,
                                        min_trials, pair_name)

TENANT = "calibration"


@dataclasses.dataclass
class Encoded:
    """Every pool member as the cache sees it: packed code, unit z, payload record, class, exact key."""
    modality: np.ndarray     # str [N]
    codes: np.ndarray        # uint8 [N, bits / 8]
    z: np.ndarray            # float32 [N, dim]
    records: dict            # modality -> (member indices, payload records uint8 [n, nbytes])
    cls: np.ndarray          # int [N]
    key: list
    src: np.ndarray = None   # int [N]: the source input (Pool.source_ids); same class or same source = equivalent

    def __post_init__(self):
        if self.src is None:
            self.src = np.arange(len(self.cls), dtype=np.int64)

    def wrong(self, entry, request) -> np.ndarray | bool:
        """Whether serving `entry` (member indices) to `request` is a false hit: another class and another
        source input (Pool.source_ids)."""
        return (self.cls[entry] != self.cls[request]) & (self.src[entry] != self.src[request])


def encode_pool(head, pool) -> Encoded:
    mods = np.asarray(pool.modality)
    n = len(pool)
    codes = np.zeros((n, int(head.bits) // 8), np.uint8)
    z = np.zeros((n, int(head.dim)), np.float32)
    records = {}
    for m in sorted(set(pool.modality)):
        idx = np.flatnonzero(mods == m)
        c, zz = head.encode(m, np.stack([pool.features[i] for i in idx]))
        zz = zz / np.maximum(np.linalg.norm(zz, axis=1, keepdims=True), 1e-30)
        codes[idx], z[idx] = c, zz
        if getattr(head, "payload", None) is not None:
            records[m] = (idx, head.payload.encode(m, zz.astype(np.float32)))
    src = pool.source_ids() if len(getattr(pool, "source", [])) == n else None
    return Encoded(mods, codes, z, records, np.asarray(pool.cls), list(pool.key), src)


def payload_cosines(head, enc: Encoded) -> np.ndarray:
    """cos[q, e]: request q's z against entry e's payload record, decoded by the codec (float32 [N, N])."""
    n = len(enc.cls)
    cos = np.zeros((n, n), np.float32)
    for m, (idx, recs) in enc.records.items():
        for q in range(n):
            cos[q, idx] = head.payload.scores(m, enc.z[q], recs, checked=False)
    return cos


def repeat_floor(head, enc: Encoded) -> dict[str, float]:
    """The lowest cosine an exact repeat reaches through the payload codec, per modality."""
    out = {}
    for m, (idx, recs) in enc.records.items():
        out[m] = float(min(head.payload.scores(m, enc.z[i], recs[j:j + 1])[0] for j, i in enumerate(idx)))
    return out


def _path(settings: CalibrationSettings) -> np.ndarray:
    s = settings
    n = int(round((float(s.threshold_max) - float(s.threshold_min)) / float(s.threshold_step))) + 1
    return np.round(float(s.threshold_max) - np.arange(n) * float(s.threshold_step), 6)


def offline_counts(enc: Encoded, cos: np.ndarray, stream: np.ndarray, thresholds: np.ndarray, radii: np.ndarray):
    """Per pair: hits and false hits [R, T] on the grid radii x thresholds, every earlier distinct request
    a candidate entry (the hit rule: the nearest within the radius with cosine >= the threshold)."""
    dist = hamming(enc.codes, enc.codes)
    mods = sorted(set(enc.modality.tolist()))
    mod_idx = {m: i for i, m in enumerate(mods)}
    mcode = np.array([mod_idx[m] for m in enc.modality])
    R, T = len(radii), len(thresholds)
    rmax = int(radii.max())
    out = {pair_name(a, b): [np.zeros((R, T), np.int64), np.zeros((R, T), np.int64)] for a in mods for b in mods}
    seen = np.zeros(len(enc.cls), bool)
    order = []
    for q in stream.tolist():
        if order:
            cand = np.asarray(order)
            d = dist[q, cand]
            near = d <= rmax
            for b in mods:
                sel = cand[near & (mcode[cand] == mod_idx[b])]
                if not len(sel):
                    continue
                ds, cs = dist[q, sel], cos[q, sel]
                o = np.lexsort((sel, -cs, ds))
                sel, ds, cs = sel[o], ds[o], cs[o]
                runmax = np.maximum.accumulate(cs)
                # the first candidate (in serving order) with cosine >= t, per threshold t: a hit at radius r
                # when it lies within r (the serving order is by distance first)
                jj = np.searchsorted(runmax, thresholds, side="left")
                ok = jj < len(runmax)
                jj = np.minimum(jj, len(runmax) - 1)
                okr = ok[None, :] & (ds[jj][None, :] <= radii[:, None])
                wrong = enc.wrong(sel[jj], q)[None, :]
                acc = out[pair_name(enc.modality[q], b)]
                acc[0] += okr
                acc[1] += okr & wrong
        if not seen[q]:
            seen[q] = True
            order.append(q)
    return out


def pair_path(n: np.ndarray, radii: np.ndarray, thresholds: np.ndarray, need: int, floor: float | None,
              points: int) -> list[tuple[int, float]]:
    """A pair's path of (radius, threshold), tightest first, from hit counts only (never the labels): the
    grid points with at least `need` hits (and a threshold no higher than `floor`), ordered by hits, at most
    `points` of them evenly spaced in that order."""
    rr, tt = np.meshgrid(np.arange(len(radii)), np.arange(len(thresholds)), indexing="ij")
    ok = n >= need
    if floor is not None:
        ok &= thresholds[None, :] <= floor + 1e-9
    cells = [(int(n[i, j]), int(radii[i]), -float(thresholds[j])) for i, j in zip(rr[ok], tt[ok])]
    cells.sort()
    if len(cells) > points:
        pick = np.unique(np.round(np.linspace(0, len(cells) - 1, points)).astype(int))
        cells = [cells[i] for i in pick]
    return [(r, -t) for _, r, t in cells]


def calibrate(head, pool, stream: np.ndarray, target: float, settings: CalibrationSettings | None = None,
              cache_cfg: dict | None = None, info: dict | None = None) -> Calibration:
    s = settings or CalibrationSettings()
    target = float(target)
    delta = 1.0 - float(s.confidence)
    enc = encode_pool(head, pool)
    cos = payload_cosines(head, enc)
    floors = repeat_floor(head, enc) if s.repeat_floor else {}
    thresholds = _path(s)
    radii = np.arange(int(s.max_radius) + 1)
    counts = offline_counts(enc, cos, stream, thresholds, radii)
    need = min_trials(target, delta)
    # pass 1 (offline, every earlier request an entry): each pair's path, ended before its first point whose
    # bound fails offline (ending a fixed sequence earlier only declares fewer points safe)
    paths: dict[str, list[tuple[int, float]]] = {}
    points: dict[str, PairPoint] = {}
    for k, (n, bad) in sorted(counts.items()):
        a, b = k.split(">")
        path = pair_path(n, radii, thresholds, need, floors.get(b) if a == b else None, int(s.path_points))
        ri = {int(r): i for i, r in enumerate(radii)}
        ti = {float(t): j for j, t in enumerate(thresholds)}
        kept = []
        for r, t in path:
            i, j = ri[r], ti[t]
            if clopper_pearson_upper(int(bad[i, j]), int(n[i, j]), delta) > target:
                break
            kept.append((r, t))
        if not kept:
            why = (f"at most {int(n.max())} hits on the calibration stream, {need} needed" if not path
                   else f"bound {clopper_pearson_upper(int(bad[ri[path[0][0]], ti[path[0][1]]]), int(n[ri[path[0][0]], ti[path[0][1]]]), delta):.4f} > {target} "
                        "at its tightest point")
            points[k] = PairPoint(False, reason=why)
        else:
            paths[k] = kept
            points[k] = PairPoint(False, reason="not yet tested")
    # pass 2: the cache itself (store on miss) replays the stream; every pair still walking is at the next
    # threshold of its path, the others at the last point that passed (or off)
    walking = {k: 0 for k in paths}
    rounds = []
    while walking:
        trial = {k: (dataclasses.replace(points[k]) if k not in walking else
                     PairPoint(True, *paths[k][walking[k]]))
                 for k in points}
        cal = Calibration(str(head.revision), target, float(s.confidence), trial)
        res = measure(head, pool, stream, calibration=cal, cache_cfg=cache_cfg, enc=enc, confidence=float(s.confidence))
        rounds.append({k: (*paths[k][i], res["pairs"].get(k, {}).get("hits", 0),
                           res["pairs"].get(k, {}).get("false_hits", 0)) for k, i in walking.items()})
        for k in list(walking):
            pr = dict(res["pairs"].get(k, {"hits": 0, "false_hits": 0, "upper": 1.0, "distinct": 0,
                                           "distinct_false": 0, "distinct_upper": 1.0}))
            if s.count == "distinct":
                pr.update(hits=pr["distinct"], false_hits=pr["distinct_false"], upper=pr["distinct_upper"])
            r, t = paths[k][walking[k]]
            if pr["hits"] >= need and pr["upper"] > target:   # the first failure ends the pair's sequence
                if not points[k].on:
                    points[k] = PairPoint(False, reason=f"bound {pr['upper']:.4f} > {target} at its tightest "
                                                        f"testable point (radius {r}, threshold {t:.4f})")
                del walking[k]
                continue
            prev = points[k]
            if pr["hits"] >= need and prev.on and s.marginal:
                dn, dk = pr["hits"] - prev.hits, pr["false_hits"] - prev.false_hits
                if dn <= 0:        # nothing gained: stay at the tighter point, walk on
                    walking[k] += 1
                    if walking[k] >= len(paths[k]):
                        del walking[k]
                    continue
                if dk > float(target) * dn:   # the added hits are false more often than the budget allows
                    del walking[k]
                    continue
            if pr["hits"] >= need:
                points[k] = PairPoint(True, int(r), t, int(pr["hits"]), int(pr["false_hits"]),
                                      float(pr["upper"]))
            walking[k] += 1
            if walking[k] >= len(paths[k]):
                del walking[k]
        for k in paths:
            if not points[k].on and k not in walking and points[k].reason == "not yet tested":
                points[k] = PairPoint(False, reason=f"fewer than {need} hits at every point of its path")
    return Calibration(str(head.revision), target, float(s.confidence), points,
                       {**(info or {}), "settings": dataclasses.asdict(s), "repeat_floor": floors,
                        "calibration_requests": int(len(stream)), "min_trials": need,
                        "replays": rounds})


def measure(head, pool, stream: np.ndarray, calibration: Optional[Calibration] = None, cache_cfg: dict | None = None,
            enc: Encoded | None = None, confidence: float = 0.95) -> dict:
    """Replay `stream` through a `SemanticCache` (store on a miss, no expiry) and count; a hit is false
    when the entry is of another class and another source input (`Encoded.wrong`)."""
    from ushash.serving.cache import Query, SemanticCache

    enc = enc or encode_pool(head, pool)
    cfg = {"capacity_bytes": 1 << 30, "ttl_s": None, **(cache_cfg or {}), "l2": None}
    cache = SemanticCache(head, cfg, rng=random.Random(0), calibration=calibration)
    queries = [Query(str(m), c.tobytes(), zz) for m, c, zz in zip(enc.modality, enc.codes, enc.z)]
    hits = false = exact = oracle = 0
    pairs: dict[str, list[int]] = {}
    keys, classes = set(), set()
    for q in stream.tolist():
        c = int(enc.cls[q])
        exact += enc.key[q] in keys
        oracle += c in classes
        keys.add(enc.key[q])
        classes.add(c)
        h = cache.lookup(queries[q], TENANT)
        if h is None:
            cache.store(queries[q], int(q), TENANT)   # the entry's member: its class and source input
            continue
        hits += 1
        wrong = bool(enc.wrong(int(h.value), q))
        false += wrong
        acc = pairs.setdefault(pair_name(queries[q].modality, h.modality), [0, 0, 0, set(), set()])
        acc[0] += 1
        acc[1] += wrong
        acc[2] = max(acc[2], int(h.distance))
        acc[3].add((q, h.entry))
        if wrong:
            acc[4].add((q, h.entry))
    n = len(stream)
    delta = 1.0 - float(confidence)
    hr, ex, orc = hits / n, exact / n, oracle / n
    return {"requests": n, "hit_rate": hr, "hits": hits, "false_hits": false,
            "false_per_hit": false / hits if hits else 0.0, "false_per_request": false / n,
            "false_per_hit_upper": clopper_pearson_upper(false, hits, delta),
            "exact_hit_rate": ex, "oracle_hit_rate": orc, "headroom_captured": headroom(hr, ex, orc),
            "pairs": {k: {"hits": a, "false_hits": b, "rate": b / a if a else 0.0,
                          "upper": clopper_pearson_upper(b, a, delta), "max_distance": r,
                          "distinct": len(da), "distinct_false": len(db),
                          "distinct_upper": clopper_pearson_upper(len(db), len(da), delta)}
                      for k, (a, b, r, da, db) in sorted(pairs.items())}}


def headroom(hit_rate: float, exact_hit_rate: float, oracle_hit_rate: float) -> float:
    """Semantic headroom captured: (hit - exact) / (oracle - exact); nan when the oracle gains nothing."""
    gap = oracle_hit_rate - exact_hit_rate
    return (hit_rate - exact_hit_rate) / gap if gap > 0 else float("nan")


__all__ = ["Encoded", "calibrate", "encode_pool", "headroom", "measure", "offline_counts", "payload_cosines"]
