"""Real GPTCache (pinned) on the streams the false-hit budget benchmark measures ushash on, at its best threshold.

    python benchmarks/gptcache/compare.py --export exports/budget-tuxpaint-offline [--export ...] \
        [--embeddings z features] [--budgets 0.01] [--calibrations experiments/budget] [--out experiments/gptcache]

GPTCache runs in its own virtual environment (benchmarks/gptcache/.venv, made here on the first run with
gptcache==0.1.44, faiss-cpu and numpy from PyPI; ignored by git). The val and test pools and streams are
benchmarks/false_hit_budget.py's (same splits, seeds and lengths). Each request's embedding is handed to
GPTCache as a precomputed embedding (its sqlite + faiss data manager, SearchDistanceEvaluation, top_k 1):

- `z`: the export's unit z (the shared space: one GPTCache for every modality, so cross-modal hits exist);
- `features`: the raw encoder features, L2-normalised, one GPTCache per modality (an encoder's image and
  text features have different sizes and spaces; this is GPTCache in front of the encoder itself).

GPTCache's similarity_threshold t accepts a faiss L2 distance d^2 <= 4 (1 - t), i.e. cosine >= 2t - 1 for unit
vectors. Its threshold is chosen on val as ushash's points are: over a grid of cosines (1.0 down to 0.5 in
steps of 0.005), the highest val hit rate whose one-sided 95 % Clopper-Pearson upper bound on false hits per
hit is within the budget (no fixed-sequence restriction: the most generous selection on val). The sweep is
GPTCache's decision rule replayed in numpy (`emulate`: the nearest stored embedding of the request's cache,
a hit when its cosine >= the threshold, a miss stores the request; ties to the earliest stored, as faiss's
flat index); real GPTCache then replays the test stream at the chosen threshold (and, with --real-val, the
val stream), and the emulation must give the same hits and false hits (checked, reported). Also reported:
the best test hit rate of the sweep whose test false hits per hit are within the budget (chosen on test: an
upper bound on what GPTCache could reach, not a deployable setting).

Cost, each cache in a fresh process of its own environment, one thread (inner.py for GPTCache, ours.py for
ushash): on the test stream at the threshold chosen on val (GPTCache) and the calibrated points (ushash), every
lookup and store timed and the process's RSS growth with the cache alive; and `--fill` distinct entries (the
test pool's image features plus seeded noise, through the export's head for ushash) stored into an empty
cache, RSS growth per entry beside the bytes ushash's cache accounts for.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PINS = ["gptcache==0.1.44", "faiss-cpu==1.15.1", "numpy<3", "sqlalchemy>=2,<2.1"]  # gptcache pip-installs sqlalchemy itself at run time otherwise
COSINES = np.round(np.arange(1.0, 0.5 - 1e-9, -0.005), 4)


def gptcache_python() -> Path:
    env = HERE / ".venv"
    py = env / "bin" / "python"
    if not py.exists():
        venv.create(env, with_pip=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *PINS], check=True)
    return py


def embeddings(kind: str, enc, pool) -> tuple[dict[int, np.ndarray], np.ndarray]:
    """({cache group: unit embeddings [N, d]}, the group of every member) for `z` or `features`."""
    n = len(pool)
    if kind == "z":
        return {0: np.asarray(enc.z, np.float32)}, np.zeros(n, np.int64)
    if kind != "features":
        raise ValueError(f"embedding {kind!r}: z or features")
    mods = sorted(set(pool.modality))
    group = np.array([mods.index(m) for m in pool.modality], np.int64)
    xs = {}
    for g, m in enumerate(mods):
        idx = np.flatnonzero(group == g)
        d = len(pool.features[idx[0]])
        x = np.zeros((n, d), np.float32)
        f = np.stack([pool.features[i] for i in idx]).astype(np.float32)
        x[idx] = f / np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-30)
        xs[g] = x
    return xs, group


def emulate(xs: dict[int, np.ndarray], group: np.ndarray, cls: np.ndarray, stream: np.ndarray,
            cosines, src: np.ndarray | None = None, served: dict | None = None) -> list[dict]:
    """GPTCache's decision (top_k 1, SearchDistanceEvaluation) replayed per cosine threshold: the nearest
    stored member of the request's group is served when its cosine >= the threshold; a miss stores the
    request. A hit is false when the entry is of another class and another source input (`src`, as
    ushash.sim.calibrate counts). Returns one row per threshold: hits, false hits. served: {cosine: list}
    for the thresholds whose answers are wanted: per request, the member served (-1: a miss)."""
    n = len(group)
    sims = np.full((n, n), -np.inf, np.float32)
    for g, x in xs.items():
        idx = np.flatnonzero(group == g)
        sims[np.ix_(idx, idx)] = x[idx] @ x[idx].T
    cls = np.asarray(cls)
    src = np.arange(n) if src is None else np.asarray(src)
    rows = []
    for c in cosines:
        best = np.full(n, -np.inf, np.float32)     # each member's highest cosine with a stored entry
        arg = np.full(n, -1, np.int64)              # ... and which entry (the earliest stored on ties)
        hits = false = 0
        out = (served or {}).get(float(c))
        for q in stream.tolist():
            if arg[q] >= 0 and best[q] >= c:
                hits += 1
                false += int(cls[arg[q]] != cls[q] and src[arg[q]] != src[q])
                if out is not None:
                    out.append(int(arg[q]))
                continue
            if out is not None:
                out.append(-1)
            col = sims[:, q]
            better = col > best
            best[better] = col[better]
            arg[better] = q
        rows.append({"cosine": float(c), "threshold": round((1 + float(c)) / 2, 6), "hits": hits,
                     "false_hits": false, "hit_rate": hits / len(stream), "false_per_hit": false / hits if hits else 0.0})
    return rows


def with_bounds(rows: list[dict], delta: float = 0.05) -> list[dict]:
    from ushash.serving.calibration import clopper_pearson_upper

    return [{**r, "upper": clopper_pearson_upper(r["false_hits"], r["hits"], delta)} for r in rows]


def select_on_val(val_rows: list[dict], budget: float) -> dict | None:
    """The grid point with the highest val hit rate whose upper bound is within the budget."""
    ok = [r for r in val_rows if r["upper"] <= budget]
    return max(ok, key=lambda r: (r["hit_rate"], r["cosine"])) if ok else None


def best_on_test(test_rows: list[dict], limit: float) -> dict | None:
    """The grid point with the highest test hit rate whose test false hits per hit are within `limit` (chosen
    on test: GPTCache's best case); a point that serves nothing is none (it has no false hit per hit either)."""
    ok = [r for r in test_rows if r["hits"] and r["false_per_hit"] <= limit]
    return max(ok, key=lambda r: r["hit_rate"]) if ok else None


def gains(enc, payload_cos: np.ndarray, stream: np.ndarray, ours: list[int], theirs: list[int]) -> dict:
    """Request by request on the same stream: how many requests each cache serves that the other does not,
    and GPTCache's gains by (request modality > entry modality, Hamming distance between the request's code
    and the entry's): count, the range of their z cosines (what GPTCache compared) and of the cosines ushash's
    check reads (`payload_cos`: the request's z against the entry's decoded payload,
    ushash.sim.calibrate.payload_cosines), which its pair's payload threshold would have to admit."""
    from ushash.core.codes import hamming

    ours, theirs = np.asarray(ours), np.asarray(theirs)
    only = np.flatnonzero((theirs >= 0) & (ours < 0))
    rows: dict[tuple, list[tuple[float, float]]] = {}
    for i in only.tolist():
        q, e = int(stream[i]), int(theirs[i])
        d = int(hamming(enc.codes[[q]], enc.codes[[e]])[0, 0])
        rows.setdefault((f"{enc.modality[q]}>{enc.modality[e]}", d), []).append(
            (float(enc.z[q] @ enc.z[e]), float(payload_cos[q, e])))
    return {"theirs_only": int(len(only)), "ours_only": int(((ours >= 0) & (theirs < 0)).sum()),
            "by_pair_distance": [{"pair": k[0], "distance": k[1], "requests": len(v),
                                  "cos_min": min(c for c, _ in v), "cos_max": max(c for c, _ in v),
                                  "check_min": min(c for _, c in v), "check_max": max(c for _, c in v)}
                                 for k, v in sorted(rows.items())]}


def json_lines(cmd: list[str]) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}   # one query at a time: no thread team to wake
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def real_gptcache(py: Path, xs, group, cls, src, stream, thresholds) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "stream.npz"
        np.savez(f, cls=np.asarray(cls), src=np.asarray(src), stream=np.asarray(stream), group=group,
                 **{f"x{g}": x for g, x in xs.items()})
        return json_lines([str(py), str(HERE / "inner.py"), "replay", str(f), *map(str, thresholds)])


