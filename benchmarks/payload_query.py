"""The hit check's two sides: the request's fp32 z, or the request as its own payload would store it.

    python benchmarks/payload_query.py --export exports/budget-tuxpaint-offline --export exports/budget-emoji-offline \
        [--features-dir data/features] [--out experiments/payload_query]

The cache checks a candidate by the cosine of the request's z with the entry's decoded payload (INT4 for
images by default), so an exact repeat scores below 1 (docs/cache.md: the repeat floor). Comparing like with
like, the request's z quantised by the same codec first (decode(encode(z)) of its own modality), gives an
exact repeat 1. This measures what that would change, without changing the cache: on the false-hit
budget's pools and streams (the same heads, rows, seeds and request counts as
benchmarks/false_hit_budget.py), per same-modality pair, by the calibration's own offline count of the hit
rule (ushash.sim.calibrate.offline_counts: every earlier distinct request a candidate entry, the nearest
within the radius with cosine >= the threshold served; no eviction, no expiry):
- the lowest cosine an exact repeat reaches, on the test pool;
- test hits and false hits at the cache's default point (radius 3, cosine 0.98);
- the grid point (radius 0-10, cosine 1.00 down to 0.50 in steps of 0.01, no higher than the pair's repeat
  floor) with the most val hits whose one-sided 95 % Clopper-Pearson bound on false hits per hit is <= the
  budget (ties: the smaller radius, then the higher threshold), and its test hits and false hits.
The selection is a plain best-on-val point, simpler than the calibration's walk (which tests points in a
fixed sequence on part of val): it compares the two sides of the check under one rule, it is not the
cache's calibrated hit rate. Writes results.json and results.md to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ushash.core.io import atomic_write, write_json  # noqa: E402
from ushash.serving.artifact import load_export  # noqa: E402
from ushash.serving.calibration import clopper_pearson_upper, pair_name  # noqa: E402
from ushash.sim.calibrate import encode_pool, offline_counts, payload_cosines  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from false_hit_budget import pools_and_streams, stream_arguments  # noqa: E402

SIDES = ("z", "payload")   # the request's fp32 z | the request through its own modality's payload codec
RADII = np.arange(11)
THRESHOLDS = np.round(1.0 - 0.01 * np.arange(51), 6)
DEFAULT = (3, 0.98)        # CacheConfig's radius and payload_threshold


def request_rows(head, enc, side: str) -> np.ndarray:
    """float32 [N, dim] unit rows: each pool member's z as the request side of the check sees it."""
    if side == "z":
        return enc.z
    out = np.empty_like(enc.z)
    for m in sorted(set(enc.modality.tolist())):
        idx = np.flatnonzero(enc.modality == m)
        dec = head.payload.decode(m, head.payload.encode(m, enc.z[idx]))
        out[idx] = dec / np.maximum(np.linalg.norm(dec, axis=1, keepdims=True), 1e-15)
    return out


def cosines(head, enc, rows: np.ndarray) -> np.ndarray:
    """cos[q, e]: request row q against entry e's decoded payload: the calibration's own
    ushash.sim.calibrate.payload_cosines, with the request rows given in place of z."""
    return payload_cosines(head, dataclasses.replace(enc, z=rows))


def cell(radius: int, threshold: float) -> tuple[int, int]:
    """The grid indices of (radius, threshold)."""
    return int(np.flatnonzero(RADII == radius)[0]), int(np.flatnonzero(np.isclose(THRESHOLDS, threshold))[0])


def repeat_floor(enc, cos: np.ndarray) -> dict[str, float]:
    """The lowest cosine of a member with its own payload, per modality."""
    return {m: float(np.min(cos[idx, idx])) for m, (idx, _) in enc.records.items()}


def best_on_val(n: np.ndarray, bad: np.ndarray, floor: float, target: float, delta: float):
    """(radius, threshold, val hits) of the grid point with the most val hits whose bound meets the target,
    threshold <= floor; None when none does."""
    best = None
    for i, r in enumerate(RADII):
        for j, t in enumerate(THRESHOLDS):
            if t > floor + 1e-9 or n[i, j] == 0 or clopper_pearson_upper(int(bad[i, j]), int(n[i, j]), delta) > target:
                continue
            key = (int(n[i, j]), -int(r), float(t))
            if best is None or key > best[0]:
                best = (key, int(r), float(t), int(n[i, j]))
    return None if best is None else best[1:]


