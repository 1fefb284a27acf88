"""Cache internals that keep lookups cheap and entries small, each against a naive reference: the hits a
batch builds from the L1 columns, the batch metrics, the narrow columns and how they widen at their limit,
and giving freed heap pages back."""

import dataclasses
import math
import random

import numpy as np
import pytest

from ushash.serving.cache import SemanticCache
from ushash.serving.cache.entries import Entry, EntryTable, Hit
from ushash.serving.cache.lsh import LSHHead


class FakeClock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def _entries(rng, n, payload_bytes=6):
    out = []
    for i in range(n):
        kind = ["b", "s", "j"][i % 3]
        value = {"b": bytes(rng.integers(0, 256, int(rng.integers(0, 20)), dtype=np.uint8)),
                 "s": "é" * int(rng.integers(0, 9)), "j": f'{{"i":{i},"x":[1,2.5,null]}}'.encode()}[kind]
        if kind == "s":
            value = value.encode()
        out.append(Entry(code=rng.integers(0, 256, 8, dtype=np.uint8).tobytes(),
                         payload=rng.integers(0, 256, int(rng.integers(0, payload_bytes + 1)), dtype=np.uint8).tobytes(),
                         modality=["image", "text"][i % 2], value=value, kind=kind, revision="r1",
                         created=float(rng.random() * 1e9), expires=math.inf if i % 4 else float(rng.random() * 2e9),
                         compute_s=float(np.float16(rng.random() * 90)), id=None))
    return out


def test_table_holds_compute_seconds_to_three_digits_and_clamps_beyond_float16():
    """The compute seconds column is float16: a value reads back within float16's rounding (relative 2^-11),
    and a compute longer than float16's range reads back as its largest value (65,504 s), finite, not inf
    (XFetch would then refresh on every hit)."""
    t = EntryTable(8)
    mods, rev = ["image"], "r1"
    for cs in (0.0, 0.001234, 0.25, 1.7, 3600.5, 65504.0, 1e6, math.inf):
        s = t.alloc()
        t.write(s, Entry(code=bytes(8), payload=b"", modality="image", value=b"v", kind="b", revision=rev,
                         created=1.0, expires=math.inf, compute_s=cs), tenant=0, modality=0)
        got = t.read(s, mods, rev).compute_s
        assert math.isfinite(got)
        assert got == (65504.0 if cs >= 65504.0 else float(np.float16(cs)))
        assert abs(got - min(cs, 65504.0)) <= 2 ** -11 * min(cs, 65504.0)


def test_table_hits_equal_hit_of_each_entry_read():
    """`EntryTable.hits` (a batch's hits straight from the columns) is `Hit.of(read(slot), ...)` field for
    field, for one slot and for many, NaN cosines as None, with each entry's compute seconds."""
    rng = np.random.default_rng(0)
    t = EntryTable(8, payload_bytes=6)
    mods, rev = ["image", "text"], "r1"
    es = _entries(rng, 40)
    slots = []
    for e in es:
        s = t.alloc()
        t.write(s, e, tenant=0, modality=mods.index(e.modality))
        slots.append(s)
    for pick in ([slots[7]], slots[::3], list(reversed(slots))):
        dists = [int(d) for d in rng.integers(0, 9, len(pick))]
        cos = [float("nan") if k % 2 else float(np.float32(rng.random())) for k in range(len(pick))]
        got, cs = t.hits(pick, dists, cos, "l1", mods, rev)
        want = [Hit.of(t.read(s, mods, rev), d, None if c != c else c, "l1", False, f"l1:{s}")
                for s, d, c in zip(pick, dists, cos)]
        assert got == want
        assert [type(getattr(h, f)) for h in got for f in ("distance", "created", "expires")] == \
               [type(getattr(h, f)) for h in want for f in ("distance", "created", "expires")]
        assert cs == [t.read(s, mods, rev).compute_s for s in pick]