def fill_rows(head, pool, n: int, seed: int = 0) -> dict:
    """`n` distinct entries for the memory per entry: image features of the pool (its first modality if it
    has no images) plus seeded noise of a tenth of their spread; the raw features unit-normalised (GPTCache in
    front of the encoder), and their codes and z through the export's head (ushash; GPTCache on z)."""
    from ushash.core.checks import unit_rows

    mods = np.asarray(pool.modality)
    m = "image" if "image" in set(mods.tolist()) else str(mods[0])
    f = np.stack([pool.features[i] for i in np.flatnonzero(mods == m)]).astype(np.float32)
    rng = np.random.default_rng(seed)
    x = f[rng.integers(0, len(f), n)] + 0.1 * f.std(axis=0) * rng.standard_normal((n, f.shape[1]), dtype=np.float32)
    codes, z = head.encode(m, x)
    return {"modality": m, "features": unit_rows(x), "codes": codes, "z": unit_rows(z)}


def calibration_file(calibrations, dataset: str, budget) -> Path | None:
    """Where benchmarks/false_hit_budget.py --out wrote a data set's calibration for a budget."""
    return Path(calibrations) / f"{dataset}-{budget}.calibration.json" if calibrations else None


def costs(py: Path, export: str, cal_file: Path, enc, stream: np.ndarray, fill: dict, kinds) -> dict:
    """Both caches weighed alike, each in a fresh process (ours.py, inner.py): ushash's replay of the test
    stream at the calibration's points and its fill; GPTCache's fill per embedding of `kinds` (its replay is
    the real test replay of `run`)."""
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "ours.npz"
        n = len(fill["codes"])
        np.savez(f, modality=np.asarray(enc.modality), codes=enc.codes, z=enc.z, cls=np.asarray(enc.cls),
                 src=np.asarray(enc.src), key=np.asarray([str(k) for k in enc.key]), stream=np.asarray(stream),
                 fill_modality=np.full(n, fill["modality"]), fill_codes=fill["codes"], fill_z=fill["z"])
        ours = json_lines([sys.executable, str(HERE / "ours.py"), str(f), str(export), str(cal_file)])[0]
        theirs = {}
        for kind in kinds:
            g = Path(d) / f"fill-{kind}.npz"
            np.savez(g, x=fill["z"] if kind == "z" else fill["features"])
            theirs[kind] = json_lines([str(py), str(HERE / "inner.py"), "fill", str(g)])[0]
    return {"ushash": ours, "gptcache_fill": theirs, "fill_modality": fill["modality"]}


