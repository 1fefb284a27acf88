"""Real GPTCache (pinned) on the stream and embeddings the false-hit budget benchmark measures ushash on.

    python benchmarks/gptcache/compare.py --export exports/tuxpaint-64b [--features-dir data/features] \
        [--test-requests 20000] [--thresholds 0.995 0.99 ...]

GPTCache runs in its own virtual environment (benchmarks/gptcache/.venv, made here on the first run with
gptcache==0.1.44, faiss-cpu and numpy from PyPI; ignored by git). The test pool and stream are the same as
benchmarks/false_hit_budget.py's (same seeds); every request's embedding is the export's unit z, handed to
GPTCache as a precomputed embedding (its sqlite + faiss data manager, SearchDistanceEvaluation). GPTCache's
similarity_threshold t accepts a faiss L2 distance d^2 <= 4 (1 - t), i.e. cosine >= 2t - 1 for unit z.
Reported per threshold: hit rate, false hits per hit, lookup p50; and the best hit rate at each budget.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PINS = ["gptcache==0.1.44", "faiss-cpu==1.15.1", "numpy<3", "sqlalchemy>=2,<2.1"]  # gptcache pip-installs sqlalchemy itself at run time otherwise


def gptcache_python() -> Path:
    env = HERE / ".venv"
    py = env / "bin" / "python"
    if not py.exists():
        venv.create(env, with_pip=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *PINS], check=True)
    return py


def main(argv=None):
    from false_hit_budget import store_of
    from ushash.serving.artifact import load_export
    from ushash.sim.calibrate import encode_pool
    from ushash.sim.pool import pool_from_split
    from ushash.sim.stream import make_stream

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", action="append", required=True)
    ap.add_argument("--features-dir", default=str(ROOT / "data" / "features"))
    ap.add_argument("--test-requests", type=int, default=5000)
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.995, 0.99, 0.985, 0.98, 0.97])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.01])
    ap.add_argument("--calibrations", default=None,
                    help="folder of <dataset>-<budget>.calibration.json (false_hit_budget.py --out): ushash measured "
                         "on this same stream with them")
    ap.add_argument("--out", default=str(ROOT / "experiments" / "gptcache"))
    a = ap.parse_args(argv)
    py = gptcache_python()
    results = {}
    for export in a.export:
        head = load_export(export)
        ds = (head.manifest.get("source") or {}).get("dataset")
        test = pool_from_split(store_of(Path(a.features_dir), ds, "test", head.encoder.fingerprint, head.encoder.name), seed=1)
        stream = make_stream(test, a.test_requests, 1.0, 1)
        enc = encode_pool(head, test)
        with tempfile.TemporaryDirectory() as d:
            f = Path(d) / "stream.npz"
            np.savez(f, z=enc.z, cls=enc.cls, stream=stream)
            out = subprocess.run([str(py), str(HERE / "inner.py"), str(f), *map(str, a.thresholds)], check=True,
                                 capture_output=True, text=True).stdout
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        best = {str(b): max((r for r in rows if r["false_per_hit"] <= b), key=lambda r: r["hit_rate"], default=None)
                for b in a.budgets}
        results[ds] = {"rows": rows, "best": best, "ushash": {}}
        if a.calibrations:
            from ushash.serving.calibration import Calibration
            from ushash.sim.calibrate import headroom, measure
            for b in a.budgets:
                f = Path(a.calibrations) / f"{ds}-{b}.calibration.json"
                if f.exists():
                    r = measure(head, test, stream, calibration=Calibration.load(f), enc=enc)
                    r.pop("pairs")
                    g = best[str(b)]
                    r["gptcache_headroom"] = headroom(g["hit_rate"], r["exact_hit_rate"], r["oracle_hit_rate"]) if g else None
                    results[ds]["ushash"][str(b)] = r
        print(ds, json.dumps({"gptcache": best, "ushash": results[ds]["ushash"]}), flush=True)
    o = Path(a.out)
    o.mkdir(parents=True, exist_ok=True)
    (o / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
