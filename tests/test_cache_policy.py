"""Eviction policies with byte capacities, checked against naive references."""

import numpy as np
import pytest

from ushash.serving.cache.policies import make_policy
from ushash.serving.cache.policies.lruk import LRUKDecay


class FakeClock:
    def __init__(self, t=0.0):
        self.t = t

    def __call__(self):
        return self.t


def _run(policy, ops):
    held = set()
    for op, key, nbytes in ops:
        if op == "put":
            held.add(key)
            for k in policy.insert(key, nbytes):
                held.discard(k)
        else:
            policy.access(key)
        assert policy.used_bytes <= policy.capacity_bytes
        assert set(k for k in held if k in policy) == held
    return held


def _ops(seed=0, n=3000, keys=300):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(10, 200, size=keys)
    ops = []
    for _ in range(n):
        k = int(rng.zipf(1.3) % keys)
        ops.append(("put" if rng.random() < 0.4 else "get", k, int(sizes[k])))
    return ops


def test_lru_matches_reference():
    cap = 2000
    pol = make_policy("lru", cap)
    order: list[int] = []  # most recent last
    sizes: dict[int, int] = {}
    for op, k, nb in _ops():
        if op == "put":
            if k in sizes:
                order.remove(k)
            sizes[k] = nb
            order.append(k)
            while sum(sizes.values()) > cap:
                v = order.pop(0)
                del sizes[v]
            pol.insert(k, nb)
        elif k in sizes:
            order.remove(k)
            order.append(k)
            pol.access(k)
        assert sorted(sizes) == sorted(k2 for k2 in range(300) if k2 in pol)
    assert pol.used_bytes == sum(sizes.values())


def test_lfu_evicts_least_frequent():
    pol = make_policy("lfu", 300)
    pol.insert(1, 100)
    pol.insert(2, 100)
    pol.insert(3, 100)
    for _ in range(3):
        pol.access(1)
        pol.access(3)
    assert pol.insert(4, 100) == [2]


@pytest.mark.parametrize("name", ["lru", "lfu", "wtinylfu", "lruk"])
def test_every_policy_keeps_bytes_under_capacity(name):
    pol = make_policy(name, 5000)
    _run(pol, _ops(seed=1, n=4000))
    assert pol.used_bytes <= 5000
    assert make_policy(name, 100).insert(1, 101) == [1]  # larger than the whole cache: refused


def test_wtinylfu_resists_a_scan_that_flushes_lru():
    hot = list(range(50))
    results = {}
    for name in ("lru", "wtinylfu"):
        pol = make_policy(name, 100 * 64)
        for k in hot:
            pol.insert(k, 64)
        for _ in range(10):
            for k in hot:
                pol.access(k)
        for k in range(1000, 3000):  # a one-hit-wonder scan, 20x the cache
            pol.insert(k, 64)
        results[name] = sum(k in pol for k in hot)
    assert results["lru"] == 0
    assert results["wtinylfu"] >= 45, results


def test_wtinylfu_stores_large_values_and_counts_requests_not_slots():
    pol = make_policy("wtinylfu", 1 << 20)
    assert pol.insert(1, 600_000) == [] and 1 in pol and pol.used_bytes == 600_000
    assert pol.insert(2, 500_000) and pol.used_bytes <= 1 << 20     # something had to go
    # a request stored again under a new key keeps its count: it wins admission over a colder victim
    pol = make_policy("wtinylfu", 1000)
    for k in range(10):
        pol.insert(k, 100, ident=1000 + k)
    assert pol.insert(20, 100, ident=7) == [20]     # seen once, as often as the victim: refused
    assert pol.insert(21, 100, ident=7) == [0]      # seen twice: admitted, the LRU of probation goes
    assert 21 in pol and len(pol) == 10


def test_wtinylfu_replays_are_identical():
    runs = []
    for _ in range(2):
        pol = make_policy("wtinylfu", 5000)
        held = _run(pol, _ops(seed=3, n=6000))
        runs.append((sorted(held), pol.used_bytes))
    assert runs[0] == runs[1]


def test_lruk_decay_ranks_by_decayed_reference_count():
    clock = FakeClock()
    pol = LRUKDecay(300, k=2, half_life_s=10.0, clock=clock)
    pol.insert(1, 100)          # t=0, referenced twice
    clock.t = 1
    pol.access(1)
    clock.t = 2
    pol.insert(2, 100)          # referenced once
    clock.t = 3
    pol.insert(3, 100)
    clock.t = 4
    assert pol.insert(4, 100) == [2]  # once-referenced and older than 3 loses; twice-referenced 1 stays
    # much later, a key referenced twice long ago decays below one referenced once recently
    clock.t = 100
    pol.access(3)               # 3 now: referenced at t=3 and t=100
    clock.t = 101
    assert pol.insert(5, 100) == [4]  # 4 (once, t=4) < 1 (twice, t=0,1), both decayed ~10 half-lives
    clock.t = 130
    pol.access(5)
    assert pol.insert(6, 100) == [1]  # 1's two old references weigh less than 3's recent one


