"""The cache runtime's L2 and helpers: what a corrupt or hostile value in Redis does (a
miss, counted; never an exception or a promotion), the L2 lookup against a brute-force reference, and the
thread safety and memory bound of the hot-key window and the rolling p99."""

import math
import sys
import threading

import numpy as np
import pytest

from ushash.serving.cache import SemanticCache
from ushash.serving.cache.adaptive import RollingP99
from ushash.serving.cache.hotkeys import HotKeys, HotKeysCollector
from ushash.serving.cache.lsh import LSHHead
from ushash.serving.cache.redis_store import revision_tag

from test_cache_redis import _cache, redis_server  # noqa: F401 (fixture)


def _race(workers, reader, switch_s=1e-6):
    """Run `workers` (callables) in threads while `reader` runs in this one, with a tiny GIL switch
    interval so that the threads interleave; returns the exceptions raised."""
    errors = []

    def guard(fn):
        try:
            fn()
        except Exception as e:   # noqa: BLE001 - the test asserts there are none
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    try:
        ts = [threading.Thread(target=guard, args=(w,)) for w in workers]
        for t in ts:
            t.start()
        guard(lambda: reader(ts))
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old)
    return errors


def test_hot_keys_record_from_threads_while_scraped():
    """Lookups record hot keys from many threads while /metrics renders the window: no error (was
    'dictionary changed size during iteration' and KeyErrors from Space-Saving's replacement)."""
    hk = HotKeys(window_s=60.0, buckets=6, max_keys=64, clock=lambda: 1.0)

    def worker(off):
        def run():
            for i in range(20_000):
                hk.record(("t", off + i))
        return run

    def reader(ts):
        col = HotKeysCollector(hk)
        while any(t.is_alive() for t in ts):
            list(col.collect())

    assert _race([worker(0), worker(10**9)], reader) == []
    assert sum(hk.counts().values()) == 40_000   # Space-Saving keeps the total


def test_rolling_p99_records_from_threads_while_read():
    """Computations record their time from many threads while a store reads the p99 (adaptive TTL):
    no 'deque mutated during iteration'."""
    p = RollingP99(60.0, clock=lambda: 1.0)

    def worker():
        for _ in range(30_000):
            p.record(0.01)

    def reader(ts):
        while any(t.is_alive() for t in ts):
            p.p99_ms()

    assert _race([worker], reader) == []
    assert p.p99_ms() == pytest.approx(10.0)


def test_rolling_p99_stays_within_its_window_when_never_read():
    """With adaptive_ttl on, every computation is recorded, but the p99 is read only by stores without
    their own ttl_s: with ttl_s given on every call the window must still drop what left it."""
    head = LSHHead({"image": 16, "text": 16}, bits=64, dim=32, aligned=True, seed=0)
    cache = SemanticCache(head, {"radius": 3, "adaptive_ttl": True, "ttl_s": 600})
    now = [0.0]
    cache.compute_p99.clock = lambda: now[0]
    rng = np.random.default_rng(0)
    for i in range(300):
        now[0] = float(i)   # one computation a second, 60 s window
        f = rng.normal(size=(16,)).astype(np.float32)
        cache.get_or_compute("text", features=f, compute=lambda: "v", ttl_s=30)
    assert len(cache.compute_p99._q) <= 61
    # the naive reference: the p99 of what the last 60 s recorded
    r = RollingP99(60.0, clock=lambda: now[0])
    for t in range(300):
        r.record(float(t % 7) / 1000, now=float(t))
    xs = sorted(float(t % 7) / 1000 for t in range(300) if t >= 299 - 60)
    assert r.p99_ms() == pytest.approx(1e3 * xs[round(0.99 * (len(xs) - 1))])


# ---------------------------------------------------------------------------------------------- hostile Redis

def _stored(srv):
    """One entry stored by a replica; (its request's features, its entry key, its bucket keys)."""
    a = _cache(srv)
    f = np.random.default_rng(1).normal(size=(1, 16)).astype(np.float32)
    a.store(a.queries("text", features=f)[0], "v1")
    keys = sorted(k.decode() for k in srv.client.keys("*"))
    return f, [k for k in keys if ":e:" in k][0], [k for k in keys if ":b:" in k]