def run(export: str, features_dir: Path, kinds, budgets, n_val: int, n_test: int, calibrations, real_val: bool,
        py: Path | None, n_fill: int = 0) -> dict:
    from false_hit_budget import pools_and_streams
    from ushash.serving.artifact import load_export
    from ushash.serving.calibration import Calibration, clopper_pearson_upper
    from ushash.sim.calibrate import encode_pool, headroom, measure, payload_cosines

    head = load_export(export)
    ds, val, test, sv, st = pools_and_streams(head, features_dir, n_val, n_test)
    ev, et = encode_pool(head, val), encode_pool(head, test)
    out = {"dataset": ds, "revision": head.revision, "val_requests": n_val, "test_requests": n_test,
           "embeddings": {}, "ushash": {}}
    ref = None
    ours: dict[str, list[int]] = {}   # per budget: the member ushash served each test request (-1: a miss)
    for b in budgets:
        f = calibration_file(calibrations, ds, b)
        cal = Calibration.load(f) if f and f.exists() else None
        if cal is not None and cal.revision != str(head.revision):
            print(f"{f}: calibrated for revision {cal.revision}, not {head.revision}: ushash not measured "
                  "(rerun benchmarks/false_hit_budget.py)", flush=True)
            cal = None
        if cal is not None:
            r = measure(head, test, st, calibration=cal, enc=et, served=ours.setdefault(str(b), []))
            r.pop("pairs")
            out["ushash"][str(b)] = r
            ref = ref or r
    for kind in kinds:
        t0 = time.perf_counter()
        xv, gv = embeddings(kind, ev, val)
        xt, gt = embeddings(kind, et, test)
        vrows = with_bounds(emulate(xv, gv, val.cls, sv, COSINES, ev.src))
        trows = with_bounds(emulate(xt, gt, test.cls, st, COSINES, et.src))
        res = {"groups": len(xv), "sweep": [{"cosine": a["cosine"], "val_hit_rate": a["hit_rate"],
                                             "val_false_per_hit": a["false_per_hit"], "val_upper": a["upper"],
                                             "test_hit_rate": c["hit_rate"], "test_false_per_hit": c["false_per_hit"]}
                                            for a, c in zip(vrows, trows)], "budgets": {}}
        for b in budgets:
            sel = select_on_val(vrows, b)
            entry = {"val": sel}
            if sel is not None:
                emu = next(r for r in trows if r["cosine"] == sel["cosine"])
                entry["test_emulated"] = emu
                if py is not None:
                    real = real_gptcache(py, xt, gt, test.cls, et.src, st, [sel["threshold"]])[0]
                    real["upper"] = clopper_pearson_upper(real["false_hits"], real["hits"])
                    entry["test"] = real
                    entry["emulation_matches_test"] = (real["hits"], real["false_hits"]) == (emu["hits"], emu["false_hits"])
                    if real_val:
                        rv = real_gptcache(py, xv, gv, val.cls, ev.src, sv, [sel["threshold"]])[0]
                        entry["val_real"] = rv
                        entry["emulation_matches_val"] = (rv["hits"], rv["false_hits"]) == (sel["hits"], sel["false_hits"])
                else:
                    entry["test"] = emu
                if ref is not None:
                    t = entry["test"]   # correct hits only (headroom's rule)
                    entry["headroom"] = headroom(t["hit_rate"] * (1 - t["false_per_hit"]), ref["exact_hit_rate"],
                                                 ref["oracle_hit_rate"])
            entry["test_chosen_on_test"] = best_on_test(trows, b)
            u = out["ushash"].get(str(b))
            if u is not None:   # GPTCache at no more false hits per hit than ushash had on this test stream
                entry["test_at_ushash_false_rate"] = like = best_on_test(trows, u["false_per_hit"])
                if like is not None:   # GPTCache's answers at that one threshold, request by request
                    theirs = {like["cosine"]: []}
                    emulate(xt, gt, test.cls, st, [like["cosine"]], et.src, served=theirs)
                    entry["gains_at_ushash_false_rate"] = gains(et, payload_cosines(head, et), st, ours[str(b)],
                                                                theirs[like["cosine"]])
            res["budgets"][str(b)] = entry
        res["seconds"] = round(time.perf_counter() - t0, 1)
        out["embeddings"][kind] = res
        print(ds, kind, json.dumps({b: {k: (v.get("hit_rate"), v.get("false_per_hit"), v.get("cosine"))
                                        if isinstance(v, dict) else v for k, v in e.items()}
                                    for b, e in res["budgets"].items()}), flush=True)
    b = str(budgets[0])
    if py is not None and n_fill > 0 and b in out["ushash"]:   # the cost of each cache at the first budget
        out["costs"] = {"budget": b, **costs(py, export, calibration_file(calibrations, ds, b), et, st,
                                             fill_rows(head, test, n_fill), list(out["embeddings"]))}
        print(ds, "costs", json.dumps(out["costs"]), flush=True)
    return out


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"Run {meta['date']} on {meta['machine']}: `{meta['command']}`", "",
             "| data | budget | cache | threshold (chosen on val) | val hit rate, false / hit (95 % upper) | "
             "test hit rate | test false / hit (95 % upper) | headroom captured | real = emulated | "
             "best test hit rate at test false/hit <= budget (chosen on test) | ... <= ushash's test false/hit |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for b in sorted({b for e in r["embeddings"].values() for b in e["budgets"]} | set(r["ushash"])):
            u = r["ushash"].get(b)
            if u:
                lines.append(f"| {r['dataset']} | {b} | ushash (calibrated on val) | per pair | - | {u['hit_rate']:.4f} | "
                             f"{u['false_per_hit']:.4f} ({u['false_per_hit_upper']:.4f}) | {u['headroom_captured']:.3f} | - | - | - |")
            for kind, e in r["embeddings"].items():
                x = e["budgets"].get(b)
                if x is None:
                    continue
                name = f"GPTCache, {'export z' if kind == 'z' else 'raw encoder features'}"
                if x["val"] is None:
                    lines.append(f"| {r['dataset']} | {b} | {name} | none passes on val | - | 0 | - | 0 | - | - | - |")
                    continue
                v, t, o = x["val"], x["test"], x["test_chosen_on_test"]
                match = x.get("emulation_matches_test")
                hd = x.get("headroom")
                best = f"{o['hit_rate']:.4f} at cos >= {o['cosine']:.3f}" if o else "-"
                s_ = x.get("test_at_ushash_false_rate")
                same = f"{s_['hit_rate']:.4f} at cos >= {s_['cosine']:.3f}" if s_ else "-"
                lines.append(f"| {r['dataset']} | {b} | {name} | cos >= {v['cosine']:.3f} (t = {v['threshold']:.4f}) | "
                             f"{v['hit_rate']:.4f}, {v['false_per_hit']:.4f} ({v['upper']:.4f}) | {t['hit_rate']:.4f} | "
                             f"{t['false_per_hit']:.4f} ({t.get('upper', float('nan')):.4f}) | "
                             f"{'-' if hd is None else f'{hd:.3f}'} | {'-' if match is None else ('yes' if match else 'NO')} | "
                             f"{best} | {same} |")
    gained = [(r["dataset"], b, kind, x["test_at_ushash_false_rate"], x["gains_at_ushash_false_rate"])
              for r in results for kind, e in r["embeddings"].items() for b, x in sorted(e["budgets"].items())
              if x.get("gains_at_ushash_false_rate")]
    if gained:
        lines += ["", "Request by request on the test stream, GPTCache at its like-for-like threshold (the last column above) "
                  "against ushash: the requests each serves that the other does not, and GPTCache's gains by pair and "
                  "by the Hamming distance between the request's code and the entry's, with the range of their z "
                  "cosines (what GPTCache compares) and of the cosine ushash's hit check reads (the request's z against "
                  "the entry's decoded payload, which its pair's payload threshold must admit):", "",
                  "| data | budget | cache | served by GPTCache only | by ushash only | GPTCache's gains: pair, distance: requests (z cos; ushash's check) |",
                  "|---|---|---|---|---|---|"]
        for ds, b, kind, like, g in gained:
            parts = "; ".join(f"{x['pair']} d={x['distance']}: {x['requests']} ({x['cos_min']:.4f}-{x['cos_max']:.4f}; "
                              f"{x['check_min']:.4f}-{x['check_max']:.4f})" for x in g["by_pair_distance"]) or "-"
            lines.append(f"| {ds} | {b} | GPTCache, {'export z' if kind == 'z' else 'raw encoder features'}, "
                         f"cos >= {like['cosine']:.3f} | {g['theirs_only']} | {g['ours_only']} | {parts} |")
    lines += cost_lines(results)
    return "\n".join(lines) + "\n"