def test_value_offsets_widen_at_their_limit():
    """Value offsets are uint32 until the arena passes VOFF_LIMIT bytes, then int64; entries read back the
    same either side of the switch, through compaction too."""
    rng = np.random.default_rng(1)
    small, ref = EntryTable(8, payload_bytes=6), EntryTable(8, payload_bytes=6)
    small.VOFF_LIMIT = 300
    assert small.voff.dtype == np.uint32
    live = {}
    for step, e in enumerate(_entries(rng, 120)):
        for t in (small, ref):
            s = t.alloc()
            t.write(s, e, tenant=0, modality=0)
        live[s] = e
        if step % 3 == 2:   # removals make garbage, and the arena compacts
            gone = int(rng.choice(list(live)))
            small.release(gone), ref.release(gone)
            del live[gone]
    assert small.voff.dtype == np.int64 and ref.voff.dtype == np.uint32
    for s, e in live.items():
        assert small.value_of(s) == ref.value_of(s) == e.value


def test_narrow_columns_widen_before_a_value_they_cannot_hold():
    """Tenant and modality ids and value lengths start in one byte; the write that needs more widens the
    column first (never a wrapped value), and every entry reads back as written, through compaction too.
    The payload length column is as wide as the rows; a negative id or a second revision is refused."""
    rng = np.random.default_rng(3)
    t = EntryTable(8, payload_bytes=6)
    assert (t.tenant.dtype, t.modality.dtype, t.vlen.dtype, t.plen.dtype) == (np.uint8, np.int8, np.uint8, np.uint8)
    assert EntryTable(8, payload_bytes=300).plen.dtype == np.uint16
    live = {}
    for i, e in enumerate(_entries(rng, 400)):
        if i == 300:
            e = dataclasses.replace(e, value=bytes(70_000))   # past uint16
        elif i % 7 == 0:
            e = dataclasses.replace(e, value=bytes(rng.integers(0, 256, 300, dtype=np.uint8)))   # past uint8
        ten, mod = i * 997, i % 200   # tenant ids past uint16, modality ids past int8
        s = t.alloc()
        t.write(s, e, tenant=ten, modality=mod)
        live[s] = (e, ten, mod)
        if i % 3 == 2:
            gone = int(rng.choice(list(live)))
            t.release(gone)
            del live[gone]
    assert (t.tenant.dtype, t.modality.dtype, t.vlen.dtype) == (np.uint32, np.int16, np.uint32)
    mods, rev = [f"m{k}" for k in range(200)], "r1"
    for s, (e, ten, mod) in live.items():
        assert (int(t.tenant[s]), int(t.modality[s])) == (ten, mod)
        assert t.read(s, mods, rev) == dataclasses.replace(e, modality=mods[mod])
    for bad in ({"tenant": -1, "modality": 0}, {"tenant": 0, "modality": -1}):
        with pytest.raises(ValueError, match=">= 0"):
            t.write(t.alloc(), e, **bad)


def test_an_l1_refuses_a_batch_holding_an_entry_of_another_revision_before_writing_any():
    """An L1 holds one revision (the entries' is not stored): a batch with an entry of another revision is
    refused with its name, and none of the batch is stored (not the entries before it either)."""
    c = SemanticCache(LSHHead({"image": 8}, bits=64, dim=8, seed=0), {"bloom": False}, clock=FakeClock())
    rev = c.revision
    good = [dataclasses.replace(e, modality="image", payload=b"", revision=rev)
            for e in _entries(np.random.default_rng(5), 3)]
    with pytest.raises(ValueError, match="revision 'old'"):
        c.l1.put_many("t", [good[0], dataclasses.replace(good[1], revision="old"), good[2]])
    assert len(c) == 0
    assert c.l1.put_many("t", good) == [True, True, True] and len(c) == 3
    assert {c.table.read(s, ["image"], rev).revision for s in c.table.live_slots().tolist()} == {rev}


