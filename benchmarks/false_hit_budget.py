"""The false-hit budget on real data: calibrate on val, measure on a held-out test stream.

    python benchmarks/false_hit_budget.py --export exports/budget-tuxpaint-offline --export exports/budget-emoji-offline \
        [--features-dir data/features] [--budgets 0.01 0.05] [--detail 0.01] [--out experiments/budget]

Per export: the val and test pools (feature-space variants, ushash/sim/pool.py) of the stores of exactly the
rows the head's data settings give (ushash.sim.calibrate.pool_and_stream), a Zipf stream of each (`--requests` on
val to calibrate, `--test-requests` on test; different seeds), then per budget the calibration
(ushash.sim.calibrate, written to --out as <dataset>-<budget>.calibration.json) and its replay on the test
stream, beside the cache's uncalibrated defaults. Writes results.json and results.md to --out: a row per
(export, budget) with each pair's point, and each point's evidence on val and per-pair counts on test for the
budgets of --detail (all by default). GPTCache on the same streams: benchmarks/gptcache/compare.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ushash.serving.artifact import load_export  # noqa: E402
from ushash.serving.calibration import UNIT_NAMES, CalibrationSettings  # noqa: E402
from ushash.sim.calibrate import calibrate, measure, pool_and_stream  # noqa: E402


def pools_and_streams(head, features_dir: Path, n_val: int, n_test: int):
    """(dataset, val pool, test pool, val stream, test stream): the pools of the head's own val and test rows
    (ushash.sim.calibrate.pool_and_stream, what python -m ushash.calibrate replays), seeds 0 and 1."""
    dataset, val, sv = pool_and_stream(head, features_dir, "val", n_val, seed=0)
    _, test, st = pool_and_stream(head, features_dir, "test", n_test, seed=1)
    return dataset, val, test, sv, st


def stream_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every benchmark of the budget heads' streams takes alike (this one, payload_query.py,
    gptcache/compare.py): the exports, their feature stores, and the val and test stream lengths."""
    ap.add_argument("--export", action="append", required=True)
    ap.add_argument("--features-dir", default=str(ROOT / "data" / "features"))
    ap.add_argument("--requests", type=int, default=40000, help="val stream (calibration)")
    ap.add_argument("--test-requests", type=int, default=20000)
    return ap


