"""The calibration's rules compared on val alone: each calibrated on one half of val's items, measured on the other.

    python scripts/calibration_rules.py --export exports/budget-tuxpaint-offline --export exports/budget-emoji-offline \
        [--budget 0.01] [--rules tight loose] [--out experiments/calibration-rules]

Per export: the val pool and stream benchmarks/false_hit_budget.py calibrates on (`--requests`, seed 0), split by
item (ushash.sim.calibrate.split_stream: disjoint items, stratified by modalities and popularity; `--split-seed`)
into two halves. Per half and per rule (`CalibrationSettings.prefer`, every other setting the default), the
calibration on that half and the replay of the other half's requests through a cache at its points: each pair's
point, the hits, false hits and their 95 % upper bound per hit, the correct hit rate and the headroom captured. No
test split is read: this is how a rule is chosen, on val, on both sets. Writes results.json and results.md to
--out; an export whose result is kept there (same head revision, settings, code and packages) is not computed again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from false_hit_budget import kept, stream_arguments  # noqa: E402

from ushash.serving.artifact import load_export  # noqa: E402
from ushash.serving.calibration import CalibrationSettings  # noqa: E402
from ushash.sim.calibrate import calibrate, measure, pool_and_stream, split_stream  # noqa: E402


def compare(head, features_dir: Path, budget: float, rules, n_requests: int, split_seed: int) -> dict:
    """{"dataset", "revision", "rows": [{half, rule, points, hits, false_hits, upper, correct_hit_rate, ...}]}."""
    dataset, pool, stream = pool_and_stream(head, features_dir, "val", n_requests, seed=0)
    first = split_stream(pool, stream, "item", 0.5, split_seed)
    rows = []
    for half, (cal_on, eval_on) in enumerate([(first, ~first), (~first, first)]):
        for rule in rules:
            cal = calibrate(head, pool, stream[cal_on], budget, CalibrationSettings(prefer=rule),
                            info={"dataset": dataset, "split": "val", "half": half})
            res = measure(head, pool, stream[eval_on], calibration=cal)
            rows.append({"half": half, "rule": rule, "calibration_requests": int(cal_on.sum()),
                         "requests": res["requests"], "hits": res["hits"], "false_hits": res["false_hits"],
                         "upper": res["false_per_hit_upper"],
                         "correct_hit_rate": (res["hits"] - res["false_hits"]) / res["requests"],
                         "exact_hit_rate": res["exact_hit_rate"], "oracle_hit_rate": res["oracle_hit_rate"],
                         "headroom_captured": res["headroom_captured"],
                         "points": {k: [p.radius, p.threshold] for k, p in sorted(cal.pairs.items()) if p.on}})
            print(f"{dataset} half {half} {rule}: {res['hits']} hits, {res['false_hits']} false", flush=True)
    return {"dataset": dataset, "revision": head.revision, "rows": rows}


def resumed(export: str, a) -> dict:
    """compare(), or its result kept in --out from an earlier run of the same head, settings and code."""
    head = load_export(export)
    key = {"budget": a.budget, "rules": a.rules, "requests": a.requests, "split_seed": a.split_seed}
    return kept(Path(a.out), export, head, a.features_dir, Path(__file__), key,
                lambda: compare(head, Path(a.features_dir), a.budget, a.rules, a.requests, a.split_seed))


def markdown(results: list[dict], meta: dict) -> str:
    budget = meta["budget"]
    lines = [f"Run {meta['date']} on {meta['machine']}: `{meta['command']}`", "",
             f"Budget {budget}, each rule calibrated on one half of val's items and replayed on the other half "
             "(the halves share no item); hits and false hits on the replayed half:", "",
             "| data | calibrated on | rule | points (radius, threshold) | hits | false hits | false / hit (95 % upper) "
             "| correct hit rate | headroom captured |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for x in r["rows"]:
            pts = ", ".join(f"{k} ({p[0]}, {p[1]:.2f})" for k, p in x["points"].items()) or "none"
            lines.append(f"| {r['dataset']} | half {x['half'] + 1} ({x['calibration_requests']} requests) | {x['rule']} "
                         f"| {pts} | {x['hits']} | {x['false_hits']} | {x['false_hits'] / max(x['hits'], 1):.4f} "
                         f"({x['upper']:.4f}) | {x['correct_hit_rate']:.4f} | {x['headroom_captured']:.3f} |")
    base = meta["rules"][0]
    lines += ["", f"Against `{base}` on the same half: correct hits gained (false hits added), by set and half:", ""]
    for r in results:
        for rule in meta["rules"][1:]:
            parts = []
            for half in (0, 1):
                a = next(x for x in r["rows"] if x["half"] == half and x["rule"] == base)
                b = next(x for x in r["rows"] if x["half"] == half and x["rule"] == rule)
                gain = (b["hits"] - b["false_hits"]) - (a["hits"] - a["false_hits"])
                parts.append(f"half {half + 1}: {gain:+d} ({b['false_hits'] - a['false_hits']:+d})")
            lines.append(f"- {r['dataset']}, `{rule}`: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def main(argv=None):
    from ushash.core.provenance import machine_summary
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stream_arguments(ap)
    ap.add_argument("--budget", type=float, default=0.01)
    ap.add_argument("--rules", nargs="+", default=["tight", "loose"], choices=["tight", "loose"],
                    help="values of CalibrationSettings.prefer; the first is the one the others are compared with")
    ap.add_argument("--split-seed", type=int, default=100)
    ap.add_argument("--out", default=str(ROOT / "experiments" / "calibration-rules"))
    a = ap.parse_args(argv)
    results = [resumed(e, a) for e in a.export]
    meta = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": machine_summary(), "budget": a.budget,
            "rules": a.rules,
            "command": f"python scripts/calibration_rules.py --budget {a.budget} --rules {' '.join(a.rules)} "
                       f"--requests {a.requests} --split-seed {a.split_seed}"
                       + "".join(f" --export {Path(e).name}" for e in a.export)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=float))
    (out / "results.md").write_text(markdown(results, meta))
    print(markdown(results, meta))


if __name__ == "__main__":
    main()
