"""The false-hit budget on real data: calibrate on val, measure on a held-out test stream.

    python benchmarks/false_hit_budget.py --export exports/tuxpaint-64b --export exports/emoji-64b \
        [--features-dir data/features] [--budgets 0.01 0.05] [--out experiments/budget]

Per export: the val and test pools (feature-space variants, ushash/sim/pool.py), a Zipf stream of each
(`--requests` on val to calibrate, `--test-requests` on test; different seeds), then per budget the
calibration (ushash.sim.calibrate) and its replay on the test stream; beside it the cache's uncalibrated
defaults and the float-z cosine cache (GPTCache-like, in process) at the best threshold of its sweep whose
false hits per hit on the test stream are within the budget (chosen on test: an upper bound on what that
cache could reach). Writes results.json and results.md to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ushash.data.store import open_split  # noqa: E402
from ushash.serving.artifact import load_export  # noqa: E402
from ushash.serving.calibration import CalibrationSettings  # noqa: E402
from ushash.sim.adapters import CosineCache  # noqa: E402
from ushash.sim.calibrate import calibrate, headroom, measure  # noqa: E402
from ushash.sim.pool import pool_from_split  # noqa: E402
from ushash.sim.replay import replay  # noqa: E402
from ushash.sim.stream import SimClock, make_stream  # noqa: E402

THRESHOLDS = [0.99, 0.98, 0.97, 0.96, 0.95, 0.94, 0.93, 0.92, 0.9, 0.88, 0.85, 0.8, 0.75, 0.7]


def store_of(features_dir: Path, dataset: str, split: str, fingerprint: str, name: str = "offline"):
    exact = features_dir / dataset / split / f"{name}-{fingerprint}"
    if (exact / "meta.json").exists():  # the store the head was trained from (no rows fingerprint in its name)
        return open_split(exact)
    found = sorted(p for p in (features_dir / dataset / split).glob(f"*-{fingerprint}*")
                   if (p / "meta.json").exists())
    if len(found) != 1:
        raise SystemExit(f"{len(found)} feature stores of {dataset}/{split} under {features_dir}: {found}")
    return open_split(found[0])


def cosine_best(head, pool, stream, budget: float) -> dict:
    clock = SimClock()
    best = None
    cache = CosineCache(head, pool, clock, None, threshold=THRESHOLDS[0])
    for th in THRESHOLDS:
        cache.reset(threshold=th)
        r = replay(cache, stream, pool, clock, revision_change_at=0.0)
        if r["false_per_hit"] <= budget and (best is None or r["hit_rate"] > best["hit_rate"]):
            best = {**r, "threshold": th}
    return best or {"hit_rate": 0.0, "threshold": None}


def run(export: str, features_dir: Path, budgets, n_val: int, n_test: int, settings: CalibrationSettings,
        out_dir: Path) -> dict:
    head = load_export(export)
    dataset = (head.manifest.get("source") or {}).get("dataset")
    sp = {s: store_of(features_dir, dataset, s, head.encoder.fingerprint, head.encoder.name) for s in ("val", "test")}
    val, test = pool_from_split(sp["val"], seed=0), pool_from_split(sp["test"], seed=1)
    sv, st = make_stream(val, n_val, 1.0, 0), make_stream(test, n_test, 1.0, 1)
    out = {"dataset": dataset, "revision": head.revision, "bits": int(head.bits),
           "val_pool": len(val), "test_pool": len(test), "val_requests": n_val, "test_requests": n_test,
           "default": measure(head, test, st), "budgets": {}}
    for b in budgets:
        t0 = time.perf_counter()
        cal = calibrate(head, val, sv, b, settings, info={"dataset": dataset, "split": "val"})
        out_dir.mkdir(parents=True, exist_ok=True)
        cal.save(out_dir / f"{dataset}-{b}.calibration.json")
        res = measure(head, test, st, calibration=cal)
        cos = cosine_best(head, test, st, b)
        out["budgets"][str(b)] = {"calibration": cal.to_dict(), "table": cal.table(), "test": res,
                                  "cosine": {k: cos.get(k) for k in ("hit_rate", "false_per_hit", "threshold")},
                                  "cosine_headroom": headroom(cos["hit_rate"], res["exact_hit_rate"],
                                                              res["oracle_hit_rate"]),
                                  "seconds": round(time.perf_counter() - t0, 1)}
        print(cal.table(), flush=True)
        print(f"{dataset} budget {b}: test hit {res['hit_rate']:.4f} false/hit {res['false_per_hit']:.4f} "
              f"(bound {res['false_per_hit_upper']:.4f}) headroom {res['headroom_captured']:.3f}; cosine "
              f"{cos['hit_rate']:.4f} at {cos.get('threshold')}", flush=True)
    return out


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"Run {meta['date']} on {meta['machine']}: `{meta['command']}`", "",
             "| data | budget | pairs on | test hit rate | false / hit (95 % upper) | false / request | exact | oracle | "
             "headroom captured | float-z cosine hit rate (threshold) | defaults r=3, t=0.98: hit, false/hit, headroom |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        d = r["default"]
        for b, x in r["budgets"].items():
            t = x["test"]
            on = [k for k, p in x["calibration"]["pairs"].items() if p["on"]]
            c = x["cosine"]
            lines.append(f"| {r['dataset']} | {b} | {', '.join(on) or 'none'} | {t['hit_rate']:.4f} | "
                         f"{t['false_per_hit']:.4f} ({t['false_per_hit_upper']:.4f}) | {t['false_per_request']:.4f} | "
                         f"{t['exact_hit_rate']:.4f} | {t['oracle_hit_rate']:.4f} | {t['headroom_captured']:.3f} | "
                         f"{c['hit_rate']:.4f} ({c['threshold']}) | {d['hit_rate']:.4f}, {d['false_per_hit']:.4f}, "
                         f"{d['headroom_captured']:.3f} |")
    for r in results:
        for b, x in r["budgets"].items():
            lines += ["", f"{r['dataset']}, budget {b}, calibrated on val ({r['val_requests']} requests):", "", x["table"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", action="append", required=True)
    ap.add_argument("--features-dir", default=str(ROOT / "data" / "features"))
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.01])
    ap.add_argument("--requests", type=int, default=40000)
    ap.add_argument("--test-requests", type=int, default=20000)
    ap.add_argument("--marginal", type=int, default=1)
    ap.add_argument("--count", default="hits", choices=["hits", "distinct"])
    ap.add_argument("--out", default=str(ROOT / "experiments" / "budget"))
    a = ap.parse_args(argv)
    settings = CalibrationSettings(marginal=bool(a.marginal), count=a.count)
    results = [run(e, Path(a.features_dir), a.budgets, a.requests, a.test_requests, settings, Path(a.out))
               for e in a.export]
    meta = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": f"{platform.machine()}, 2 cores shared",
            "command": "python benchmarks/false_hit_budget.py " + " ".join(
                f"--{k.replace('_', '-')} {v if not isinstance(v, list) else ' '.join(map(str, v))}"
                for k, v in vars(a).items() if k not in ("features_dir", "out", "export")) +
            "".join(f" --export {Path(e).name}" for e in a.export)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=float))
    (out / "results.md").write_text(markdown(results, meta))
    print(markdown(results, meta))


if __name__ == "__main__":
    main()
