"""The simulator's numbers against a naive replay written here from scratch, on small seeded streams."""

import numpy as np
import pytest

from ushash.sim.adapters import CosineCache
from ushash.sim.pool import Pool
from ushash.sim.replay import replay
from ushash.sim.stream import SimClock


class _IdentityHead:
    """A head whose float z is the features themselves."""

    def __init__(self, dim):
        self.dim = dim

    def embed(self, modality, x):
        return np.asarray(x, np.float32)


def _pool(n_cls=6, per_cls=3, dim=8, seed=0):
    rng = np.random.default_rng(seed)
    pool = Pool()
    for c in range(n_cls):
        base = rng.normal(size=dim)
        for k in range(per_cls):
            x = base + (0.3 * rng.normal(size=dim) if k else 0.0)
            pool.add("image", x, c, "original" if k == 0 else "perturbed", f"{c}-{k}".encode())
    return pool


def _naive_cosine(pool, stream, ttl, thr, spr):
    """Serve the most similar unexpired entry with cosine >= thr; a miss stores (z, value, expiry)."""
    z = np.stack([f / np.linalg.norm(f) for f in pool.features])
    cls = np.asarray(pool.cls)
    entries = []  # (index, value, expires)
    hits = false = nn_right = 0
    for t, i in enumerate(stream.tolist()):
        now = t * spr
        live = [e for e in entries if e[2] > now]
        best = max(live, key=lambda e: float(z[e[0]] @ z[i]), default=None)
        if best is not None and float(z[best[0]] @ z[i]) >= thr - 1e-6:
            hits += 1
            false += cls[best[1]] != cls[i]
        else:
            nn_right += best is not None and cls[best[1]] == cls[i]
            entries.append((i, i, now + ttl))
    n = len(stream)
    return {"hit_rate": hits / n, "false_hit_rate": false / n, "misses_nn_correct": nn_right / max(1, n - hits)}


def _one_request(n: int, every_s: float) -> dict:
    """The float cache (TTL 10 s) replaying one request n times, every `every_s` seconds."""
    pool = Pool()
    pool.add("image", np.array([1, 0, 0, 0], np.float32), 0, "original", b"a")
    clock = SimClock()
    cache = CosineCache(_IdentityHead(4), pool, clock, ttl_s=10.0)
    return replay(cache, np.zeros(n, np.int64), pool, clock, seconds_per_request=every_s)


def test_cosine_cache_serves_a_live_entry_behind_many_expired_copies():
    # one request, asked every 6 s, TTL 10 s: stored, hit, expired -> stored again, hit, ... a hit rate of 1/2.
    # The float cache kept expired entries in its index and looked only at the 8 nearest: after 8 expiries the
    # live copy (tied at cosine 1 with the expired ones) was never found again, and it missed for ever.
    res = _one_request(60, 6.0)
    assert res["hit_rate"] == pytest.approx(0.5)


def test_cosine_cache_nearest_entry_of_a_miss_is_a_live_one():
    # every miss of this stream comes after the only entry expired: nothing is cached, so no miss has a
    # "correct nearest entry" (as for the code caches, which drop expired entries before they search)
    res = _one_request(10, 12.0)
    assert res["hit_rate"] == 0.0 and res["misses_nn_correct"] == 0.0


@pytest.mark.parametrize("ttl,thr", [(15.0, 0.8), (40.0, 0.9), (7.0, 0.5)])
def test_cosine_cache_matches_a_naive_replay(ttl, thr):
    pool = _pool()
    rng = np.random.default_rng(1)
    stream = rng.integers(0, len(pool), size=400)
    clock = SimClock()
    res = replay(CosineCache(_IdentityHead(8), pool, clock, ttl_s=ttl, threshold=thr), stream, pool, clock)
    ref = _naive_cosine(pool, stream, ttl, thr, 1.0)
    for k, v in ref.items():
        assert res[k] == pytest.approx(v), k


def test_exact_key_cache_and_oracle_match_a_naive_replay():
    from ushash.sim.adapters import ExactKeyCache

    pool = _pool()
    pool.source[4] = pool.source[0]  # a shared input under two classes: equivalent, never a false hit
    pool.key[4] = pool.key[0]
    rng = np.random.default_rng(2)
    stream = rng.integers(0, len(pool), size=300)
    clock = SimClock()
    res = replay(ExactKeyCache(pool, clock, ttl_s=20.0), stream, pool, clock, revision_change_at=0.5)
    cls, src = np.asarray(pool.cls), pool.source
    d, hits = {}, 0
    stale = false = oracle = 0
    seen = []
    for t, i in enumerate(stream.tolist()):
        rev = int(t >= 150)
        if t == 150:
            seen = []
        oracle += any(cls[j] == cls[i] or src[j] == src[i] for j in seen)
        seen.append(i)
        e = d.get(pool.key[i])
        if e is not None and e[1] > t:
            hits += 1
            stale += e[2] != rev
            false += not (cls[e[0]] == cls[i] or src[e[0]] == src[i])
        else:
            d[pool.key[i]] = (i, t + 20.0, rev)
    assert res["hit_rate"] == hits / 300 and res["stale_hits"] == stale and res["false_hit_rate"] == false / 300
    assert res["oracle_hit_rate"] == oracle / 300 and false == 0
