"""The cache against naive models (plain dicts and lists) on seeded random operation sequences: the L1 end to
end (byte-capacity LRU eviction, TTL expiry on a fake clock, tenants, same-request replacement inside a batch,
and the counters: entries, bytes, puts, evictions by reason, hits and misses, nearest distances), the L1 under
every policy, the L1 with Redis behind it, W-TinyLFU's segments, QoS eviction, hot-key counts; and hostile
requests (codes and z that are not what they claim to be) refused rather than served another request's answer."""

import numpy as np
import pytest

from ushash.serving.cache import SemanticCache
from ushash.serving.cache.lsh import LSHHead


class FakeClock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def _head():
    return LSHHead({"text": 16, "image": 16}, bits=64, dim=32, aligned=True, seed=0)


def _popcount(a: bytes, b: bytes) -> int:
    return bin(int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).count("1")


class Model:
    """LRU over bytes (the least recently stored or hit entry goes first), absolute expiries, one entry per
    (tenant, modality, code, scope); a lookup serves the tenant's nearest live entry within the radius."""

    def __init__(self, cap, radius):
        self.cap, self.radius = cap, radius
        self.entries: dict[tuple, dict] = {}   # key -> {value, nbytes, expires}; insertion order = LRU order
        self.evicted = {"capacity": 0, "expired": 0}
        self.puts = 0

    def expire(self, now):
        for k in [k for k, e in self.entries.items() if e["expires"] <= now]:
            del self.entries[k]
            self.evicted["expired"] += 1

    def used(self):
        return sum(e["nbytes"] for e in self.entries.values())

    def put(self, key, value, nbytes, expires):
        if nbytes > self.cap:
            return False
        self.entries.pop(key, None)
        while self.used() + nbytes > self.cap:
            del self.entries[next(iter(self.entries))]
            self.evicted["capacity"] += 1
        self.entries[key] = {"value": value, "nbytes": nbytes, "expires": expires}
        self.puts += 1
        return True

    def candidates(self, tenant, code):
        """The keys a lookup may serve: the tenant's entries at the smallest distance within the radius."""
        ds = {k: _popcount(k[2], code) for k in self.entries if k[0] == tenant}
        ds = {k: d for k, d in ds.items() if d <= self.radius}
        if not ds:
            return []
        m = min(ds.values())
        return [k for k, d in ds.items() if d == m]

    def touch(self, key):
        self.entries[key] = self.entries.pop(key)


