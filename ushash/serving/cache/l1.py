"""L1: the in-process tier. Entries as columns (`EntryTable`), one Hamming index per tenant (search.py), a
byte-capacity eviction policy (policy.py), expiry sweeps (`ExpiryHeap`) and the Bloom guard (protection.py).

A tier (this one and `ushash.serving.cache.redis_store.RedisStore`) offers

    find(q, tenant, revision, check, now) -> Found      the entry to serve for a Query, by the hit check
    put(tenant, entry) -> bool                          store an Entry (False: refused)

Thread-safe: one lock guards every structure; `find` runs the hit check under it, so the chosen slot is
the one read.
"""

from __future__ import annotations

import threading
import numpy as np

from ushash.serving.cache.entries import MISS, Candidates, Entry, EntryTable, Found
from ushash.serving.cache.freshness import ExpiryHeap
from ushash.serving.cache.policies import make_policy
from ushash.serving.cache.protection import BloomGuard
from ushash.serving.cache.search import make_backend


class L1Tier:
    name = "l1"

    def __init__(self, bits: int, config, metrics, clock, payload_codec, modalities, revision: str):
        c = config
        self.config, self.metrics, self.clock = c, metrics, clock
        self.bits, self.code_bytes = int(bits), int(bits) // 8
        self.radius = int(c.radius)
        self.observe_radius = int(c.observe_radius if c.observe_radius is not None else c.radius)
        self.table = EntryTable(self.code_bytes)
        opts = dict(c.policy_options or {})
        if str(c.policy).lower() == "wtinylfu" and "slot_bytes" not in opts:
            # theine's core costs ~170 B per slot: about one slot per small entry (code + payload + 32 B of
            # value); an entry uses ceil(bytes / slot) slots, so on average half a slot per entry is unused
            payload = min(payload_codec.nbytes(m) for m in modalities) if payload_codec else 0
            opts["slot_bytes"] = -(-(self.code_bytes + payload + 32) // 16) * 16
        self.policy = make_policy(c.policy, c.capacity_bytes, clock=clock, **opts)
        self._backends: dict[int, object] = {}
        self._tenant_ids: dict[str, int] = {}
        self._modalities: list[str] = []
        self._revisions: list[str] = [str(revision)]   # every L1 entry is of this revision (reload: a new tier)
        self._expiry = ExpiryHeap()
        self._exact: dict[int, int] = {}  # hash of (tenant, modality, code, payload) -> slot
        self.bloom = None
        if c.bloom:
            min_entry = self.code_bytes + 1 + (min(payload_codec.nbytes(m) for m in modalities)
                                                if payload_codec is not None else 0)
            # sized for what fits, but start small: the filter doubles on rebuild as entries arrive
            expected = min(max(1024, c.capacity_bytes // max(1, min_entry)), 1 << 16)
            self.bloom = BloomGuard(self.bits, self.observe_radius, expected_items=expected,
                                    fp_rate=c.bloom_fp_rate, chunks=c.bloom_chunks)
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ bookkeeping (lock held)
    @property
    def live(self) -> int:
        return self.table.live

    @property
    def tenants(self) -> int:
        return len(self._tenant_ids)

    def _tenant(self, tenant: str) -> int:
        ti = self._tenant_ids.get(tenant)
        if ti is None:
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

    def expire(self, now: float) -> None:
        t = self.table
        for slot, gen in self._expiry.due(now):
            if t.alive[slot] and t.gen[slot] == gen:
                self._remove(slot, "expired")

    def update_gauges(self) -> None:
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

    # ------------------------------------------------------------------ the tier
    def find(self, q, tenant: str, revision: str, check, now: float) -> Found:
        with self.lock:
            self.expire(now)
            ti = self._tenant_ids.get(tenant)
            if ti is None:
                return MISS
            if self.bloom is not None and not self.bloom.may_contain(ti, q.code):
                self.metrics.bloom_skips.inc()
                return Found(skip_next=self.config.bloom_guard_l2)
            slots, dists = self._backends[ti].search(np.frombuffer(q.code, np.uint8), self.observe_radius)
            if not len(dists):
                return MISS
            nearest = int(dists[0])
            if self.observe_radius != self.radius:  # distances are sorted: keep those within the radius
                k = int(np.searchsorted(dists, self.radius, side="right"))
                slots, dists = slots[:k], dists[:k]
            mc = self.config.max_candidates
            sl = slots[:mc].tolist()
            if not sl:
                return Found(nearest=nearest)
            t = self.table
            mods, revs = self._modalities, self._revisions
            cands = Candidates(ids=sl, dists=dists[:mc].tolist(), modalities=[mods[t.modality[s]] for s in sl],
                               payloads=[t.payload[s] for s in sl], revisions=[revs[t.revision[s]] for s in sl],
                               expires=[float(t.expires[s]) for s in sl], nearest=nearest)
            best = check.choose(q, cands, revision, now, trusted=True)
            if best is None:
                return Found(nearest=nearest)
            i, d, cos = best
            slot = cands.ids[i]
            self.policy.access(slot)
            return Found(t.read(slot, mods, revs), d, cos, f"l1:{slot}", nearest)

    def put(self, tenant: str, e: Entry) -> bool:
        """Store `e` (of this tier's revision) unless it is larger than the capacity or refused by
        admission; the same (tenant, modality, code, payload) stored again replaces the older entry."""
        nbytes = e.nbytes
        m = self.metrics
        if nbytes > self.config.capacity_bytes:
            m.rejections.labels(reason="too_large").inc()
            return False
        with self.lock:
            self.expire(self.clock())
            ti = self._tenant(tenant)
            mi = self._modality_id(e.modality)
            key = hash((ti, mi, e.code, e.payload))  # a hash collision only replaces an unrelated entry
            old = self._exact.get(key)
            if old is not None:
                self._remove(old, None)  # the same request stored again: replace its value
            t = self.table
            slot = t.alloc()
            t.write(slot, e, ti, mi, self._revisions.index(e.revision))
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
                self._expiry.push(e.expires, slot, int(t.gen[slot]))
                if self.bloom is not None:
                    self.bloom.add(ti, e.code)
                    self._maybe_rebuild_bloom()
                m.puts.inc()
            self.update_gauges()
            return admitted

    def delete_tenant(self, tenant: str) -> int:
        with self.lock:
            ti = self._tenant_ids.get(tenant)
            if ti is None:
                return 0
            slots = [int(s) for s in self.table.live_slots() if self.table.tenant[s] == ti]
            for s in slots:
                self._remove(s, None)
            self.update_gauges()
            return len(slots)
