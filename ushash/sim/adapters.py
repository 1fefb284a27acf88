"""The caches under test: one `CacheUnderTest` protocol, four implementations.

A request is a pool index (each cache precomputes what it looks up by: an exact key, a float z, a code);
an answer is the pool index of the request that stored it (the replay judges it by that member's class
and source input). The replay (ushash/sim/replay.py) drives every cache the same way:
`reset(**settings)` to start empty with the settings of one sweep point, then per request `lookup`, and
on a miss `nearest_value` (for the report) and `store`; `new_revision()` when a new model is deployed
mid-stream, `nbytes` for the memory used.

- `ExactKeyCache`: sha256 of the normalised input, what a plain HTTP / LLM response cache does;
- `CosineCache`: float embeddings, a flat inner-product index and one global cosine threshold, like
  GPTCache / RedisVL;
- `LSHCodesCache`: a `SemanticCache` over random-hyperplane codes of the export's float z;
- `USHashCache`: a `SemanticCache` over the export's own codes.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ushash.sim.pool import Pool
from ushash.sim.stream import SimClock

TENANT = "sim"


@dataclass
class Outcome:
    """The result of one lookup: a hit with its answer, and whether the entry was stale (an older
    revision's, or past its expiry)."""
    hit: bool
    value: int | None = None
    stale: bool = False


@runtime_checkable
class CacheUnderTest(Protocol):
    name: str

    def reset(self, **settings: Any) -> None:
        """Empty the cache and apply `settings` (over those given to the constructor) until the next reset.
        A setting the cache does not have is a ValueError."""

    def new_revision(self) -> None:
        """A new model revision is deployed."""

    def lookup(self, i: int) -> Outcome:
        """Look up request `i` of the pool."""

    def store(self, i: int, value: int) -> None:
        """Store `value` as the answer to request `i`."""

    def nearest_value(self, i: int) -> int | None:
        """The answer of the cached entry nearest to request `i` (None when empty or not defined)."""

    @property
    def nbytes(self) -> int:
        """Bytes the live entries take."""


def _settings(name: str, settings: dict, allowed: dict) -> dict:
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise ValueError(f"{name} has no setting {', '.join(unknown)}; it takes {sorted(allowed) or 'none'}")
    return {**allowed, **settings}


def _freshness(ttl_s: float | None, jitter: float):
    """The expiry rule the code caches replay with (`Freshness`: ttl x (1 - jitter x u), seeded as theirs), so
    that every cache of a replay loses its entries alike (the baselines once kept theirs the whole ttl while
    the code caches' expired up to `jitter` earlier)."""
    from ushash.serving.cache.freshness import Freshness

    return Freshness(ttl_s or None, float(jitter), 0.0, rng=random.Random(0))


class ExactKeyCache:
    """An exact-key cache: sha256 of the normalised input (what a plain HTTP/LLM response cache does).
    It does not track model revisions: after a change it keeps serving the old model's answers."""

    def __init__(self, pool: Pool, clock: SimClock, ttl_s: float | None, ttl_jitter: float = 0.0):
        self.name, self.keys, self.clock, self.ttl_s, self.ttl_jitter = "exact key", pool.key, clock, ttl_s, ttl_jitter
        self.reset()

    def reset(self, **settings) -> None:
        _settings(type(self).__name__, settings, {})
        self.freshness = _freshness(self.ttl_s, self.ttl_jitter)
        self.d: dict[bytes, tuple[int, float, int]] = {}
        self.n_rev = 0

    def new_revision(self) -> None:
        self.n_rev += 1

    def lookup(self, i: int) -> Outcome:
        e = self.d.get(self.keys[i])
        if e is None or e[1] <= self.clock():
            return Outcome(False)
        return Outcome(True, e[0], e[2] != self.n_rev)

    def store(self, i: int, value: int) -> None:
        self.d[self.keys[i]] = (value, self.freshness.expiry(self.clock()), self.n_rev)

    def nearest_value(self, i: int) -> int | None:
        return None

    @property
    def nbytes(self) -> int:
        now = self.clock()
        return sum(1 for e in self.d.values() if e[1] > now) * (32 + 8)


class CosineCache:
    """GPTCache / RedisVL-like: float embeddings, flat inner-product index, one global threshold, TTL;
    entries are not tied to a model revision (those caches do not track one). Setting: `threshold`."""

    def __init__(self, head, pool: Pool, clock: SimClock, ttl_s: float | None, threshold: float = 0.8,
                 ttl_jitter: float = 0.0):
        self.name, self.clock, self.ttl_s, self.ttl_jitter = "float z cosine", clock, ttl_s, ttl_jitter
        self.base = {"threshold": float(threshold)}
        z = np.zeros((len(pool), head.dim), np.float32)
        mods = np.asarray(pool.modality)
        for m in sorted(set(pool.modality)):
            idx = np.flatnonzero(mods == m)
            z[idx] = head.embed(m, np.stack([pool.features[i] for i in idx]))
        z /= np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12)
        self.z = z
        self.reset()

    def reset(self, **settings) -> None:
        import faiss

        self.threshold = float(_settings(type(self).__name__, settings, self.base)["threshold"])
        self.freshness = _freshness(self.ttl_s, self.ttl_jitter)
        self.index = faiss.IndexFlatIP(self.z.shape[1])
        self.values, self.expires, self.rev = [], [], []
        self.n_rev = 0

    def new_revision(self) -> None:
        self.n_rev += 1  # GPTCache-like caches keep serving entries of the old model

    def _best_live(self, i: int, threshold: float = -math.inf) -> int | None:
        """The most similar unexpired entry with cosine >= threshold (None if there is none). Expired
        entries stay in the index, so the search widens past them (8, 16, ... nearest) until it finds one."""
        n, now = self.index.ntotal, self.clock()
        k = min(8, n)
        while k:
            S, I = self.index.search(self.z[i:i + 1], k)
            for s, j in zip(S[0], I[0]):
                if j < 0 or s < threshold:
                    return None
                if self.expires[j] > now:
                    return int(j)
            if k == n:
                return None
            k = min(2 * k, n)
        return None

    def lookup(self, i: int) -> Outcome:
        j = self._best_live(i, self.threshold)
        if j is None:
            return Outcome(False)
        return Outcome(True, self.values[j], self.rev[j] != self.n_rev)

    def store(self, i: int, value: int) -> None:
        self.index.add(self.z[i:i + 1])
        self.values.append(value)
        self.expires.append(self.freshness.expiry(self.clock()))
        self.rev.append(self.n_rev)

    def nearest_value(self, i: int) -> int | None:
        j = self._best_live(i)  # live entries only, as the code caches (expired ones are not cached)
        return None if j is None else self.values[j]

    @property
    def nbytes(self) -> int:
        now = self.clock()
        live = sum(1 for e in self.expires if e > now)
        return live * (4 * self.z.shape[1] + 8)