def _fresh_lookup(srv, f, code_only=False):
    """A lookup by a new replica (nothing in its L1): (hit, corrupt count)."""
    b = _cache(srv)
    q = b.queries("text", features=f)[0]
    if code_only:
        q = b.query_from_code("text", np.frombuffer(q.code, np.uint8))
    hit = b.lookup(q)
    if hit is not None:   # and what it promoted into L1 is served from there
        assert b.lookup(q).value == hit.value
    return hit, b.metrics.value("cache_l2_errors_total", op="corrupt")


@pytest.mark.parametrize("field,value", [
    ("x", b"garbage"),        # expiry that is not a number
    ("x", b"nan"),            # NaN expiry: would never expire
    ("m", b"\xff\xfe"),       # modality that is not UTF-8
    ("m", None),              # a field missing
    ("p", b"\x01\x02"),       # payload record of another size
    ("p", b"\x00" * 100_000),
    ("c", b"\x00"),           # code of another length than its bucket member's
    ("c", b"\x01" * 8),       # code other than its bucket member's
    ("v", b"\xff"),           # a str value that is not UTF-8
    ("k", b"zz"),             # a value kind no put writes
    ("k", b"j"),              # a value that is not JSON
])
@pytest.mark.parametrize("code_only", [False, True])
def test_corrupt_entry_in_redis_is_a_counted_miss(redis_server, field, value, code_only):
    """A corrupt or hostile entry hash in Redis is a miss for every replica, counted as
    cache_l2_errors_total{op="corrupt"}: never an exception (a 500 in the service), never served (a
    request without z skips the payload check) and never promoted into L1."""
    f, ekey, _ = _stored(redis_server)
    hit, bad = _fresh_lookup(redis_server, f, code_only)
    assert hit is not None and hit.value == "v1" and bad == 0
    if value is None:
        redis_server.client.hdel(ekey, field)
    else:
        redis_server.client.hset(ekey, field, value)
    hit, bad = _fresh_lookup(redis_server, f, code_only)
    assert hit is None and bad >= 1


@pytest.mark.parametrize("member", [b"nothex:abc", b"\xff\xfe:abc", b"00112233", b"0011:abc", b":abc"])
def test_corrupt_bucket_member_is_skipped(redis_server, member):
    """A bucket member no put writes (not hex, not UTF-8, no id, a code of another length) is skipped
    and counted; the real entry of the bucket is still served."""
    f, _, bkeys = _stored(redis_server)
    for k in bkeys:
        redis_server.client.sadd(k, member)
    hit, bad = _fresh_lookup(redis_server, f)
    assert hit is not None and hit.value == "v1" and bad >= 1


def _two_entries(srv, prefix):
    """A store holding two entries of one request's neighbourhood (distances 0 and 1 from `q`); (store, q, the
    entry keys nearest first)."""
    from ushash.serving.cache.entries import Entry
    from ushash.serving.cache.redis_store import RedisStore
    from ushash.serving.cache.telemetry import CacheMetrics

    store = RedisStore(srv.url, bits=64, prefix=prefix, metrics=CacheMetrics(64))
    q = np.random.default_rng(5).integers(0, 256, 8, dtype=np.uint8)
    near = q.copy()
    near[7] ^= 1
    for i, c in enumerate((q, near)):
        store.put("t", Entry(code=c.tobytes(), payload=b"", modality="text", value=b"%d" % i, kind="b",
                             revision="r1", created=0.0, expires=math.inf, compute_s=0.0, id=f"e{i}"))
    return store, q.tobytes(), [store.entry_key("t", f"e{i}") for i in range(2)]


@pytest.mark.parametrize("write", [
    lambda c, k: c.set(k, b"a string"),
    lambda c, k: c.rpush(k, b"a list"),
])
def test_an_entry_key_of_another_type_costs_only_that_entry(redis_server, write):
    """An entry key holding another type (WRONGTYPE to HMGET) failed the whole pipelined fetch, so every
    lookup near it missed the live entries beside it too. It is a corrupt entry (counted), the others are
    served."""
    store, q, (k0, k1) = _two_entries(redis_server, "wt")
    redis_server.client.delete(k0)
    write(redis_server.client, k0)
    entries, dists = store.lookup("t", "r1", q, 3)
    assert [e.id for e in entries] == ["e1"] and dists == [1]
    assert store.metrics.value("cache_l2_errors_total", op="corrupt") >= 1