def _codes(rng, n_base=6, n=40):
    base = rng.integers(0, 256, size=(n_base, 8), dtype=np.uint8)
    out = []
    for _ in range(n):
        c = base[rng.integers(n_base)].copy()
        for b in rng.integers(0, 64, size=rng.integers(0, 4)):
            c[b // 8] ^= np.uint8(1 << (b % 8))
        out.append(c.tobytes())
    return sorted(set(out))


def _replay(seed, n_ops=300, backend="mindex", n_codes=40, caps=(60, 400), radii=(0, 4), batch=7):
    rng = np.random.default_rng(seed)
    clock = FakeClock()
    radius = int(rng.integers(*radii))
    cap = int(rng.integers(*caps))
    observe = radius + int(rng.integers(0, 4))
    cache = SemanticCache(_head(), {"radius": radius, "observe_radius": observe, "payload_check": False,
                                    "capacity_bytes": cap, "policy": "lru", "ttl_s": 0, "ttl_jitter": 0.0,
                                    "xfetch_beta": 0.0, "backend": backend, "mih_min_entries": 8}, clock=clock)
    model = Model(cap, radius)
    dist_sum = {"hit": 0, "miss": 0}   # the nearest-distance histogram's sums: a hit's distance; a miss's nearest
                                       # entry within observe_radius, or bits + 1
    codes = _codes(rng, n=n_codes)
    tenants = ["a", "B.b-1", "x_" + "y" * 60]
    scopes = [b"", b"s1"]
    serial = 0
    hits = misses = 0
    for _ in range(n_ops):
        clock.t += float(rng.choice([0.0, 0.5, 3.0]))
        now = clock.t
        op = rng.random()
        tenant = tenants[rng.integers(len(tenants))]
        if op < 0.45:   # a batch of stores, repeats of one request among them
            b = int(rng.integers(1, batch))
            ttl = [None, 2.0, 10.0][rng.integers(3)]
            qs, vals, scs = [], [], []
            for _ in range(b):
                code = codes[rng.integers(len(codes))]
                mod = ["text", "image"][rng.integers(2)]
                qs.append(cache.query_from_code(mod, np.frombuffer(code, np.uint8)))
                serial += 1
                vals.append("v" * int(rng.integers(0, 120)) + str(serial))
                scs.append(scopes[rng.integers(2)])
            got = cache.store_many(qs, vals, tenant, ttl_s=ttl, scopes=scs)
            nb = [8 + len(v) + len(s) for v, s in zip(vals, scs)]
            if any(n <= cap for n in nb):
                model.expire(now)
            want = [model.put((tenant, q.modality, q.code, s), v, n, now + ttl if ttl else np.inf)
                    for q, v, s, n in zip(qs, vals, scs, nb)]
            assert got == want
        elif op < 0.95:   # a batch of lookups
            b = int(rng.integers(1, 5))
            qcodes = [codes[rng.integers(len(codes))] for _ in range(b)]
            qs = [cache.query_from_code("text", np.frombuffer(c, np.uint8)) for c in qcodes]
            model.expire(now)
            res = cache.lookup_many(qs, tenant)
            for c, h in zip(qcodes, res):
                cands = model.candidates(tenant, c)
                if not cands:
                    assert h is None
                    misses += 1
                    near = [_popcount(k[2], c) for k in model.entries if k[0] == tenant]
                    near = [d for d in near if d <= observe]
                    dist_sum["miss"] += min(near) if near else 65
                    continue
                dist_sum["hit"] += _popcount(cands[0][2], c)
                assert h is not None
                served = [k for k in cands if model.entries[k]["value"] == h.value]
                assert len(served) == 1, (h.value, cands)
                assert h.distance == _popcount(served[0][2], c) and h.modality == served[0][1]
                assert h.expires > now
                hits += 1
            for c, h in zip(qcodes, res):   # the policy is told of the hits in query order
                if h is not None:
                    model.touch(next(k for k in model.entries if model.entries[k]["value"] == h.value))
        else:
            n = cache.delete_tenant(tenant)
            gone = [k for k in model.entries if k[0] == tenant]
            assert n == len(gone)
            for k in gone:
                del model.entries[k]
        assert len(cache) == len(model.entries)
        assert cache.policy.used_bytes == model.used()
        m = cache.metrics
        assert m.value("cache_entries") == len(model.entries)
        assert m.value("cache_puts_total") == model.puts
        for reason, n in model.evicted.items():
            assert m.value("cache_evictions_total", reason=reason) == n, reason
        assert m.value("cache_gets_total", result="hit") == hits
        assert m.value("cache_gets_total", result="miss") == misses
        for res in ("hit", "miss"):
            assert m.value("cache_nearest_hamming_distance_sum", result=res) == dist_sum[res], res
    return hits, misses


@pytest.mark.parametrize("seed", range(12))
def test_l1_matches_a_naive_lru_ttl_tenant_model(seed):
    hits, misses = _replay(seed)
    assert hits and misses


def test_l1_matches_the_model_with_many_entries_through_index_tables_merges_and_renumbering():
    """Thousands of entries in few tenants: the own index builds its tables, merges its tail and renumbers
    after removals (replacements, expiry, capacity, deleted tenants), reading the codes from the entry table
    by slot while slots are freed and reused."""
    for seed in range(2):
        _replay(200 + seed, n_ops=250, n_codes=3000, caps=(20_000, 60_000), radii=(0, 9), batch=120)


@pytest.mark.parametrize("backend", ["flat", "torch"])
def test_l1_matches_the_model_on_other_backends(backend):
    if backend == "torch":
        pytest.importorskip("torch")
    for seed in range(3):
        _replay(100 + seed, backend=backend)


def test_a_batch_storing_a_request_again_after_its_slot_was_reused_keeps_the_other_entry():
    """A batch [A, B, C, D, A'] in room for two entries: C evicts A, D reuses A's slot, then A' must replace
    nothing but evict the least recent (C), not D, which sat in A's old slot."""
    clock = FakeClock()
    cache = SemanticCache(_head(), {"radius": 0, "payload_check": False, "capacity_bytes": 20, "policy": "lru",
                                    "ttl_s": 0}, clock=clock)
    q = [cache.query_from_code("text", np.full(8, i, np.uint8)) for i in range(4)]
    assert cache.store_many([q[0], q[1], q[2], q[3], q[0]], ["a0", "b0", "c0", "d0", "a1"]) == [True] * 5
    assert [h and h.value for h in cache.lookup_many(q)] == ["a1", None, None, "d0"]
    assert cache.metrics.value("cache_evictions_total", reason="capacity") == 3


def test_a_lookup_that_sweeps_expired_entries_updates_the_entry_and_byte_gauges():
    clock = FakeClock()
    cache = SemanticCache(_head(), {"radius": 0, "payload_check": False, "ttl_s": 10, "ttl_jitter": 0.0}, clock=clock)
    q = cache.query_from_code("text", np.arange(8, dtype=np.uint8))
    cache.store(q, "v")
    assert cache.metrics.value("cache_entries") == 1 and cache.metrics.value("cache_size_bytes") == 9
    clock.t += 10
    assert cache.lookup(q) is None
    assert cache.metrics.value("cache_evictions_total", reason="expired") == 1
    assert cache.metrics.value("cache_entries") == 0 and cache.metrics.value("cache_size_bytes") == 0


class WTinyLFUModel:
    """W-TinyLFU as its docstring states it, on plain lists (index 0: the LRU end); the frequencies from a
    sketch of its own, fed the same increments (the sketch itself is checked against a naive one in
    test_cache_policy.py)."""

    def __init__(self, cap, window=0.01, protected=0.8):
        from ushash.serving.cache.policies.wtinylfu import _Sketch

        self.cap = cap
        self.window_bytes = max(1, int(cap * window))
        self.protected_bytes = max(1, int((cap - self.window_bytes) * protected))
        self.seg = {"w": [], "p": [], "q": []}   # window, probation, protected
        self.size, self.ident = {}, {}
        self.sketch = _Sketch()

    def bytes(self, s):
        return sum(self.size[k] for k in self.seg[s])

    def used(self):
        return sum(self.size.values())

    def where(self, k):
        return next((s for s, ks in self.seg.items() if k in ks), None)

    def remove(self, k):
        s = self.where(k)
        if s is not None:
            self.seg[s].remove(k)
            del self.size[k]

    def insert(self, k, nb, ident):
        if nb > self.cap:
            return [k]
        self.remove(k)
        self.size[k], self.ident[k] = nb, (k if ident is None else ident)
        self.sketch.ensure(len(self.size))
        self.sketch.increment(self.ident[k])
        self.seg["w"].append(k)
        cands = []
        while self.bytes("w") > self.window_bytes and self.seg["w"]:
            c = self.seg["w"].pop(0)
            self.seg["p"].append(c)
            cands.append(c)
        out = []
        while self.used() > self.cap:
            victim = next(self.seg[s][0] for s in ("p", "q", "w") if self.seg[s])
            live = [c for c in cands if c in self.seg["p"]]
            cand = live[0] if live else None
            if cand is None or cand == victim:
                drop = victim
            elif self.sketch.frequency(self.ident[cand]) > self.sketch.frequency(self.ident[victim]):
                drop = victim
            else:
                drop = cand
                cands.remove(cand)
            self.remove(drop)
            out.append(drop)
        return out

    def access(self, k):
        s = self.where(k)
        if s is None:
            return
        self.sketch.increment(self.ident[k])
        self.seg[s].remove(k)
        if s == "w":
            self.seg["w"].append(k)
            return
        self.seg["q"].append(k)
        while self.bytes("q") > self.protected_bytes and self.seg["q"][0] != k:
            self.seg["p"].append(self.seg["q"].pop(0))


@pytest.mark.parametrize("seed", range(6))
def test_wtinylfu_matches_a_list_model(seed):
    from ushash.serving.cache.policies.wtinylfu import WTinyLFU

    rng = np.random.default_rng(seed)
    big = seed % 3 == 2   # sizes beyond uint16: the size column widens
    cap = int(rng.integers(500, 5000)) if not big else 400_000
    window = float(rng.choice([0.01, 0.1, 0.3]))
    pol, ref = WTinyLFU(cap, window=window), WTinyLFUModel(cap, window=window)
    keys = int(rng.integers(20, 200))
    for _ in range(2500):
        r = rng.random()
        k = int(rng.zipf(1.2) % keys)
        if r < 0.4:
            nb = int(rng.integers(1, cap // 4)) if not big else int(rng.choice([5, 70_000, 200, 500_000]))
            ident = None if rng.random() < 0.5 else int(rng.integers(0, 50))
            assert [int(x) for x in pol.insert(k, nb, ident)] == ref.insert(k, nb, ident)
        elif r < 0.9:
            ks = [k] + [int(rng.zipf(1.2) % keys) for _ in range(int(rng.integers(0, 3)))]
            pol.access_many(ks)
            for kk in ks:
                ref.access(kk)
        else:
            pol.remove(k), ref.remove(k)
        assert pol.used_bytes == ref.used() <= cap
        assert len(pol) == len(ref.size)
    for s, seg in (("w", 1), ("p", 2), ("q", 3)):   # the same lists, LRU to MRU
        got, k = [], int(pol._head[seg])
        while k >= 0:
            got.append(k)
            k = int(pol._next[k])
        assert got == ref.seg[s], s


def _held(cache):
    """The L1's live entries as {(tenant, modality, code, scope): (value, expires)}."""
    l1, t = cache.l1, cache.table
    out = {}
    for s in t.live_slots().tolist():
        key = (l1._tenant_names[int(t.tenant[s])], l1._modalities[int(t.modality[s])], t.code[s].tobytes(),
               t.scope.get(s, b""))
        assert key not in out, "two live entries of one request"
        out[key] = (t.decoded_value(s), float(t.expires[s]))
    return out


@pytest.mark.parametrize("policy", ["wtinylfu", "lruk", "lfu"])
@pytest.mark.parametrize("seed", range(3))
def test_l1_under_any_policy_holds_only_each_requests_latest_value_and_serves_the_nearest(policy, seed):
    """Whatever a policy evicts: every held entry is its request's latest stored value, unexpired, of its own
    tenant; the byte count is the held entries'; a lookup serves one of the nearest held entries of its
    tenant within the radius, and misses only when there is none."""
    rng = np.random.default_rng(seed)
    clock = FakeClock()
    radius, cap = int(rng.integers(0, 4)), int(rng.integers(100, 600))
    cache = SemanticCache(_head(), {"radius": radius, "payload_check": False, "capacity_bytes": cap, "policy": policy,
                                    "ttl_s": 0, "ttl_jitter": 0.0, "xfetch_beta": 0.0, "mih_min_entries": 8},
                          clock=clock)
    codes = _codes(rng)
    tenants = ["a", "b"]
    latest: dict[tuple, str] = {}
    serial = 0
    for _ in range(300):
        clock.t += float(rng.choice([0.0, 0.5, 3.0]))
        now = clock.t
        tenant = tenants[rng.integers(2)]
        if rng.random() < 0.5:
            qs, vals, scs = [], [], []
            ttl = [None, 2.0, 10.0][rng.integers(3)]
            for _ in range(int(rng.integers(1, 7))):
                code = codes[rng.integers(len(codes))]
                qs.append(cache.query_from_code(["text", "image"][rng.integers(2)], np.frombuffer(code, np.uint8)))
                serial += 1
                vals.append("v" * int(rng.integers(0, 60)) + str(serial))
                scs.append([b"", b"s"][rng.integers(2)])
            cache.store_many(qs, vals, tenant, ttl_s=ttl, scopes=scs)
            for q, v, s in zip(qs, vals, scs):
                latest[(tenant, q.modality, q.code, s)] = v
        else:
            held = _held(cache)
            qcodes = [codes[rng.integers(len(codes))] for _ in range(int(rng.integers(1, 4)))]
            res = cache.lookup_many([cache.query_from_code("text", np.frombuffer(c, np.uint8)) for c in qcodes],
                                    tenant)
            for c, h in zip(qcodes, res):
                ds = {k: _popcount(k[2], c) for k, (v, exp) in held.items() if k[0] == tenant and exp > now}
                ds = {k: d for k, d in ds.items() if d <= radius}
                if not ds:
                    assert h is None
                    continue
                assert h is not None and h.distance == min(ds.values())
                assert any(held[k][0] == h.value and d == h.distance for k, d in ds.items())
        held = _held(cache)
        for k, (v, exp) in held.items():
            assert latest[k] == v and exp > now
        assert cache.policy.used_bytes == sum(8 + len(v) + len(k[3]) for k, (v, _) in held.items())
        assert len(cache.policy) == len(held)


@pytest.mark.parametrize("code", [np.array([300] + [0] * 7, np.int64), np.array([-1] * 8, np.int64),
                                  np.full(8, 0.7), np.ones(8, bool)], ids=["300", "-1", "0.7", "bool"])
def test_a_code_that_is_not_bytes_is_refused_not_wrapped(code):
    """A cast to uint8 would wrap 300 to 44 and -1 to 255 and truncate 0.7 to 0: another request's code."""
    from ushash.serving.cache import RequestError

    cache = SemanticCache(_head(), {"radius": 0, "payload_check": False})
    cache.store(cache.query_from_code("text", np.array([44] + [0] * 7, np.uint8)), "another request's")
    cache.store(cache.query_from_code("text", np.zeros(8, np.uint8)), "another request's")
    cache.store(cache.query_from_code("text", np.full(8, 255, np.uint8)), "another request's")
    with pytest.raises(RequestError, match="code must be"):
        cache.query_from_code("text", code)
    assert cache.query_from_code("text", bytes(8)).code == bytes(8)   # bytes are a code as they are
    assert cache.query_from_code("text", np.array([7] * 8, np.int64)).code == bytes([7] * 8)


def test_a_query_z_of_another_width_or_not_finite_is_refused_not_broadcast():
    """A 1-d z broadcast against a 32-d payload gave a cosine of 5.66 and served the entry."""
    from ushash.serving.cache import RequestError
    from ushash.serving.cache.request import Query

    cache = SemanticCache(_head(), {"radius": 3, "ttl_s": 0, "payload_threshold": 0.99})
    code = np.arange(8, dtype=np.uint8)
    cache.store(cache.query_from_code("text", code, np.ones(32)), "val")
    for z in (np.ones(1), np.ones(5), np.ones(64), np.full(32, np.nan), np.r_[np.inf, np.zeros(31)],
              np.full(32, 1e300)):
        with pytest.raises(RequestError, match="z must be"):
            cache.query_from_code("text", code, z)
    for z in (np.ones(1, np.float32), np.ones((1, 32), np.float32)):   # a Query made by hand
        with pytest.raises(RequestError, match="z must be 32 floats"):
            cache.lookup(Query("text", code.tobytes(), z))
        with pytest.raises(RequestError, match="z must be 32 floats"):
            cache.lookup_top(Query("text", code.tobytes(), z), k=2)
    with pytest.raises(RequestError, match="not served"):
        cache.query_from_code("video", code)
    h = cache.lookup(cache.query_from_code("text", code, np.ones(32)))
    assert h.value == "val" and h.cosine <= 1.0 + 1e-6


def test_a_query_z_not_of_unit_norm_is_refused_not_served():
    """The hit check takes z . payload as the cosine: a hand-built Query whose z was 3 times too long was
    served an entry at a true cosine of 0.4, past a threshold of 0.98. Such a z is refused in lookups and
    stores; z within float32 rounding of unit norm is served; query_from_code normalises (a zero z it
    refuses: it has no direction)."""
    from ushash.serving.cache import RequestError
    from ushash.serving.cache.request import Query

    cache = SemanticCache(_head(), {"radius": 3, "ttl_s": 0, "payload_threshold": 0.98})
    code = np.arange(8, dtype=np.uint8)
    rng = np.random.default_rng(0)
    a = rng.normal(size=32)
    a /= np.linalg.norm(a)
    b = rng.normal(size=32)
    b -= (b @ a) * a
    b /= np.linalg.norm(b)
    cache.store(cache.query_from_code("text", code, a), "A")
    q = (0.4 * a + np.sqrt(1 - 0.16) * b).astype(np.float32)   # unit, cosine 0.4 with the entry
    for z in (3 * q, 0.5 * q, q * (1 + 1e-3), np.full(32, np.nan, np.float32), np.zeros(32, np.float32)):
        with pytest.raises(RequestError, match="unit L2 norm"):
            cache.lookup(Query("text", code.tobytes(), z))
        with pytest.raises(RequestError, match="unit L2 norm"):
            cache.lookup_many([cache.query_from_code("text", code, a), Query("text", code.tobytes(), z)])
        with pytest.raises(RequestError, match="unit L2 norm"):
            cache.store(Query("text", code.tobytes(), z), "B")
    assert cache.lookup(Query("text", code.tobytes(), q)) is None
    assert cache.lookup(cache.query_from_code("text", code, 3 * q)) is None
    near = (a * (1 + 2e-5)).astype(np.float32)   # rounding, not scale
    assert cache.lookup(Query("text", code.tobytes(), near)).value == "A"
    assert cache.lookup(Query("text", code.tobytes(), a.astype(np.float32))).value == "A"
    with pytest.raises(RequestError, match="all zeros"):
        cache.query_from_code("text", code, np.zeros(32))
    assert len(cache) == 1   # nothing stored by the refused stores


def test_l1_refuses_a_batch_whose_z_rows_differ_in_width():
    """Rows of 32, 16 and 48 floats concatenate to 96 = 3 x 32: reshaped, they would be misaligned rows."""
    from ushash.serving.cache.request import Query

    cache = SemanticCache(_head(), {"radius": 3, "ttl_s": 0, "payload_threshold": 0.5})
    code = np.arange(8, dtype=np.uint8)
    cache.store(cache.query_from_code("text", code, np.ones(32)), "val")
    qs = [Query("text", code.tobytes(), np.ones(n, np.float32) / np.sqrt(n)) for n in (32, 16, 48)]
    with pytest.raises(ValueError, match="z must"):
        cache.l1.hits_many(qs, "default", cache.revision, cache.hit_check, 0.0)


@pytest.mark.parametrize("seed", range(4))
def test_qos_lru_matches_a_list_model(seed):
    """Class-ordered eviction: the victim is the least recent entry of the lowest class present not above
    the newcomer's; a newcomer with only higher classes' entries left is refused; within a class, LRU. The
    admission draws are replayed from the same seeded generator."""
    import random

    from ushash.serving.cache.qos import CLASSES, QoSAdmission, QoSLRU

    rng = np.random.default_rng(seed)
    classes = {"pay": "critical", "web": "normal", "rep": "batch"}
    cap = int(rng.integers(5, 40))
    lru = QoSLRU(cap, QoSAdmission(classes, onset=0.5, rng=random.Random(seed)))
    adm = QoSAdmission(classes, onset=0.5, rng=random.Random(seed))
    seg: list[list] = [[] for _ in CLASSES]   # per class rank, LRU first: [key, value]
    refused = evicted = 0
    for i in range(3000):
        tenant = ["pay", "web", "rep", "other"][rng.integers(4)]
        key = int(rng.integers(0, 60))
        r = CLASSES.index(classes.get(tenant, "normal"))
        at = next((j for j, (k, _) in enumerate(seg[r]) if k == (tenant, key)), None)
        if rng.random() < 0.5:
            want = None
            if at is not None:
                item = seg[r].pop(at)
                seg[r].append(item)
                want = item[1]
            assert lru.get(tenant, key) == want
            continue
        got = lru.put(tenant, key, i)
        if at is not None:
            seg[r].pop(at)
            seg[r].append([(tenant, key), i])
            assert got
        else:
            n = sum(len(x) for x in seg)
            ok = adm.admit(tenant, n / cap)
            if ok and n >= cap:
                low = next((x for x in seg[: r + 1] if x), None)
                if low is None:
                    ok = False
                else:
                    low.pop(0)
                    evicted += 1
            if ok:
                seg[r].append([(tenant, key), i])
            else:
                refused += 1
            assert got == ok
        assert len(lru) == sum(len(x) for x in seg) <= cap
        assert (lru.refused, lru.evicted) == (refused, evicted)
    assert refused and evicted


def test_hot_keys_count_what_a_list_of_events_counts():
    """Without Space-Saving replacements (max_keys above the keys seen) a key's count is the number of its
    events in the buckets of the window; with them, every count kept in a bucket over-estimates its key's
    count in that bucket, and the counts add up to the requests."""
    from ushash.serving.cache.hotkeys import HotKeys

    rng = np.random.default_rng(0)
    clock = FakeClock(0.0)
    exact, small = HotKeys(60.0, 6, 1000, clock=clock), HotKeys(60.0, 6, 8, clock=clock)
    events = []
    for _ in range(4000):
        clock.t += float(rng.exponential(0.05))
        k, n = int(rng.zipf(1.3) % 50), int(rng.integers(1, 3))
        exact.record(k, n), small.record(k, n)
        events.append((clock.t, k, n))
        if rng.random() < 0.05:
            cur = int(np.floor(clock.t / 10.0))
            true: dict = {}
            for t, kk, nn in events:
                if int(np.floor(t / 10.0)) > cur - 6:
                    true[kk] = true.get(kk, 0) + nn
            assert exact.counts() == true
            assert exact.count(k) == true[k]
            assert sum(small.counts().values()) == sum(true.values())
            for idx, c in small._b:   # per bucket (Space-Saving's guarantee): kept counts over-estimate
                in_b: dict = {}
                for t, kk, nn in events:
                    if int(np.floor(t / 10.0)) == idx:
                        in_b[kk] = in_b.get(kk, 0) + nn
                assert len(c) <= 8 and all(v >= in_b.get(kk, 0) for kk, v in c.items())
                assert sum(c.values()) == sum(in_b.values())


def test_queries_made_by_hand_with_codes_of_another_length_are_refused_not_shifted():
    """A batch's codes are joined and cut into rows: codes of 4 and 12 bytes were read as the two 8-byte codes
    A and B, and served A's and B's answers; stored, the short one left a slot taken by no entry."""
    from ushash.serving.cache import RequestError
    from ushash.serving.cache.request import Query

    cache = SemanticCache(_head(), {"radius": 0, "payload_check": False, "ttl_s": 0})
    a, b = bytes(range(8)), bytes(range(8, 16))
    cache.store(cache.query_from_code("text", a), "answer of A")
    cache.store(cache.query_from_code("text", b), "answer of B")
    shifted = [Query("text", a[:4], None), Query("text", a[4:] + b, None)]
    with pytest.raises(RequestError, match="code must be 8 bytes"):
        cache.lookup_many(shifted)
    with pytest.raises(RequestError, match="code must be 8 bytes"):
        cache.lookup_top(shifted[0], k=2)
    with pytest.raises(RequestError, match="code must be 8 bytes"):
        cache.store_many(shifted, ["x", "y"])
    from ushash.serving.cache.entries import Entry

    short = Entry(code=a[:4], payload=b"", modality="text", value=b"x", kind="b", revision=cache.revision,
                  created=0.0, expires=float("inf"), compute_s=0.0)
    with pytest.raises(ValueError, match="4-byte code"):
        cache.l1.put_many("default", [short])
    assert len(cache) == cache.table.live == 2 and cache.l1._tenant_live == {0: 2}
    assert [h.value for h in cache.lookup_many([cache.query_from_code("text", c) for c in (a, b)])] == \
        ["answer of A", "answer of B"]


@pytest.mark.parametrize("seed", range(6))
def test_l1_and_redis_match_a_two_tier_model(seed):
    """With the L2: an L1 miss is asked of Redis, which holds every stored entry (latest per request, until it
    expires); its hit is promoted into the L1 (a put there, the most recent). Tenants never see each other's."""
    from test_cache_redis import REDIS, RedisServer

    if REDIS is None:
        pytest.skip("redis-server not installed")
    srv = RedisServer()
    try:
        import time

        rng = np.random.default_rng(seed)
        clock = FakeClock(time.time())   # Redis expires keys at the entry's expiry on the wall clock
        radius, cap = int(rng.integers(0, 4)), int(rng.integers(60, 300))
        cache = SemanticCache(_head(), {"radius": radius, "payload_check": False, "capacity_bytes": cap,
                                        "policy": "lru", "ttl_s": 0, "ttl_jitter": 0.0, "xfetch_beta": 0.0,
                                        "l2": {"url": srv.url, "watermark_check_s": 0.0}}, clock=clock)
        l1 = Model(cap, radius)
        l2: dict[tuple, dict] = {}   # every stored request's latest entry
        codes = _codes(rng, n=30)
        tenants = ["a", "b"]
        serial = tiers_hit = 0
        for _ in range(200):
            clock.t += float(rng.choice([0.0, 0.5, 3.0]))
            now = clock.t
            tenant = tenants[rng.integers(2)]
            op = rng.random()
            if op < 0.03:
                assert cache.delete_tenant(tenant) == sum(k[0] == tenant for k in l1.entries)
                for d in (l1.entries, l2):
                    for k in [k for k in d if k[0] == tenant]:
                        del d[k]
            elif op < 0.4:
                qs, vals = [], []
                ttl = [None, 2.0, 10.0][rng.integers(3)]
                for _ in range(int(rng.integers(1, 5))):
                    code = codes[rng.integers(len(codes))]
                    qs.append(cache.query_from_code("text", np.frombuffer(code, np.uint8)))
                    serial += 1
                    vals.append("v" * int(rng.integers(0, 80)) + str(serial))
                cache.store_many(qs, vals, tenant, ttl_s=ttl)
                l1.expire(now)
                for q, v in zip(qs, vals):
                    exp = now + ttl if ttl else np.inf
                    l1.put((tenant, "text", q.code, b""), v, 8 + len(v), exp)
                    l2[(tenant, "text", q.code, b"")] = {"value": v, "expires": exp}
            else:
                c = codes[rng.integers(len(codes))]
                l1.expire(now)
                h = cache.lookup(cache.query_from_code("text", np.frombuffer(c, np.uint8)), tenant)
                cands = l1.candidates(tenant, c)
                if cands:
                    assert h is not None and h.tier == "l1"
                    key = next(k for k in cands if l1.entries[k]["value"] == h.value)
                    l1.touch(key)
                    continue
                ds = {k: _popcount(k[2], c) for k, e in l2.items() if k[0] == tenant and e["expires"] > now}
                ds = {k: d for k, d in ds.items() if d <= radius}
                if not ds:
                    assert h is None
                    continue
                assert h is not None and h.tier == "l2" and h.distance == min(ds.values())
                key = next(k for k, d in ds.items() if l2[k]["value"] == h.value and d == h.distance)
                tiers_hit += 1
                e = l2[key]
                l1.put(key, e["value"], 8 + len(e["value"]), e["expires"])   # promoted
            assert len(cache) == len(l1.entries) and cache.policy.used_bytes == l1.used()
        assert tiers_hit
    finally:
        srv.stop()


def test_bulk_loaded_codes_are_checked_as_a_requests_are():
    """store_codes cast float codes to uint8 (0.7 -> 0: stored under another request's code) and took any
    tenant name, one outside the configured tenants too."""
    from ushash.serving.cache import InvalidTenant, RequestError, UnknownTenant

    cache = SemanticCache(_head(), {"radius": 0, "payload_check": False, "tenants": ["acme"]})
    with pytest.raises(RequestError, match="code must be packed bytes"):
        cache.store_codes("acme", "text", np.full((1, 8), 0.7), ["wrong"])
    with pytest.raises(RequestError, match=r"codes must be uint8 \[N, 8\]"):
        cache.store_codes("acme", "text", np.zeros((1, 4), np.uint8), ["short"])
    with pytest.raises(UnknownTenant):
        cache.store_codes("other", "text", np.zeros((1, 8), np.uint8), ["x"])
    with pytest.raises(InvalidTenant):
        cache.store_codes("ténant", "text", np.zeros((1, 8), np.uint8), ["x"])
    assert len(cache) == 0
    assert cache.store_codes("acme", "text", np.zeros((2, 8), np.int64) + [[0], [1]], ["a", "b"]) == 2
    assert cache.lookup(cache.query_from_code("text", bytes(8)), "acme").value == "a"


@pytest.mark.parametrize("seed", range(6))
def test_slo_window_ratios_and_cdi_equal_sums_over_a_list_of_events(seed):
    """Hit and stale ratios over the seconds (now - window, now] and the CDI (evictions of that window x the
    read-QPS increase against the window before / 60), from one request, a batch, reads and evictions at a
    time, equal the sums over the events themselves."""
    import math

    from ushash.serving.cache.telemetry import SLOWindow

    rng = np.random.default_rng(seed)
    clock = FakeClock(float(rng.uniform(-50, 1000)))
    win = float(rng.choice([10, 60]))
    w = SLOWindow(window_s=win, jitter_s=float(rng.choice([30, 300])), clock=clock)
    ev: list[tuple] = []   # (second, what, n)
    for i in range(1500):
        clock.t += float(rng.exponential(0.3))
        s, r = math.floor(clock.t), rng.random()
        if r < 0.4:
            hit, stale, read = (bool(x) for x in rng.random(3) < [0.5, 0.1, 0.5])
            w.record_request(hit, 0.01, stale=stale, read=read)
            ev += [(s, "req", 1), (s, "hit", int(hit)), (s, "stale", int(stale)), (s, "read", int(read))]
        elif r < 0.8:
            hits = [bool(x) for x in rng.random(int(rng.integers(1, 5))) < 0.5]
            w.record_requests(hits, 0.01)
            ev += [e for h in hits for e in ((s, "req", 1), (s, "hit", int(h)), (s, "read", int(not h)))]
        else:
            n = int(rng.integers(1, 4))
            (w.record_evictions if r < 0.9 else w.record_read)(n)
            ev.append((s, "ev" if r < 0.9 else "read", n))
        if i % 50 == 0:
            now = math.floor(clock.t)

            def total(what, lo, hi):
                return sum(n for s2, k, n in ev if k == what and lo <= s2 <= hi)

            req = total("req", now - win + 1, now)
            inc = (total("read", now - win + 1, now) - total("read", now - 2 * win + 1, now - win)) / win
            want = (total("hit", now - win + 1, now) / req if req else 0.0,
                    total("stale", now - win + 1, now) / req if req else 0.0,
                    total("ev", now - win + 1, now) * max(0.0, inc) / 60.0)
            np.testing.assert_allclose((w.hit_ratio(), w.stale_ratio(), w.cdi()), want, rtol=1e-12, atol=1e-12)


def test_rolling_p99_is_the_nearest_rank_of_the_window():
    from ushash.serving.cache.adaptive import RollingP99

    for seed in range(6):
        rng = np.random.default_rng(seed)
        clock = FakeClock(0.0)
        r, ev = RollingP99(window_s=float(rng.choice([1, 10, 60])), clock=clock), []
        for i in range(1500):
            clock.t += float(rng.exponential(0.1))
            x = float(rng.exponential(0.05))
            r.record(x)
            ev.append((clock.t, x))
            if i % 30 == 0:
                xs = sorted(v for t, v in ev if t >= clock.t - r.window_s)
                assert r.p99_ms() == 1e3 * xs[int(round(0.99 * (len(xs) - 1)))]
