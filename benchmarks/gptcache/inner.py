"""Runs inside the pinned GPTCache environment (see compare.py): replays one stream through real GPTCache
with precomputed embeddings, once per similarity threshold. Prints one JSON line per threshold.

    inner.py STREAM.npz THRESHOLD [THRESHOLD ...]

STREAM.npz holds `cls` [N] (each pool member's class), `src` [N] (its source input: a hit is false when
the entry's class and source both differ from the request's), `stream` [n] (member indices), `group` [N] (which
cache a member is looked up in and stored to: one GPTCache per group, e.g. per modality when the embeddings
are per-modality encoder features of different sizes) and `x<g>` [N, d_g] (the embedding of every member
of group g; the rows of other groups are unused)."""

import json
import sys
import tempfile
import time

import numpy as np
from gptcache import Cache, Config
from gptcache.adapter.api import get, init_similar_cache, put
from gptcache.manager import CacheBase, VectorBase, get_data_manager
from gptcache.similarity_evaluation.distance import SearchDistanceEvaluation


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


def replay(xs, group, cls, src, stream, threshold):
    with tempfile.TemporaryDirectory() as d:
        caches = {g: make_cache(d, x, threshold, f"g{g}") for g, x in xs.items()}
        hits = false = 0
        lat = []
        for i in stream.tolist():
            cache = caches[int(group[i])]
            t0 = time.perf_counter()
            ans = get(str(i), cache_obj=cache)
            lat.append(time.perf_counter() - t0)
            if ans is None:
                put(str(i), str(i), cache_obj=cache)     # the answer names the entry's member
            else:
                hits += 1
                e = int(ans)
                false += int(cls[e] != cls[i] and src[e] != src[i])
        n = len(stream)
        return {"threshold": threshold, "cosine": round(2 * threshold - 1, 6), "hit_rate": hits / n, "hits": hits,
                "false_hits": false, "false_per_hit": false / hits if hits else 0.0,
                "get_p50_us": float(np.percentile(lat, 50) * 1e6)}


def main():
    data = np.load(sys.argv[1])
    cls, src, stream, group = data["cls"], data["src"], data["stream"], data["group"]
    xs = {int(k[1:]): data[k].astype("float32") for k in data.files if k.startswith("x")}
    for th in map(float, sys.argv[2:]):
        print(json.dumps(replay(xs, group, cls, src, stream, th)), flush=True)


if __name__ == "__main__":
    main()