def cost_lines(results: list[dict]) -> list[str]:
    """The cost table: per data set, ushash and GPTCache (per embedding) on the same test stream and fill."""
    rows = [r for r in results if r.get("costs")]
    if not rows:
        return []
    mb = 1 << 20
    n_fill = rows[0]["costs"]["ushash"]["fill"]["entries"]
    out = ["", f"Cost on the same test stream and a fill of {n_fill:,} distinct {rows[0]['costs']['fill_modality']} "
           "entries, each cache in a fresh process of its own, one thread; lookups of precomputed embeddings (no "
           "encoder); RSS growth with the cache alive, from after each library's one-off loading (ushash's compiled "
           "kernels and scipy.stats, reported apart; GPTCache's imports and a throwaway cache). The process RSS "
           "includes what each process imported (ushash's: torch, for the export's heads):", "",
           "| data | cache | lookup p50 / p99 µs | GPTCache p50 / ushash p50 | store p50 µs | entries after the replay | "
           "RSS growth over the replay (MB) | fill: RSS per entry (B) | fill: bytes accounted per entry (B) | "
           "store p50 in the fill µs | process RSS at the end (MB) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, b = r["costs"], r["costs"]["budget"]
        u = c["ushash"]
        out.append(f"| {r['dataset']} | ushash (calibrated on val) | {u['lookup_p50_us']:.1f} / {u['lookup_p99_us']:.1f} | "
                   f"1 | {u['store_p50_us']:.1f} | {u['entries']} | {u['replay_rss_growth'] / mb:.1f} | "
                   f"{u['fill']['rss_per_entry']:.0f} | {u['fill']['accounted_per_entry']:.0f} | "
                   f"{u['fill']['store_p50_us']:.1f} | {u['process_rss'] / mb:.0f} (one-off loading {u['loading_rss'] / mb:.0f}) |")
        for kind, e in r["embeddings"].items():
            t, f = e["budgets"].get(b, {}).get("test"), c["gptcache_fill"].get(kind)
            if not t or "get_p99_us" not in t or f is None:
                continue
            name = f"GPTCache, {'export z' if kind == 'z' else 'raw encoder features'}, cos >= {t['cosine']:.3f}"
            out.append(f"| {r['dataset']} | {name} | {t['get_p50_us']:.1f} / {t['get_p99_us']:.1f} | "
                       f"{t['get_p50_us'] / u['lookup_p50_us']:.0f}x | {t['put_p50_us']:.1f} | {t['entries']} | "
                       f"{t['replay_rss_growth'] / mb:.1f} | {f['rss_per_entry']:.0f} | - | {f['put_p50_us']:.1f} | "
                       f"{t['process_rss'] / mb:.0f} |")
    return out


def main(argv=None):
    from false_hit_budget import stream_arguments

    ap = stream_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--embeddings", nargs="+", default=["z", "features"], choices=["z", "features"])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.01])
    ap.add_argument("--calibrations", default=str(ROOT / "experiments" / "budget"),
                    help="folder of <dataset>-<budget>.calibration.json (false_hit_budget.py --out): ushash measured "
                         "on this same stream with them")
    ap.add_argument("--real", type=int, default=1, help="0: the emulation only (no GPTCache environment)")
    ap.add_argument("--real-val", type=int, default=0, help="1: also replay the val stream through real GPTCache")
    ap.add_argument("--fill", type=int, default=50000, help="distinct entries stored into each cache for the "
                    "memory per entry (0: no cost runs)")
    ap.add_argument("--out", default=str(ROOT / "experiments" / "gptcache"))
    a = ap.parse_args(argv)
    py = gptcache_python() if a.real else None
    results = [run(e, Path(a.features_dir), a.embeddings, a.budgets, a.requests, a.test_requests, a.calibrations,
                   bool(a.real_val), py, a.fill) for e in a.export]

    from ushash.core.provenance import machine_summary
    meta = {"date": time.strftime("%Y-%m-%d", time.gmtime()),
            "machine": machine_summary(),
            "command": "python benchmarks/gptcache/compare.py " + " ".join(
                f"--{k.replace('_', '-')} {v if not isinstance(v, list) else ' '.join(map(str, v))}"
                for k, v in vars(a).items() if k not in ("features_dir", "out", "export", "calibrations")) +
            "".join(f" --export {Path(e).name}" for e in a.export)}
    o = Path(a.out)
    o.mkdir(parents=True, exist_ok=True)
    (o / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (o / "results.md").write_text(markdown(results, meta))
    print(markdown(results, meta))


if __name__ == "__main__":
    main()
