"""`SemanticCache`: a cache keyed by binary hash codes, for image, text or audio requests.

    cache = SemanticCache.from_export("exports/tuxpaint-offline-64b", {"capacity_bytes": 64 << 20, "radius": 3})
    hit = cache.get("text", "a frog", tenant="acme")             # Hit or None
    cache.put("text", "a frog", value=b"...", tenant="acme")
    res = cache.get_or_compute("image", png_bytes, compute=answer, tenant="acme")   # res.value

A lookup encodes the request (raw media through the export's frozen encoder, or precomputed encoder
features) into a packed code and a shared-space embedding z, then takes the cached entries of the same
tenant and revision within `radius` bits of the code, nearest first, and serves the first one that is not
expired and whose payload (the quantized copy of the entry's z) has cosine >= `payload_threshold` with
the request's z. Without a hit in L1 it asks the L2 (Redis), with the same checks, and copies a hit
into L1. See docs/cache.md for the guarantees and the Redis layout.

Thread-safe: one lock guards the L1 structures; encoding and the L2 round trips run outside it.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ushash.serving.cache.config import CacheConfig
from ushash.serving.cache.entries import EntryTable
from ushash.serving.cache.freshness import Freshness, RevisionWatermark
from ushash.serving.cache.policy import make_policy
from ushash.serving.cache.protection import AsyncSingleFlight, BloomGuard, SingleFlight
from ushash.serving.cache.redis_store import TENANT_RE, L2Record, L2Unavailable, RedisStore
from ushash.serving.cache.request import Query, QueryEncoder, RequestError
from ushash.serving.cache.search import make_backend
from ushash.serving.cache.telemetry import CacheMetrics

DEFAULT_TENANT = "default"


class UnknownTenant(KeyError):
    """The tenant is not one this cache serves (config `tenants`)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown tenant"