def run(export: str, features_dir: Path, n_val: int, n_test: int, target: float, delta: float) -> dict:
    head = load_export(export)
    dataset, val, test, sv, st = pools_and_streams(head, features_dir, n_val, n_test)
    ev, et = encode_pool(head, val), encode_pool(head, test)
    out = {"dataset": dataset, "revision": head.revision, "payload": {m: head.payload[m].name for m in ev.records},
           "val_requests": n_val, "test_requests": n_test, "sides": {}}
    for side in SIDES:
        cv, ct = cosines(head, ev, request_rows(head, ev, side)), cosines(head, et, request_rows(head, et, side))
        floors_val, floors_test = repeat_floor(ev, cv), repeat_floor(et, ct)
        counts_val = offline_counts(ev, cv, np.asarray(sv), THRESHOLDS, RADII)
        counts_test = offline_counts(et, ct, np.asarray(st), THRESHOLDS, RADII)
        pairs = {}
        di, dj = cell(*DEFAULT)
        for m in sorted(ev.records):
            k = pair_name(m, m)
            (nv, bv), (nt, bt) = counts_val[k], counts_test[k]
            pick = best_on_val(nv, bv, floors_val[m], target, delta)
            row = {"repeat_floor_val": floors_val[m], "repeat_floor_test": floors_test[m],
                   "default": {"hits": int(nt[di, dj]), "false_hits": int(bt[di, dj])}, "chosen": None}
            if pick is not None:
                r, t, hv = pick
                i, j = cell(r, t)
                row["chosen"] = {"radius": r, "threshold": t, "val_hits": hv, "val_false_hits": int(bv[i, j]),
                                 "hits": int(nt[i, j]), "false_hits": int(bt[i, j])}
            pairs[k] = row
        out["sides"][side] = pairs
        print(f"{dataset} {side}: " + "; ".join(
            f"{k} floor {v['repeat_floor_test']:.4f}, default {v['default']['hits']} ({v['default']['false_hits']} false)"
            + (f", chosen r={v['chosen']['radius']} t={v['chosen']['threshold']:.2f}: {v['chosen']['hits']} "
               f"({v['chosen']['false_hits']} false)" if v["chosen"] else ", none passes")
            for k, v in pairs.items()), flush=True)
    return out


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"Run {meta['date']} on {meta['machine']}: `{meta['command']}`", "",
             "Per same-modality pair, on test unless named val: the lowest cosine an exact repeat reaches, the hits "
             "(false hits) at the default point (radius 3, cosine 0.98), and the point with the most val hits whose "
             f"95 % upper bound on false hits per hit is <= {meta['target']} with its test hits (false hits); hits "
             "counted offline (every earlier distinct request an entry, no eviction or expiry).", "",
             "| data | pair | payload | request side | exact repeat's lowest cosine (val / test) | "
             "default r=3, cos >= 0.98: test hits (false) | best val point | its test hits (false) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for side in SIDES:
            for k, v in r["sides"][side].items():
                c = v["chosen"]
                m = k.split(">")[0]
                lines.append(f"| {r['dataset']} | {k} | {r['payload'][m]} | "
                             f"{'fp32 z (shipped)' if side == 'z' else 'its own payload'} | "
                             f"{v['repeat_floor_val']:.4f} / {v['repeat_floor_test']:.4f} | "
                             f"{v['default']['hits']} ({v['default']['false_hits']}) | "
                             + (f"r={c['radius']}, cos >= {c['threshold']:.2f}: {c['val_hits']} ({c['val_false_hits']}) | "
                                f"{c['hits']} ({c['false_hits']}) |" if c else "none passes | - |"))
        tot = {s: (sum(v["default"]["hits"] for v in r["sides"][s].values()),
                   sum((v["chosen"] or {}).get("hits", 0) for v in r["sides"][s].values()),
                   sum((v["chosen"] or {}).get("false_hits", 0) for v in r["sides"][s].values())) for s in SIDES}
        lines.append(f"| {r['dataset']} | all same-modality pairs | | fp32 z / own payload | | "
                     f"{tot['z'][0]} / {tot['payload'][0]} of {r['test_requests']} | | "
                     f"{tot['z'][1]} ({tot['z'][2]}) / {tot['payload'][1]} ({tot['payload'][2]}) |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    from ushash.core.provenance import machine_summary
    ap = stream_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--budget", type=float, default=0.01)
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--out", default=str(ROOT / "experiments" / "payload_query"))
    a = ap.parse_args(argv)
    results = [run(e, Path(a.features_dir), a.requests, a.test_requests, a.budget, 1.0 - a.confidence)
               for e in a.export]
    meta = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": machine_summary(), "target": a.budget,
            "command": f"python benchmarks/payload_query.py --requests {a.requests} --test-requests {a.test_requests} "
                       f"--budget {a.budget} --confidence {a.confidence}"
                       + "".join(f" --export {Path(e).name}" for e in a.export)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", {"meta": meta, "results": results})
    atomic_write(out / "results.md", markdown(results, meta))
    print(markdown(results, meta))


if __name__ == "__main__":
    main()
