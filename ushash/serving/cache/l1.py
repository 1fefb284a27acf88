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

import collections
import math
import sys
import threading
import time
import zlib

import numpy as np
from ushash.core.jit import njit

from ushash.serving.cache.entries import MISS, VALUE_KINDS, Entry, EntryTable, Found, found
from ushash.serving.cache.freshness import ExpiryHeap
from ushash.serving.cache.hitcheck import _CHECK, _SERVABLE, Batch, HitCheck
from ushash.serving.cache.mindex import _NO_IDS, _NO_OFFS, _NO_TC, _search
from ushash.serving.payload.format import int4_group_cosine
from ushash.serving.cache.policies import make_policy
from ushash.serving.cache.protection import BloomGuard
from ushash.serving.cache.search import MIndexBackend, make_backend


def _bloom_key(tenant: str) -> int:
    """A tenant's key in the Bloom filter: its name's, not its L1 id's (ids are reused once a tenant has nothing
    in L1, and the codes filed under a name must stay its own while its L2 entries live on)."""
    return zlib.crc32(tenant.encode()) & 0xFFFF


@njit(cache=True, nogil=True)
def _gather(lims, slots, dists, radius, max_candidates, current, expires, modality, plen):
    """From a search's results (each query's sorted by distance): per query the number of results and the
    nearest distance (-1: none), and the candidates (those within `radius`, at most `max_candidates` per
    query) as flat columns: lims, slot, distance, of the revision served (`current`: the L1's entries are
    all of one revision), expiry, modality, has a payload."""
    b = len(lims) - 1
    counts = np.empty(b, np.int64)
    nearest = np.empty(b, np.int64)
    qlims = np.zeros(b + 1, np.int64)
    tot = 0
    for qi in range(b):
        a, e = lims[qi], lims[qi + 1]
        counts[qi] = e - a
        nearest[qi] = dists[a] if e > a else -1
        c = 0
        while a + c < e and c < max_candidates and dists[a + c] <= radius:
            c += 1
        tot += c
        qlims[qi + 1] = tot
    s = np.empty(tot, np.int64)
    d = np.empty(tot, np.int64)
    cur = np.empty(tot, np.bool_)
    exp = np.empty(tot, np.float64)
    mod = np.empty(tot, np.int64)
    hasp = np.empty(tot, np.bool_)
    for qi in range(b):
        a = lims[qi]
        for j in range(qlims[qi + 1] - qlims[qi]):
            w = qlims[qi] + j
            slot = slots[a + j]
            s[w] = slot
            d[w] = dists[a + j]
            cur[w] = current
            exp[w] = expires[slot]
            mod[w] = modality[slot]
            hasp[w] = plen[slot] > 0
    return counts, nearest, qlims, s, d, cur, exp, mod, hasp