class RevisedHead:
    """The same head under another revision id (simulates deploying a new model mid-stream)."""

    def __init__(self, head, revision: str):
        self._head, self.revision = head, revision

    def __getattr__(self, name):
        return getattr(self._head, name)


class CodesCache:
    """A `SemanticCache` over precomputed queries of a head's codes and z. Settings: the cache's own
    (configs/cache/default.yaml keys), over `cache_cfg`. A new revision reloads the head under a new
    revision id, so the cache's revision watermark retires the older entries."""

    def __init__(self, name: str, head, pool: Pool, cache_cfg: dict, clock: SimClock):
        from ushash.serving.cache import Query

        self.name, self.head, self.cache_cfg, self.clock = name, head, dict(cache_cfg), clock
        self.queries: list = [None] * len(pool)
        mods = np.asarray(pool.modality)
        for m in sorted(set(pool.modality)):
            idx = np.flatnonzero(mods == m)
            codes, z = head.encode(m, np.stack([pool.features[i] for i in idx]))
            z = z / np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-30)
            for i, c, zz in zip(idx, codes, z):
                self.queries[i] = Query(m, c.tobytes(), np.ascontiguousarray(zz, np.float32))
        self.bits = int(head.bits)
        self.reset()

    def reset(self, **settings) -> None:
        from ushash.serving.cache import SemanticCache

        cfg = {**self.cache_cfg, **settings}  # SemanticCache's CacheConfig refuses unknown settings
        # seeded: TTL jitter and XFetch draws are part of the replay, which must be reproducible
        self.cache = SemanticCache(self.head, cfg, clock=self.clock, rng=random.Random(0))
        self.n_rev = 0

    def new_revision(self) -> None:
        self.n_rev += 1
        self.cache.reload(RevisedHead(self.head, f"{self.head.revision}+sim{self.n_rev}"))

    def lookup(self, i: int) -> Outcome:
        hit = self.cache.lookup(self.queries[i], TENANT)
        if hit is None:
            return Outcome(False)
        stale = hit.revision != self.cache.revision or hit.expires <= self.clock()
        return Outcome(True, int(hit.value), stale)

    def store(self, i: int, value: int) -> None:
        self.cache.store(self.queries[i], value, TENANT)

    def nearest_value(self, i: int) -> int | None:
        from ushash.core.codes import hamming

        t = self.cache.table
        live = t.live_slots()
        if not len(live):
            return None
        d = hamming(np.frombuffer(self.queries[i].code, np.uint8)[None], t.code[live])[0]
        j = live[int(np.argmin(d))]
        return int(t.decoded_value(j))

    @property
    def nbytes(self) -> int:
        return int(self.cache.policy.used_bytes)


class USHashCache(CodesCache):
    """The US-HASH export's own codes in a `SemanticCache`."""

    def __init__(self, head, pool: Pool, cache_cfg: dict, clock: SimClock):
        super().__init__("ushash", head, pool, cache_cfg, clock)


class LSHCodesCache(CodesCache):
    """Random-hyperplane (SimHash) codes of the export's float z, same bits and payload codec, in a
    `SemanticCache`: what the codes add over hashing the float space."""

    def __init__(self, head, pool: Pool, cache_cfg: dict, clock: SimClock, seed: int = 0):
        from ushash.serving.cache.lsh import LSHHead

        super().__init__("lsh", LSHHead.over(head, seed=int(seed)), pool, cache_cfg, clock)
