"""L1: the in-process tier. Entries as columns (`EntryTable`), one Hamming index per tenant (search.py), a
byte-capacity eviction policy (policies/), expiry sweeps (`ExpiryHeap`) and the Bloom guard (protection.py).

A tier (this one and `ushash.serving.cache.redis_store.RedisStore`) offers

    find(q, tenant, revision, check, now) -> Found      the entry to serve for a Query, by the hit check
    put(tenant, entry) -> bool                          store an Entry (False: refused)

and L1 does both for batches too (`find_many`, `put_many`: one index call and one vectorised hit check
for the batch; `find` and `put` are batches of one).

Memory: a tenant's index is freed with its last entry (so live tenants <= live entries), and the expiry
heap is compacted when its stale records outnumber the live entries.

Thread-safe: one lock guards every structure; `find` runs the hit check under it, so the chosen slot is
the one read.
"""

from __future__ import annotations

import threading

import numpy as np

from ushash.serving.cache.entries import MISS, Entry, EntryTable, Found
from ushash.serving.cache.freshness import ExpiryHeap
from ushash.serving.cache.hitcheck import Batch
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
        self.payload_codec = payload_codec
        pw = max(payload_codec.nbytes(m) for m in modalities) if payload_codec is not None else 0
        self.table = EntryTable(self.code_bytes, pw)
        opts = dict(c.policy_options or {})
        self.policy = make_policy(c.policy, c.capacity_bytes, clock=clock, **opts)
        self._backends: dict[int, object] = {}
        self._tenant_ids: dict[str, int] = {}
        self._tenant_names: dict[int, str] = {}
        self._tenant_live: dict[int, int] = {}
        self._free_tenant_ids: list[int] = []
        self._modalities: list[str] = []
        self._revisions: list[str] = [str(revision)]   # every L1 entry is of this revision (reload: a new tier)
        self._expiry = ExpiryHeap()
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
            ti = self._free_tenant_ids.pop() if self._free_tenant_ids else len(self._tenant_ids)
            self._tenant_ids[tenant], self._tenant_names[ti], self._tenant_live[ti] = ti, tenant, 0
            c = self.config
            self._backends[ti] = make_backend(c.backend, self.bits, device=c.device, mih_nhash=c.mih_nhash,
                                              mih_min_entries=c.mih_min_entries)
        return ti

    def _drop_tenant_if_empty(self, ti: int) -> None:
        if self._tenant_live.get(ti, 1) == 0:
            del self._tenant_ids[self._tenant_names.pop(ti)], self._backends[ti], self._tenant_live[ti]
            self._free_tenant_ids.append(ti)

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
        t.release(slot)
        self._tenant_live[ti] -= 1
        self._drop_tenant_if_empty(ti)
        if reason is not None:
            self.metrics.evictions.labels(reason=reason).inc()

    def expire(self, now: float) -> None:
        t = self.table
        for slot, gen in self._expiry.due(now):
            if t.alive[slot] and t.gen[slot] == gen:
                self._remove(slot, "expired")
        if len(self._expiry) > 2 * t.live + 1024:  # records of evicted / replaced entries: drop them
            live = t.live_slots()
            self._expiry.replace(t.expires[live], live, t.gen[live])

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
    def find(self, q, tenant: str, revision: str, check, now: float, k: int = 1) -> Found:
        return self.find_many([q], tenant, revision, check, now, k)[0]

    def find_many(self, queries: list, tenant: str, revision: str, check, now: float, k: int = 1) -> list[Found]:
        """`find` for a batch of Queries: one index search and one vectorised hit check for all. With k > 1
        (one query) the next k - 1 servable entries too (`Found.more`)."""
        out = [MISS] * len(queries)
        with self.lock:
            self.expire(now)
            ti = self._tenant_ids.get(tenant)
            if ti is None or not queries:
                return out
            todo = list(range(len(queries)))
            if self.bloom is not None:
                skip = Found(skip_next=self.config.bloom_guard_l2)
                keep = []
                for i in todo:
                    if self.bloom.may_contain(ti, queries[i].code):
                        keep.append(i)
                    else:
                        out[i] = skip
                if len(keep) < len(todo):
                    self.metrics.bloom_skips.inc(len(todo) - len(keep))
                todo = keep
            if not todo:
                return out
            qs = [queries[i] for i in todo]
            codes = np.frombuffer(b"".join(q.code for q in qs), np.uint8).reshape(len(qs), self.code_bytes)
            lims, slots, dists = self._backends[ti].search_many(codes, self.observe_radius)
            counts = lims[1:] - lims[:-1]
            nearest_d = dists[np.minimum(lims[:-1], max(0, len(dists) - 1))] if len(dists) else counts
            # each query's candidates: within the radius (a prefix: distances are sorted), at most max_candidates
            mc = self.config.max_candidates
            if len(qs) == 1:
                nc = min(int(np.count_nonzero(dists <= self.radius)), mc)   # not `k`: that is the top-k asked for
                slots, dists = slots[:nc], dists[:nc]
                qlims = np.array([0, nc], np.int64)
            else:
                rank = np.arange(len(slots)) - np.repeat(lims[:-1], counts)
                sel = np.flatnonzero((dists <= self.radius) & (rank < mc))
                slots, dists = slots[sel], dists[sel]
                qlims = np.zeros(len(qs) + 1, np.int64)
                np.cumsum(np.bincount(np.repeat(np.arange(len(qs)), counts)[sel], minlength=len(qs)), out=qlims[1:])
            t = self.table
            mods = list(self._modalities)
            qmod = np.array([mods.index(q.modality) if q.modality in mods else len(mods) for q in qs], np.int64)
            has_z = np.array([q.z is not None for q in qs], bool)
            qz = None
            if len(qs) == 1:
                qz = None if qs[0].z is None else qs[0].z[None]
            elif has_z.any():
                dim = next(q.z for q in qs if q.z is not None).shape[0]
                qz = np.stack([q.z if q.z is not None else np.zeros(dim, np.float32) for q in qs])
            codec = self.payload_codec
            payload = t.payload

            def records(idx, modality):
                return np.ascontiguousarray(payload[slots[idx], : codec.nbytes(modality)])

            revs = self._revisions
            current = (t.revision[slots] == 0) if len(revs) == 1 and revs[0] == revision else \
                np.array([r == revision for r in revs], bool)[t.revision[slots]]
            batch = Batch(lims=qlims, dists=dists, modality=t.modality[slots], current=current,
                          expires=t.expires[slots], has_payload=t.plen[slots] > 0, records=records)
            if k > 1 and len(qs) == 1:
                ranked = check.select_top(qz, has_z, qmod, mods, batch, now, trusted=True, k=k)
                n, nearest = int(counts[0]), int(nearest_d[0])
                if n == 0:
                    return out
                if not ranked:
                    out[todo[0]] = Found(nearest=nearest)
                    return out
                (c0, cs0), rest = ranked[0], ranked[1:]
                slot = int(slots[c0])
                self.policy.access(slot)
                more = tuple((t.read(int(slots[j]), mods, revs), int(dists[j]), cs, f"l1:{int(slots[j])}")
                             for j, cs in rest)
                out[todo[0]] = Found(t.read(slot, mods, revs), int(dists[c0]), cs0, f"l1:{slot}", nearest, more=more)
                return out
            chosen, cos = check.select(qz, has_z, qmod, mods, batch, now, trusted=True)
            for j, (i, n, nearest, c, cs) in enumerate(zip(todo, counts.tolist(), nearest_d.tolist(), chosen.tolist(),
                                                           cos.tolist())):
                if n == 0:
                    continue
                if c < 0:
                    out[i] = Found(nearest=nearest)
                    continue
                slot = int(slots[c])
                self.policy.access(slot)
                out[i] = Found(t.read(slot, mods, revs), int(dists[c]), None if cs != cs else cs, f"l1:{slot}", nearest)
        return out

    def put(self, tenant: str, e: Entry) -> bool:
        return self.put_many(tenant, [e])[0]

    def put_many(self, tenant: str, entries: list[Entry]) -> list[bool]:
        """Store each entry (of this tier's revision) unless it is larger than the capacity or refused by
        admission; the same (tenant, modality, code, payload) stored again replaces the older entry (a
        later one of the batch replaces an earlier one). One index search finds the entries replaced, one
        index add takes the batch."""
        m = self.metrics
        cap = self.config.capacity_bytes
        out = [False] * len(entries)
        fits = [i for i, e in enumerate(entries) if e.nbytes <= cap]
        if len(fits) < len(entries):
            m.rejections.labels(reason="too_large").inc(len(entries) - len(fits))
        if not fits:
            return out
        with self.lock:
            self.expire(self.clock())
            ti = self._tenant(tenant)
            t = self.table
            backend = self._backends[ti]
            codes = np.frombuffer(b"".join(entries[i].code for i in fits), np.uint8).reshape(len(fits), self.code_bytes)
            lims, same_code, _ = backend.search_many(codes, 0)
            placed: dict[tuple, int] = {}   # (modality, code, payload) -> slot, for this batch
            added: dict[int, None] = {}     # slots written by this batch, in order
            self._tenant_live[ti] += 1      # hold the tenant while the batch evicts
            for j, i in enumerate(fits):
                e = entries[i]
                mi = self._modality_id(e.modality)
                key = (mi, e.code, e.payload)
                old = placed.get(key)
                if old is None:
                    for s in same_code[lims[j]:lims[j + 1]].tolist():
                        if (t.alive[s] and t.modality[s] == mi and t.code[s].tobytes() == e.code
                                and t.payload_of(s) == e.payload):
                            old = s
                            break
                if old is not None and t.alive[old]:
                    self._remove(old, None)  # the same request stored again: replace its value
                    added.pop(old, None)
                slot = t.alloc()
                t.write(slot, e, ti, mi, self._revisions.index(e.revision))
                self._tenant_live[ti] += 1
                admitted = True
                # the request's identity for the policy's frequency counts: tenant and code (deterministic)
                ident = (int.from_bytes(e.code, "little") * 0x9E3779B97F4A7C15 + ti) & 0xFFFFFFFFFFFFFFFF
                for s in self.policy.insert(slot, e.nbytes, ident):
                    if s == slot:
                        admitted = False
                        m.rejections.labels(reason="admission").inc()
                        self._remove(slot, None)
                    else:
                        self._remove(s, "capacity")
                        added.pop(s, None)
                if admitted:
                    placed[key] = slot
                    added[slot] = None
                    self._expiry.push(e.expires, slot, int(t.gen[slot]))
                    if self.bloom is not None:
                        self.bloom.add(ti, e.code)
                    m.puts.inc()
                    out[i] = True
            live = np.array([s for s in added if t.alive[s]], np.int64)
            if len(live):
                backend.add_many(live, t.code[live])
            self._tenant_live[ti] -= 1
            self._drop_tenant_if_empty(ti)
            self._maybe_rebuild_bloom()
            self.update_gauges()
            return out

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
