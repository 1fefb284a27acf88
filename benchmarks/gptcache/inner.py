"""Runs inside the pinned GPTCache environment (see compare.py): replays one stream through real GPTCache
with precomputed embeddings, once per similarity threshold. Prints one JSON line per threshold."""

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


def replay(z, cls, stream, threshold):
    with tempfile.TemporaryDirectory() as d:
        emb = Precomputed(z)
        dm = get_data_manager(CacheBase("sqlite", sql_url=f"sqlite:///{d}/c.db"),
                              VectorBase("faiss", dimension=emb.dimension, index_path=f"{d}/f.index"),
                              max_size=10 ** 7)
        cache = Cache()
        init_similar_cache(data_dir=d, cache_obj=cache, embedding=emb, data_manager=dm,
                           evaluation=SearchDistanceEvaluation(), config=Config(similarity_threshold=threshold))
        hits = false = 0
        lat = []
        for i in stream:
            t0 = time.perf_counter()
            ans = get(str(i), cache_obj=cache)
            lat.append(time.perf_counter() - t0)
            if ans is None:
                put(str(i), str(int(cls[i])), cache_obj=cache)
            else:
                hits += 1
                false += int(ans) != int(cls[i])
        n = len(stream)
        return {"threshold": threshold, "hit_rate": hits / n, "hits": hits, "false_hits": false,
                "false_per_hit": false / hits if hits else 0.0,
                "get_p50_us": float(np.percentile(lat, 50) * 1e6)}


def main():
    data = np.load(sys.argv[1])
    z, cls, stream = data["z"].astype("float32"), data["cls"], data["stream"]
    for th in map(float, sys.argv[2:]):
        print(json.dumps(replay(z, cls, stream, th)), flush=True)


if __name__ == "__main__":
    main()
