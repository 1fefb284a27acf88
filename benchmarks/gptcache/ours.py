"""Runs in a fresh process of the project's environment (see compare.py): ushash's side of the cost comparison
with real GPTCache (inner.py), weighed as inner.py weighs GPTCache. Prints one JSON line.

    ours.py STREAM.npz EXPORT CALIBRATION

STREAM.npz holds the test pool as the cache sees it (`modality`, `codes`, `z`, `cls`, `src`, `key` per
member), the `stream` (member indices) and a fill (`fill_modality`, `fill_codes`, `fill_z`: distinct entries
that are only stored). Two caches, each made by `ushash.sim.calibrate.replay_cache` after what the process loads
once (the compiled kernels, and scipy.stats for the replay's bounds: a fixed cost per process, reported apart):

- replay: the stream through a cache at the calibration's points (`measure`, the false-hit benchmark's
  replay: store on a miss), every lookup and store timed; the process's RSS growth with the cache alive;
- fill: every fill entry stored into an empty cache, each store timed; RSS growth per entry beside the bytes
  the cache accounts for (what `capacity_bytes` bounds).
"""

import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cache_memory import rss_bytes as rss  # noqa: E402  (the RSS inner.py reads)


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs), q) * 1e6)


def main():
    from ushash.serving.artifact import load_export
    from ushash.serving.cache import Query
    from ushash.serving.calibration import Calibration
    from ushash.sim.calibrate import TENANT, Encoded, measure, replay_cache

    data = np.load(sys.argv[1])
    head, cal = load_export(sys.argv[2]), Calibration.load(sys.argv[3])
    enc = Encoded(data["modality"], data["codes"], data["z"], {}, data["cls"], data["key"].tolist(), data["src"])
    base = rss()
    t0 = time.perf_counter()
    replay_cache(head, cal).warm_up()        # the compiled kernels: loaded once per process
    measure(head, None, data["stream"][:200], calibration=cal, enc=enc)   # and what a replay imports (the bounds' scipy.stats)
    loading = rss() - base, time.perf_counter() - t0

    before = rss()
    cache, timings = replay_cache(head, cal), {}
    res = measure(head, None, data["stream"], calibration=cal, enc=enc, timings=timings, cache=cache)
    grown = rss() - before
    out = {"hits": res["hits"], "false_hits": res["false_hits"], "hit_rate": res["hit_rate"],
           "entries": len(cache), "lookup_p50_us": pct(timings["lookup"], 50),
           "lookup_p99_us": pct(timings["lookup"], 99), "store_p50_us": pct(timings["store"], 50),
           "replay_rss_growth": grown, "replay_accounted": cache.stats()["size_bytes"],
           "loading_rss": loading[0], "loading_s": loading[1]}

    fill = replay_cache(head)
    queries = [Query(str(m), c.tobytes(), z) for m, c, z in
               zip(data["fill_modality"], data["fill_codes"], data["fill_z"])]
    before, lat = rss(), []
    for i, q in enumerate(queries):
        t0 = time.perf_counter()
        fill.store(q, i, TENANT)
        lat.append(time.perf_counter() - t0)
    n = len(fill)
    out["fill"] = {"entries": n, "store_p50_us": pct(lat, 50), "rss_per_entry": (rss() - before) / n,
                   "accounted_per_entry": fill.stats()["size_bytes"] / n}
    out["process_rss"] = rss()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
