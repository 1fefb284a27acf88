"""Runs inside the pinned GPTCache environment (see compare.py): replays one stream through real GPTCache
with precomputed embeddings, once per similarity threshold, or fills one with distinct entries. Prints one
JSON line per threshold (or one for the fill).

    inner.py replay STREAM.npz THRESHOLD [THRESHOLD ...]
    inner.py fill FILL.npz

STREAM.npz holds `cls` [N] (each pool member's class), `src` [N] (its source input: a hit is false when
the entry's class and source both differ from the request's), `stream` [n] (member indices), `group` [N] (which
cache a member is looked up in and stored to: one GPTCache per group, e.g. per modality when the embeddings
are per-modality encoder features of different sizes) and `x<g>` [N, d_g] (the embedding of every member
of group g; the rows of other groups are unused). FILL.npz holds `x` [M, d]: M distinct embeddings, each
put once into one empty GPTCache.

Weighed as ours.py weighs ushash's cache: every get and put timed; the process's RSS growth with the caches
alive, from before they are made (after GPTCache's imports and one throwaway cache, its fixed cost per
process) to the end of the replay or the fill."""

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gptcache import Cache, Config
from gptcache.adapter.api import get, init_similar_cache, put
from gptcache.manager import CacheBase, VectorBase, get_data_manager
from gptcache.similarity_evaluation.distance import SearchDistanceEvaluation

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cache_memory import rss_bytes as rss  # noqa: E402  (the RSS ours.py reads; that module imports numpy only)


class Precomputed:
    """GPTCache's embedding interface over vectors computed beforehand: the prompt is the row index."""

    def __init__(self, z):
        self.z = z
        self.dimension = z.shape[1]

    def to_embeddings(self, data, **_):
        return self.z[int(data)]


def make_cache(d, x, threshold, name):
    emb = Precomputed(x)
    dm = get_data_manager(CacheBase("sqlite", sql_url="sqlite://"),
                          VectorBase("faiss", dimension=emb.dimension, index_path=f"{d}/{name}.index"),
                          max_size=10 ** 7)
    cache = Cache()
    init_similar_cache(data_dir=f"{d}/{name}", cache_obj=cache, embedding=emb, data_manager=dm,
                       evaluation=SearchDistanceEvaluation(), config=Config(similarity_threshold=threshold))
    return cache


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs), q) * 1e6)


def warm_up(d, dim, threshold):
    """One throwaway cache, one put and one get: what GPTCache loads once per process is loaded before RSS is read."""
    x = np.eye(2, dim, dtype="float32")
    cache = make_cache(d, x, threshold, "warm")
    put("0", "0", cache_obj=cache)
    get("1", cache_obj=cache)


def replay(xs, group, cls, src, stream, threshold):
    with tempfile.TemporaryDirectory() as d:
        warm_up(d, next(iter(xs.values())).shape[1], threshold)
        before = rss()
        caches = {g: make_cache(d, x, threshold, f"g{g}") for g, x in xs.items()}
        hits = false = 0
        lat, plat = [], []
        for i in stream.tolist():
            cache = caches[int(group[i])]
            t0 = time.perf_counter()
            ans = get(str(i), cache_obj=cache)
            lat.append(time.perf_counter() - t0)
            if ans is None:
                t0 = time.perf_counter()
                put(str(i), str(i), cache_obj=cache)     # the answer names the entry's member
                plat.append(time.perf_counter() - t0)
            else:
                hits += 1
                e = int(ans)
                false += int(cls[e] != cls[i] and src[e] != src[i])
        n = len(stream)
        return {"threshold": threshold, "cosine": round(2 * threshold - 1, 6), "hit_rate": hits / n, "hits": hits,
                "false_hits": false, "false_per_hit": false / hits if hits else 0.0, "entries": len(plat),
                "get_p50_us": pct(lat, 50), "get_p99_us": pct(lat, 99), "put_p50_us": pct(plat, 50),
                "replay_rss_growth": rss() - before, "process_rss": rss()}


def fill(x, threshold=1.0):   # a put reads no threshold
    with tempfile.TemporaryDirectory() as d:
        warm_up(d, x.shape[1], threshold)
        before = rss()
        cache = make_cache(d, x, threshold, "fill")
        lat = []
        for i in range(len(x)):
            t0 = time.perf_counter()
            put(str(i), str(i), cache_obj=cache)
            lat.append(time.perf_counter() - t0)
        return {"entries": len(x), "put_p50_us": pct(lat, 50), "rss_per_entry": (rss() - before) / len(x)}


def main():
    mode, path, thresholds = sys.argv[1], sys.argv[2], list(map(float, sys.argv[3:]))
    data = np.load(path)
    if mode == "fill":
        print(json.dumps(fill(data["x"].astype("float32"))), flush=True)
        return
    if mode != "replay":
        raise SystemExit(f"mode {mode!r}: replay or fill")
    cls, src, stream, group = data["cls"], data["src"], data["stream"], data["group"]
    xs = {int(k[1:]): data[k].astype("float32") for k in data.files if k.startswith("x")}
    for th in thresholds:
        print(json.dumps(replay(xs, group, cls, src, stream, th)), flush=True)


if __name__ == "__main__":
    main()