def test_an_l1_batch_that_raises_midway_lets_go_of_its_tenant_and_keeps_what_it_admitted_findable():
    from ushash.serving.cache.request import Query

    """A raise inside put_many (here the eviction policy's, at the batch's third entry) used to leave the
    tenant held forever (never dropped when emptied) and the entries admitted before it out of the index."""
    c = SemanticCache(LSHHead({"image": 8}, bits=64, dim=8, seed=0), {"bloom": False}, clock=FakeClock())
    rev = c.revision
    batch = [dataclasses.replace(e, modality="image", payload=b"", revision=rev, expires=math.inf)
             for e in _entries(np.random.default_rng(9), 4)]
    insert, calls = c.l1.policy.insert, []

    def failing(slot, nbytes):
        calls.append(slot)
        if len(calls) == 3:
            raise MemoryError("policy")
        return insert(slot, nbytes)

    c.l1.policy.insert = failing
    with pytest.raises(MemoryError):
        c.l1.put_many("t", batch)
    c.l1.policy.insert = insert
    ti = c.l1._tenant_ids["t"]
    assert c.l1._tenant_live[ti] == 2 and len(c) == 2   # the two admitted; the slot it raised at is freed
    for e in batch[:2]:
        q = Query(modality="image", code=e.code, z=None)
        assert c.l1.find(q, "t", rev, c.hit_check, c.clock(), 1).entry.value == e.value
    assert c.delete_tenant("t") == 2 and "t" not in c.l1._tenant_ids   # emptied: the tenant is dropped


def test_a_scope_that_is_not_bytes_is_refused():
    """bytes(5) is five zero bytes: an int scope would silently file the answer in another scope."""
    c = SemanticCache(LSHHead({"image": 8}, bits=64, dim=8, seed=0), {"bloom": False}, clock=FakeClock())
    q = c.query("image", None, np.ones(8, np.float32))
    with pytest.raises(TypeError, match="scope is bytes.*got int 5"):
        c.store_query(q, "v", scope=5)
    assert len(c) == 0 and c.store_query(q, "v", scope=b"\x05")


def test_expiry_records_drop_only_the_entry_they_were_made_for():
    """An expiry record names (expires, slot): a slot reused by a later entry keeps that entry until its own
    expiry, however many records of earlier entries of the slot come due before it."""
    clock = FakeClock(1000.0)
    c = SemanticCache(LSHHead({"image": 8}, bits=64, dim=8, seed=0),
                      {"ttl_s": 10, "ttl_jitter": 0.0, "bloom": False, "xfetch_beta": 0.0}, clock=clock)
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 256, size=(3, 8), dtype=np.uint8)
    c.store_codes("t", "image", codes[:1], ["a"])          # slot 0, expires 1010
    c.delete_tenant("t")                                    # its record stays in the heap
    clock.t = 1005.0
    c.store_codes("t", "image", codes[1:2], ["b"])         # slot 0 again, expires 1015
    assert c.table.live_slots().tolist() == [0]
    clock.t = 1011.0
    assert c.lookup(c.query_from_code("image", codes[1]), "t").value == "b"
    clock.t = 1015.0
    assert c.lookup(c.query_from_code("image", codes[1]), "t") is None and len(c) == 0


def test_expiry_heap_pops_what_heapq_pops():
    """The array heap against heapq on (expires, slot) tuples, seeded: the same records come due in the same
    order (equal expiries by slot, repeated records included), infinite expiries are never held, and
    replace keeps exactly the records it is given."""
    import heapq

    from ushash.serving.cache.freshness import ExpiryHeap

    rng = np.random.default_rng(0)
    popped = 0
    for _ in range(100):
        h, ref = ExpiryHeap(), []
        for _ in range(300):
            r = rng.random()
            if r < 0.6:
                k = int(rng.integers(1, 6))
                e = rng.integers(0, 20, k).astype(float)   # few distinct expiries and slots: many ties
                e[rng.random(k) < 0.1] = math.inf
                s = rng.integers(0, 8, k)
                h.push_many(e, s)
                for a, b in zip(e.tolist(), s.tolist()):
                    if math.isfinite(a):
                        heapq.heappush(ref, (a, b))
            elif r < 0.95:
                now = float(rng.integers(0, 20))
                want = []
                while ref and ref[0][0] <= now:
                    e, s = heapq.heappop(ref)
                    want.append((s, e))
                assert list(h.due(now)) == want
                popped += len(want)
            else:
                keep = [x for x in ref if x[1] % 2 == 0]
                h.replace([x[0] for x in keep] + [math.inf], [x[1] for x in keep] + [3])
                ref = keep
                heapq.heapify(ref)
            assert len(h) == len(ref)
    assert popped > 1000
    with pytest.raises(ValueError, match="slots"):
        ExpiryHeap().push_many([1.0], [1 << 31])