@njit(cache=True, nogil=True)
def _find_fused(q, codes, by_slot, tcodes, p2s, n, nbase, offs, ids, tc, masks, nchunks, observe_radius,
                use_tables, radius,
                max_candidates, current, expires, modality, plen, payload, qmod, has_z, qz, now,
                cross_modal, check, thr, o_vals, length, group):
    """One compiled call for a batch of lookups on the own multi-index with the int4 group-scaled payloads
    (or no payload check) and one threshold: the search (mindex._search), the candidates (`_gather`), the
    hit check's triage, cosines and pick (hitcheck._triage / _pick, the same decisions in the same order;
    the cosine is format.int4_group_cosine, the same arithmetic as the codec's). Per query: the slot
    chosen (-1: none), its distance and cosine (NaN: not checked), the number of results and the nearest
    distance (-1: none), as one int64 [4, B] array (chosen, distance, results, nearest: one array to hand
    back rather than four), the cosines float32 [B]; and the revision, expired and payload refusal counts."""
    nq = q.shape[0]
    lims = np.zeros(nq + 1, np.int64)
    cap = max(64, 16 * nq)
    while True:
        out_s = np.empty(cap, np.int64)
        out_d = np.empty(cap, np.int32)
        m = _search(q, codes, by_slot, tcodes, p2s, n, nbase, offs, ids, tc, masks, nchunks, observe_radius,
                    use_tables, lims, out_s, out_d)
        if m <= cap:
            break
        cap = m
    res = np.full((4, nq), -1, np.int64)
    chosen, cdist, counts, nearest = res[0], res[1], res[2], res[3]
    ccos = np.full(nq, np.nan, np.float32)
    n_rev = n_exp = n_bad = 0
    for qi in range(nq):
        a, e = lims[qi], lims[qi + 1]
        counts[qi] = e - a
        nearest[qi] = out_d[a] if e > a else -1
        best, bd, bc, bst = -1, 0, np.float32(0.0), 0
        c = 0
        while a + c < e and c < max_candidates and out_d[a + c] <= radius:
            j = a + c
            c += 1
            slot = out_s[j]
            if not current:
                n_rev += 1
                continue
            if expires[slot] <= now:
                n_exp += 1
                continue
            mj = modality[slot]
            if not cross_modal and mj != qmod[qi]:
                continue
            if check and has_z[qi]:
                if plen[slot] <= 0:
                    n_bad += 1
                    continue
                cj = int4_group_cosine(payload, slot, 0, o_vals[mj], length[mj], group[mj], qz, qi)
                if not np.float64(cj) >= thr:   # NaN fails too, as in hitcheck
                    n_bad += 1
                    continue
                st = _CHECK
            else:
                cj = np.float32(0.0)
                st = _SERVABLE
            d = out_d[j]
            if best < 0 or d < bd or (d == bd and cj > bc):
                best, bd, bc, bst = slot, d, cj, st
        if best >= 0:
            chosen[qi] = best
            cdist[qi] = bd
            if bst == _CHECK:
                ccos[qi] = bc
    return res, ccos, n_rev, n_exp, n_bad


_NO_Z = np.zeros((1, 1), np.float32)
_TRUE1, _FALSE1 = np.ones(1, bool), np.zeros(1, bool)
_LITTLE = sys.byteorder == "little"