# ---------------------------------------------------------------------------------------------- values
def encode_value(value) -> tuple[str, bytes]:
    """Values are stored as bytes: bytes as they are, str as UTF-8, anything else as JSON (no pickle:
    an L2 shared with other processes must never be able to run code in this one)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "b", bytes(value)
    if isinstance(value, str):
        return "s", value.encode("utf-8")
    try:
        return "j", json.dumps(value, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise TypeError(f"cache values must be bytes, str or JSON-serialisable; got {type(value).__name__} ({e})") from e


def decode_value(kind: str, data: bytes):
    if kind == "b":
        return bytes(data)
    if kind == "s":
        return bytes(data).decode("utf-8")
    if kind == "j":
        return json.loads(bytes(data).decode("utf-8"))
    raise ValueError(f"unknown stored value kind {kind!r}")


@dataclass
class Hit:
    value: Any
    distance: int           # Hamming distance between the request's code and the entry's
    cosine: float | None    # request z vs the entry's decoded payload (None: check off)
    tier: str               # "l1" or "l2"
    modality: str           # the entry's modality (a text request can hit an image entry)
    revision: str
    created: float
    expires: float
    refresh: bool = False   # XFetch: the caller should recompute early (get_or_compute does)
    entry: str = ""         # entry id ("l1:<slot>" or the L2 id)


@dataclass
class Result:
    value: Any
    hit: Hit | None         # the hit served, or None when computed
    computed: bool          # this call ran `compute`
    waited: bool = False    # this call waited for another caller's computation (single-flight)


class SemanticCache:
    def __init__(self, head, config: CacheConfig | dict | None = None, encoder=None,
                 clock: Callable[[], float] = time.time, registry=None, rng: random.Random | None = None,
                 l2_client=None):
        self.config = config if isinstance(config, CacheConfig) else CacheConfig.from_dict(config)
        c = self.config
        self.clock = clock
        self.rng = rng or random.Random()
        self.metrics = CacheMetrics(int(head.bits), registry)
        self.metrics.capacity_bytes.set(c.capacity_bytes)
        self.freshness = Freshness(c.ttl_s, c.ttl_jitter, c.xfetch_beta, rng=self.rng)
        self._lock = threading.RLock()
        self._sf = SingleFlight()
        self._asf: dict[int, AsyncSingleFlight] = {}
        self._l2_client = l2_client
        self.l2: RedisStore | None = None
        self._install(head, encoder)

    @classmethod
    def from_export(cls, path, config: CacheConfig | dict | None = None, expect_bits=None, expect_encoder=None,
                    device: str = "cpu", **kw) -> "SemanticCache":
        from ushash.serving.artifact import load_export

        return cls(load_export(path, expect_bits=expect_bits, expect_encoder=expect_encoder, device=device), config, **kw)

    # ------------------------------------------------------------------ (re)loading a head
    def _make_l2(self, bits: int) -> RedisStore:
        c, l2 = self.config, self.config.l2
        return RedisStore(l2.url, bits=bits, prefix=l2.prefix, chunks=l2.chunks, cluster=l2.cluster,
                          timeout_s=l2.timeout_s, connect_timeout_s=l2.connect_timeout_s,
                          breaker_failures=l2.breaker_failures, breaker_backoff_s=l2.breaker_backoff_s,
                          breaker_max_backoff_s=l2.breaker_max_backoff_s, max_candidates=c.max_candidates,
                          metrics=self.metrics, clock=self.clock, client=self._l2_client)

    def _install(self, head, encoder=None) -> None:
        c = self.config
        if c.l2 is not None and (self.l2 is None or self.l2.bits != int(head.bits)):
            self.l2 = self._make_l2(int(head.bits))
        self.head = head
        self.bits = int(head.bits)
        self.code_bytes = self.bits // 8
        self.payload_codec = getattr(head, "payload", None)
        self.encoder = QueryEncoder(head, encoder)
        self.table = EntryTable(self.code_bytes)
        opts = dict(c.policy_options or {})
        if str(c.policy).lower() == "wtinylfu" and "slot_bytes" not in opts:
            # theine's core costs ~170 B per slot: about one slot per small entry (code + payload + 32 B of
            # value); an entry uses ceil(bytes / slot) slots, so on average half a slot per entry is unused
            payload = min(self.payload_codec.nbytes(m) for m in head.modalities) if self.payload_codec else 0
            opts["slot_bytes"] = -(-(self.code_bytes + payload + 32) // 16) * 16
        self.policy = make_policy(c.policy, c.capacity_bytes, clock=self.clock, **opts)
        self._backends: dict[int, Any] = {}
        self._tenant_ids: dict[str, int] = {}
        self._modalities: list[str] = []
        self._revisions: list[str] = [str(head.revision)]
        self._rev_id = 0
        self._expiry: list[tuple[float, int, int]] = []
        self._exact: dict[int, int] = {}  # hash of (tenant, modality, code, payload) -> slot
        self.observe_radius = int(c.observe_radius if c.observe_radius is not None else c.radius)
        self.radius = int(c.radius)
        self.bloom = None
        if c.bloom:
            min_entry = self.code_bytes + 1 + (min(self.payload_codec.nbytes(m) for m in head.modalities)
                                                if self.payload_codec is not None else 0)
            # sized for what fits, but start small: the filter doubles on rebuild as entries arrive
            expected = min(max(1024, c.capacity_bytes // max(1, min_entry)), 1 << 16)
            self.bloom = BloomGuard(self.bits, self.observe_radius, expected_items=expected,
                                    fp_rate=c.bloom_fp_rate, chunks=c.bloom_chunks)
        self.watermark = RevisionWatermark(str(head.revision), check_s=c.l2.watermark_check_s if c.l2 else 1.0,
                                           clock=time.monotonic)
        if self.l2 is not None:
            self.watermark.attach(self.l2.announce, self.l2.newest_revision)
        self._update_gauges()

    def reload(self, head, encoder=None) -> None:
        """Serve a new head (a new export revision). Every L1 entry is dropped at once: none of an older
        revision is ever served again. With an L2, the new revision is announced; replicas still on the
        old one stop serving until they reload too."""
        with self._lock:
            n = self.table.live
            self._install(head, encoder)
            if n:
                self.metrics.evictions.labels(reason="revision").inc(n)

    @property
    def revision(self) -> str:
        return self.watermark.revision

    # ------------------------------------------------------------------ tenants
    def check_tenant(self, tenant: str) -> str:
        if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
            raise UnknownTenant(f"tenant must be 1-64 characters of [A-Za-z0-9_.-]; got {tenant!r}")
        if self.config.tenants is not None and tenant not in self.config.tenants:
            raise UnknownTenant(f"unknown tenant {tenant!r}")
        return tenant

    def _tenant(self, tenant: str, create: bool) -> int | None:
        ti = self._tenant_ids.get(tenant)
        if ti is None and create:
            ti = self._tenant_ids[tenant] = len(self._tenant_ids)
            c = self.config
            self._backends[ti] = make_backend(c.backend, self.bits, device=c.device, mih_nhash=c.mih_nhash,
                                              mih_min_entries=c.mih_min_entries)
        return ti

    def _modality_id(self, m: str) -> int:
        try:
            return self._modalities.index(m)
        except ValueError:
            self._modalities.append(m)
            return len(self._modalities) - 1

    # ------------------------------------------------------------------ encoding
    def query(self, modality: str, data=None, features=None) -> Query:
        """Encode a request (raw input or encoder features) into a Query; raises RequestError."""
        return self.encoder(modality, data, features)

    def query_from_code(self, modality: str, code, z=None) -> Query:
        """A Query from a precomputed packed code (and z for the payload check)."""
        code = np.asarray(code, dtype=np.uint8).reshape(-1)
        if code.shape != (self.code_bytes,):
            raise RequestError(f"code must be {self.code_bytes} bytes ({self.bits} bits); got {code.shape}")
        if z is not None:
            z = np.asarray(z, np.float32).reshape(-1)
            z = z / max(float(np.sqrt(z @ z)), 1e-30)
        return Query(modality, code.tobytes(), z)

    # ------------------------------------------------------------------ housekeeping (lock held)
    def _remove(self, slot: int, reason: str | None) -> None:
        t = self.table
        if not t.alive[slot]:
            return
        ti = int(t.tenant[slot])
        self._backends[ti].remove(slot)
        self.policy.remove(slot)
        key = hash((ti, int(t.modality[slot]), t.code[slot].tobytes(), t.payload[slot]))
        if self._exact.get(key) == slot:
            del self._exact[key]
        t.release(slot)
        if reason is not None:
            self.metrics.evictions.labels(reason=reason).inc()

    def _expire(self, now: float) -> None:
        h = self._expiry
        t = self.table
        while h and h[0][0] <= now:
            _, slot, gen = heapq.heappop(h)
            if t.alive[slot] and t.gen[slot] == gen:
                self._remove(slot, "expired")

    def _update_gauges(self) -> None:
        self.metrics.size_bytes.set(self.policy.used_bytes)
        self.metrics.entries.set(self.table.live)

    def _maybe_rebuild_bloom(self) -> None:
        b = self.bloom
        if b is None or not b.needs_rebuild:
            return
        t = self.table
        live = t.live_slots()
        b.expected_items = max(b.expected_items, 2 * len(live))
        b.rebuild((int(t.tenant[s]), t.code[s].tobytes()) for s in live)

    # ------------------------------------------------------------------ lookup
    def get(self, modality: str, data=None, *, features=None, tenant: str = DEFAULT_TENANT) -> Hit | None:
        """The cached answer for this request, or None. Raises RequestError / UnknownTenant on bad input."""
        tenant = self.check_tenant(tenant)
        return self.lookup(self.query(modality, data, features), tenant)

    def lookup(self, q: Query, tenant: str = DEFAULT_TENANT, count: bool = True) -> Hit | None:
        t0 = time.perf_counter()
        tenant = self.check_tenant(tenant)
        hit, nearest, skip_l2 = self._lookup_l1(q, tenant)
        tier = "l1"
        if hit is None and self.l2 is not None and not skip_l2 and self.watermark.current:
            tier = "l2"
            hit, d2 = self._lookup_l2(q, tenant)
            if d2 is not None and (nearest is None or d2 < nearest):
                nearest = d2
        if count:
            # nearest: the hit's distance; on a miss the nearest candidate seen, or bits + 1 (the +Inf
            # bucket) when nothing was within observe_radius
            d = hit.distance if hit else (nearest if nearest is not None else self.bits + 1)
            self.metrics.record_lookup(hit is not None, hit.tier if hit else tier, d, time.perf_counter() - t0)
        return hit

    def _lookup_l1(self, q: Query, tenant: str) -> tuple[Hit | None, int | None, bool]:
        """(hit, nearest distance seen, skip the L2?)"""
        now = self.clock()
        with self._lock:
            self._expire(now)
            if not self.watermark.current:
                self.metrics.rejections.labels(reason="stale_revision").inc()
                return None, None, True
            ti = self._tenant_ids.get(tenant)
            if ti is None:
                return None, None, False
            if self.bloom is not None and not self.bloom.may_contain(ti, q.code):
                self.metrics.bloom_skips.inc()
                return None, None, self.config.bloom_guard_l2
            slots, dists = self._backends[ti].search(np.frombuffer(q.code, np.uint8), self.observe_radius)
            if not len(dists):
                return None, None, False
            nearest = int(dists[0])
            if self.observe_radius != self.radius:  # distances are sorted: keep those within the radius
                k = int(np.searchsorted(dists, self.radius, side="right"))
                slots, dists = slots[:k], dists[:k]
            mc = self.config.max_candidates
            sl, dl = slots[:mc].tolist(), dists[:mc].tolist()
            if not sl:
                return None, nearest, False
            t = self.table
            rev, exp, mod, pay, rid = t.revision, t.expires, t.modality, t.payload, self._rev_id
            mods = self._modalities
            best = self._choose(q, sl, dl, [mods[mod[s]] for s in sl], [pay[s] for s in sl],
                                [rev[s] == rid for s in sl], [float(exp[s]) for s in sl], now)
            if best is None:
                return None, nearest, False
            slot, d, cos = best
            self.policy.access(slot)
            exp = float(t.expires[slot])
            hit = Hit(value=decode_value(t.kind[slot], t.value[slot]), distance=d, cosine=cos, tier="l1",
                      modality=self._modalities[t.modality[slot]], revision=self._revisions[t.revision[slot]],
                      created=float(t.created[slot]), expires=exp,
                      refresh=self.freshness.should_refresh(now, exp, float(t.compute_s[slot])), entry=f"l1:{slot}")
            return hit, nearest, False

    def _choose(self, q: Query, ids: list, dists: list, mods: list, payloads: list, current, expires, now: float):
        """Candidates nearest first: ids, distances, entry modalities, payloads, current-revision flags and
        expiries. Returns (id, distance, cosine) of the entry to serve, or None. Order: distance, then
        cosine (higher first), then id."""
        c = self.config
        keep, n_rev, n_exp = [], 0, 0
        for i in range(len(ids)):
            if not current[i]:
                n_rev += 1
            elif expires[i] <= now:
                n_exp += 1
            elif c.cross_modal or mods[i] == q.modality:
                keep.append(i)
        if n_rev:
            self.metrics.rejections.labels(reason="revision").inc(n_rev)
        if n_exp:
            self.metrics.rejections.labels(reason="expired").inc(n_exp)
        if not keep:
            return None
        if not c.payload_check or q.z is None or self.payload_codec is None:
            i = keep[0]
            return ids[i], dists[i], None
        by_mod: dict[str, list[int]] = {}
        for i in keep:
            by_mod.setdefault(mods[i], []).append(i)
        best, n_bad = None, 0
        for m, idx in by_mod.items():
            recs = np.frombuffer(b"".join(payloads[i] for i in idx), np.uint8).reshape(len(idx), -1)
            # cosine with the decoded records (q.z is unit-norm): PayloadCodec.cosine computes the same,
            # but its argument checks cost ~35 us a call, more than the decoding itself
            dec = self.payload_codec.decode(m, recs)
            cos = (dec @ q.z) / np.sqrt(np.maximum(np.einsum("ij,ij->i", dec, dec), 1e-30))
            for i, cs in zip(idx, cos.tolist()):
                if cs >= c.payload_threshold:
                    key = (dists[i], -cs, ids[i])
                    if best is None or key < best:
                        best = key
                else:
                    n_bad += 1
        if n_bad:
            self.metrics.rejections.labels(reason="payload").inc(n_bad)
        if best is None:
            return None
        return best[2], best[0], -best[1]

    def _lookup_l2(self, q: Query, tenant: str) -> tuple[Hit | None, int | None]:
        try:
            recs = self.l2.lookup(tenant, self.revision, q.code, self.radius)
        except L2Unavailable:
            return None, None
        if not recs:
            return None, None
        nearest = min(r.distance for r in recs)
        now = self.clock()
        by_id = {r.id: r for r in recs}
        best = self._choose(q, [r.id for r in recs], [r.distance for r in recs], [r.modality for r in recs],
                            [r.payload for r in recs], [r.revision == self.revision for r in recs],
                            [r.expires for r in recs], now)
        if best is None:
            return None, nearest
        rid, d, cos = best
        r = by_id[rid]
        # promote into L1 (same expiry and revision; not written back)
        self._store(tenant, Query(r.modality, r.code, None), r.kind, r.value, r.payload, created=r.created,
                    expires=r.expires, compute_s=r.compute_s, l2id=r.id)
        return Hit(value=decode_value(r.kind, r.value), distance=d, cosine=cos, tier="l2", modality=r.modality,
                   revision=r.revision, created=r.created, expires=r.expires,
                   refresh=self.freshness.should_refresh(now, r.expires, r.compute_s), entry=r.id), nearest

    # ------------------------------------------------------------------ store
    def put(self, modality: str, data=None, *, features=None, value, tenant: str = DEFAULT_TENANT,
            ttl_s: float | None = None, compute_s: float = 0.0) -> bool:
        """Store `value` for this request. False when not stored in L1 (too large, refused by admission,
        or this replica's revision is stale); the L2 still gets it unless the revision is stale."""
        tenant = self.check_tenant(tenant)
        return self.store(self.query(modality, data, features), value, tenant, ttl_s=ttl_s, compute_s=compute_s)

    def store(self, q: Query, value, tenant: str = DEFAULT_TENANT, ttl_s: float | None = None,
              compute_s: float = 0.0) -> bool:
        t0 = time.perf_counter()
        tenant = self.check_tenant(tenant)
        kind, vbytes = encode_value(value)
        if self.payload_codec is not None and q.z is not None:
            payload = self.payload_codec.encode(q.modality, q.z[None]).tobytes()
        else:
            payload = b""
        now = self.clock()
        expires = self.freshness.expiry(now, ttl_s)
        if not self.watermark.current:
            self.metrics.rejections.labels(reason="stale_revision").inc()
            return False
        l2id = os.urandom(8).hex() if self.l2 is not None and self.config.l2.write else None
        stored = self._store(tenant, q, kind, vbytes, payload, created=now, expires=expires,
                             compute_s=float(compute_s), l2id=l2id)
        if l2id is not None:
            self.l2.put(tenant, L2Record(id=l2id, code=q.code, payload=payload, modality=q.modality, value=vbytes,
                                         kind=kind, revision=self.revision, created=now, expires=expires,
                                         compute_s=float(compute_s)))
        self.metrics.put_seconds.observe(time.perf_counter() - t0)
        return stored

    def _store(self, tenant: str, q: Query, kind: str, vbytes: bytes, payload: bytes, created: float,
               expires: float, compute_s: float, l2id: str | None) -> bool:
        nbytes = len(q.code) + len(payload) + len(vbytes)
        m = self.metrics
        if nbytes > self.config.capacity_bytes:
            m.rejections.labels(reason="too_large").inc()
            return False
        with self._lock:
            self._expire(self.clock())
            ti = self._tenant(tenant, create=True)
            mi = self._modality_id(q.modality)
            key = hash((ti, mi, q.code, payload))  # a hash collision only replaces an unrelated entry
            old = self._exact.get(key)
            if old is not None:
                self._remove(old, None)  # the same request stored again: replace its value
            t = self.table
            slot = t.alloc()
            t.code[slot] = np.frombuffer(q.code, np.uint8)
            t.tenant[slot], t.modality[slot], t.revision[slot] = ti, mi, self._rev_id
            t.created[slot], t.expires[slot], t.compute_s[slot], t.nbytes[slot] = created, expires, compute_s, nbytes
            t.payload[slot], t.value[slot], t.kind[slot], t.l2id[slot] = payload, vbytes, kind, l2id
            self._backends[ti].add(slot, t.code[slot])
            self._exact[key] = slot
            admitted = True
            for s in self.policy.insert(slot, nbytes):
                if s == slot:
                    admitted = False
                    m.rejections.labels(reason="admission").inc()
                    self._remove(slot, None)
                else:
                    self._remove(s, "capacity")
            if admitted:
                if math.isfinite(expires):
                    heapq.heappush(self._expiry, (expires, slot, int(t.gen[slot])))
                if self.bloom is not None:
                    self.bloom.add(ti, q.code)
                    self._maybe_rebuild_bloom()
                m.puts.inc()
            self._update_gauges()
            return admitted

    def store_codes(self, tenant: str, modality: str, codes: np.ndarray, values: list, payloads: np.ndarray | None = None,
                    ttl_s: float | None = None) -> int:
        """Bulk-load precomputed codes uint8 [N, bits/8] (and payload records uint8 [N, nbytes]) into L1
        (benchmarks, warm starts). Returns how many were admitted. Not written to the L2."""
        codes = np.ascontiguousarray(codes, dtype=np.uint8)
        n = 0
        for i in range(len(codes)):
            kind, vbytes = encode_value(values[i])
            now = self.clock()
            payload = payloads[i].tobytes() if payloads is not None else b""
            n += self._store(tenant, Query(modality, codes[i].tobytes(), None), kind, vbytes, payload, created=now,
                             expires=self.freshness.expiry(now, ttl_s), compute_s=0.0, l2id=None)
        return n

    def delete_tenant(self, tenant: str) -> int:
        """Drop every L1 entry of one tenant; returns how many."""
        with self._lock:
            ti = self._tenant_ids.get(tenant)
            if ti is None:
                return 0
            slots = [int(s) for s in self.table.live_slots() if self.table.tenant[s] == ti]
            for s in slots:
                self._remove(s, None)
            self._update_gauges()
            return len(slots)

    # ------------------------------------------------------------------ get or compute
    def get_or_compute(self, modality: str, data=None, *, features=None, compute: Callable[[], Any],
                       tenant: str = DEFAULT_TENANT, ttl_s: float | None = None) -> Result:
        """The cached value, or compute() stored and returned. N concurrent misses on the same request
        code run compute() once (followers wait, then look up again with their own checks); a hit that
        XFetch marks for early refresh is recomputed by one caller while the others are served."""
        tenant = self.check_tenant(tenant)
        q = self.query(modality, data, features)
        hit = self.lookup(q, tenant)
        key = (tenant, q.code)
        if hit is not None:
            if not hit.refresh:
                return Result(hit.value, hit, computed=False)
            leader, ev = self._sf.lead(("refresh",) + key)
            if not leader:
                return Result(hit.value, hit, computed=False)
            try:
                self.metrics.early_refresh.inc()
                return Result(self._compute_store(q, compute, tenant, ttl_s), None, computed=True)
            finally:
                self._sf.done(("refresh",) + key, ev)
        leader, ev = self._sf.lead(key)
        if not leader:
            self.metrics.singleflight_waits.inc()
            ev.wait(self.config.singleflight_timeout_s)
            hit = self.lookup(q, tenant, count=False)
            if hit is not None:
                return Result(hit.value, hit, computed=False, waited=True)
            return Result(self._compute_store(q, compute, tenant, ttl_s), None, computed=True, waited=True)
        try:
            return Result(self._compute_store(q, compute, tenant, ttl_s), None, computed=True)
        finally:
            self._sf.done(key, ev)

    def _compute_store(self, q: Query, compute, tenant, ttl_s):
        t0 = self.clock()  # the cache's clock: XFetch compares compute time with expiries on it
        value = compute()
        self.store(q, value, tenant, ttl_s=ttl_s, compute_s=max(0.0, self.clock() - t0))
        return value

    async def aget_or_compute(self, modality: str, data=None, *, features=None, compute,
                              tenant: str = DEFAULT_TENANT, ttl_s: float | None = None) -> Result:
        """`get_or_compute` for coroutines: compute is an async callable; single-flight per event loop."""
        import asyncio

        tenant = self.check_tenant(tenant)
        loop = asyncio.get_running_loop()
        sf = self._asf.setdefault(id(loop), AsyncSingleFlight())
        q = self.query(modality, data, features)
        hit = self.lookup(q, tenant)
        key = (tenant, q.code)
        if hit is not None and not hit.refresh:
            return Result(hit.value, hit, computed=False)
        lkey = (("refresh",) + key) if hit is not None else key
        leader, ev = sf.lead(lkey)
        if not leader:
            if hit is not None:
                return Result(hit.value, hit, computed=False)
            self.metrics.singleflight_waits.inc()
            await asyncio.wait_for(ev.wait(), self.config.singleflight_timeout_s)
            hit = self.lookup(q, tenant, count=False)
            if hit is not None:
                return Result(hit.value, hit, computed=False, waited=True)
        try:
            if hit is not None:
                self.metrics.early_refresh.inc()
            t0 = self.clock()
            value = await compute()
            self.store(q, value, tenant, ttl_s=ttl_s, compute_s=max(0.0, self.clock() - t0))
            return Result(value, None, computed=True, waited=not leader)
        finally:
            if leader:
                sf.done(lkey, ev)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict:
        m = self.metrics
        with self._lock:
            return {"entries": self.table.live, "size_bytes": self.policy.used_bytes,
                    "capacity_bytes": self.config.capacity_bytes, "tenants": len(self._tenant_ids),
                    "hits": m.value("cache_gets_total", result="hit"), "misses": m.value("cache_gets_total", result="miss"),
                    "revision": self.revision, "serving": self.watermark.current,
                    "l2": None if self.l2 is None else {"url_host": self.config.l2.url.split("@")[-1],
                                                        "available": self.l2.available}}

    def __len__(self) -> int:
        return self.table.live