def test_wtinylfu_sizes_widen_at_their_limit():
    """Entry sizes are held as uint16 until one reaches its limit, then as uint32, then as int64 (one
    insert may skip a step): the evictions are those of a policy that held int64 sizes from the start."""
    from ushash.serving.cache.policies.wtinylfu import WTinyLFU

    assert WTinyLFU(5000)._size.dtype == np.uint16
    for limits, sizes, dtypes in ((((np.uint16, 100), (np.uint32, 150), (np.int64, None)), (100, 150, 200),
                                   (np.uint16, np.uint32, np.int64)),
                                  (((np.uint16, 100), (np.uint32, 150), (np.int64, None)), (100, 100, 200),
                                   (np.uint16, np.uint16, np.int64))):
        rng = np.random.default_rng(2)
        a, b = WTinyLFU(5000, window=0.05), WTinyLFU(5000, window=0.05)
        a.SIZE_DTYPES = limits
        b._size = b._size.astype(np.int64)
        for phase, top in enumerate(sizes):
            for step in range(1500):
                k = int(rng.integers(0, 200))
                if rng.random() < 0.4:
                    size = int(rng.integers(1, top))
                    assert [int(x) for x in a.insert(k, size)] == [int(x) for x in b.insert(k, size)]
                else:
                    a.access(k), b.access(k)
            assert a._size.dtype == dtypes[phase]
        np.testing.assert_array_equal(a._size, b._size)
        assert a.used_bytes == b.used_bytes <= 5000
    c = WTinyLFU(5000)
    c.SIZE_DTYPES = ((np.uint16, 100), (np.uint32, 150), (np.int64, None))
    c.insert(0, 50), c.insert(1, 180)   # past both limits at once
    assert c._size.dtype == np.int64 and c._size[:2].tolist() == [50, 180]


def test_batch_metrics_equal_one_record_per_lookup():
    """`record_many` (a batch's outcomes counted per distinct value) leaves the same counts and sums as
    `record` of each lookup, with one tier for all and with a tier per lookup."""
    from ushash.serving.cache.telemetry import _LookupStats

    rng = np.random.default_rng(3)
    for one_tier in (True, False):
        a, b = _LookupStats(64), _LookupStats(64)
        for _ in range(20):
            n = int(rng.integers(2, 60))
            hits = [object() if rng.random() < 0.5 else None for _ in range(n)]
            tiers = "l1" if one_tier else [str(rng.choice(["l1", "l2"])) for _ in range(n)]
            nearest = [int(d) for d in rng.integers(0, 66, n)]
            seconds = float(rng.random() * 1e-3)
            a.record_many(hits, tiers, nearest, seconds)
            for i in range(n):
                b.record(hits[i] is not None, tiers if one_tier else tiers[i], nearest[i], seconds)
        assert (a.gets, a.hits, a.lat, a.lat_sum, a.dist, a.dist_sum) == (b.gets, b.hits, b.lat, b.lat_sum, b.dist,
                                                                          b.dist_sum)