def _query_columns(queries: list, mods: list[str], no_z, zdim: int | None = None):
    """(modality id int64 [B], has z bool [B], z float32 [B, dim] with zero rows where there is none, or `no_z`
    when no query has one, the modality names the ids index). A query modality the tier holds no entry of gets
    an id past `mods`, its name appended to the names, so a per-pair point still finds its pair by name."""
    if len(queries) == 1:
        q0 = queries[0]
        if q0.z is not None and zdim is not None and q0.z.shape != (zdim,):
            raise ValueError(f"a query's z must be {zdim} floats (the shared space); got shape {np.shape(q0.z)}")
        if q0.modality in mods:
            qmod, names = np.array([mods.index(q0.modality)], np.int64), mods
        else:
            qmod, names = np.array([len(mods)], np.int64), [*mods, q0.modality]
        return qmod, (_TRUE1 if q0.z is not None else _FALSE1), (q0.z[None] if q0.z is not None else no_z), names
    ids = {m: i for i, m in enumerate(mods)}
    names = list(mods)
    for q in queries:
        if q.modality not in ids:
            ids[q.modality] = len(names)
            names.append(q.modality)
    qmod = np.array([ids[q.modality] for q in queries], np.int64)
    zs = [q.z for q in queries]
    has_z = np.array([z is not None for z in zs], bool)
    if not has_z.any():
        return qmod, has_z, no_z, names
    dim = next(z for z in zs if z is not None).shape[0]
    if any(z is not None and z.shape != (dim,) for z in zs):   # rows of other widths would be cut and misaligned
        widths = sorted({np.shape(z) for z in zs if z is not None})
        raise ValueError(f"the queries' z must all be 1-d of one width; got {widths}")
    if not has_z.all():
        zero = np.zeros(dim, np.float32)
        zs = [zero if z is None else z for z in zs]
    if zdim is not None and dim != zdim:
        raise ValueError(f"a query's z must be {zdim} floats (the shared space); got {dim}")
    # np.stack's rows, by one concatenation (stack makes a view of every row first)
    return qmod, has_z, np.concatenate(zs).reshape(len(zs), dim), names


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
        # the shared space's width: a query z of another would broadcast in the payload check (cosines > 1)
        self._zdim = payload_codec[modalities[0]].dim if payload_codec is not None and len(modalities) else None
        self.table = EntryTable(self.code_bytes, pw)
        opts = dict(c.policy_options or {})
        self.policy = make_policy(c.policy, c.capacity_bytes, clock=clock, **opts)
        # the request's identity for the policy's frequency counts, tenant and code, read from the slot's row
        # (written before the policy's insert, released after its remove)
        self.policy.bind_idents(self.table)
        self._backends: dict[int, object] = {}
        self._tenant_ids: dict[str, int] = {}
        self._tenant_names: dict[int, str] = {}
        self._tenant_live: dict[int, int] = {}
        self._free_tenant_ids: list[int] = []
        self._modalities: list[str] = []
        self._revision = str(revision)   # every L1 entry is of this revision (reload: a new tier)
        self._expiry = ExpiryHeap()
        self.bloom = None
        if c.bloom and c.l2 is not None:   # its "no entry" matters only for the L2 behind (an L1 alone has searched)
            min_entry = self.code_bytes + 1 + (min(payload_codec.nbytes(m) for m in modalities)
                                                if payload_codec is not None else 0)
            # sized for what fits, but start small: the filter doubles on rebuild as entries arrive
            expected = min(max(1024, c.capacity_bytes // max(1, min_entry)), 1 << 16)
            self.bloom = BloomGuard(self.bits, self.observe_radius, expected_items=expected,
                                    fp_rate=c.bloom_fp_rate, chunks=c.bloom_chunks)
        self.lock = threading.RLock()
        # the L2 entries other replicas changed lately: (tenant, id or "*") -> when it was heard (monotonic), and when
        # every copy went (changes missed); `promote` refuses a copy read before such a change
        self._changes: collections.OrderedDict = collections.OrderedDict()
        self._all_changed = -math.inf
        self._fused_cache = None

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
            # the own index reads the codes of the entry table (one copy per code) where they are whole
            # little-endian 64-bit words
            words = self.table.code_words if self.bits % 64 == 0 and _LITTLE else None
            self._backends[ti] = make_backend(c.backend, self.bits, device=c.device, mih_nhash=c.mih_nhash,
                                              mih_min_entries=c.mih_min_entries, codes=words)
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
        n = t.live
        for slot, exp in self._expiry.due(now):
            if t.alive[slot] and t.expires[slot] == exp:
                self._remove(slot, "expired")
        if t.live != n:   # a lookup's sweep too: the gauges say what is held now
            self.update_gauges()
        if len(self._expiry) > 2 * t.live + 1024:  # records of evicted / replaced entries: drop them
            live = t.live_slots()
            self._expiry.replace(t.expires[live], live)

    def update_gauges(self) -> None:
        self.metrics.size_bytes.set(self.policy.used_bytes)
        self.metrics.entries.set(self.table.live)

    def _maybe_rebuild_bloom(self) -> None:
        b = self.bloom
        if b is None or not b.needs_rebuild:
            return
        if self.config.bloom_guard_l2:   # an entry evicted here may live on in the L2 it guards: forget no code
            b.grow()                     # (a rebuild from the live entries made the L2 unreachable for it)
            return
        t = self.table
        live = t.live_slots()
        b.expected_items = max(b.expected_items, 2 * len(live))
        names = self._tenant_names
        b.rebuild((_bloom_key(names[int(t.tenant[s])]), t.code[s].tobytes()) for s in live)

    # ------------------------------------------------------------------ the tier
    def find(self, q, tenant: str, revision: str, check, now: float, k: int = 1) -> Found:
        return self.find_many([q], tenant, revision, check, now, k)[0]

    def find_many(self, queries: list, tenant: str, revision: str, check, now: float, k: int = 1) -> list[Found]:
        """`find` for a batch of Queries: one index search and one vectorised hit check for all (`_pick`).
        With k > 1 (one query) the next k - 1 servable entries too (`Found.more`)."""
        nq = len(queries)
        out = [MISS] * nq
        with self.lock:
            if k > 1 and nq == 1:
                return self._find_top(queries[0], tenant, revision, check, now, k)
            p = self._pick(queries, tenant, revision, check, now)
            if p is None:
                return out
            chosen, dist, cos, nearest, skipped = p
            for i, (c, d) in enumerate(zip(chosen, nearest)):
                if c < 0 and d >= 0:
                    out[i] = found(None, -1, None, "", d)
            if skipped:
                skip = Found(skip_next=self.config.bloom_guard_l2)
                for i in skipped:
                    out[i] = skip
            hits = [i for i, c in enumerate(chosen) if c >= 0]
            if hits:
                entries = self.table.read_many([chosen[i] for i in hits], self._modalities, self._revision)
                for i, e in zip(hits, entries):
                    cs = cos[i]
                    out[i] = found(e, dist[i], None if cs != cs else cs, f"l1:{chosen[i]}", nearest[i])
        return out

    def hits_many(self, queries: list, tenant: str, revision: str, check, now: float):
        """The served view of `find_many`'s answers, made from the columns for the whole batch (no Entry,
        no Found): (hits: a Hit with refresh=False or None per query, nearest: the nearest distance seen
        per query (-1: none), skip_next: the queries whose next tier is skipped (`Found.skip_next`: the
        Bloom filter answered "no entry", with bloom_guard_l2), hit_idx: the queries with a hit, in
        order, compute_s: their entries' compute seconds (XFetch is the caller's))."""
        nq = len(queries)
        with self.lock:
            p = self._pick(queries, tenant, revision, check, now)
            if p is None:
                return [None] * nq, [-1] * nq, (), [], []
            chosen, dist, cos, nearest, skipped = p
            if nq == 1:
                hit_idx = [0] if chosen[0] >= 0 else []
            else:
                hit_idx = [i for i, c in enumerate(chosen) if c >= 0]
            if not self.config.bloom_guard_l2:
                skipped = ()
            hits: list = [None] * nq
            cs_l: list = []
            if hit_idx:
                made, cs_l = self.table.hits([chosen[i] for i in hit_idx], [dist[i] for i in hit_idx],
                                             [cos[i] for i in hit_idx], self.name, self._modalities, self._revision)
                for i, h in zip(hit_idx, made):
                    hits[i] = h
        return hits, nearest, skipped, hit_idx, cs_l

    def _pick(self, queries, tenant: str, revision: str, check, now: float):
        """(lock held) The L1's choice for each query, as lists: the slot to serve (-1: none; the policy
        has been told of each hit, in query order), its distance, its cosine (NaN: not checked), the
        nearest distance seen (-1: nothing within observe_radius), and the indices of the queries the
        Bloom filter answered "no entry". None when the tenant has nothing here. One compiled call on the
        own multi-index with int4 payloads (`_find_fused`), else one search and `check.select`."""
        ti = self._tenant_at(tenant, now)
        nq = len(queries)
        if ti is None or not nq:
            return None
        codes = queries[0].code if nq == 1 else b"".join([q.code for q in queries])
        backend = self._backends[ti]
        fused = self._fused_params(check) if isinstance(backend, MIndexBackend) else None
        if fused is not None:
            res = self._pick_fused(queries, backend, codes, revision, fused, now)
        else:
            res = self._pick_general(queries, backend, codes, revision, check, now)
        chosen, dist, cos, counts, nearest = res
        skipped = self._bloom_skips(ti, queries, counts) if self.bloom is not None and 0 in counts else ()
        hits = [c for c in chosen if c >= 0]
        if hits:
            self.policy.access_many(hits)
        return chosen, dist, cos, nearest, skipped

    def _tenant_at(self, tenant: str, now: float) -> int | None:
        """(lock held) What every search does first: entries expired by `now` dropped, then the tenant's id
        (None: it has nothing here)."""
        if len(self._expiry):
            self.expire(now)
        return self._tenant_ids.get(tenant)

    def _bloom_skips(self, ti: int, queries, counts) -> list[int]:
        """The queries whose search found nothing that the Bloom filter says have no entry. The filter
        holds every live code's chunks, so it can only say "no" for those: asked for them only, it gives
        the same answers as asking first, without costing the lookups that have candidates."""
        may, key = self.bloom.may_contain, _bloom_key(self._tenant_names[ti])
        skipped = [i for i, c in enumerate(counts) if c == 0 and not may(key, queries[i].code)]
        if skipped:
            self.metrics.bloom_skips.inc(len(skipped))
        return skipped

    def _current(self, revision: str) -> bool:
        """Is `revision` the one of every entry here (the one the tier was made for)?"""
        return revision == self._revision

    def _candidates(self, queries, backend, codes: bytes, revision: str):
        """One index search of the batch and `_gather`'s columns of its candidates."""
        arr = np.frombuffer(codes, np.uint8).reshape(len(queries), self.code_bytes)
        lims, slots, dists = backend.search_many(arr, self.observe_radius)
        t = self.table
        return _gather(lims, slots, dists, self.radius, self.config.max_candidates, self._current(revision),
                       t.expires, t.modality, t.plen)

    def _batch(self, qlims, slots, dists, cur, exp, mod, hasp) -> Batch:
        codec, payload = self.payload_codec, self.table.payload

        def records(idx, modality):
            return np.ascontiguousarray(payload[slots[idx], : codec.nbytes(modality)])

        return Batch(lims=qlims, dists=dists, modality=mod, current=cur, expires=exp, has_payload=hasp, records=records)

    def _pick_general(self, queries, backend, codes: bytes, revision: str, check, now: float):
        """`_pick`'s (chosen, distance, cosine, results, nearest) lists by the search and `check.select`."""
        nq = len(queries)
        counts, nearest_d, qlims, slots, dists, cur, exp, mod, hasp = self._candidates(queries, backend, codes, revision)
        counts_l, nearest_l = counts.tolist(), nearest_d.tolist()
        if len(slots) == 0:   # nothing within the radius: the nearest seen, if any, is all there is to say
            return [-1] * nq, [-1] * nq, [float("nan")] * nq, counts_l, nearest_l
        qmod, has_z, qz, names = _query_columns(queries, self._modalities, None, self._zdim)
        chosen, cos = check.select(qz, has_z, qmod, list(names), self._batch(qlims, slots, dists, cur, exp, mod, hasp),
                                   now, trusted=True)
        sel = chosen >= 0
        at = np.where(sel, chosen, 0)
        return (np.where(sel, slots[at], -1).tolist(), np.where(sel, dists[at], -1).tolist(), cos.tolist(), counts_l,
                nearest_l)

    def _find_top(self, q, tenant: str, revision: str, check, now: float, k: int) -> list[Found]:
        """(lock held) find(q, ..., k > 1): the best servable entry and the next k - 1 (`Found.more`)."""
        out = [MISS]
        ti = self._tenant_at(tenant, now)
        if ti is None:
            return out
        counts, nearest_d, qlims, slots, dists, cur, exp, mod, hasp = self._candidates([q], self._backends[ti], q.code,
                                                                                      revision)
        n, nearest = int(counts[0]), int(nearest_d[0])
        if n == 0:
            if self.bloom is not None and self._bloom_skips(ti, [q], [0]):
                out[0] = Found(skip_next=self.config.bloom_guard_l2)
            return out
        if len(slots) == 0:
            out[0] = Found(nearest=nearest)
            return out
        t, mods, rev = self.table, list(self._modalities), self._revision
        qmod, has_z, qz, names = _query_columns([q], mods, None, self._zdim)
        ranked = check.select_top(qz, has_z, qmod, list(names), self._batch(qlims, slots, dists, cur, exp, mod, hasp), now,
                                  trusted=True, k=k)
        if not ranked:
            out[0] = Found(nearest=nearest)
            return out
        (c0, cs0), rest = ranked[0], ranked[1:]
        slot = int(slots[c0])
        self.policy.access(slot)
        more = tuple((t.read(int(slots[j]), mods, rev), int(dists[j]), cs, f"l1:{int(slots[j])}") for j, cs in rest)
        out[0] = Found(t.read(slot, mods, rev), int(dists[c0]), cs0, f"l1:{slot}", nearest, more=more)
        return out

    def _fused_params(self, check):
        """(check payloads, threshold, cross_modal, per-modality int4 layout) when `_find_fused` decides
        exactly what the general path does: the plain HitCheck (no per-pair points), and payloads, if
        checked, all int4 group-scaled; else None."""
        chk = getattr(check, "inner", check)   # telemetry.TracedCheck traces the L2's choose only
        if not isinstance(chk, HitCheck) or chk.points is not None:
            return None
        codec = chk.codec
        on = chk.payload_check and codec is not None
        key = (on, len(self._modalities), chk.threshold, chk.cross_modal)
        if self._fused_cache is not None and self._fused_cache[0] == key:
            return self._fused_cache[1]
        nm = max(1, len(self._modalities))
        o_vals, length, group = np.zeros(nm, np.int64), np.zeros(nm, np.int64), np.ones(nm, np.int64)
        if on:
            for i, name in enumerate(self._modalities):
                f = codec[name]
                if not (f.kind == "int4" and f.scale == "group" and f.topk is None):
                    return None
                o_vals[i], length[i], group[i] = f.scale_bytes, f.length, f.group_size
        params = (on, float(chk.threshold), bool(chk.cross_modal), o_vals, length, group)
        self._fused_cache = (key, params)
        return params

    def _pick_fused(self, queries, backend, codes: bytes, revision: str, params, now: float):
        """`_pick`'s (chosen, distance, cosine, results, nearest) lists by one `_find_fused` call."""
        on, thr, cross, o_vals, length, group = params
        nq = len(queries)
        t = self.table
        mi = backend._mi
        masks, use = mi.plan(self.observe_radius, len(backend))
        qmod, has_z, qz, _ = _query_columns(queries, self._modalities, _NO_Z, self._zdim)
        # the query words straight from the code bytes where they are whole 64-bit words
        qw = np.frombuffer(codes, "<u8").reshape(nq, mi.nwords) if self.bits % 64 == 0 and _LITTLE else \
            mi.words(np.frombuffer(codes, np.uint8).reshape(nq, self.code_bytes))
        res, ccos, n_rev, n_exp, n_bad = _find_fused(
            qw, mi.codes, mi.by_slot, mi.tail_codes, mi.p2s, mi.n, mi.nbase, mi.offs if use else _NO_OFFS, mi.ids if use else _NO_IDS,
            mi.tc if use else _NO_TC, masks, mi.nchunks,
            int(min(self.observe_radius, self.bits)), use, self.radius, self.config.max_candidates,
            self._current(revision), t.expires, t.modality, t.plen, t.payload, qmod, has_z, qz, float(now), cross,
            on and qz is not _NO_Z, thr, o_vals, length, group)
        if n_rev or n_exp or n_bad:
            m = self.metrics
            if n_rev:
                m.rejections.labels(reason="revision").inc(n_rev)
            if n_exp:
                m.rejections.labels(reason="expired").inc(n_exp)
            if n_bad:
                m.rejections.labels(reason="payload").inc(n_bad)
        chosen, cdist, counts, nearest = res.tolist()
        return chosen, cdist, ccos.tolist(), counts, nearest

    def put(self, tenant: str, e: Entry) -> bool:
        return self.put_many(tenant, [e])[0]

    def put_many(self, tenant: str, entries: list[Entry]) -> list[bool]:
        """Store each entry (of this tier's revision) unless it is larger than the capacity or refused by
        admission; the same (tenant, modality, code, payload, scope) stored again replaces the older entry (a
        later one of the batch replaces an earlier one). One index search finds the entries replaced, one
        index add takes the batch."""
        other = next((e.revision for e in entries if e.revision != self._revision), None)
        if other is not None:  # before any write: a batch is stored whole or not at all
            raise ValueError(f"an entry of revision {other!r} put into the L1 of revision {self._revision!r}")
        cb, pw = self.code_bytes, self.table.payload_bytes
        bad = next((e for e in entries if len(e.code) != cb or len(e.payload) > pw or e.kind not in VALUE_KINDS),
                   None)
        if bad is not None:   # before any write: a slot taken and then refused would be held by nothing
            raise ValueError(f"an entry of a {len(bad.code)}-byte code, a {len(bad.payload)}-byte payload record and "
                             f"value kind {bad.kind!r} put into an L1 of {cb}-byte codes and payload rows of {pw} "
                             f"bytes")
        m = self.metrics
        cap = self.config.capacity_bytes
        out = [False] * len(entries)
        if self.bloom is not None:   # every entry, admitted or not: one L1 refuses (too large, admission) is
            bkey = _bloom_key(tenant)  # still in the L2 the filter guards
            with self.lock:
                for e in entries:
                    self.bloom.add(bkey, e.code)
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
            placed: dict[tuple, int] = {}   # (modality, code, payload, scope) -> slot, for this batch
            placed_key: dict[int, tuple] = {}   # its inverse: a slot of this batch removed (replaced, evicted)
                                                # leaves `placed` at once, as its slot may be reused
            added: dict[int, None] = {}     # slots written by this batch, in order
            exp_at: list[float] = []         # expiry records (expires, slot) of the admitted entries (finite ones kept)
            exp_slots: list[int] = []
            self._tenant_live[ti] += 1      # hold the tenant while the batch evicts
            pending = None                   # a slot written and not yet admitted or refused
            try:
                for j, i in enumerate(fits):
                    e = entries[i]
                    mi = self._modality_id(e.modality)
                    key = (mi, e.code, e.payload, e.scope)
                    old = placed.get(key)
                    if old is None:
                        for s in same_code[lims[j]:lims[j + 1]].tolist():
                            if (t.alive[s] and t.modality[s] == mi and t.code[s].tobytes() == e.code
                                    and t.payload_of(s) == e.payload and t.scope.get(s, b"") == e.scope):
                                old = s
                                break
                    if old is not None and t.alive[old]:
                        self._remove(old, None)  # the same request stored again: replace its value
                        added.pop(old, None)
                        placed.pop(placed_key.pop(old, None), None)
                    slot = pending = t.alloc()
                    t.write(slot, e, ti, mi)
                    self._tenant_live[ti] += 1
                    admitted = True
                    for s in self.policy.insert(slot, e.nbytes):
                        if s == slot:
                            admitted = False
                            m.rejections.labels(reason="admission").inc()
                            self._remove(slot, None)
                        else:
                            self._remove(s, "capacity")
                            added.pop(s, None)
                            placed.pop(placed_key.pop(s, None), None)
                    pending = None
                    if admitted:
                        placed[key] = slot
                        placed_key[slot] = key
                        added[slot] = None
                        exp_at.append(e.expires)
                        exp_slots.append(slot)
                        m.puts.inc()
                        out[i] = True
            finally:   # after a raise: the slot it left half-stored is freed, what was admitted before it
                       # stays findable, and the hold is let go
                if pending is not None:
                    self._remove(pending, None)
                if exp_at:   # pushed together: the same records, popped in the same order, as one by one
                    self._expiry.push_many(exp_at, exp_slots)
                live = np.array([s for s in added if t.alive[s]], np.int64)
                if len(live):
                    backend.add_many(live, t.code[live])
                self._tenant_live[ti] -= 1
                self._drop_tenant_if_empty(ti)
            self._maybe_rebuild_bloom()
            self.update_gauges()
            return out

    def held(self, tenant: str, ident: tuple, slot: int | None = None, l2id: str | None = None) -> dict:
        """The slot -> L2 id (or None) of `slot`, or of the copy of the L2 entry `l2id`, where it still holds the
        entry a lookup of `tenant` served: `ident` = (value kind, value bytes, created or None: not compared),
        as `ushash.serving.cache.api.served_entry` gives them; not another entry that took its place since."""
        kind, value, created = ident
        with self.lock:
            t, ti = self.table, self._tenant_ids.get(tenant)
            if ti is None or kind not in VALUE_KINDS:
                return {}
            k = VALUE_KINDS.index(kind)
            slots = [slot] if slot is not None else [s for s, i in t.l2id.items() if i == l2id]
            return {s: t.l2id.get(s) for s in slots if 0 <= s < len(t.alive) and t.alive[s] and t.tenant[s] == ti
                    and t.kind[s] == k and (created is None or t.created[s] == created) and t.value_of(s) == value}

    def drop(self, tenant: str, ident: tuple, slot: int | None = None, l2id: str | None = None) -> int:
        """Remove what `held` finds (`SemanticCache.drop`); returns how many entries (0 or 1)."""
        with self.lock:
            slots = self.held(tenant, ident, slot, l2id)
            for s in slots:
                self._remove(s, None)
            if slots:
                self.update_gauges()
            return len(slots)

    def forget_copies(self, tenant: str | None = None, l2id: str | None = None) -> int:
        """Remove the copies of L2 entries this tier holds: of entry `l2id` of `tenant` (another replica replaced
        or dropped it), of every entry of `tenant` (`l2id` "*": it deleted the tenant), or every copy of every
        tenant (no tenant: changes may have been missed). Returns how many (counted as
        cache_evictions_total{reason="changed_elsewhere"})."""
        with self.lock:
            self._heard(tenant, l2id)
            t = self.table
            ti = self._tenant_ids.get(tenant) if tenant is not None else None
            if tenant is not None and ti is None:
                return 0
            if tenant is not None and l2id not in (None, "*"):
                slots = list(t.slots_of_l2id.get(l2id, ()))
            else:
                slots = list(t.l2id)
            slots = [s for s in slots if t.alive[s] and (ti is None or t.tenant[s] == ti)]
            for s in slots:
                self._remove(s, "changed_elsewhere")
            if slots:
                self.update_gauges()
            return len(slots)

    #: how long a change is remembered for `promote`: far longer than an L2 lookup takes (its calls time out in
    #: `l2.timeout_s`, 50 ms), short enough that a replica storing thousands of answers a second holds little
    CHANGES_KEPT_S = 5.0

    def note_changes(self, tenant: str, l2ids) -> None:
        """This replica stores or drops these L2 entries now: a lookup that read one before does not copy it over
        (one lock for a batch of stores)."""
        with self.lock:
            for l2id in l2ids:
                self._heard(tenant, l2id)

    def _heard(self, tenant: str | None, l2id: str | None) -> None:
        now = time.monotonic()
        if tenant is None:
            self._all_changed = now
            return
        key = (tenant, "*" if l2id in (None, "*") else l2id)
        self._changes.pop(key, None)
        self._changes[key] = now
        while self._changes and next(iter(self._changes.values())) < now - self.CHANGES_KEPT_S:
            self._changes.popitem(last=False)

    def promote(self, tenant: str, e: Entry, read_at: float) -> bool:
        """Copy an entry a lookup served from the L2 into this tier, unless a change to it (or to every copy) was
        heard or made since `read_at` (time.monotonic() before the L2 was asked): another replica's message can
        arrive, or this replica store the entry again, between the L2's answer and this copy, which would then
        keep the old answer until it expires."""
        with self.lock:
            since = max(self._all_changed, self._changes.get((tenant, e.id), -math.inf),
                        self._changes.get((tenant, "*"), -math.inf))
            if since >= read_at:
                return False
            return self.put(tenant, e)

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