def test_lruk_matches_naive_reference():
    clock = FakeClock()
    cap = 1500
    pol = LRUKDecay(cap, k=3, half_life_s=50.0, clock=clock)
    hist: dict[int, list[float]] = {}
    sizes: dict[int, int] = {}

    def score(k, now):
        return sum(2 ** (-(now - t) / 50.0) for t in hist[k][-3:])

    for i, (op, k, nb) in enumerate(_ops(seed=3, n=2000)):
        clock.t = float(i)
        if op == "put":
            if k in sizes:
                del sizes[k], hist[k]
            sizes[k], hist[k] = nb, [clock.t]
            evicted = pol.insert(k, nb)
            expect = []
            while sum(sizes.values()) > cap:
                v = min((kk for kk in sizes if kk != k), key=lambda kk: (score(kk, clock.t), kk))
                expect.append(v)
                del sizes[v], hist[v]
            assert sorted(evicted) == sorted(expect)
        elif k in sizes:
            hist[k].append(clock.t)
            pol.access(k)


def test_unknown_policy_and_options():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("arc", 10)
    with pytest.raises(ValueError, match="takes no options"):
        make_policy("lru", 10, k=2)


class _Rows:
    """An entry table's `code` and `tenant` columns (what `bind_idents` reads), replaced as they grow."""

    def __init__(self, code_bytes):
        import numpy as np
        self.code, self.tenant = np.zeros((4, code_bytes), np.uint8), np.zeros(4, np.uint8)

    def write(self, k, code, tenant):
        import numpy as np
        while k >= len(self.tenant):
            self.code = np.concatenate([self.code, np.zeros_like(self.code)])
            self.tenant = np.concatenate([self.tenant, np.zeros_like(self.tenant)])
        if tenant > np.iinfo(self.tenant.dtype).max:
            self.tenant = self.tenant.astype(np.int64)
        self.code[k], self.tenant[k] = np.frombuffer(code, np.uint8), tenant