@pytest.mark.parametrize("backend", ["mindex", "flat"])
def test_hits_many_equal_find_many(backend):
    """L1's `hits_many` (what lookups serve) and `find_many` (a tier's Found answers) come from one pick:
    the same entry, distance, cosine and nearest distance for every query, hits and misses alike."""
    head = LSHHead({"image": 24, "text": 24}, bits=64, dim=32, aligned=True, seed=0)
    clock = FakeClock()
    cfg = {"radius": 4, "observe_radius": 6, "backend": backend, "mih_min_entries": 64, "ttl_s": 30}
    a, b = (SemanticCache(head, cfg, clock=clock, rng=random.Random(0)) for _ in range(2))
    rng = np.random.default_rng(4)
    centres = rng.integers(0, 256, size=(6, 8), dtype=np.uint8)
    qs = []
    for i in range(300):
        code = centres[i % 6].copy()
        for bit in rng.integers(0, 64, int(rng.integers(0, 5))):
            code[bit // 8] ^= np.uint8(1 << (bit % 8))
        z = rng.normal(size=32).astype(np.float32)
        qs.append(a.query_from_code(["image", "text"][i % 2], code, None if i % 7 == 0 else z))
    for c in (a, b):
        c.store_many(qs[:150], [f"v{i}" for i in range(150)])
    clock.t += 10
    probe = qs[100:300]
    hits, nearest, _, hit_idx, _ = a.l1.hits_many(probe, "default", a.revision, a.hit_check, clock.t)
    found = b.l1.find_many(probe, "default", b.revision, b.hit_check, clock.t)
    assert hit_idx == [i for i, f in enumerate(found) if f.entry is not None] and hit_idx
    assert hits == [Hit.of(f.entry, f.distance, f.cosine, "l1", False, f.ref) if f.entry is not None else None
                    for f in found]
    assert nearest == [-1 if f.nearest is None else f.nearest for f in found]


def test_mindex_tables_hold_eight_bytes_per_code_and_chunk():
    """A table run holds a position (int32) and 32 more bits of the code (uint32), and nothing else."""
    from ushash.serving.cache.mindex import MultiIndex

    mi = MultiIndex(64, min_entries=16, tail_max=16)
    codes = np.random.default_rng(5).integers(0, 256, size=(1000, 8), dtype=np.uint8)
    mi.append(np.arange(1000), mi.words(codes))
    mi.merge()
    assert (mi.ids.dtype, mi.tc.dtype) == (np.int32, np.uint32)
    assert not hasattr(mi, "th")
    assert mi.nbytes == mi._codes.nbytes + mi.p2s.nbytes + mi.offs.nbytes + 8 * mi.nchunks * mi.ids.shape[1]


def test_freed_large_arrays_give_heap_pages_back():
    """Growing a column past TRIM_MIN_BYTES trims the heap once per growth; small columns never do."""
    from ushash.serving.cache import heap

    if heap._TRIM is None:
        pytest.skip("no malloc_trim in this C library")
    t = EntryTable(8, payload_bytes=0)
    e = Entry(code=bytes(8), payload=b"", modality="image", value=b"x", kind="b", revision="r", created=0.0,
              expires=math.inf, compute_s=0.0)
    n0 = heap.trims
    for _ in range(1000):
        t.write(t.alloc(), e, 0, 0)
    assert heap.trims == n0   # columns of ~60 KB
    old = heap.TRIM_MIN_BYTES
    heap.TRIM_MIN_BYTES = 4096
    try:
        cap = t._cap
        while t._cap == cap:
            t.write(t.alloc(), e, 0, 0)
        assert heap.trims == n0 + 1
    finally:
        heap.TRIM_MIN_BYTES = old


def test_large_zeros_have_pages_of_their_own():
    """heap.zeros is np.zeros: large arrays in an anonymous mapping (writable, zero, page-aligned, freed
    with the array), small ones as numpy makes them."""
    import mmap

    from ushash.serving.cache import heap

    small = heap.zeros((10, 3), np.uint16)
    assert small.base is None and small.shape == (10, 3) and small.dtype == np.uint16 and not small.any()
    big = heap.zeros((4, heap.MMAP_MIN_BYTES // 8), np.uint32)
    base = big
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    assert isinstance(base, mmap.mmap) and big.ctypes.data % mmap.PAGESIZE == 0
    assert big.shape == (4, heap.MMAP_MIN_BYTES // 8) and big.dtype == np.uint32 and big.flags.c_contiguous
    assert big.flags.writeable and not big.any()
    big[3, -1] = 7
    assert int(big.sum()) == 7 and heap.zeros(heap.MMAP_MIN_BYTES, np.uint8).shape == (heap.MMAP_MIN_BYTES,)


def test_query_columns_equal_stacked_rows():
    """A batch's query columns (modality ids, has z, z rows with zeros where there is none, the names the ids
    index) are those of the naive per-query construction with np.stack, dtypes included; a modality the tier
    holds none of gets its own id past the tier's, named."""
    from ushash.serving.cache.l1 import _query_columns
    from ushash.serving.cache.request import Query

    rng = np.random.default_rng(6)
    for none_every in (1, 3, 10 ** 9):
        qs = [Query(str(rng.choice(["image", "text", "audio"])), bytes(8),
                    None if i % none_every == 0 else rng.normal(size=16).astype(np.float32)) for i in range(50)]
        mods = ["image", "text"]
        qmod, has_z, qz, names = _query_columns(qs, mods, "none")
        assert names[:2] == mods and sorted(names[2:]) == (["audio"] if any(q.modality == "audio" for q in qs) else [])
        assert qmod.dtype == np.int64 and [names[i] for i in qmod.tolist()] == [q.modality for q in qs]
        one = _query_columns(qs[:1], mods, "none")
        assert one[3][one[0][0]] == qs[0].modality
        assert has_z.tolist() == [q.z is not None for q in qs]
        if not has_z.any():
            assert qz == "none"
            continue
        ref = np.stack([q.z if q.z is not None else np.zeros(16, np.float32) for q in qs])
        assert qz.dtype == ref.dtype and qz.shape == ref.shape and np.array_equal(qz, ref)


def test_l1_policy_idents_from_the_table_equal_idents_given_at_insert():
    """The L1 binds W-TinyLFU's idents to its entry table (nothing held per entry for them): a cache's
    admissions and evictions are exactly those of one whose policy is given `request_ident(code, tenant)`
    of the entry at insert and holds it, under a seeded stream of stores (requests recurring, stored
    again, across tenants, one of them deleted and its id reused) and lookups."""
    from ushash.serving.cache.policies.wtinylfu import request_ident

    clock = FakeClock()
    cfg = {"capacity_bytes": 4000, "policy": "wtinylfu", "policy_options": {"window": 0.05}, "bloom": False,
           "ttl_s": 1e9, "ttl_jitter": 0.0, "xfetch_beta": 0.0, "radius": 0}
    head = LSHHead({"image": 8}, bits=64, dim=8, seed=0)
    a, b = (SemanticCache(head, cfg, clock=clock, rng=random.Random(0)) for _ in range(2))
    assert a.l1.policy._ident is None
    pol = b.l1.policy
    pol._rows, pol._ident = None, np.zeros(len(pol._seg), np.uint64)    # held idents, as given at insert
    insert = pol.insert

    refused, admitted = [0], [0]

    def insert_with_ident(slot, nbytes, ident=None):
        t = b.table
        window = set(np.flatnonzero(pol._seg == 1).tolist()) | {slot}   # candidates come from here
        out = insert(slot, nbytes, request_ident(t.code[slot].tobytes(), int(t.tenant[slot])))
        refused[0] += sum(int(s) in window for s in out)
        admitted[0] += sum(int(s) not in window for s in out)
        return out

    pol.insert = insert_with_ident
    rng = np.random.default_rng(8)
    pool = rng.integers(0, 256, size=(300, 8), dtype=np.uint8)
    tenants = ["t0", "t1", "t2"]
    stored = 0
    for step in range(1500):
        tenant = tenants[int(rng.integers(0, 3))]
        idx = rng.integers(0, len(pool), int(rng.integers(1, 6)))
        if rng.random() < 0.5:
            values = [f"v{step}-{int(i)}" for i in idx]
            na, nb = (c.store_codes(tenant, "image", pool[idx], values) for c in (a, b))
            assert na == nb
            stored += na
        else:
            qa, qb = ([c.query_from_code("image", pool[i]) for i in idx] for c in (a, b))
            ha, hb = a.lookup_many(qa, tenant), b.lookup_many(qb, tenant)
            assert [h.value if h else None for h in ha] == [h.value if h else None for h in hb]
        if step == 700:
            assert a.delete_tenant("t1") == b.delete_tenant("t1")
        if step % 100 == 0:
            assert a.table.live_slots().tolist() == b.table.live_slots().tolist()
            for name in ("_prev", "_next", "_seg", "_size", "_head", "_tail", "_bytes"):
                np.testing.assert_array_equal(getattr(a.l1.policy, name), getattr(pol, name), err_msg=name)
            np.testing.assert_array_equal(a.l1.policy.sketch.table, pol.sketch.table)
    ev_a, ev_b = (c.metrics.evictions.labels(reason="capacity")._value.get() for c in (a, b))
    assert ev_a == ev_b > 100
    assert refused[0] > 100 and admitted[0] > 100, (refused, admitted)   # the sketch decided both ways
    assert a.table.live_slots().tolist() == b.table.live_slots().tolist() and stored > 1000
