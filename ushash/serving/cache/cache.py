"""`SemanticCache`: a cache keyed by binary hash codes, for image, text or audio requests.

    cache = SemanticCache.from_export("exports/tuxpaint-offline-64b", {"capacity_bytes": 64 << 20, "radius": 3})
    hit = cache.get("text", "a frog", tenant="acme")             # Hit or None
    cache.put("text", "a frog", value=b"...", tenant="acme")
    res = cache.get_or_compute("image", png_bytes, compute=answer, tenant="acme")   # res.value

A lookup encodes the request (raw media through the export's frozen encoder, or precomputed encoder
features) into a packed code and a shared-space embedding z, then asks each tier in turn, L1 then the L2
(Redis), for the entry to serve: the tier's entries of the same tenant within `radius` bits of the code,
nearest first, of which the hit check (`HitCheck`) serves the first that is of the current revision, not
expired, and whose payload (the quantized copy of the entry's z) has cosine >= `payload_threshold` with the
request's z. An L2 hit is promoted into L1. See docs/cache.md for the guarantees and the Redis layout.

The pieces: the entry record and the tier interface (entries.py), L1 (l1.py), the L2 (redis_store.py),
the hit check (hitcheck.py), TTL / XFetch / the revision watermark (freshness.py), single-flight and the
Bloom guard (protection.py), requests (request.py), metrics (telemetry.py). This module composes them.

Thread-safe: L1 has its lock; encoding and the L2 round trips run outside it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from ushash.serving.calibration import Calibration
from ushash.serving.cache.api import CheckStore
from ushash.serving.cache.budget import PairBudget
from ushash.serving.cache.config import CacheConfig
from ushash.serving.cache.entries import Entry, Found, Hit, encode_value, shared_id, valid_tenant
from ushash.serving.cache.freshness import Freshness, RevisionWatermark, revision_rank
from ushash.serving.cache.hitcheck import HitCheck
from ushash.serving.cache.l1 import L1Tier
from ushash.serving.cache.protection import AsyncSingleFlight, SingleFlight, leading
from ushash.serving.cache.redis_store import RedisStore
from ushash.serving.cache.request import Query, QueryEncoder, RequestError
from ushash.serving.cache.telemetry import CacheMetrics, TracedCheck, key_hash

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
_NO_VALUE = object()


class UnknownTenant(KeyError):
    """The tenant is not one this cache serves (config `tenants`)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown tenant"


class InvalidTenant(RequestError):
    """A tenant name that is not 1-64 characters of [A-Za-z0-9_.-]: bad input (a RequestError, so a
    ValueError, and a 400 from the service), not a missing key."""


@dataclass
class Result:
    value: Any
    hit: Hit | None         # the hit served, or None when computed
    computed: bool          # this call ran `compute`
    waited: bool = False    # this call waited for another caller's computation (single-flight)
    verified: bool | None = None   # a shadow check computed this hit anyway: did the answers agree


def _packed(codes) -> np.ndarray:
    """Packed code bytes as uint8: bytes as they are, integer arrays of values 0..255 as uint8; anything else
    is refused (a cast would wrap 300 to 44 or truncate 0.7 to 0: another request's code)."""
    if isinstance(codes, (bytes, bytearray, memoryview)):
        return np.frombuffer(codes, np.uint8)
    a = np.asarray(codes)
    if a.dtype == np.uint8:
        return a
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer) or \
            (a.size and (int(a.min()) < 0 or int(a.max()) > 255)):
        raise RequestError(f"code must be packed bytes (uint8, or integers 0..255); got {a.dtype} "
                           f"{a.reshape(-1)[:4].tolist()}...")
    return a.astype(np.uint8)


def _url_host(url: str) -> str:
    """A Redis URL without its credentials: scheme, host, port and database only (a password may be given as
    user:password@ or as ?password=, which redis-py reads too; any token may read /v1/stats)."""
    from urllib.parse import urlsplit

    u = urlsplit(str(url))
    try:
        port = u.port
    except ValueError:   # not a number: no port is shown
        port = None
    host = f"[{u.hostname}]" if u.hostname and ":" in u.hostname else (u.hostname or "")
    return f"{u.scheme}://{host}{f':{port}' if port else ''}{u.path}"


def _flight_key(hit: Hit | None, tenant: str, q: Query):
    """The single-flight key of a lookup's outcome: None when the hit is served as it is; a miss computes
    once per (tenant, code); an XFetch refresh once per ("refresh", tenant, code)."""
    if hit is not None and not hit.refresh:
        return None
    return (tenant, q.code) if hit is None else ("refresh", tenant, q.code)


UNIT_TOLERANCE = 1e-4   # |z . z - 1| a hand-built Query's z may have (float32 rounding is ~1e-7; 1e-4 moves a
                        # cosine by at most 5e-5, under any threshold step)