def test_a_bucket_key_of_another_type_costs_only_that_bucket(redis_server):
    """A probe bucket key holding another type (WRONGTYPE to SCARD / SUNION) failed the lookup script, so the
    entries it shares with the other probe buckets were missed too. The bucket is skipped (counted as
    corrupt); its entries are found through their other chunks' buckets."""
    store, q, _ = _two_entries(redis_server, "wb")
    (first, *rest) = store._bucket_keys("t", revision_tag("r1"), q)
    redis_server.client.delete(first)
    redis_server.client.set(first, b"a string")
    entries, dists = store.lookup("t", "r1", q, 3)
    assert [e.id for e in entries] == ["e0", "e1"] and dists == [0, 1]
    assert store.metrics.value("cache_l2_errors_total", op="corrupt") >= 1
    assert [[e.id for e in es] for es, _ in store.lookup_many("t", "r1", [q, q], 3)] == [["e0", "e1"]] * 2


def test_lookup_matches_a_brute_force_reference(redis_server):
    """RedisStore.lookup against a naive scan of every stored code: the entries within the radius, by
    (distance, id), at most max_candidates; radii below and above the chunk count (probes with flips),
    duplicates and ties included."""
    from ushash.serving.cache.entries import Entry
    from ushash.serving.cache.redis_store import RedisStore

    rng = np.random.default_rng(7)
    store = RedisStore(redis_server.url, bits=64, prefix="ref", max_candidates=12)
    base = rng.integers(0, 256, size=(40, 8), dtype=np.uint8)
    codes = []
    for i in range(400):
        c = base[rng.integers(len(base))].copy()
        for b in rng.choice(64, size=rng.integers(0, 7), replace=False):
            c[b // 8] ^= 1 << (b % 8)
        codes.append(c.tobytes())
    for i, c in enumerate(codes):
        store.put("t", Entry(code=c, payload=b"", modality="text", value=b"%d" % i, kind="b",
                             revision="r1", created=0.0, expires=math.inf, compute_s=0.0, id=f"e{i:04d}"))
    for _ in range(60):
        q = base[rng.integers(len(base))].copy()
        for b in rng.choice(64, size=rng.integers(0, 4), replace=False):
            q[b // 8] ^= 1 << (b % 8)
        q = q.tobytes()
        for radius in (3, 6, 9):
            x = int.from_bytes(q, "little")
            ref = sorted(((int.from_bytes(c, "little") ^ x).bit_count(), f"e{i:04d}") for i, c in enumerate(codes))
            ref = [(d, e) for d, e in ref if d <= radius][:12]
            entries, dists = store.lookup("t", "r1", q, radius)
            assert list(zip(dists, [e.id for e in entries])) == ref


def test_entries_gone_from_redis_do_not_take_the_places_of_live_ones(redis_server):
    """The nearest max_candidates members were fetched and those whose hash Redis had dropped (expired,
    evicted) were skipped, so live entries further out were never served until the gone ones had been
    forgotten. The next candidates are fetched in their place (the reference: the live entries within the
    radius by (distance, id), at most max_candidates), and the gone members are dropped from their buckets."""
    from ushash.serving.cache.entries import Entry
    from ushash.serving.cache.redis_store import RedisStore

    store = RedisStore(redis_server.url, bits=64, prefix="gone", max_candidates=5)
    q = np.random.default_rng(3).integers(0, 256, 8, dtype=np.uint8)
    codes = []
    for i in range(20):   # distances 0, 1, 1, 2, 2, ... from q, all within radius 9
        c = q.copy()
        for b in range((i + 1) // 2):
            c[b // 8] ^= 1 << (b % 8)
        codes.append(c.tobytes())
        store.put("t", Entry(code=codes[-1], payload=b"", modality="text", value=b"%d" % i, kind="b",
                             revision="r1", created=0.0, expires=math.inf, compute_s=0.0, id=f"e{i:02d}"))
    x = int.from_bytes(q.tobytes(), "little")
    dist = {f"e{i:02d}": (int.from_bytes(c, "little") ^ x).bit_count() for i, c in enumerate(codes)}
    vanished = [e for _, e in sorted((d, e) for e, d in dist.items())[:8]]   # the 8 nearest
    for e in vanished:
        redis_server.client.delete(store.entry_key("t", e))
    ref = sorted((d, e) for e, d in dist.items() if e not in vanished)[:5]
    entries, dists = store.lookup("t", "r1", q.tobytes(), 9)
    assert list(zip(dists, [e.id for e in entries])) == ref
    members = set().union(*(redis_server.client.smembers(k) for k in redis_server.client.keys("gone:*:b:*")))
    assert not {m for m in members if m.decode().rsplit(":", 1)[1] in vanished}
    assert store.lookup("t", "r1", q.tobytes(), 9)[0] == entries


def test_an_entry_stored_again_while_a_lookup_forgets_it_stays_findable(redis_server):
    """A lookup that found an entry gone drops its bucket members afterwards; a replica storing the same
    request again in between (same id, same code, its members added back) lost them to that cleanup, and the
    fresh entry was found by no lookup until it was stored once more. The members are dropped only while the
    entry is still gone."""
    from ushash.serving.cache.entries import Entry
    from ushash.serving.cache.redis_store import RedisStore

    store = RedisStore(redis_server.url, bits=64, prefix="race")
    q = np.random.default_rng(9).integers(0, 256, 8, dtype=np.uint8).tobytes()

    def put(value):
        store.put("t", Entry(code=q, payload=b"", modality="text", value=value, kind="b", revision="r1",
                             created=0.0, expires=math.inf, compute_s=0.0, id="e0"))

    put(b"old")
    redis_server.client.delete(store.entry_key("t", "e0"))   # expired or evicted by Redis
    forget = store._forget

    def stored_meanwhile(*args):
        put(b"new")   # another replica, between this lookup's fetch and its cleanup
        forget(*args)

    store._forget = stored_meanwhile
    assert store.lookup("t", "r1", q, 3) == ([], [])
    del store._forget
    entries, _ = store.lookup("t", "r1", q, 3)
    assert [e.value for e in entries] == [b"new"]


def test_a_lookup_reads_at_most_max_bucket_read_members_leaving_out_the_largest_buckets(redis_server):
    """SUNION read every member of the probe buckets, however many (a hot chunk value, or a hostile writer):
    one lookup's memory and time had no bound. The lookup script leaves out the largest buckets (largest
    first, ties by position) until the rest hold at most max_bucket_read members, against a reference on
    random sizes, ties and empty buckets included."""
    from ushash.serving.cache.redis_store import RedisStore

    store = RedisStore(redis_server.url, bits=64, prefix="cap")
    rng = np.random.default_rng(11)
    for trial in range(40):
        sizes = [int(v) for v in rng.choice([0, 1, 3, 5, 5, 8, 13, 40], size=int(rng.integers(1, 7)))]
        keys = [f"cap:{{t}}:b:{trial}:{i}" for i in range(len(sizes))]
        for k, n in zip(keys, sizes):
            if n:
                redis_server.client.sadd(k, *[f"{k}:{m}" for m in range(n)])
        cap = int(rng.integers(1, 60))
        order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
        total, skip = sum(sizes), set()
        for i in order:
            if total <= cap or sizes[i] == 0:
                break
            skip.add(i)
            total -= sizes[i]
        over, members, wrong = store._union_script(keys=keys, args=[cap])
        want = {f"{keys[i]}:{m}".encode() for i in range(len(sizes)) if i not in skip for m in range(sizes[i])}
        assert wrong == 0 and over == len(skip) and set(members) == want and len(members) <= cap


def test_an_entry_in_an_oversized_bucket_is_still_found_through_its_other_chunks(redis_server):
    """Left out, a crowded bucket costs only the entries found in no other probe bucket: the request's own
    entry (distance 0) is in all four of its buckets and is served through the others; the buckets left out
    are counted (cache_l2_errors_total{op="oversized"})."""
    from ushash.serving.cache.entries import Entry
    from ushash.serving.cache.redis_store import RedisStore
    from ushash.serving.cache.telemetry import CacheMetrics

    metrics = CacheMetrics(64)
    store = RedisStore(redis_server.url, bits=64, prefix="hot", max_bucket_read=30, metrics=metrics)
    rng = np.random.default_rng(4)
    q = rng.integers(0, 256, 8, dtype=np.uint8)

    def put(code, i):
        store.put("t", Entry(code=code.tobytes(), payload=b"", modality="text", value=b"%d" % i, kind="b",
                             revision="r1", created=0.0, expires=math.inf, compute_s=0.0, id=f"e{i:03d}"))

    put(q, 0)
    for i in range(1, 60):   # the same first 16 bits as q, the rest far from it
        c = q.copy()
        c[2:] = ~q[2:]
        c[2 + i % 6] ^= np.uint8(i)
        put(c, i)
    entries, dists = store.lookup("t", "r1", q.tobytes(), 3)
    assert [e.id for e in entries] == ["e000"] and dists == [0]
    assert metrics.value("cache_l2_errors_total", op="oversized") == 1


def test_request_stored_again_without_ttl_loses_its_old_redis_expiry(redis_server):
    """The same request stored again (same L2 id) without a TTL: its hash must not keep the Redis expiry
    of the earlier put (it said expires = inf, yet Redis dropped it at the old time for every replica)."""
    a = _cache(redis_server)
    f = np.random.default_rng(1).normal(size=(1, 16)).astype(np.float32)
    q = a.queries("text", features=f)[0]
    a.store(q, "v1", ttl_s=60)
    a.store(q, "v2", ttl_s=0)
    (ekey,) = [k for k in redis_server.client.keys("*") if b":e:" in k]
    assert redis_server.client.hget(ekey, "x") == b"inf"
    assert redis_server.client.pttl(ekey) == -1   # no expiry, as its entry says
    hit, _ = _fresh_lookup(redis_server, f)
    assert hit is not None and hit.value == "v2" and math.isinf(hit.expires)


def test_member_whose_code_is_not_its_entrys_is_not_served(redis_server):
    """A bucket member "<code>:<id>" naming a real entry under another code: a request near that code is
    not served the entry (its code is far) and the mismatch is counted."""
    a = _cache(redis_server)
    x = np.random.default_rng(2).integers(0, 256, 8, dtype=np.uint8)
    a.store(a.query_from_code("text", x), "v1")
    (ekey,) = [k.decode() for k in redis_server.client.keys("*") if b":e:" in k]
    eid = ekey.rsplit(":", 1)[1]
    y = x ^ np.uint8(0xFF)   # 64 bits away
    l2 = a._serving[1][1]
    for key in l2._bucket_keys("default", revision_tag(a._serving[2]), y.tobytes()):
        redis_server.client.sadd(key, f"{y.tobytes().hex()}:{eid}")
    b = _cache(redis_server)
    assert b.lookup(b.query_from_code("text", y)) is None
    assert b.metrics.value("cache_l2_errors_total", op="corrupt") >= 1
    assert b.lookup(b.query_from_code("text", x)).value == "v1"


def test_one_trial_call_at_a_time_once_the_circuit_half_opens():
    """When the open time is up, one caller makes the trial call and the others are refused as if the circuit
    were still open. Before, every arriving thread made a call (pybreaker lets all through in half-open), so a
    dead Redis cost each of them its timeout."""
    import time

    import redis

    from ushash.serving.cache.redis_store import L2Unavailable, RedisStore

    calls, release, failing = [], threading.Event(), [True]

    class Dead:
        def register_script(self, _):
            return self.script

        def script(self, keys, args, client=None):   # the lookup's union of its probe buckets
            calls.append(threading.get_ident())
            if failing[0]:
                raise redis.ConnectionError("down")
            release.wait(5)  # the trial call hangs, as on a connect timeout
            return [0, [], 0]

    store = RedisStore(bits=64, breaker_failures=1, breaker_backoff_s=0.05, client=Dead())
    code = bytes(8)
    with pytest.raises(L2Unavailable):
        store.lookup("t", "r", code, 2)  # the failure opens the circuit
    assert not store.available
    time.sleep(0.1)  # the open time is up
    failing[0] = False
    refused = []

    def one():
        try:
            store.lookup("t", "r", code, 2)
        except L2Unavailable:
            refused.append(1)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    release.set()
    for t in threads:
        t.join(5)
    assert len(calls) == 2 and len(refused) == 7  # the opening failure and one trial call
    assert store._breaker.current_state == "closed"  # the trial succeeded
    store.lookup("t", "r", code, 2)
    assert len(calls) == 3  # closed again: every call goes through