@pytest.mark.parametrize("code_bytes", [8, 4, 16])
def test_wtinylfu_bound_idents_equal_held_ones(code_bytes):
    """Bound to an entry table (`bind_idents`), W-TinyLFU derives each key's ident from its row when it
    needs it; its evictions, links, sizes and sketch are exactly those of a policy given
    `request_ident(code, tenant)` at insert and holding it, under a seeded stream of inserts (codes drawn
    from a small pool, so requests recur under new keys; keys reused; tenants past uint8), compiled and
    Python hits and removals that refuses and admits candidates and ages the sketch."""
    import numpy as np

    from ushash.serving.cache.policies.wtinylfu import WTinyLFU, request_ident

    rng = np.random.default_rng(11)
    rows = _Rows(code_bytes)
    a, b = WTinyLFU(6000, window=0.05), WTinyLFU(6000, window=0.05)
    a.bind_idents(rows)
    assert a._ident is None
    pool = [rng.integers(0, 256, code_bytes, dtype=np.uint8).tobytes() for _ in range(120)]
    held: list[int] = []
    refused = admitted = 0
    for step in range(8000):
        r = rng.random()
        if r < 0.4 or not held:
            k = int(rng.integers(0, 400))
            if k in a:
                a.remove(k), b.remove(k)   # a row is rewritten only after its key left the policy
            code, tenant = pool[int(rng.integers(0, len(pool)))], int(rng.choice([0, 1, 2, 300]))
            rows.write(k, code, tenant)
            size = int(rng.integers(1, 150))
            window = set(np.flatnonzero(a._seg == 1).tolist()) | {k}   # the candidates come from here
            ea, eb = a.insert(k, size), b.insert(k, size, request_ident(code, tenant))
            assert [int(x) for x in ea] == [int(x) for x in eb]
            refused += sum(int(x) in window for x in ea)
            admitted += sum(int(x) not in window for x in ea)
            held = [x for x in range(400) if x in a]
        elif r < 0.9:
            ks = [int(rng.choice(held)) for _ in range(int(rng.integers(1, 4)))] + [int(rng.integers(400, 500))]
            if step % 2:
                a.access_many(ks), b.access_many(ks)
            else:
                for k in ks:
                    a._access_py(k), b._access_py(k)
        else:
            k = int(rng.choice(held))
            a.remove(k), b.remove(k)
            held.remove(k)
        if step % 400 == 0:
            for name in ("_prev", "_next", "_seg", "_size", "_head", "_tail", "_bytes"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
            np.testing.assert_array_equal(a.sketch.table, b.sketch.table)
            assert a.sketch.additions == b.sketch.additions
    assert refused > 50 and admitted > 50, (refused, admitted)
    assert rows.tenant.dtype == np.int64
    assert a.used_bytes == b.used_bytes <= 6000
    with pytest.raises(RuntimeError, match="empty"):
        a.bind_idents(rows)


@pytest.mark.parametrize("bound", [False, True])
def test_wtinylfu_compiled_access_equals_the_python_one(bound):
    """The compiled hit path (access / access_many) leaves exactly the state the Python methods leave:
    links, segments, bytes per segment, sketch counters and aging, under a seeded stream of inserts,
    hits and removals that overflows the protected segment and halves the sketch; with idents held and
    bound to an entry table."""
    import numpy as np

    from ushash.serving.cache.policies.wtinylfu import WTinyLFU

    rng = np.random.default_rng(5)
    a, b = WTinyLFU(4000, window=0.05), WTinyLFU(4000, window=0.05)
    rows = _Rows(8)
    if bound:
        a.bind_idents(rows), b.bind_idents(rows)
    held: list[int] = []
    aged, last, width = False, 0, 0
    for step in range(6000):
        aged |= a.sketch.additions < last and len(a.sketch.table) == width   # halved, not reset by growth
        last, width = a.sketch.additions, len(a.sketch.table)
        r = rng.random()
        if r < 0.3 or not held:
            k = int(rng.integers(0, 300))
            ident = int(rng.integers(0, 1 << 63)) if rng.random() < 0.5 else None
            if bound:
                if k in a:
                    a.remove(k), b.remove(k)
                rows.write(k, rng.integers(0, 256, 8, dtype=np.uint8).tobytes(), int(rng.integers(0, 3)))
            size = int(rng.integers(1, 200))
            ea, eb = a.insert(k, size, ident), b.insert(k, size, ident)
            assert [int(x) for x in ea] == [int(x) for x in eb]
            held = [x for x in range(300) if x in a]
        elif r < 0.95:
            ks = [int(rng.choice(held)) for _ in range(int(rng.integers(1, 4)))] + [int(rng.integers(300, 400))]
            a.access_many(ks)
            for k in ks:
                b._access_py(k)
        else:
            k = int(rng.choice(held))
            a.remove(k), b.remove(k)
            held.remove(k)
        if step % 500 == 0:
            for name in ("_prev", "_next", "_seg", "_size", "_ident", "_head", "_tail", "_bytes"):
                if bound and name == "_ident":
                    assert a._ident is None and b._ident is None
                    continue
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
            np.testing.assert_array_equal(a.sketch.table, b.sketch.table)
            assert a.sketch.additions == b.sketch.additions
    assert aged
    assert a.used_bytes == b.used_bytes <= 4000


def test_sketch_two_counters_per_byte_equal_one_counter_per_byte():
    """The sketch's packed 4-bit counters (Python and compiled increments) hold exactly what a naive sketch of
    one saturating counter per byte holds, under a seeded stream of few idents (counters reach 15) that ages
    the sketch several times; frequencies alike."""
    import numpy as np

    from ushash.serving.cache.policies.wtinylfu import _nb_increment, _Sketch

    class Naive:   # the same hashing, a byte per counter
        def __init__(self, width):
            self.width, self.table, self.additions = width, np.zeros(width, np.int64), 0

        def increment(self, ident):
            for i in _Sketch(self.width)._index(ident):
                self.table[i] = min(15, self.table[i] + 1)
            self.additions += 1
            if self.additions >= 10 * self.width:
                self.table >>= 1
                self.additions //= 2

    rng = np.random.default_rng(3)
    sk, ref = _Sketch(128), Naive(128)
    assert sk.table.nbytes == 64
    idents = [int(x) for x in rng.integers(0, 1 << 63, 40)]
    ages = 0
    for step in range(6000):
        ident = idents[int(rng.zipf(1.3)) % len(idents)]
        before = sk.additions
        if step % 2:
            sk.increment(ident)
        else:
            sk.additions = int(_nb_increment(sk.table, np.uint64(ident), sk.additions))
        ref.increment(ident)
        ages += sk.additions < before
        assert sk.additions == ref.additions
        if step % 97 == 0:
            assert [sk.counter(j) for j in range(128)] == ref.table.tolist()
            assert all(sk.frequency(i) == min(ref.table[j] for j in sk._index(i)) for i in idents)
    assert ages >= 3 and ref.table.max() == 15