class SemanticCache(CheckStore):
    def __init__(self, head, config: CacheConfig | dict | None = None, encoder=None,
                 clock: Callable[[], float] = time.time, registry=None, rng: random.Random | None = None,
                 l2_client=None, calibration: Calibration | None = None):
        self.config = config if isinstance(config, CacheConfig) else CacheConfig.from_dict(config)
        c = self.config
        if calibration is None and c.calibration:
            calibration = Calibration.load(c.calibration)
        self.clock = clock
        self.rng = rng or random.Random()
        self.metrics = CacheMetrics(int(head.bits), registry)
        self.metrics.capacity_bytes.set(c.capacity_bytes)
        self.freshness = Freshness(c.ttl_s, c.ttl_jitter, c.xfetch_beta, rng=self.rng)
        self._sf = SingleFlight()
        # one async single-flight table per event loop, dropped with its loop (an id() key outlived it, and a
        # later loop given the same id found the old loop's events)
        self._asf: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._l2_client = l2_client
        self.l2: RedisStore | None = None
        self.tracer = None      # OpenTelemetry spans when set (`trace`); None: no span is opened
        self.ttl_policy = None  # a TTL policy (`ttl()`, e.g. adaptive.AdaptiveTTL) for stores without ttl_s
        if c.adaptive_ttl and c.ttl_s:
            from ushash.serving.cache.adaptive import AdaptiveTTL, RollingP99, memory_percent

            self.compute_p99 = RollingP99(60.0)
            self.ttl_policy = AdaptiveTTL(c.ttl_s, memory=lambda: memory_percent(c.device), p99=self.compute_p99.p99_ms)
        self.hotkeys = None     # heavy hitters when tracked (`track_hot_keys`)
        self.budget = PairBudget(c, self.metrics.registry)
        self._install(head, encoder, calibration)

    @classmethod
    def from_export(cls, path, config: CacheConfig | dict | None = None, expect_bits=None, expect_encoder=None,
                    device: str = "cpu", **kw) -> "SemanticCache":
        from ushash.serving.artifact import load_export

        return cls(load_export(path, expect_bits=expect_bits, expect_encoder=expect_encoder, device=device), config, **kw)

    # ------------------------------------------------------------------ (re)loading a head
    def _make_l2(self, bits: int) -> RedisStore:
        c, l2 = self._tier_config, self.config.l2
        store = RedisStore(l2.url, bits=bits, prefix=l2.prefix, chunks=l2.chunks, cluster=l2.cluster,
                           timeout_s=l2.timeout_s, connect_timeout_s=l2.connect_timeout_s,
                           breaker_failures=l2.breaker_failures, breaker_backoff_s=l2.breaker_backoff_s,
                           breaker_max_backoff_s=l2.breaker_max_backoff_s, max_candidates=c.max_candidates,
                           radius=c.radius, metrics=self.metrics, clock=self.clock, client=self._l2_client,
                           max_bucket_read=l2.max_bucket_read)
        store.check_layout()
        return store

    def _install(self, head, encoder=None, calibration: Calibration | None = None) -> None:
        c = self.config
        c.check_head(int(head.bits))
        if calibration is not None:
            calibration.check_head(head)
            if not c.payload_check or getattr(head, "payload", None) is None:
                raise ValueError("a calibration sets payload thresholds: it needs payload_check and a payload codec")
        self.budget.install(head.modalities, calibration)
        r = self.budget.search_radius   # a calibration: the tiers search as far as its widest pair
        self._tier_config = c if r is None else dataclasses.replace(
            c, radius=r, observe_radius=r if c.observe_radius is None else max(r, int(c.observe_radius)))
        replaced = None
        if c.l2 is not None and (self.l2 is None or self.l2.bits != int(head.bits)):
            # the new store first: one refused (another layout) leaves the old one serving, still listening
            replaced, self.l2 = self.l2, self._make_l2(int(head.bits))
        elif self.l2 is not None:   # the same store: it searches as far as the new head's points, as L1 does
            t = self._tier_config
            self.l2.radius, self.l2.max_candidates = int(t.radius), int(t.max_candidates)
        self.head = head
        self.bits = int(head.bits)
        self.code_bytes = self.bits // 8
        self.payload_codec = getattr(head, "payload", None)
        # a query z's shape (the shared space): one of another width would broadcast in a tier's payload check
        self._zshape = (self.payload_codec[head.modalities[0]].dim,) if self.payload_codec is not None else None
        self._zdim = int(head.dim) if getattr(head, "dim", None) is not None else None
        self.encoder = QueryEncoder(head, encoder, c.media)
        self.l1 = L1Tier(self.bits, self._tier_config, self.metrics, self.clock, self.payload_codec, head.modalities,
                         str(head.revision))
        self.tiers = [self.l1] + ([self.l2] if self.l2 is not None else [])
        self.hit_check = HitCheck(self.payload_codec, c.payload_check, c.payload_threshold, c.cross_modal, self.metrics,
                                  points=self.budget.points if self.budget.per_pair else None)
        if self.tracer is not None:
            self.hit_check = TracedCheck(self.hit_check, self.tracer)
        self.radius, self.observe_radius = self.l1.radius, self.l1.observe_radius
        old = getattr(self, "watermark", None)
        self.watermark = RevisionWatermark(str(head.revision), revision_rank(head),
                                           check_s=c.l2.watermark_check_s if c.l2 else 1.0, clock=time.monotonic)
        # a newer revision another replica announced stays known (until the L2 says otherwise); without an L2 the
        # only revision older than a reload's is this cache's own last head: a rollback serves the head installed
        if self.l2 is not None and old is not None and (old.newest_rank, old.newest or "") > (
                self.watermark.newest_rank, self.watermark.revision):
            self.watermark.newest, self.watermark.newest_rank = old.newest, old.newest_rank  # still known newer
        if self.l2 is not None:
            self.watermark.attach(self.l2.announce, self.l2.newest_revision)
            if c.l2.invalidate:
                self.l2.listen(self._changed_elsewhere, self._changes_missed)
        if replaced is not None:
            replaced.close()
        # what a lookup or a store reads at once: the L1 tier, the tiers and their revision (a reload swaps it)
        self._serving = (self.l1, self.tiers, str(head.revision))
        self.l1.update_gauges()

    def _changed_elsewhere(self, tenant: str, l2id: str) -> None:
        """Another replica replaced or dropped L2 entry `l2id` of `tenant` ("*": deleted the tenant): this one's
        L1 copy goes, so that its next lookup reads the L2 (the subscriber thread of `RedisStore.listen`)."""
        self._serving[0].forget_copies(tenant, l2id)

    def _changes_missed(self) -> None:
        """The change channel was down: every L1 copy of an L2 entry goes, as any may have changed meanwhile."""
        n = self._serving[0].forget_copies()
        if n:
            log.info("the L2's change channel is back: %d L1 copies of L2 entries dropped", n)

    def close(self) -> None:
        """Stop the L2's subscriber thread (a cache without an L2 holds nothing to close)."""
        if self.l2 is not None:
            self.l2.close()

    def warm_up(self) -> None:
        """Load the compiled (numba) kernels of lookups and stores now, on a throwaway L1-only cache of the
        same head and settings: loading them costs ~1 s and tens of MB of code once per process, which the
        first requests would otherwise pay for (the service calls this before it starts serving)."""
        warm_head = getattr(self.head, "warm_up", None)   # the head's one-row pass (ExportedHead's kernels)
        if warm_head is not None:
            warm_head()
        self.budget.warm_up()
        cfg = dataclasses.replace(self.config, l2=None, calibration=None, mih_min_entries=8, ttl_s=0,
                                  tenants=None, capacity_bytes=1 << 24)
        tmp = SemanticCache(self.head, cfg, clock=self.clock, rng=random.Random(0))
        rng = np.random.default_rng(0)
        codes = rng.integers(0, 256, size=(64, self.code_bytes), dtype=np.uint8)
        for m in self.head.modalities:
            dim = getattr(self.head, "dim", None)
            z = rng.normal(size=(len(codes), dim)).astype(np.float32) if dim else [None] * len(codes)
            qs = [tmp.query_from_code(m, c, zz) for c, zz in zip(codes, z)]
            tmp.store_many(qs[:40], list(range(40)))
            tmp.store_many(qs[40:50], list(range(10)))      # a merge into the index's tables
            tmp.lookup(qs[0]), tmp.lookup(qs[60]), tmp.lookup_many(qs)
            tmp.lookup(tmp.query_from_code(m, codes[1]))

    def reload(self, head, encoder=None, calibration: Calibration | None = None) -> None:
        """Serve a new head (a new export revision). Every L1 entry is dropped at once: none of an older
        revision is ever served again. With an L2, the new revision is announced; replicas still on the
        old one stop serving until they reload too. A calibration is kept only for the head it was made
        for (pass the new head's, or the reload is refused with a ValueError)."""
        with self.l1.lock:
            n = self.l1.live
            self._install(head, encoder, calibration or self.budget.calibration)
            if n:
                self.metrics.evictions.labels(reason="revision").inc(n)

    @property
    def revision(self) -> str:
        return self.watermark.revision

    @property
    def table(self):
        """L1's entry columns (ushash.serving.cache.entries.EntryTable)."""
        return self.l1.table

    @property
    def policy(self):
        """L1's eviction policy."""
        return self.l1.policy

    @property
    def bloom(self):
        return self.l1.bloom

    # ------------------------------------------------------------------ tenants and requests
    def check_tenant(self, tenant: str) -> str:
        if not valid_tenant(tenant):
            raise InvalidTenant(f"tenant must be 1-64 characters of [A-Za-z0-9_.-]; got {tenant!r}")
        if self.config.tenants is not None and tenant not in self.config.tenants:
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        return tenant

    def query(self, modality: str, data=None, features=None) -> Query:
        """Encode a request (raw input or encoder features) into a Query; raises RequestError. An image
        or a sound may also be a file path (str or os.PathLike)."""
        if modality in ("image", "audio") and isinstance(data, (str, os.PathLike)):
            from ushash.serving.cache.api import read_media_file
            data = read_media_file(modality, data)
        if self.tracer is None:
            return self.encoder(modality, data, features)
        with self.tracer.start_as_current_span("ushash.encode", attributes={"cache.modality": modality}):
            return self.encoder(modality, data, features)

    def query_from_code(self, modality: str, code, z=None) -> Query:
        """A Query from a precomputed packed code (and z for the payload check)."""
        modality = self.encoder.check_modality(modality)
        code = _packed(code).reshape(-1)
        if code.shape != (self.code_bytes,):
            raise RequestError(f"code must be {self.code_bytes} bytes ({self.bits} bits); got {code.shape}")
        if z is not None:
            if not (type(z) is np.ndarray and z.dtype == np.float32):   # (errstate costs a lookup's 2 us)
                with np.errstate(over="ignore", invalid="ignore"):
                    z = np.asarray(z, np.float32)
            z = z.reshape(-1)
            if self._zdim is not None and z.shape[0] != self._zdim:
                # a z of another width would broadcast in the payload check (a 1-d z gives cosines > 1)
                raise RequestError(f"z must be {self._zdim} floats (the head's shared space); got {z.shape[0]}")
            n = float(z @ z)   # NaN or inf in z (or a norm past float32's range) makes it so too
            if not math.isfinite(n):
                raise RequestError("z must be finite float32 numbers (and its norm too)")
            if n == 0.0:   # no direction: every payload check would read cosine 0, and the entry it stored too
                raise RequestError("z must not be all zeros (or too small for float32): the payload check needs "
                                   "its direction")
            z = z / math.sqrt(n)
        return Query(modality, code.tobytes(), z)

    # ------------------------------------------------------------------ lookup
    def get(self, modality: str, data=None, *, features=None, tenant: str = DEFAULT_TENANT) -> Hit | None:
        """The cached answer for this request, or None. Raises RequestError / UnknownTenant on bad input."""
        tenant = self.check_tenant(tenant)
        return self.lookup(self.query(modality, data, features), tenant)

    def get_many(self, modality: str, data: list | None = None, *, features=None,
                 tenant: str = DEFAULT_TENANT) -> list[Hit | None]:
        """`get` for a batch of requests of one modality: raw inputs, or encoder features [B, in_dim]
        (encoded in one forward pass); one L1 search and hit check for the batch."""
        tenant = self.check_tenant(tenant)
        return self.lookup_many(self.queries(modality, data, features), tenant)

    def queries(self, modality: str, data: list | None = None, features=None) -> list[Query]:
        """Queries for a batch of raw inputs, or of encoder features [B, in_dim] (one forward pass)."""
        if (data is None) == (features is None):
            raise RequestError("give exactly one of: the raw inputs, or precomputed encoder features")
        if features is not None:
            return self.encoder.from_feature_rows(modality, features)
        return [self.query(modality, d) for d in data]

    def lookup(self, q: Query, tenant: str = DEFAULT_TENANT, count: bool = True) -> Hit | None:
        return self.lookup_many([q], tenant, count)[0]

    def lookup_many(self, queries: list[Query], tenant: str = DEFAULT_TENANT, count: bool = True) -> list[Hit | None]:
        """The hit (or None) for each Query: L1 answers the batch with one index search and one
        vectorised hit check; its misses go to the L2 together (`find_many`: two round trips to Redis for the
        batch). Same answers as `lookup` of each. Only
        entries of the revision that encoded a query are served, while that is the one served: a query
        encoded before a reload() misses, and a hit found while one happened is not served."""
        t0 = time.perf_counter()
        tenant = self.check_tenant(tenant)
        self._check_queries(queries)
        n = len(queries)
        hits: list[Hit | None] = [None] * n
        tiers: str | list[str] = "l1"   # one tier for all, or one per lookup once the L2 is asked
        nearest = [-1] * n              # the nearest distance seen (-1: none)
        l1, tier_list, rev = self._serving
        l2 = tier_list[1] if len(tier_list) > 1 else None
        live = [i for i, q in enumerate(queries) if q.revision is None or q.revision == rev]
        if len(live) < n:
            self.metrics.rejections.labels(reason="query_revision").inc(n - len(live))
        if not self.watermark.current:
            if live:
                self.metrics.rejections.labels(reason="stale_revision").inc(len(live))
        elif live:
            now = self.clock()
            qs = queries if len(live) == n else [queries[i] for i in live]
            l1_hits, l1_nearest, skip_next, hit_idx, compute_s = \
                l1.hits_many(qs, tenant, rev, self.hit_check, now) if self.tracer is None else \
                self._traced_hits_many(l1, qs, tenant, rev, now)
            if len(live) == n:
                hits, nearest = l1_hits, l1_nearest
            else:
                for j, i in enumerate(live):
                    hits[i], nearest[i] = l1_hits[j], l1_nearest[j]
            fresh = self.freshness
            l1_pairs = []
            if l2 is None:
                for j, cs in zip(hit_idx, compute_s):
                    h = l1_hits[j]
                    h.refresh = fresh.should_refresh(now, h.expires, cs)
                    l1_pairs.append((qs[j].modality, h.modality))
            else:   # the L1's misses asked of the L2 together: two round trips for the batch
                tiers = ["l1"] * n
                skip_next = set(skip_next)
                k = 0
                ask = []
                for j, i in enumerate(live):
                    h = l1_hits[j]
                    if h is not None:
                        h.refresh = fresh.should_refresh(now, h.expires, compute_s[k])
                        k += 1
                        l1_pairs.append((queries[i].modality, h.modality))
                    elif j not in skip_next:
                        tiers[i] = l2.name
                        ask.append(i)
                if ask:
                    now, read_at = self.clock(), time.monotonic()
                    q2 = [queries[i] for i in ask]
                    found2 = l2.find_many(q2, tenant, rev, self.hit_check, now) if self.tracer is None else \
                        self._traced_l2_find_many(l2, q2, tenant, rev, now)
                    for i, f2 in zip(ask, found2):
                        if f2.nearest is not None and (nearest[i] < 0 or f2.nearest < nearest[i]):
                            nearest[i] = f2.nearest
                        if f2.entry is not None and self._serving[0] is l1:
                            # promote into L1 (same expiry and revision; not written back), unless it changed since
                            l1.promote(tenant, f2.entry, read_at)
                            hits[i] = self._hit(f2, l2.name, now, queries[i])
            if l1_pairs:
                self.budget.count_hits(l1_pairs)
            if self._serving[0] is not l1:  # reloaded meanwhile: these are of an older revision now
                dropped = sum(h is not None for h in hits)
                if dropped:
                    self.metrics.rejections.labels(reason="query_revision").inc(dropped)
                hits = [None] * n
        if count:
            if self.hotkeys is not None:   # a follower's second look (count=False) is the same request once more
                for q in queries:
                    self.hotkeys.record((tenant, q.code))
            # nearest: the hit's distance; on a miss the nearest candidate seen, or bits + 1 (the +Inf
            # bucket) when nothing was within observe_radius
            dt = (time.perf_counter() - t0) / max(1, n)
            miss_d = self.bits + 1
            self.metrics.record_lookups(hits, tiers, [h.distance if h is not None else (d if d >= 0 else miss_d)
                                                      for h, d in zip(hits, nearest)], dt)
        return hits

    def _check_queries(self, queries) -> None:
        """Refuse a Query made by hand whose code is not `code_bytes` bytes (a batch's codes are joined and
        cut into rows: a short one would shift the others onto codes of other requests) or whose z is not
        a vector of the shared space's width (the payload check would broadcast it: a 1-d z gives cosines
        far above 1, a false hit), or not of unit L2 norm (the hit check takes z . payload as the cosine: a z
        three times too long serves an entry at a true cosine of 0.33 past a threshold of 0.98)."""
        cb, shape = self.code_bytes, self._zshape
        for q in queries:
            if not isinstance(q.code, bytes) or len(q.code) != cb:
                raise RequestError(f"a query's code must be {cb} bytes ({self.bits} bits); got "
                                   f"{type(q.code).__name__} of {len(q.code) if hasattr(q.code, '__len__') else '?'}")
            z = q.z
            if z is None or shape is None:
                continue
            if np.shape(z) != shape:
                raise RequestError(f"a query's z must be {shape[0]} floats (the shared space); got shape "
                                   f"{np.shape(z)}")
            n = float(z @ z) if type(z) is np.ndarray else float(np.dot(z, z))
            if not abs(n - 1.0) <= UNIT_TOLERANCE:   # NaN fails too
                raise RequestError(f"a query's z must have unit L2 norm; got norm {math.sqrt(n) if n >= 0 else n:.6g}: "
                                   f"make the query with cache.query_from_code(modality, code, z) (it normalises z) "
                                   f"or QueryEncoder")

    def _hit(self, f, tier: str, now: float, q: Query | None = None) -> Hit:
        e = f.entry
        if q is not None:
            self.budget.count_hit(q.modality, e.modality)
        return Hit.of(e, f.distance, f.cosine, tier, self.freshness.should_refresh(now, e.expires, e.compute_s), f.ref)

    def lookup_top(self, q: Query, tenant: str = DEFAULT_TENANT, k: int = 1, count: bool = True,
                   accept: Callable[[Any], bool] | None = None) -> list[Hit]:
        """Up to k servable hits for one Query, best first, from the first tier that has one (one lookup in
        the metrics); k == 1 is `lookup`. `accept(value)`: only hits whose value it accepts count, so a tier
        whose candidates it refuses all (an L1 holding only another scope's answer) hands over to the next."""
        if k <= 1 and accept is None:
            h = self.lookup(q, tenant, count)
            return [h] if h is not None else []
        t0 = time.perf_counter()
        tenant = self.check_tenant(tenant)
        self._check_queries([q])
        hit, nearest, tier, more = None, None, "l1", []
        l1, tier_list, rev = self._serving   # as lookup_many: the query's revision, while it is the one served
        if q.revision is not None and q.revision != rev:
            self.metrics.rejections.labels(reason="query_revision").inc()
        elif not self.watermark.current:
            self.metrics.rejections.labels(reason="stale_revision").inc()
        else:
            for t in tier_list:
                tier = t.name
                now, read_at = self.clock(), time.monotonic()
                found = t.find(q, tenant, rev, self.hit_check, now, k)
                if found.nearest is not None and (nearest is None or found.nearest < nearest):
                    nearest = found.nearest
                if found.entry is not None:
                    ranked = [(found.entry, found.distance, found.cosine, found.ref), *found.more]
                    hits = [(e2, Hit.of(e2, d2, c2, t.name, self.freshness.should_refresh(now, e2.expires, e2.compute_s), r2))
                            for e2, d2, c2, r2 in ranked]
                    hits = [(e2, h) for e2, h in hits if accept is None or accept(h.value)][:max(1, k)]
                    if hits:
                        if t is not l1:  # promote the served entry into L1 (same expiry and revision; not written
                            l1.promote(tenant, hits[0][0], read_at)   # back), unless it changed since it was read
                        self.budget.count_hit(q.modality, hits[0][0].modality)
                        hit, more = hits[0][1], [h for _, h in hits[1:]]
                        break
                if found.skip_next:
                    break
            if hit is not None and self._serving[0] is not l1:  # reloaded meanwhile: an older revision now
                self.metrics.rejections.labels(reason="query_revision").inc()
                hit, more = None, []
        if self.hotkeys is not None:
            self.hotkeys.record((tenant, q.code))
        if count:
            d = hit.distance if hit else (nearest if nearest is not None else self.bits + 1)
            self.metrics.record_lookup(hit is not None, hit.tier if hit else tier, d, time.perf_counter() - t0)
        return [hit] + more if hit is not None else []

    # ------------------------------------------------------------------ store
    def put(self, modality: str, data=None, value=_NO_VALUE, *, features=None, tenant: str = DEFAULT_TENANT,
            ttl_s: float | None = None, compute_s: float = 0.0) -> bool:
        """Store `value` for this request: `put("text", "a frog", answer)`, or `value=` by keyword (with
        `features=`, `put("image", None, answer, features=f)`). False when not stored in L1 (too large,
        refused by admission, or this replica's revision is stale); the L2 still gets it unless the
        revision is stale."""
        if value is _NO_VALUE:
            raise TypeError("put() needs the value to store: put(modality, input, value)")
        tenant = self.check_tenant(tenant)
        return self.store(self.query(modality, data, features), value, tenant, ttl_s=ttl_s, compute_s=compute_s)

    def put_many(self, modality: str, data: list | None = None, *, features=None, values: list,
                 tenant: str = DEFAULT_TENANT, ttl_s: float | None = None) -> list[bool]:
        """`put` for a batch of requests of one modality (raw inputs, or features [B, in_dim])."""
        tenant = self.check_tenant(tenant)
        return self.store_many(self.queries(modality, data, features), values, tenant, ttl_s=ttl_s)

    def store(self, q, value=_NO_VALUE, *args, **kwargs):
        """Two forms. The cache's own: store(query: Query, value, tenant="default", ttl_s=None,
        compute_s=0.0) -> bool (stored in L1). RedisVL's (ushash.serving.cache.api): store(input, response,
        modality="text", *, features=None, metadata=None, tenant="default", ttl=None) -> entry id or None."""
        if value is _NO_VALUE:
            raise TypeError("store() needs the request and the value to store")
        if isinstance(q, Query):
            return self.store_query(q, value, *args, **kwargs)
        return self.store_api(q, value, *args, **kwargs)

    def store_query(self, q: Query, value, tenant: str = DEFAULT_TENANT, ttl_s: float | None = None,
                    compute_s: float = 0.0, scope: bytes = b"") -> bool:
        return self.store_many([q], [value], tenant, ttl_s=ttl_s, compute_s=compute_s, scopes=[scope])[0]

    def store_many(self, queries: list[Query], values: list, tenant: str = DEFAULT_TENANT, ttl_s: float | None = None,
                   compute_s: float = 0.0, scopes: list[bytes] | None = None) -> list[bool]:
        """Store values[i] for queries[i]; a later query of the batch equal to an earlier one (in the same
        scope, `Entry.scope`) replaces it. The payloads of each modality are encoded in one call and L1 takes
        the batch in one index add."""
        t0 = time.perf_counter()
        tenant = self.check_tenant(tenant)
        self._check_queries(queries)
        if len(values) != len(queries):
            raise ValueError(f"{len(queries)} queries but {len(values)} values")
        scopes = list(scopes) if scopes is not None else [b""] * len(queries)
        if len(scopes) != len(queries):
            raise ValueError(f"{len(queries)} queries but {len(scopes)} scopes")
        bad = next((s for s in scopes if not isinstance(s, (bytes, bytearray))), None)
        if bad is not None:   # bytes(5) would be five zero bytes: another scope, silently
            raise TypeError(f"an entry's scope is bytes (a digest of what its answer depends on); got "
                            f"{type(bad).__name__} {bad!r}")
        encoded = [encode_value(v) for v in values]
        payloads = [b""] * len(queries)
        if self.payload_codec is not None:
            by_mod: dict[str, list[int]] = {}
            for i, q in enumerate(queries):
                if q.z is not None:
                    by_mod.setdefault(q.modality, []).append(i)
            for m, idx in by_mod.items():
                recs = self.payload_codec.encode(m, np.stack([queries[i].z for i in idx]))
                for i, r in zip(idx, recs):
                    payloads[i] = r.tobytes()
        now = self.clock()
        l1, tier_list, rev = self._serving
        fresh = [q.revision is None or q.revision == rev for q in queries]  # others: encoded before a reload()
        if not all(fresh):
            self.metrics.rejections.labels(reason="query_revision").inc(len(queries) - sum(fresh))
        if ttl_s is None and self.ttl_policy is not None:
            ttl_s = self.ttl_policy.ttl()
        if not self.watermark.current:
            self.metrics.rejections.labels(reason="stale_revision").inc(sum(fresh))
            return [False] * len(queries)
        l2 = tier_list[1] if len(tier_list) > 1 else None
        shared = l2 is not None and self.config.l2.write
        # filed under the revision that made the code: a reload() from here on leaves them in the old tiers
        keep = [i for i in range(len(queries)) if fresh[i]]
        entries = [Entry(code=queries[i].code, payload=payloads[i], modality=queries[i].modality, value=encoded[i][1],
                         kind=encoded[i][0], revision=rev, created=now, expires=self.freshness.expiry(now, ttl_s),
                         compute_s=float(compute_s), scope=bytes(scopes[i]))
                   for i in keep]
        if shared:
            for e in entries:
                e.id = shared_id(e)
            # a lookup of this replica that read an entry's older answer from the L2 before now does not copy it
            # over this one (`L1Tier.promote`)
            l1.note_changes(tenant, [e.id for e in entries])
        put = l1.put_many(tenant, entries) if entries else []
        stored = [False] * len(queries)
        for i, ok in zip(keep, put):
            stored[i] = ok
        if shared:
            for e in entries:
                l2.put(tenant, e)
        dt = (time.perf_counter() - t0) / max(1, len(queries))
        for _ in entries:
            self.metrics.put_seconds.observe(dt)
        return stored

    def store_codes(self, tenant: str, modality: str, codes: np.ndarray, values: list, payloads: np.ndarray | None = None,
                    ttl_s: float | None = None, batch: int = 4096) -> int:
        """Bulk-load precomputed codes uint8 [N, bits/8] (and payload records uint8 [N, nbytes]) into L1
        (benchmarks, warm starts), `batch` entries per L1 call. Returns how many were admitted. Not written
        to the L2."""
        tenant = self.check_tenant(tenant)
        modality = self.encoder.check_modality(modality)
        codes = np.ascontiguousarray(_packed(codes))
        if codes.ndim != 2 or codes.shape[1] != self.code_bytes:
            raise RequestError(f"codes must be uint8 [N, {self.code_bytes}] ({self.bits}-bit codes); got {codes.shape}")
        if len(values) != len(codes):
            raise ValueError(f"{len(codes)} codes but {len(values)} values")
        if payloads is not None:  # L1 records are decoded unchecked on every lookup: check them once here
            payloads = self.payload_codec[modality].check_records(payloads, "payloads")
        n = 0
        for s in range(0, len(codes), batch):
            now = self.clock()
            entries = []
            for i in range(s, min(len(codes), s + batch)):
                kind, vbytes = encode_value(values[i])
                entries.append(Entry(code=codes[i].tobytes(), payload=payloads[i].tobytes() if payloads is not None
                                     else b"", modality=modality, value=vbytes, kind=kind, revision=self.revision,
                                     created=now, expires=self.freshness.expiry(now, ttl_s), compute_s=0.0))
            n += sum(self.l1.put_many(tenant, entries))
        return n

    def delete_tenant(self, tenant: str) -> int:
        """Drop every entry of one tenant, in L1 and in the L2 (every revision); returns how many L1
        entries. Raises RuntimeError when the L2 could not be cleared."""
        tenant = self.check_tenant(tenant)
        n = self.l1.delete_tenant(tenant)
        if self.l2 is not None:
            from ushash.serving.cache.redis_store import L2Unavailable

            try:
                self.l2.delete_tenant(tenant)
            except L2Unavailable:
                raise RuntimeError(f"tenant {tenant!r}: L1 cleared, but the L2 could not be reached; call "
                                   f"delete_tenant again (its entries would come back through it)") from None
        return n

    def drop(self, hits, tenant: str = DEFAULT_TENANT) -> int:
        """Remove the entries these hits served (RedisVL's `drop`): a Hit (get, lookup) or a result of `check`,
        or a list of them, each from L1 and from the L2 (the L1 copy of an L2 entry too), and only while it is
        the entry the lookup served: a slot or L2 id that holds another entry by now (one stored since in its
        place) keeps it. Returns how many were removed (one already gone: 0). Raises RuntimeError when the L2
        could not be reached (that hit's L1 entry is kept: call drop again)."""
        from ushash.serving.cache.api import served_entry
        from ushash.serving.cache.redis_store import L2Unavailable

        tenant = self.check_tenant(tenant)
        l1, tier_list, rev = self._serving
        l2 = tier_list[1] if len(tier_list) > 1 else None
        n = 0
        for h in [hits] if isinstance(hits, (Hit, Mapping)) else hits:
            ref, kind, value, created, revision = served_entry(h)
            ident = (kind, value, created)
            in_l1 = revision is None or revision == rev   # an older revision's L1 entries went with its reload
            if ref.startswith("l1:") and ref[3:].isascii() and ref[3:].isdigit():
                where = {"slot": int(ref[3:])}
                ids = [i for i in l1.held(tenant, ident, **where).values() if i] if in_l1 else []
            else:
                where, ids = {"l2id": ref}, [ref]
            removed = False
            if l2 is not None:
                l1.note_changes(tenant, ids)
                try:
                    removed = any([l2.drop(tenant, i, ident) for i in ids])
                except L2Unavailable:
                    raise RuntimeError(f"entry {ref!r} of tenant {tenant!r} could not be dropped from the L2; call "
                                       f"drop again") from None
            if in_l1:
                removed = l1.drop(tenant, ident, **where) > 0 or removed
            n += removed
        return n

    # ------------------------------------------------------------------ get or compute
    def _flight(self, q: Query, tenant: str, sf):
        """The one single-flight decision of get_or_compute and aget_or_compute, before any waiting:
        (result, None, (None, None, None)) to serve now, or (None, role, (fkey, flight, hit)) with role "lead" (compute,
        store, tell the followers) or "follow" (wait for the leader, then `_after_wait`)."""
        hit = self.lookup(q, tenant)
        fkey = _flight_key(hit, tenant, q)
        if fkey is None:
            return Result(hit.value, hit, computed=False), None, (None, None, None)
        if fkey in leading.get():
            raise RecursionError(f"compute() asked the cache for its own request (tenant {tenant!r}, "
                                 f"{q.modality}): it would wait for itself; compute the value without the cache")
        leader, fl = sf.lead(fkey)
        if not leader:
            if hit is not None:  # another caller refreshes it: serve the cached value meanwhile
                return Result(hit.value, hit, computed=False), None, (None, None, None)
            self.metrics.singleflight_waits.inc()
            return None, "follow", (fkey, fl, hit)
        if hit is not None:
            self.metrics.early_refresh.inc()
        return None, "lead", (fkey, fl, hit)

    def _after_wait(self, q: Query, tenant: str, fl, finished: bool) -> Result | None:
        """A follower once the leader is done (or its wait timed out): the leader's error, or a hit served
        by the follower's own checks, or None (compute for itself)."""
        if finished and fl.error is not None:
            raise fl.error
        hit = self.lookup(q, tenant, count=False)
        return Result(hit.value, hit, computed=False, waited=True) if hit is not None else None

    def get_or_compute(self, modality: str, data=None, *, features=None, compute: Callable[[], Any],
                       tenant: str = DEFAULT_TENANT, ttl_s: float | None = None,
                       equivalent: Callable[[Any, Any], bool] | None = None) -> Result:
        """The cached value, or compute() stored and returned. N concurrent misses on the same request
        code run compute() once (followers wait, then look up again with their own checks; a follower
        whose wait times out computes for itself; the leader's error is raised in its followers too); a hit
        that XFetch marks for early refresh is recomputed by one caller while the others are served. A
        compute() that asks for its own request raises RecursionError at once. A share `shadow.fraction`
        of hits is computed anyway and compared (`equivalent`, default ==): the fresh value is returned, a
        disagreement stores it, and the pair's shadow estimate counts it (`Result.verified`)."""
        tenant = self.check_tenant(tenant)
        q = self.query(modality, data, features)
        res, role, (fkey, fl, hit) = self._flight(q, tenant, self._sf)
        if res is not None:
            if res.hit is not None and self._shadow_due():
                t0 = self.clock()
                try:
                    value = compute()
                except Exception as e:   # noqa: BLE001 (the cached answer is still servable)
                    return self._kept(res, e, "shadow")
                return self._shadow_result(q, res.hit, value, tenant, ttl_s, equivalent, max(0.0, self.clock() - t0))
            return res
        if role == "follow":
            res = self._after_wait(q, tenant, fl, fl.event.wait(self.config.singleflight_timeout_s))
            if res is not None:
                return res
            return Result(self._compute_store(q, compute, tenant, ttl_s), None, computed=True, waited=True)
        token = leading.set(leading.get() | {fkey})
        try:
            value = self._compute_store(q, compute, tenant, ttl_s)
        except BaseException as e:
            self._sf.done(fkey, fl, e)
            if hit is not None and isinstance(e, Exception):   # an early refresh: the entry is still fresh
                return self._kept(Result(hit.value, hit, computed=False), e, "refresh")
            raise
        finally:
            leading.reset(token)
        self._sf.done(fkey, fl)
        return Result(value, None, computed=True)

    def _kept(self, res: Result, error: Exception, during: str) -> Result:
        """The cached answer `res`, served when an early refresh or a shadow check of it failed: the entry
        is still fresh, and a backend's failure must not turn a hit into an error (counted, logged)."""
        self.metrics.compute_failures.labels(during=during).inc()
        log.warning("the %s of a cached answer failed (%s: %s); the cached answer was served", during,
                    type(error).__name__, error)
        return res

    def _compute_store(self, q: Query, compute, tenant, ttl_s):
        t0 = self.clock()  # the cache's clock: XFetch compares compute time with expiries on it
        if self.tracer is None:
            value = compute()
        else:
            with self.tracer.start_as_current_span("ushash.compute", attributes={
                    "cache.key.hash": key_hash(q.code), "cache.strategy": "compute", "cache.tenant": tenant}):
                value = compute()
        compute_s = max(0.0, self.clock() - t0)
        if self.ttl_policy is not None and hasattr(self, "compute_p99"):
            self.compute_p99.record(compute_s)
        self.store(q, value, tenant, ttl_s=ttl_s, compute_s=compute_s)
        return value

    async def aget_or_compute(self, modality: str, data=None, *, features=None, compute,
                              tenant: str = DEFAULT_TENANT, ttl_s: float | None = None,
                              equivalent: Callable[[Any, Any], bool] | None = None) -> Result:
        """`get_or_compute` for coroutines (compute is an async callable), with the same decisions:
        single-flight per event loop; shadow checks as `get_or_compute`."""
        import asyncio

        tenant = self.check_tenant(tenant)
        loop = asyncio.get_running_loop()
        sf = self._asf.get(loop)
        if sf is None:
            sf = self._asf[loop] = AsyncSingleFlight()
        q = self.query(modality, data, features)
        res, role, (fkey, fl, hit) = self._flight(q, tenant, sf)
        if res is not None:
            if res.hit is not None and self._shadow_due():
                t0 = self.clock()
                try:
                    value = await compute()
                except Exception as e:   # noqa: BLE001 (the cached answer is still servable)
                    return self._kept(res, e, "shadow")
                return self._shadow_result(q, res.hit, value, tenant, ttl_s, equivalent, max(0.0, self.clock() - t0))
            return res

        async def compute_store():
            t0 = self.clock()
            value = await compute()
            self.store(q, value, tenant, ttl_s=ttl_s, compute_s=max(0.0, self.clock() - t0))
            return value

        if role == "follow":
            try:
                await asyncio.wait_for(asyncio.shield(fl.event.wait()), self.config.singleflight_timeout_s)
                finished = True
            except asyncio.TimeoutError:
                finished = False
            res = self._after_wait(q, tenant, fl, finished)
            if res is not None:
                return res
            return Result(await compute_store(), None, computed=True, waited=True)
        token = leading.set(leading.get() | {fkey})
        try:
            value = await compute_store()
        except BaseException as e:
            sf.done(fkey, fl, e)
            if hit is not None and isinstance(e, Exception):   # an early refresh: the entry is still fresh
                return self._kept(Result(hit.value, hit, computed=False), e, "refresh")
            raise
        finally:
            leading.reset(token)
        sf.done(fkey, fl)
        return Result(value, None, computed=True)

    # ------------------------------------------------------------------ tracing and hot keys
    def trace(self, tracer) -> None:
        """Open OpenTelemetry spans (telemetry.configure_tracing) for encode, search (L1), verify, L2 and
        compute, with cache.hit, cache.key.hash, cache.ttl.remaining_ms, cache.strategy; None: off."""
        self.tracer = tracer
        check = getattr(self.hit_check, "inner", self.hit_check)
        self.hit_check = check if tracer is None else TracedCheck(check, tracer)

    def _traced_hits_many(self, l1, queries: list[Query], tenant: str, rev: str, now: float):
        with self.tracer.start_as_current_span("ushash.search") as span:
            res = l1.hits_many(queries, tenant, rev, self.hit_check, now)
            span.set_attribute("cache.strategy", "l1")
            span.set_attribute("cache.tenant", tenant)
            span.set_attribute("cache.batch_size", len(queries))
            if len(queries) == 1:
                h = res[0][0]
                self._hit_attributes(span, queries[0], h, now)
            else:
                span.set_attribute("cache.hits", len(res[3]))
        return res

    @staticmethod
    def _hit_attributes(span, q: Query, found, now: float) -> None:
        """found: a tier's Found, or a Hit, or None (a miss)."""
        e = found.entry if isinstance(found, Found) else found
        span.set_attribute("cache.hit", e is not None)
        span.set_attribute("cache.key.hash", key_hash(q.code))
        if e is not None:
            span.set_attribute("cache.distance", int(found.distance))
            span.set_attribute("cache.ttl.remaining_ms", (e.expires - now) * 1e3 if e.expires != float("inf") else -1.0)

    def _traced_l2_find_many(self, t, queries: list[Query], tenant: str, rev: str, now: float) -> list[Found]:
        """The L2's `find_many` in an `ushash.l2` span (the L1's lookups have theirs: `_traced_hits_many`)."""
        with self.tracer.start_as_current_span("ushash.l2") as span:
            found = t.find_many(queries, tenant, rev, self.hit_check, now)
            span.set_attribute("cache.strategy", t.name)
            span.set_attribute("cache.tenant", tenant)
            span.set_attribute("cache.batch_size", len(queries))
            if len(queries) == 1:
                self._hit_attributes(span, queries[0], found[0], now)
            else:
                span.set_attribute("cache.hits", sum(f.entry is not None for f in found))
        return found

    def track_hot_keys(self, window_s: float = 60.0, buckets: int = 6, max_keys: int = 10_000, top: int = 10,
                       clock=None) -> None:
        """Count lookups per (tenant, code) over a sliding window (hotkeys.HotKeys), exported as
        cache_hot_key_requests{rank} and cache_hot_keys_share."""
        from ushash.serving.cache.hotkeys import HotKeys, HotKeysCollector

        if self.hotkeys is None:
            self.hotkeys = HotKeys(window_s, buckets, max_keys, clock=clock or time.monotonic)
            self.metrics.registry.register(HotKeysCollector(self.hotkeys, top))

    # ------------------------------------------------------------------ shadow checks
    def _shadow_due(self) -> bool:
        f = float(self.budget.shadow_config.fraction)
        return f > 0 and self.rng.random() < f

    def _shadow_result(self, q: Query, hit: Hit, value, tenant, ttl_s, equivalent, compute_s: float) -> Result:
        agreed = bool((equivalent or (lambda a, b: a == b))(hit.value, value))
        self.verify(q.modality, hit, agreed)
        if not agreed:  # this request's own answer, so that it is not served the other one again
            self.store(q, value, tenant, ttl_s=ttl_s, compute_s=compute_s)
        return Result(value, hit, computed=True, verified=agreed)

    def verify(self, request_modality: str, hit: Hit, agreed: bool) -> None:
        """Record a shadow check of `hit` (served to a `request_modality` request): did the cached answer
        agree with the one computed anyway. A breach of the false-hit budget tightens the pair's
        threshold or turns the pair off, from the next lookup on (`cache.shadow`)."""
        changed = self.budget.verify(request_modality, hit.modality, agreed)
        check = getattr(self.hit_check, "inner", self.hit_check)   # the HitCheck itself when traced
        if changed is not None and check.points is None:
            check.points = self.budget.points   # an uncalibrated cache now serves per pair

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict:
        m = self.metrics
        with self.l1.lock:
            return {"entries": self.l1.live, "size_bytes": self.l1.policy.used_bytes,
                    "capacity_bytes": self.config.capacity_bytes, "tenants": self.l1.tenants,
                    "hits": m.value("cache_gets_total", result="hit"), "misses": m.value("cache_gets_total", result="miss"),
                    "revision": self.revision, "serving": self.watermark.current,
                    "l2": None if self.l2 is None else {"url_host": _url_host(self.config.l2.url),
                                                        "available": self.l2.available}}

    def __len__(self) -> int:
        return self.l1.live