def run(head, features_dir: Path, budgets, n_val: int, n_test: int, settings: CalibrationSettings,
        out_dir: Path) -> dict:
    dataset, val, test, sv, st = pools_and_streams(head, features_dir, n_val, n_test)
    out = {"dataset": dataset, "revision": head.revision, "bits": int(head.bits),
           "val_pool": len(val), "test_pool": len(test), "val_requests": n_val, "test_requests": n_test,
           "default": measure(head, test, st), "budgets": {}}
    for b in budgets:
        t0 = time.perf_counter()
        cal = calibrate(head, val, sv, b, settings, info={"dataset": dataset, "split": "val"})
        out_dir.mkdir(parents=True, exist_ok=True)
        cal.save(out_dir / f"{dataset}-{b}.calibration.json")
        res = measure(head, test, st, calibration=cal)
        # the seconds are printed, not kept: the results of a rerun (on the same day: they are dated) are then
        # the same bytes, and the steps that read them (gptcache_compare, proxy_overhead) are not made stale
        out["budgets"][str(b)] = {"calibration": cal.to_dict(), "table": cal.table(), "test": res}
        print(cal.table(), flush=True)
        print(f"{dataset} budget {b}: test hit {res['hit_rate']:.4f} false/hit {res['false_per_hit']:.4f} "
              f"(bound {res['false_per_hit_upper']:.4f}) headroom {res['headroom_captured']:.3f}; calibrated and "
              f"measured in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def markdown(results: list[dict], meta: dict, detail=None) -> str:
    """The summary table (every budget), then per (export, budget) of `detail` (None: all) the calibration's
    evidence and the per-pair test counts."""
    lines = [f"Run {meta['date']} on {meta['machine']}: `{meta['command']}`", "",
             "| data | budget | pairs on (radius, payload threshold) | test hit rate | false / hit (95 % upper) | false / request | exact | oracle | "
             "headroom captured | defaults r=3, t=0.98: hit, false/hit, headroom |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        d = r["default"]
        for b, x in r["budgets"].items():
            t = x["test"]
            on = [f"{k} ({p['radius']}, {p['threshold']:.2f})" for k, p in x["calibration"]["pairs"].items() if p["on"]]
            lines.append(f"| {r['dataset']} | {b} | {', '.join(on) or 'none'} | {t['hit_rate']:.4f} | "
                         f"{t['false_per_hit']:.4f} ({t['false_per_hit_upper']:.4f}) | {t['false_per_request']:.4f} | "
                         f"{t['exact_hit_rate']:.4f} | {t['oracle_hit_rate']:.4f} | {t['headroom_captured']:.3f} | "
                         f"{d['hit_rate']:.4f}, {d['false_per_hit']:.4f}, "
                         f"{d['headroom_captured']:.3f} |")
    for r in results:
        for b, x in r["budgets"].items():
            if detail is not None and float(b) not in detail:
                continue
            info = x["calibration"]["info"]
            where = (f"on val's test half ({info['test_requests']} requests, {info['test_items']} items; the path "
                     f"chosen on the other {info['path_requests']} requests, {info['path_items']} items)"
                     if "test_items" in info else f"on val ({r['val_requests']} requests)")
            lines += ["", f"{r['dataset']}, budget {b}, calibrated {where}; the evidence of each point in hits, "
                      f"distinct (request, entry) pairs and request items (certifying {b} with no false one takes "
                      f"{info.get('min_trials', '?')} of them):", "", x["table"]]
            choice = info.get("path_choice")
            unit = UNIT_NAMES.get(info.get("settings", {}).get("count", "hits"))
            if choice:
                lines += ["", "Path chosen on the path half: " + "; ".join(
                    f"{k}: {c['path']} (ends at radius {c['point'][0]}, threshold {c['point'][1]:.2f}, "
                    f"{c['learn_hits']} {unit})" for k, c in sorted(choice.items())) + "."]
            t = x["test"]["pairs"]
            lines += ["", f"{r['dataset']}, budget {b}, measured on test ({r['test_requests']} requests):", "",
                      "| pair | hits | false hits (95 % upper) | distinct pairs: false / n (upper) | items: false / n (upper) |",
                      "|---|---|---|---|---|"]
            lines += [f"| {k} | {v['hits']} | {v['false_hits']} ({v['upper']:.4f}) | {v['distinct_false']} / "
                      f"{v['distinct']} ({v['distinct_upper']:.4f}) | {v.get('items_false', '-')} / {v.get('items', '-')} "
                      f"({v.get('items_upper', float('nan')):.4f}) |" for k, v in sorted(t.items())]
    return "\n".join(lines) + "\n"


def resumed(export: str, a, settings: CalibrationSettings) -> dict:
    """run(), or its result kept in --out from an earlier run of the same head revision, settings and code
    (an interrupted benchmark resumes with the next export; a changed cache runtime, simulator, package, this
    benchmark or features folder computes it again)."""
    head = load_export(export)
    key = {"budgets": a.budgets, "requests": a.requests, "test_requests": a.test_requests, "settings": str(settings)}
    return kept(Path(a.out), export, head, a.features_dir, Path(__file__), key,
                lambda: run(head, Path(a.features_dir), a.budgets, a.requests, a.test_requests, settings, Path(a.out)))


def kept(out: Path, export: str, head, features_dir, script: Path, settings: dict, compute) -> dict:
    """The result for `export` kept in `out` (part-<export>.json) under the same key, else compute() written
    there atomically with its key: the head's revision, `settings`, the code, packages and CPU that compute it
    (`made_by`, the cache runtime's digest, `script`'s) and the features folder (relative to the repository: a
    kept result names no machine's folder)."""
    import hashlib

    from ushash.core.io import atomic_write
    from ushash.core.provenance import made_by, runtime_digest
    from ushash.data.extract import relative_to_root

    part = out / f"part-{Path(export).name}.json"
    key = {"revision": head.revision, **settings, "made_by": made_by(), "runtime": runtime_digest(),
           "features_dir": relative_to_root(features_dir, ROOT),
           "script": hashlib.sha256(script.read_bytes()).hexdigest()[:16]}
    if part.exists():
        try:
            old = json.loads(part.read_text())
        except ValueError:   # unreadable: computed again
            old = {}
        if old.get("key") == key:
            print(f"kept from {part.name}", flush=True)
            return old["result"]
    res = compute()
    atomic_write(part, json.dumps({"key": key, "result": res}, default=float))
    return res


def main(argv=None):
    from ushash.core.provenance import machine_summary
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stream_arguments(ap)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.01])
    ap.add_argument("--marginal", type=int, default=1)
    ap.add_argument("--count", default="hits", choices=["hits", "distinct", "items"])
    ap.add_argument("--path", default="split", choices=["hits", "split"])
    ap.add_argument("--split-by", default="item", choices=["item", "request"])
    ap.add_argument("--prefer", default=CalibrationSettings.prefer, choices=["tight", "loose"],
                    help="where the calibration's evidence does not decide: the tighter or the looser point")
    ap.add_argument("--detail", type=float, nargs="+", default=None,
                    help="budgets whose per-pair evidence results.md shows (default: every budget)")
    ap.add_argument("--out", default=str(ROOT / "experiments" / "budget"))
    a = ap.parse_args(argv)
    settings = CalibrationSettings(marginal=bool(a.marginal), count=a.count, path=a.path, split_by=a.split_by,
                                   prefer=a.prefer)
    results = [resumed(e, a, settings) for e in a.export]
    meta = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": machine_summary(),
            "command": "python benchmarks/false_hit_budget.py " + " ".join(
                f"--{k.replace('_', '-')} {v if not isinstance(v, list) else ' '.join(map(str, v))}"
                for k, v in vars(a).items() if k not in ("features_dir", "out", "export") and v is not None) +
            "".join(f" --export {Path(e).name}" for e in a.export)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=float))
    (out / "results.md").write_text(markdown(results, meta, a.detail))
    print(markdown(results, meta, a.detail))


if __name__ == "__main__":
    main()
