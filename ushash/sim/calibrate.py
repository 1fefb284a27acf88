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

`path: split` (Learn-then-Test with part of the stream spent on choosing the path): the stream is split
by item (`split_stream`: disjoint classes, stratified by popularity) into a path half and a test half.
On the path half each candidate path is walked as above: the hits path and a radius sweep (radius 0, 1,
... at one threshold) per `tight_thresholds` entry; each pair keeps the tightest candidate that passed
unless a looser one served at least `min_trials` more hits there (`choose_path`; `prefer: loose` takes the
sweep with the most hits, ties to the looser, and each walk's last passing point). The test half alone
then walks the chosen path (pass 1 on its own counts, then pass 2), and its counts and bounds are the
calibration's: the path was chosen without them, so fixed-sequence testing needs no correction.

The bound assumes independent hits; a Zipf stream repeats requests, so `count: distinct` counts each
(request, served entry) pair once instead, and `count: items` counts the request items a pair served, an
item with any false hit one event: an item whose first request is served another item's entry is never
stored, so every repeat of it is false: items, not hits, are the independent trials (strictest; certifying
a rate r with no event needs min_trials(r) items). Every point reports its evidence in all three units.

`measure` replays a stream through a cache with the points (or with one radius / threshold) and reports
the hit rate, false hits per hit and per request, the exact-key and oracle hit rates and the semantic
headroom captured, (hit - exact) / (oracle - exact), with per-pair counts and Clopper-Pearson bounds.

`pool_and_stream` is the labelled stream of an export's own rows of a split (what the calibrate verb and
benchmarks/false_hit_budget.py replay); `run_calibrate` is `python -m ushash.calibrate` (configs/calibrate.yaml,
every setting in `CalibrateConfig`, registered in Hydra's ConfigStore as `schema_calibrate` on import).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ushash.core.codes import hamming
from ushash.serving.calibration import (Calibration, CalibrationSettings, PairPoint, clopper_pearson_upper,
                                        min_trials, pair_name)

TENANT = "calibration"

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CalibrateConfig:
    """python -m ushash.calibrate (configs/calibrate.yaml): every setting with its default and meaning."""
    export: str = "???"               # required: the export to calibrate (python -m ushash.export); a relative
                                      # path is taken from the repository root
    target_false_hit_rate: float = 0.01   # the budget: false hits per hit of every modality pair
    split: str = "val"                # the labelled calibration stream is replayed from this split (never test)
    requests: int = 40000             # calibration stream length
    zipf_s: float = 1.0               # the stream's popularity skew over items (ushash/sim/stream.py)
    seed: int = 0                     # the pool's variants and the stream
    features_dir: Optional[str] = None  # default: the export's feature store, else paths.features_dir
    out: Optional[str] = None         # default: <export>/calibration.json (what cache.calibration= loads)
    calibration: CalibrationSettings = dataclasses.field(default_factory=CalibrationSettings)  # how the points
                                      # are chosen (ushash/serving/calibration.py); split and n_requests
                                      # follow split= and requests= (configs/calibrate.yaml)
    paths: Any = None


def register_schema() -> None:
    """Put the schema in Hydra's ConfigStore (idempotent): configs/calibrate.yaml names it in its defaults."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="schema_calibrate", node=CalibrateConfig)


register_schema()


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
    """The grid's thresholds: threshold_max down to threshold_min in threshold_step, never below threshold_min
    (a step that does not divide the range ends the grid above it)."""
    s = settings
    n = int(np.floor((float(s.threshold_max) - float(s.threshold_min)) / float(s.threshold_step) + 1e-9)) + 1
    return np.round(float(s.threshold_max) - np.arange(n) * float(s.threshold_step), 6)


def offline_counts(enc: Encoded, cos: np.ndarray, stream: np.ndarray, thresholds: np.ndarray, radii: np.ndarray):
    """Per pair: hits and false hits [R, T] on the grid radii x thresholds, every earlier distinct request
    a candidate entry (the hit rule: the nearest within the radius with cosine >= the threshold; among equals,
    the entry seen first, as the cache serves the entry stored first)."""
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
                first = np.flatnonzero(near & (mcode[cand] == mod_idx[b]))   # positions in `order`: first seen first
                if not len(first):
                    continue
                sel = cand[first]
                ds, cs = dist[q, sel], cos[q, sel]
                o = np.lexsort((first, -cs, ds))
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


def split_stream(pool, stream: np.ndarray, by: str = "item", frac: float = 0.5, seed: int = 0) -> np.ndarray:
    """Learn-then-Test's split of a calibration stream: a bool per request, True in the path-choosing half.
    By "item": every request of a class in one half, so the halves share no item and the test half's
    evidence is about items the path never saw. The split is stratified by the modalities an item has
    (few items have audio: each half gets its share of them) and by popularity (a Zipf stream puts a fifth
    of its requests on one item): within each set of modalities the classes, by request count (most
    first), are dealt in runs of round(1 / min(frac, 1 - frac)), and in each run a seeded `frac` of them
    (rounded at random) goes to the path half. By "request": a seeded `frac` of the requests."""
    stream = np.asarray(stream)
    rng = np.random.default_rng(int(seed))
    if by == "item":
        all_cls, mods = np.asarray(pool.cls), np.asarray(pool.modality)
        cls = all_cls[stream]
        items, n = np.unique(cls, return_counts=True)
        has = {int(c): tuple(sorted(set(mods[all_cls == c].tolist()))) for c in items}
        run = max(2, int(round(1.0 / min(float(frac), 1.0 - float(frac)))))
        chosen = []
        for key in sorted(set(has.values())):
            sel = np.array([has[int(c)] == key for c in items])
            group = items[sel][np.lexsort((items[sel], -n[sel]))]   # most requested first, ties by class
            for i in range(0, len(group), run):
                block = group[i:i + run]
                want = float(frac) * len(block)
                take = int(np.floor(want + 1e-9)) + int(rng.random() < want - np.floor(want + 1e-9))   # rounded at random
                chosen += rng.permutation(block)[:take].tolist()
        return np.isin(cls, chosen)
    if by == "request":
        mask = np.zeros(len(stream), bool)
        mask[rng.permutation(len(stream))[:int(round(float(frac) * len(stream)))]] = True
        return mask
    raise ValueError(f"split_by must be item or request; got {by!r}")


def unit_counts(pr: dict, count: str) -> dict:
    """A pair's replay counts in the unit the bound counts (`CalibrationSettings.count`)."""
    if count == "distinct":
        return {**pr, "hits": pr["distinct"], "false_hits": pr["distinct_false"], "upper": pr["distinct_upper"]}
    if count == "items":
        return {**pr, "hits": pr["items"], "false_hits": pr["items_false"], "upper": pr["items_upper"]}
    return pr


def _units(pr: dict) -> dict:
    return {"distinct": [int(pr["distinct"]), int(pr["distinct_false"]), float(pr["distinct_upper"])],
            "items": [int(pr["items"]), int(pr["items_false"]), float(pr["items_upper"])]}


def offline_paths(counts: dict, candidates, radii: np.ndarray, thresholds: np.ndarray, delta: float, target: float,
                  need: int) -> tuple[dict, dict]:
    """Pass 1: each pair's path (`candidates(pair, hits) -> [(radius, threshold), ...]`) ended before its first
    point whose bound fails offline (ending a fixed sequence earlier only declares fewer points safe); pairs
    with no point left get an off point with the reason. Returns (paths, points)."""
    paths: dict[str, list[tuple[int, float]]] = {}
    points: dict[str, PairPoint] = {}
    ri = {int(r): i for i, r in enumerate(radii)}
    ti = {float(t): j for j, t in enumerate(thresholds)}
    for k, (n, bad) in sorted(counts.items()):
        path = candidates(k, n)
        kept = []
        for r, t in path:
            i, j = ri[r], ti[t]
            if n[i, j] < need:       # too few hits to test here: a later point may have enough
                continue
            if clopper_pearson_upper(int(bad[i, j]), int(n[i, j]), delta) > target:
                break
            kept.append((r, t))
        if not kept:
            tested = [(r, t) for r, t in path if n[ri[r], ti[t]] >= need]
            # the most hits at its path's points (an empty path: no grid point had enough; the grid's most)
            most = (f"{max(int(n[ri[r], ti[t]]) for r, t in path)} hits at the points of its path" if path
                    else f"{int(n.max())} hits")
            why = (f"at most {most} on the calibration stream, {need} needed" if not tested
                   else f"bound {clopper_pearson_upper(int(bad[ri[tested[0][0]], ti[tested[0][1]]]), int(n[ri[tested[0][0]], ti[tested[0][1]]]), delta):.4f} > {target} "
                        "at its tightest point")
            points[k] = PairPoint(False, reason=why)
        else:
            paths[k] = kept
            points[k] = PairPoint(False, reason="not yet tested")
    return paths, points


def walk(head, pool, stream: np.ndarray, paths: dict, points: dict, target: float, s: CalibrationSettings,
         need: int, enc: Encoded, cache_cfg: dict | None = None) -> tuple[dict, list]:
    """Pass 2, fixed-sequence testing: the real `SemanticCache` (store on miss) replays `stream` once per
    step; every pair still walking is at the next point of its path, the others at the last point that
    passed (or off). A pair's walk ends at its first point whose bound (in `s.count`'s unit) exceeds the
    target, and with `s.marginal` also where the hits a looser point adds are false more often than the
    target. Returns (points, the replays' counts)."""
    points = {k: dataclasses.replace(p) for k, p in points.items()}
    walking = {k: 0 for k in paths if paths[k]}
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
            pr = unit_counts(dict(res["pairs"].get(k, _EMPTY)), s.count)
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
                if dn < 0 or (dn == 0 and s.prefer == "tight"):   # nothing gained: stay at the tighter point
                    walking[k] += 1
                    if walking[k] >= len(paths[k]):
                        del walking[k]
                    continue
                if dk > float(target) * dn:   # the added hits are false more often than the budget allows
                    del walking[k]
                    continue
            if pr["hits"] >= need:
                points[k] = PairPoint(True, int(r), t, int(pr["hits"]), int(pr["false_hits"]),
                                      float(pr["upper"]), units=_units(pr))
            walking[k] += 1
            if walking[k] >= len(paths[k]):
                del walking[k]
    for k in paths:
        if not points[k].on and points[k].reason == "not yet tested":
            points[k] = PairPoint(False, reason=f"fewer than {need} {s.count} at every point of its path")
    return settle(head, pool, stream, points, target, s, need, enc, cache_cfg, rounds)


def settle(head, pool, stream: np.ndarray, points: dict, target: float, s: CalibrationSettings, need: int,
           enc: Encoded, cache_cfg: dict | None = None, rounds: list | None = None) -> tuple[dict, list]:
    """The walk's points replayed together: a pair's evidence was counted in the round where it last passed,
    while the pairs still walking were at other points, and what one pair serves changes what another does
    (a hit is not stored; cross-modal pairs share entries). Every pair on is given the counts of `stream`
    replayed with all pairs at their final points; one whose bound then exceeds the target, or that serves
    fewer than `need`, is turned off, and the replay is repeated until none is (turning a pair off only
    declares fewer points safe). The replays are appended to `rounds` (marked "settle"). Returns (points,
    rounds)."""
    points = {k: dataclasses.replace(p) for k, p in points.items()}
    rounds = list(rounds or [])
    while any(p.on for p in points.values()):
        cal = Calibration(str(head.revision), target, float(s.confidence), points)
        res = measure(head, pool, stream, calibration=cal, cache_cfg=cache_cfg, enc=enc, confidence=float(s.confidence))
        rounds.append({"settle": True, **{k: (p.radius, p.threshold, res["pairs"].get(k, {}).get("hits", 0),
                                              res["pairs"].get(k, {}).get("false_hits", 0))
                                          for k, p in points.items() if p.on}})
        failed = False
        for k, p in points.items():
            if not p.on:
                continue
            pr = unit_counts(dict(res["pairs"].get(k, _EMPTY)), s.count)
            if pr["hits"] >= need and pr["upper"] <= target:
                points[k] = dataclasses.replace(p, hits=int(pr["hits"]), false_hits=int(pr["false_hits"]),
                                                upper=float(pr["upper"]), units=_units(pr))
                continue
            why = (f"bound {pr['upper']:.4f} > {target}" if pr["hits"] >= need else f"{pr['hits']} {s.count}, "
                   f"fewer than {need}")
            points[k] = PairPoint(False, reason=f"{why} at radius {p.radius}, threshold {p.threshold:.4f} with "
                                                f"every pair at its final point")
            failed = True
        if not failed:
            break
    return points, rounds


_EMPTY = {"hits": 0, "false_hits": 0, "upper": 1.0, "distinct": 0, "distinct_false": 0, "distinct_upper": 1.0,
          "items": 0, "items_false": 0, "items_upper": 1.0}


def radius_sweeps(radii: np.ndarray, thresholds: np.ndarray, tight, floor: float | None) -> list[list[tuple[int, float]]]:
    """The "tight" candidate paths of `path: split`: per threshold of `tight` (no higher than `floor`, on the
    grid), radius 0, 1, ... at that threshold: the radius widens, the threshold stays tight."""
    out, seen = [], set()
    for t in tight:
        t = float(t) if floor is None else min(float(t), floor)
        j = int(np.argmin(np.abs(thresholds - t)))
        if thresholds[j] > t + 1e-9:              # the grid point at or below t
            j = min(j + 1, len(thresholds) - 1)
        tj = float(thresholds[j])
        if tj in seen:
            continue
        seen.add(tj)
        out.append([(int(r), tj) for r in radii])
    return out


def choose_path(candidates):
    """`path: split`'s choice of a pair's path from its walks on the path half: `candidates` is [(name, hits
    at the walk's last passing point, or None where it passed nowhere, need)], tightest path first. A looser
    path replaces the best so far only when it serves at least its `need` more hits: `min_trials` (fewer added
    hits than that could not show their own false-hit rate within the budget, so a looser path would buy
    untestable gain with risk the calibration cannot see), or 0 (the most hits, ties to the looser). Returns
    the name, or None."""
    best = best_hits = None
    for name, hits, need in candidates:
        if hits is None:
            continue
        if best is None or hits >= best_hits + int(need):
            best, best_hits = name, hits
    return best


def calibrate(head, pool, stream: np.ndarray, target: float, settings: CalibrationSettings | None = None,
              cache_cfg: dict | None = None, info: dict | None = None) -> Calibration:
    s = settings or CalibrationSettings()
    target = float(target)
    delta = 1.0 - float(s.confidence)
    stream = np.asarray(stream)
    enc = encode_pool(head, pool)
    cos = payload_cosines(head, enc)
    floors = repeat_floor(head, enc) if s.repeat_floor else {}
    thresholds = _path(s)
    radii = np.arange(int(s.max_radius) + 1)
    need = min_trials(target, delta)

    def floor_of(k):
        a, b = k.split(">")
        return floors.get(b) if a == b else None

    def hits_path(k, n):
        return pair_path(n, radii, thresholds, need, floor_of(k), int(s.path_points))

    base = {**(info or {}), "settings": dataclasses.asdict(s), "repeat_floor": floors, "min_trials": need}
    if s.path == "hits":
        counts = offline_counts(enc, cos, stream, thresholds, radii)
        paths, points = offline_paths(counts, hits_path, radii, thresholds, delta, target, need)
        points, rounds = walk(head, pool, stream, paths, points, target, s, need, enc, cache_cfg)
        return Calibration(str(head.revision), target, float(s.confidence), points,
                           {**base, "calibration_requests": int(len(stream)), "replays": rounds})
    # path "split": Learn-then-Test; the path half chooses each pair's path, the test half tests it
    learn = split_stream(pool, stream, s.split_by, s.split_frac, s.split_seed)
    sa, sb = stream[learn], stream[~learn]
    counts_a = offline_counts(enc, cos, sa, thresholds, radii)
    def sweep(i):
        def cand(k, n):
            paths = radius_sweeps(radii, thresholds, s.tight_thresholds, floor_of(k))
            return paths[i] if i < len(paths) else []
        return cand

    families = {"hits": hits_path, **{f"sweep{i}": sweep(i) for i in range(len(s.tight_thresholds))}}
    walked = {}
    for name, cand in families.items():
        paths, points = offline_paths(counts_a, cand, radii, thresholds, delta, target, need)
        walked[name] = (paths, *walk(head, pool, sa, paths, points, target, s, need, enc, cache_cfg))
    chosen_paths, choice = {}, {}
    order = [f"sweep{i}" for i in range(len(s.tight_thresholds))] + ["hits"]   # tightest first
    for k in counts_a:
        # prefer loose: among the radius sweeps (their threshold stays tight) the most hits, ties to the looser;
        # the hits path, whose thresholds run far below them, still needs min_trials more hits
        best = choose_path([(nm, walked[nm][1][k].hits if k in walked[nm][0] and walked[nm][1][k].on else None,
                             need if s.prefer == "tight" or nm == "hits" else 0) for nm in order])
        if best is not None:
            chosen_paths[k] = walked[best][0][k]
            choice[k] = {"path": best, "learn_hits": int(walked[best][1][k].hits),
                         "point": [walked[best][1][k].radius, walked[best][1][k].threshold]}
    # the test half: offline pass 1 on its own counts, then the walk; only this half's evidence is reported
    counts_b = offline_counts(enc, cos, sb, thresholds, radii)
    paths_b, points_b = offline_paths(counts_b, lambda k, n: chosen_paths.get(k, []), radii, thresholds, delta,
                                      target, need)
    for k in counts_b:
        if k not in chosen_paths:
            why = walked["hits"][1][k].reason if k in walked["hits"][1] else "no path"
            points_b[k] = PairPoint(False, reason=f"no passing point on the path half ({why})")
    points, rounds = walk(head, pool, sb, paths_b, points_b, target, s, need, enc, cache_cfg)
    return Calibration(str(head.revision), target, float(s.confidence), points,
                       {**base, "calibration_requests": int(len(stream)), "path_requests": int(len(sa)),
                        "test_requests": int(len(sb)),
                        "path_items": int(len(np.unique(np.asarray(pool.cls)[sa]))),
                        "test_items": int(len(np.unique(np.asarray(pool.cls)[sb]))),
                        "path_choice": choice, "replays": rounds,
                        "path_replays": {nm: w[2] for nm, w in walked.items()}})


def pool_and_stream(head, features_dir, split: str, n_requests: int, zipf_s: float = 1.0, seed: int = 0):
    """(dataset, pool, stream): the pool of the head's own rows of `split` (the feature store of exactly the
    rows the export's data settings give, ushash.data.extract.stored_split; feature-space variants,
    ushash/sim/pool.py) and a Zipf stream of `n_requests` over it; `seed` seeds both."""
    from ushash.data.extract import stored_split
    from ushash.data.store import FeatureStoreError, encoder_precision
    from ushash.sim.pool import pool_from_split
    from ushash.sim.stream import make_stream

    src = dict(head.manifest.get("source") or {})
    dataset = src.get("dataset")
    if not dataset:
        raise ValueError("the export does not name the dataset it was trained on: no split to calibrate on")
    enc = {"name": head.encoder.name, "fingerprint": head.encoder.fingerprint,
           "precision": encoder_precision(src.get("encoder") or {})}   # the features the head was trained on
    try:
        sp = stored_split({**src, "encoder": enc}, str(split), features_dir)
    except FeatureStoreError as e:
        if "ushash.extract" in str(e):
            raise
        raise FeatureStoreError(f"{e}; extract it: python -m ushash.extract data={dataset} encoder={enc['name']} "
                                f"extract.splits=[{split}], or pass features_dir=") from e
    pool = pool_from_split(sp, seed=int(seed))
    return dataset, pool, make_stream(pool, int(n_requests), float(zipf_s), int(seed))


def run_calibrate(cfg) -> dict:
    """python -m ushash.calibrate: the export's per-pair operating points for `target_false_hit_rate`,
    chosen on a stream of its own `split` rows, written atomically to `out` (default
    <export>/calibration.json). Returns {"out", "calibration", "table"}."""
    from omegaconf import OmegaConf

    from ushash.config import to_dict
    from ushash.data.extract import resolve_features_dir
    from ushash.serving.artifact import load_export

    if OmegaConf.is_missing(cfg, "export"):
        raise ValueError("calibrate needs export=<export dir> (python -m ushash.export makes one)")
    settings = CalibrationSettings(**to_dict(cfg.calibration))
    if str(settings.split) in ("test", "train"):
        why = "test measures what the points promise" if settings.split == "test" else "train fitted the head"
        raise ValueError(f"split={settings.split}: the calibration split must be held out of both training and "
                         f"measuring ({why}); use split=val")
    if settings.n_requests is None or int(settings.n_requests) <= 0:
        raise ValueError(f"requests={settings.n_requests}: the calibration stream needs a positive length")
    target = float(cfg.target_false_hit_rate)
    if not 0.0 < target < 1.0:
        raise ValueError(f"target_false_hit_rate is a rate in (0, 1); got {cfg.target_false_hit_rate}")
    root = Path(cfg.paths.root)
    export = Path(str(cfg.export))
    export = export if export.is_absolute() else root / export
    if not export.is_dir():
        raise FileNotFoundError(f"no export at {export}: make one with python -m ushash.export "
                                f"ckpt=checkpoints/<run>/best.ckpt out={cfg.export}")
    head = load_export(export)
    src = head.manifest.get("source") or {}
    features_dir = resolve_features_dir(src, cfg)
    dataset, pool, stream = pool_and_stream(head, features_dir, settings.split, int(settings.n_requests),
                                            float(cfg.zipf_s), int(cfg.seed))
    log.info("calibrating %s (revision %s) on %s/%s: %d requests over %d items, budget %g", export.name,
             head.revision, dataset, settings.split, len(stream), len(set(pool.cls)), target)
    cal = calibrate(head, pool, stream, target, settings,
                    info={"dataset": dataset, "split": str(settings.split), "zipf_s": float(cfg.zipf_s),
                          "seed": int(cfg.seed)})
    out = Path(str(cfg.out)) if cfg.get("out") else export / "calibration.json"
    out = out if out.is_absolute() else root / out
    cal.save(out)
    return {"out": str(out), "calibration": cal, "table": cal.table()}


def measure(head, pool, stream: np.ndarray, calibration: Optional[Calibration] = None, cache_cfg: dict | None = None,
            enc: Encoded | None = None, confidence: float = 0.95, served: list | None = None,
            timings: dict | None = None, cache=None) -> dict:
    """Replay `stream` through a `SemanticCache` (store on a miss, no expiry) and count; a hit is false
    when the entry is of another class and another source input (`Encoded.wrong`). served: a list to
    append, per request, the pool member whose entry answered it (-1: a miss). timings: a dict whose
    "lookup" and "store" lists get each call's seconds (perf_counter), for a benchmark of the same replay.
    cache: the empty cache to replay through, made by `replay_cache` (the caller keeps it, e.g. to weigh it
    afterwards); default: a new one, dropped on return."""
    from ushash.serving.cache import Query

    enc = enc or encode_pool(head, pool)
    cache = cache if cache is not None else replay_cache(head, calibration, cache_cfg)
    queries = [Query(str(m), c.tobytes(), zz) for m, c, zz in zip(enc.modality, enc.codes, enc.z)]
    lookup, store = cache.lookup, cache.store
    if timings is not None:   # the same calls, each one's seconds kept; untimed, nothing is added to the loop
        lookup, store = _timed(lookup, timings.setdefault("lookup", [])), _timed(store, timings.setdefault("store", []))
    hits = false = exact = oracle = 0
    pairs: dict[str, list[int]] = {}
    keys, seen = set(), set()
    for q in stream.tolist():
        c = int(enc.cls[q])
        exact += enc.key[q] in keys
        mine = {("cls", c), ("src", int(enc.src[q]))}   # equivalent: same class or same source (Encoded.wrong)
        oracle += not seen.isdisjoint(mine)
        keys.add(enc.key[q])
        seen |= mine
        h = lookup(queries[q], TENANT)
        if served is not None:
            served.append(-1 if h is None else int(h.value))
        if h is None:
            store(queries[q], int(q), TENANT)   # the entry's member: its class and source input
            continue
        hits += 1
        wrong = bool(enc.wrong(int(h.value), q))
        false += wrong
        acc = pairs.setdefault(pair_name(queries[q].modality, h.modality), [0, 0, 0, set(), set(), set(), set()])
        acc[0] += 1
        acc[1] += wrong
        acc[2] = max(acc[2], int(h.distance))
        acc[3].add((q, h.entry))
        acc[5].add(c)
        if wrong:
            acc[4].add((q, h.entry))
            acc[6].add(c)
    n = len(stream)
    delta = 1.0 - float(confidence)
    hr, ex, orc = hits / n, exact / n, oracle / n
    return {"requests": n, "hit_rate": hr, "hits": hits, "false_hits": false,
            "false_per_hit": false / hits if hits else 0.0, "false_per_request": false / n,
            "false_per_hit_upper": clopper_pearson_upper(false, hits, delta),
            "exact_hit_rate": ex, "oracle_hit_rate": orc, "headroom_captured": headroom((hits - false) / n, ex, orc),
            "pairs": {k: {"hits": a, "false_hits": b, "rate": b / a if a else 0.0,
                          "upper": clopper_pearson_upper(b, a, delta), "max_distance": r,
                          "distinct": len(da), "distinct_false": len(db),
                          "distinct_upper": clopper_pearson_upper(len(db), len(da), delta),
                          "items": len(ia), "items_false": len(ib),
                          "items_upper": clopper_pearson_upper(len(ib), len(ia), delta)}
                      for k, (a, b, r, da, db, ia, ib) in sorted(pairs.items())}}


def _timed(fn, seconds: list):
    """fn, appending each call's seconds (perf_counter) to `seconds`."""
    def call(*args):
        t0 = time.perf_counter()
        out = fn(*args)
        seconds.append(time.perf_counter() - t0)
        return out
    return call


def replay_cache(head, calibration: Optional[Calibration] = None, cache_cfg: dict | None = None):
    """The cache `measure` replays a stream through: L1 only, no expiry, room for every entry."""
    from ushash.serving.cache import SemanticCache

    cfg = {"capacity_bytes": 1 << 30, "ttl_s": None, **(cache_cfg or {}), "l2": None}
    return SemanticCache(head, cfg, rng=random.Random(0), calibration=calibration)


def headroom(hit_rate: float, exact_hit_rate: float, oracle_hit_rate: float) -> float:
    """Semantic headroom captured: (hit - exact) / (oracle - exact); nan when the oracle gains nothing.
    `hit_rate` counts correct hits only: a false hit serves no headroom (with them a cache could pass 1)."""
    gap = oracle_hit_rate - exact_hit_rate
    return (hit_rate - exact_hit_rate) / gap if gap > 0 else float("nan")


__all__ = ["CalibrateConfig", "Encoded", "calibrate", "choose_path", "encode_pool", "headroom", "measure",
           "offline_counts", "offline_paths", "payload_cosines", "pool_and_stream", "radius_sweeps", "replay_cache",
           "run_calibrate", "settle", "split_stream", "unit_counts", "walk"]
