"""The Redis L2 against a real redis-server started on a free loopback port (skipped without the binary):
replicas share entries, tenants stay apart, revisions are watermarked, and a dead or slow Redis
degrades the cache to L1 without an error reaching the caller."""

import os
import shutil
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

from ushash.serving.cache import SemanticCache
from ushash.serving.cache.lsh import LSHHead
from ushash.serving.localhost import LocalRedis

REDIS = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server not installed (./run test installs it)")


def _free_cluster_port(start: int) -> int:
    """The first port from `start` that is free and whose cluster bus port (port + 10000, Redis Cluster's
    rule) is valid and free too: an ephemeral port above 55535 has no bus port, and such a node exits at start."""
    for port in range(start, 55536):
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a Redis Cluster node")


def RedisServer():
    """A throwaway redis-server (ushash.serving.localhost.LocalRedis) that allows DEBUG from the loopback."""
    return LocalRedis("--protected-mode", "yes", "--enable-debug-command", "local")


@pytest.fixture
def redis_server():
    srv = RedisServer()
    yield srv
    srv.stop()


def _head(revision=None):
    return LSHHead({"image": 16, "text": 16}, bits=64, dim=32, aligned=True, seed=0, revision=revision)


def _cache(srv, revision=None, **kw):
    l2 = {"url": srv.url, "watermark_check_s": 0.0, **kw.pop("l2", {})}
    return SemanticCache(_head(revision), {"radius": 3, "l2": l2, **kw})


def _flip(code: bytes, bits) -> bytes:
    a = bytearray(code)
    for b in bits:
        a[b // 8] ^= 1 << (b % 8)
    return bytes(a)


def test_bloom_filter_never_hides_a_hit_and_its_guard_skips_l2_trips(redis_server):
    """In front of the L2: with and without the filter the same answers; the empty searches it answers "no
    entry" for are counted, and with bloom_guard_l2 they are not asked of the L2 (only another replica's
    entries could be there: the guard is for one writer per tenant)."""
    rng = np.random.default_rng(3)
    caches = {name: _cache(redis_server, bloom=bloom, bloom_guard_l2=guard, l2={"prefix": f"bloom-{name}"})
              for name, bloom, guard in (("on", True, False), ("off", False, False), ("guard", True, True))}
    assert caches["off"].bloom is None and caches["on"].bloom is not None
    asked = {}
    for name, cache in caches.items():   # count the L2 searches each cache makes
        l2 = cache._serving[1][1]
        asked[name] = 0

        def find_many(queries, *a, _find=l2.find_many, _name=name, **kw):
            asked[_name] += len(queries)
            return _find(queries, *a, **kw)
        l2.find_many = find_many
    base = rng.integers(0, 256, size=(200, 8), dtype=np.uint8)
    for i, c in enumerate(base):
        for cache in caches.values():
            cache.store(cache.query_from_code("text", c), i)
    for _ in range(300):
        c = base[rng.integers(200)].tobytes() if rng.random() < 0.5 else rng.integers(0, 256, 8, dtype=np.uint8).tobytes()
        q = np.frombuffer(_flip(c, rng.integers(0, 64, size=rng.integers(0, 5))), np.uint8)
        answers = {n: cache.lookup(cache.query_from_code("text", q)) for n, cache in caches.items()}
        assert len({(h and h.value) for h in answers.values()}) == 1
    skips = caches["on"].metrics.value("cache_bloom_skips_total")
    assert skips > 100 and caches["guard"].metrics.value("cache_bloom_skips_total") == skips
    assert asked["on"] == asked["off"] > 0 and asked["guard"] == asked["on"] - skips


def test_the_bloom_guard_never_forgets_an_entry_that_lives_on_in_the_l2(redis_server):
    """bloom_guard_l2 skips the L2 when the filter says "no entry", so the filter must know every code whose
    entry is in the L2. Three ways it forgot some: told only what L1 admitted, it missed what L1's admission
    refused yet the L2 holds (131 of 200 served before the fix); rebuilt from L1's live entries once full,
    it dropped those evicted from L1; and keyed by L1's tenant ids, which are reused once a tenant has nothing
    in L1, it lost a tenant's codes when the tenant came back under another id. Every entry alive in the L2
    is served, as by a replica without the guard."""
    rng = np.random.default_rng(5)
    xs = rng.normal(size=(3000, 16)).astype(np.float32)
    for policy in ("wtinylfu", "lru"):   # refused by admission; admitted, then evicted (the filter grows)
        guard = _cache(redis_server, bloom_guard_l2=True, capacity_bytes=4000, policy=policy,
                       l2={"prefix": f"guard-{policy}"})
        for i, x in enumerate(xs):
            guard.put("text", features=x, value=i, tenant="a")
        served = [guard.get("text", features=x, tenant="a") for x in xs[:200]]
        assert [h.value for h in served if h is not None] == list(range(200)), policy
        assert len(guard) < 100 and guard.bloom.expected_items > 1024
    # "a" leaves L1 (its id is freed and taken by "c"), then comes back under another id
    for i, x in enumerate(rng.normal(size=(200, 16)).astype(np.float32)):
        guard.put("text", features=x, value=i, tenant="b")
    gone = guard.l1._free_tenant_ids[-1:]
    assert "a" not in guard.l1._tenant_ids and gone
    guard.put("text", features=rng.normal(size=16).astype(np.float32), value=0, tenant="c")
    guard.put("text", features=rng.normal(size=16).astype(np.float32), value=0, tenant="a")
    assert guard.l1._tenant_ids["c"] == gone[0] != guard.l1._tenant_ids["a"]
    served = [guard.get("text", features=x, tenant="a") for x in xs[200:400]]
    assert [h.value for h in served if h is not None] == list(range(200, 400))


def test_lookup_many_asks_the_l2_once_per_batch_and_answers_as_lookup_does(redis_server):
    """A batch's L1 misses go to the L2 in two round trips (the probe buckets, then the candidates'
    entries); the answers are those of `lookup` of each query on a cache with the same L1 and L2: the
    same values and distances, and the same entries promoted into L1, for hits, near hits, misses and
    queries repeated within the batch."""
    rng = np.random.default_rng(8)
    writer = _cache(redis_server, l2={"prefix": "many"})
    base = rng.integers(0, 256, size=(60, 8), dtype=np.uint8)
    for i, c in enumerate(base):
        writer.store(writer.query_from_code("text", c), {"i": i})
    picks = [base[rng.integers(60)].tobytes() if rng.random() < 0.6 else rng.integers(0, 256, 8, dtype=np.uint8).tobytes()
             for _ in range(80)]
    codes = [np.frombuffer(_flip(c, rng.integers(0, 64, size=rng.integers(0, 4))), np.uint8) for c in picks]
    codes += codes[:5]   # repeats within the batch
    batch, single = _cache(redis_server, l2={"prefix": "many"}), _cache(redis_server, l2={"prefix": "many"})
    for c in base[:10]:   # some entries in both L1s already
        for cache in (batch, single):
            cache.l1.put("default", writer.l1.table.read(int(writer.l1._backends[0].search(c, 0)[0][0]),
                                                         writer.l1._modalities, writer.revision))
    l2 = batch._serving[1][1]
    calls = []
    real = l2._call
    l2._call = lambda op, fn: calls.append(op) or real(op, fn)
    got = batch.lookup_many([batch.query_from_code("text", c) for c in codes])
    assert [op for op in calls if op != "watermark"] == ["lookup", "fetch"], calls
    want = [single.lookup(single.query_from_code("text", c)) for c in codes]
    # the tier may differ: one by one, an entry promoted by an earlier query is an L1 hit for a later one;
    # a batch's L1 is searched once, before its misses go to the L2
    assert [(h.value, h.distance) if h else None for h in got] == [(h.value, h.distance) if h else None for h in want]
    assert all(g.tier == "l2" for g, w in zip(got, want) if g is not None and w.tier == "l2")
    tiers = [h.tier for h in got if h is not None]
    assert tiers.count("l2") >= 20 and tiers.count("l1") >= 3 and sum(h is None for h in got) >= 10
    assert len(batch.l1.table.live_slots()) == len(single.l1.table.live_slots())


def test_replicas_share_entries_through_l2(redis_server):
    a, b = _cache(redis_server), _cache(redis_server)
    x = np.linspace(-1, 1, 16).astype(np.float32)
    assert a.put("image", features=x, value={"caption": "a frog"})
    hit = b.get("text", features=x + 0.01)
    assert hit is not None and hit.tier == "l2" and hit.value == {"caption": "a frog"}
    assert b.get("text", features=x).tier == "l1"  # promoted into b's L1
    assert b.metrics.value("cache_hits_total", tier="l2") == 1
    assert b.get("text", features=-x) is None
    # the payload check applies to L2 entries too
    strict = _cache(redis_server, payload_threshold=0.999999)
    far = x.copy()
    far[:3] += 0.6
    h = strict.get("text", features=far)
    assert h is None or h.cosine >= 0.999999


def test_answers_under_other_metadata_share_the_l2_and_keep_their_scope(redis_server):
    """check/store through the L2: a replica finds each model's answer for the same request by its filter,
    and the one it copies into its L1 keeps its scope (it does not replace the other model's there)."""
    a, b = _cache(redis_server), _cache(redis_server)
    x = np.linspace(-1, 1, 16).astype(np.float32)
    for model in ("m1", "m2"):
        a.store(None, f"answer of {model}", "text", features=x, metadata={"model": model})
    for model in ("m2", "m1", "m2"):
        hits = b.check(features=x, num_results=4, filters={"model": model})
        assert [h["response"] for h in hits] == [f"answer of {model}"], model
    assert sorted(b.l1.table.scope.values()) == sorted({e for e in a.l1.table.scope.values()})


def test_the_same_request_stored_again_replaces_its_l2_entry(redis_server):
    """As in L1: a replica (empty L1, the same L2) sees only the newer answer; another scope is kept apart."""
    a = _cache(redis_server)
    x = np.linspace(-1, 1, 16).astype(np.float32)
    a.store(None, "old answer", "text", features=x, metadata={"model": "m1"})
    a.store(None, "new answer", "text", features=x, metadata={"model": "m1"})
    a.store(None, "other model", "text", features=x, metadata={"model": "m2"})
    b = _cache(redis_server)
    assert [h["response"] for h in b.check(features=x, num_results=5, filters={"model": "m1"})] == ["new answer"]
    assert sorted(h["response"] for h in _cache(redis_server).check(features=x, num_results=5)) == \
        ["new answer", "other model"]
    assert len(list(redis_server.client.scan_iter(match="ushash:*:e:*"))) == 2



def test_drop_removes_the_entry_from_the_l2_and_every_copy_this_replica_holds(redis_server):
    """`drop` of an L1 hit removes its shared entry too, and of an L2 hit the copy it promoted into L1: no
    replica sharing the L2 finds it again, and a lookup drops its bucket members (lazily, as an expired
    entry's). An id holding the same request stored again since (a newer answer) keeps it."""
    client = redis_server.client
    entries = lambda: list(client.scan_iter(match="ushash:{default}:e:*"))   # noqa: E731
    a, b = _cache(redis_server), _cache(redis_server)
    x, y = np.linspace(-1, 1, 16).astype(np.float32), np.ones(16, np.float32)
    a.store(None, "a tree frog", "text", features=x, metadata={"model": "m1"})
    hit = a.check(features=x)[0]
    assert hit["tier"] == "l1" and len(entries()) == 1 and list(client.scan_iter(match="ushash:{default}:b:*"))
    assert a.drop(hit) == 1 and entries() == [] and a.check(features=x) == []
    assert b.check(features=x) == [] and not list(client.scan_iter(match="ushash:{default}:b:*"))
    assert a.drop(hit) == 0
    # an L2 hit: the entry and the L1 copy its lookup made are removed
    a.put("text", features=y, value="old")
    h = b.get("text", features=y)
    assert h.tier == "l2" and b.get("text", features=y).tier == "l1"
    assert b.drop(h) == 1 and entries() == [] and b.get("text", features=y) is None
    assert _cache(redis_server).get("text", features=y) is None
    # stored again under its id since the lookup: the L2 keeps the newer answer (b's own L1 copy of it goes: as
    # a's put replaced the entry, b heard of it and dropped the copy, or b's drop takes it)
    a.put("text", features=y, value="old")
    h = b.get("text", features=y)
    a.put("text", features=y, value="new")
    assert b.drop(h) in (0, 1) and len(entries()) == 1 and _cache(redis_server).get("text", features=y).value == "new"
    assert _until(lambda: b.get("text", features=y).value == "new")


def _until(ok, seconds: float = 5.0) -> bool:
    """Whether `ok()` became true within `seconds` (another replica's change arrives by pub/sub, asynchronously)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if ok():
            return True
        time.sleep(0.01)
    return ok()


def test_a_replica_drops_its_l1_copy_of_an_entry_another_replica_refreshed(redis_server):
    """A replica served its L1 copy of a shared entry until the copy expired (an hour by default), after another
    replica stored a fresh answer for the same request (the proxy's Cache-Control: no-cache) or dropped it. Each
    replica now hears the other's change on the L2's channel and drops its copy: its next lookup reads the L2."""
    a, b = _cache(redis_server), _cache(redis_server)
    x, y = np.linspace(-1, 1, 16).astype(np.float32), np.ones(16, np.float32)
    a.put("text", features=x, value="old")
    a.put("text", features=y, value="kept")
    assert b.get("text", features=x).tier == "l2" and b.get("text", features=x).tier == "l1"   # b's copy
    assert b.get("text", features=y).value == "kept"
    a.put("text", features=x, value="new")   # a refresh: the same request stored again
    assert _until(lambda: b.get("text", features=x).value == "new")
    assert b.get("text", features=y).tier == "l1"   # another entry's copy stays
    assert b.metrics.value("cache_evictions_total", reason="changed_elsewhere") == 1
    # a drop of the entry on one replica: the other's copy goes
    b.get("text", features=x)
    assert a.drop(a.check(features=x)[0]) == 1
    assert _until(lambda: b.get("text", features=x) is None)
    # a replica's own writes are not news to it: its entry stays in L1
    b.put("text", features=x, value="b's")
    b.put("text", features=x, value="b's again")
    time.sleep(0.2)
    assert b.get("text", features=x).tier == "l1"
    # a tenant deleted on one replica: the other's copies of its entries go, another tenant's stay
    c, d = _cache(redis_server, tenants=["t1", "t2"]), _cache(redis_server, tenants=["t1", "t2"])
    c.put("text", features=x, value="t1's", tenant="t1")
    c.put("text", features=x, value="t2's", tenant="t2")
    assert d.get("text", features=x, tenant="t1").tier == "l2" and d.get("text", features=x, tenant="t2").tier == "l2"
    c.delete_tenant("t1")
    assert _until(lambda: d.get("text", features=x, tenant="t1") is None)
    assert d.get("text", features=x, tenant="t2").tier == "l1"


@pytest.mark.parametrize("writer,tier", [("other", "l2"), ("own", "l1")])
def test_a_copy_read_before_a_change_is_not_kept(redis_server, writer, tier):
    """Between b's read of the old answer from the L2 and its copy into L1, the entry changes: another replica
    refreshes it (b hears of it, with nothing to drop yet) or b itself stores a new answer (its own writes are
    not messages it hears). The copy of the old answer was then kept until it expired, over b's own new one in
    the second case. A copy read before a change heard or made since is not kept; the read answer is served."""
    a, b = _cache(redis_server), _cache(redis_server)
    x = np.linspace(-1, 1, 16).astype(np.float32)
    a.put("text", features=x, value="old")
    store = b._serving[1][1]
    read = store.find_many

    def racing(*args, **kw):
        out = read(*args, **kw)                    # b has read the old entry ...
        (a if writer == "other" else b).put("text", features=x, value="new")
        assert _until(lambda: any(t == "default" for t, _ in b.l1._changes))   # ... and heard or made a change
        return out

    store.find_many = racing
    assert b.get("text", features=x).value == "old"   # served as it was read
    store.find_many = read
    hit = b.get("text", features=x)
    assert (hit.value, hit.tier) == ("new", tier)


def test_an_entry_stored_again_after_redis_lost_it_is_announced(redis_server):
    """A put announced only an entry it replaced: one Redis had evicted early (maxmemory) was stored again in
    silence, and other replicas kept their copies of the old answer. Every put is announced."""
    a, b = _cache(redis_server), _cache(redis_server)
    x = np.linspace(-1, 1, 16).astype(np.float32)
    a.put("text", features=x, value="old")
    assert b.get("text", features=x).tier == "l2" and b.get("text", features=x).tier == "l1"
    for key in redis_server.client.scan_iter(match="ushash:{default}:e:*"):
        redis_server.client.delete(key)   # as maxmemory's eviction would
    a.put("text", features=x, value="new")
    assert _until(lambda: b.get("text", features=x).value == "new")


def test_a_dropped_cache_ends_its_subscriber_and_is_freed(redis_server):
    """The thread held the cache's callback in a local while it waited for messages: a cache dropped without
    close() was never freed, nor its thread ended."""
    import gc
    import threading
    import weakref

    c = _cache(redis_server)
    name, ref = f"ushash-l2-changes-{c.l2.replica}", weakref.ref(c)
    assert name in {t.name for t in threading.enumerate()}
    del c
    assert _until(lambda: (gc.collect(), ref() is None)[1] and name not in {t.name for t in threading.enumerate()})


def test_a_subscription_gone_silent_is_taken_as_down(redis_server, monkeypatch):
    """A connection a NAT dropped silently gives no message and no error: the subscriber pings, and one that
    hears nothing (no PONG either) for SILENT_S is down: once subscribed again it drops every L1 copy."""
    import redis as redis_py

    from ushash.serving.cache.redis_store import _Listener

    monkeypatch.setattr(_Listener, "PING_S", 0.05)
    monkeypatch.setattr(_Listener, "SILENT_S", 0.3)
    a, b = _cache(redis_server), _cache(redis_server, l2={"breaker_backoff_s": 0.05})
    x = np.linspace(-1, 1, 16).astype(np.float32)
    a.put("text", features=x, value="old")
    assert b.get("text", features=x).tier == "l2" and b.get("text", features=x).tier == "l1"
    with monkeypatch.context() as silent:
        silent.setattr(redis_py.client.PubSub, "get_message", lambda self, *a, **kw: time.sleep(0.05))
        silent.setattr(redis_py.client.PubSub, "ping", lambda self, *a, **kw: None)
        assert _until(lambda: b.metrics.value("cache_evictions_total", reason="changed_elsewhere") >= 1)
    assert b.get("text", features=x).tier == "l2"


def test_a_refused_reload_keeps_the_subscription_and_does_not_stall(redis_server):
    """A reload onto a head the L2 refuses (another code length on this layout) closed the old store first: the
    cache went on without hearing changes, after waiting 5 s on its own subscriber thread."""
    a, b = _cache(redis_server), _cache(redis_server)
    x = np.linspace(-1, 1, 16).astype(np.float32)
    a.put("text", features=x, value="old")
    assert b.get("text", features=x).tier == "l2"
    t0 = time.monotonic()
    with pytest.raises(Exception):
        b.reload(LSHHead({"image": 16, "text": 16}, bits=128, dim=32, aligned=True, seed=0))
    assert time.monotonic() - t0 < 2.0 and b.l2._listener is not None
    a.put("text", features=x, value="new")
    assert _until(lambda: b.get("text", features=x).value == "new")


def test_a_replica_that_missed_changes_drops_every_l1_copy_once_it_hears_again(redis_server):
    """Pub/sub delivers at most once: a replica whose subscription dropped may have missed a change, so when it is
    subscribed again it drops every L1 copy of an L2 entry (its next lookups read the L2). Without the channel
    (`l2.invalidate: false`) a replica keeps its copies until they expire, as before."""
    a, b = _cache(redis_server), _cache(redis_server, l2={"breaker_backoff_s": 0.05})
    quiet = _cache(redis_server, l2={"invalidate": False})
    x = np.linspace(-1, 1, 16).astype(np.float32)
    a.put("text", features=x, value="old")
    assert b.get("text", features=x).tier == "l2" and quiet.get("text", features=x).tier == "l2"
    redis_server.client.client_kill_filter(_type="pubsub")   # every subscriber's connection cut
    assert _until(lambda: b.metrics.value("cache_evictions_total", reason="changed_elsewhere") == 1)
    assert b.get("text", features=x).tier == "l2"   # read from the L2 again, copied again
    a.put("text", features=x, value="new")
    assert _until(lambda: b.get("text", features=x).value == "new")   # subscribed again: it hears the change
    time.sleep(0.2)
    assert quiet.get("text", features=x).value == "old" and quiet.get("text", features=x).tier == "l1"
    b.close()

def test_tenants_are_isolated_in_l2_and_keys_share_a_cluster_slot(redis_server):
    from redis.cluster import key_slot

    a, b = _cache(redis_server), _cache(redis_server)
    x = np.ones(16, np.float32)
    a.put("text", features=x, value="acme", tenant="acme")
    assert b.get("text", features=x, tenant="globex") is None
    assert b.get("text", features=x, tenant="acme").value == "acme"
    keys = [k.decode() for k in redis_server.client.keys("ushash:*")]
    acme = [k for k in keys if "{acme}" in k]
    assert acme and len({key_slot(k.encode()) for k in acme}) == 1
    assert all(k in ("ushash:revisions", "ushash:layout") or "{acme}" in k for k in keys)


def test_ttl_is_kept_in_redis(redis_server):
    a, b = _cache(redis_server, ttl_s=1.0, ttl_jitter=0.0), _cache(redis_server)
    x = np.ones(16, np.float32)
    a.put("text", features=x, value=1)
    ek = [k for k in redis_server.client.keys("ushash:{default}:e:*")][0]
    assert 0 < redis_server.client.pttl(ek) <= 1000
    time.sleep(1.1)
    assert b.get("text", features=x) is None


def test_revision_watermark_across_replicas(redis_server, caplog):
    x = np.ones(16, np.float32)
    old = _cache(redis_server, revision="rev-1")
    old.put("text", features=x, value="old answer")
    assert old.get("text", features=x).value == "old answer"
    time.sleep(0.01)
    new = _cache(redis_server, revision="rev-2")  # a newer model is announced
    assert new.get("text", features=x) is None  # never an entry of rev-1
    # the old replica notices the watermark and stops serving (L1 included) and storing, and says so once
    with caplog.at_level("WARNING", logger="ushash.cache"):
        assert old.get("text", features=x) is None
        assert old.get("text", features=x) is None
    said = [r.getMessage() for r in caplog.records if "announced on the shared cache" in r.getMessage()]
    assert len(said) == 1 and "rev-2" in said[0] and "rev-1" in said[0] and "l2.prefix" in said[0]
    assert not old.put("text", features=x, value="stale write")
    assert old.metrics.value("cache_rejections_total", reason="stale_revision") >= 2
    # a replica restarted on the old revision does not win the watermark back
    again = _cache(redis_server, revision="rev-1")
    assert not again.watermark.current
    new.put("text", features=x, value="new answer")
    old.reload(_head("rev-2"))
    assert old.get("text", features=x).value == "new answer"


def test_redis_down_degrades_to_l1_and_counts(redis_server):
    a = _cache(redis_server, l2={"breaker_failures": 2, "breaker_backoff_s": 60})
    x = np.ones(16, np.float32)
    a.put("text", features=x, value="kept")
    redis_server.stop()
    assert a.get("text", features=x).value == "kept"  # L1 still serves
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for _ in range(20):
        y = rng.normal(size=16).astype(np.float32)
        assert a.get("text", features=y) is None  # misses go to L2, fail, are absorbed
        assert a.put("text", features=y, value="l1 only")  # stored in L1 all the same
        assert a.get("text", features=y).value == "l1 only"
    assert time.perf_counter() - t0 < 2.0
    errs = {op: a.metrics.value("cache_l2_errors_total", op=op)
            for op in ("watermark", "lookup", "put", "circuit_open")}
    assert errs["watermark"] + errs["lookup"] + errs["put"] == 2, errs  # then the circuit opened
    assert errs["circuit_open"] > 20, errs
    # a drop that cannot reach the L2 says so, and keeps the L1 entry for the drop to be made again
    with pytest.raises(RuntimeError, match="drop again"):
        a.drop(a.get("text", features=x))
    assert a.get("text", features=x).value == "kept"


def test_slow_redis_times_out_and_is_counted(redis_server):
    a = _cache(redis_server, l2={"timeout_s": 0.05, "breaker_failures": 100, "watermark_check_s": 60})
    x = np.ones(16, np.float32)
    a.put("text", features=x, value=1)
    blocker = threading.Thread(target=lambda: redis_server.client.execute_command("DEBUG", "SLEEP", "0.5"))
    blocker.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    assert a.get("text", features=-x) is None
    took = time.perf_counter() - t0
    blocker.join()
    assert took < 0.3, took
    assert a.metrics.value("cache_l2_errors_total", op="lookup") == 1


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli not installed")
def test_redis_cluster_layout(tmp_path):
    """Three masters on loopback: the lookup script (the union of a tenant's buckets), alone and in a pipeline,
    and the put script work because every key of a tenant carries the tenant's hash tag."""
    import redis

    nodes = []
    try:
        for i in range(3):
            d = tmp_path / f"n{i}"
            d.mkdir()
            port = _free_cluster_port(nodes[-1][0] + 1 if nodes else 20000 + os.getpid() % 20000)
            node = LocalRedis("--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"), "--dir",
                              str(d), port=port)
            nodes.append((port, node))
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p, _ in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        for _ in range(300):
            if b"cluster_state:ok" in redis.Redis(port=nodes[0][0]).execute_command("CLUSTER", "INFO"):
                break
            time.sleep(0.05)
        url = f"redis://127.0.0.1:{nodes[0][0]}/0"
        caches = [SemanticCache(_head(), {"radius": 3, "l2": {"url": url, "cluster": True, "watermark_check_s": 0,
                                                              "timeout_s": 1.0}}) for _ in range(2)]
        rng = np.random.default_rng(0)
        xs = rng.normal(size=(30, 16)).astype(np.float32)
        tenants = [f"t{i}" for i in range(10)]
        for i, x in enumerate(xs):
            assert caches[0].put("text", features=x, value=i, tenant=tenants[i % 10])
        for i, x in enumerate(xs):
            hit = caches[1].get("text", features=x, tenant=tenants[i % 10])
            assert hit is not None and hit.tier == "l2" and hit.value == i
            assert caches[1].get("text", features=x + 1e-3, tenant=tenants[(i + 1) % 10]) is None
        assert caches[0].metrics.value("cache_l2_errors_total", op="put") == 0
        assert sum(caches[1].metrics.value("cache_l2_errors_total", op=op) for op in ("lookup", "fetch")) == 0
        # a put that replaces an entry is heard by the other replica across the cluster (PUBLISH from the script
        # on the entry's node reaches a subscriber on any node): its L1 copy goes
        assert caches[1].get("text", features=xs[3], tenant="t3").tier == "l1"
        assert caches[0].put("text", features=xs[3], value="again", tenant="t3")
        assert _until(lambda: caches[1].get("text", features=xs[3], tenant="t3").value == "again")
        # a batch: the lookup script of every query in one cluster pipeline, on nodes that hold no script (a
        # restarted or new node: redis-py loads no script for a cluster pipeline, its EVALSHA was NOSCRIPT)
        for port, _ in nodes:
            redis.Redis(port=port).script_flush()
        fresh = SemanticCache(_head(), {"radius": 3, "l2": {"url": url, "cluster": True, "watermark_check_s": 0,
                                                            "timeout_s": 1.0}})
        hits = fresh.lookup_many(fresh.queries("text", features=xs[0::10]), tenant="t0")
        assert [h.value for h in hits] == [0, 10, 20] and {h.tier for h in hits} == {"l2"}
        # a gone entry's cleanup (its hash and its buckets, one slot) in a cluster pipeline: its members dropped
        for port, _ in nodes:
            redis.Redis(port=port).script_flush()
        store = fresh._serving[1][1]
        for port, _ in nodes:
            for k in redis.Redis(port=port).keys("ushash:{t1}:e:*"):
                store.r.delete(k)
        for x in xs[1::10]:
            assert fresh.get("text", features=x, tenant="t1") is None
        assert fresh.metrics.value("cache_l2_errors_total", op="cleanup") == 0
        assert not [k for port, _ in nodes for k in redis.Redis(port=port).keys("ushash:{t1}:*")]
        # the tenants spread over the cluster's masters
        owners = set()
        for port, _ in nodes:
            if redis.Redis(port=port).dbsize():
                owners.add(port)
        assert len(owners) >= 2
    finally:
        for _, node in nodes:
            node.stop()


def test_a_traced_l2_lookup_has_its_own_span(redis_server):
    """With a tracer, an L1 miss asked of the L2 is an `ushash.l2` span (strategy l2, the tenant, the batch
    size, and for a single lookup the hit and its distance) beside the L1's `ushash.search`."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ushash.serving.cache.telemetry import configure_tracing

    writer, reader = _cache(redis_server, l2={"prefix": "traced"}), _cache(redis_server, l2={"prefix": "traced"})
    code = np.random.default_rng(2).integers(0, 256, 8, dtype=np.uint8)
    writer.store(writer.query_from_code("text", code), "v")
    exporter = InMemorySpanExporter()
    reader.trace(configure_tracing(exporter=exporter))
    hit = reader.lookup(reader.query_from_code("text", np.frombuffer(_flip(code.tobytes(), [5]), np.uint8)))
    assert hit is not None and hit.value == "v" and hit.tier == "l2"
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"ushash.search", "ushash.l2"} <= set(spans)
    s = spans["ushash.l2"]
    assert s.attributes["cache.strategy"] == "l2" and s.attributes["cache.tenant"] == "default"
    assert s.attributes["cache.batch_size"] == 1 and s.attributes["cache.hit"] is True
    assert s.attributes["cache.distance"] == 1
    reader.trace(None)


def test_a_full_redis_fails_the_puts_but_keeps_serving_what_it_holds(redis_server):
    """Redis answering with an error (OOM under maxmemory with noeviction, its default policy) is up: the
    puts fail and are counted, and the circuit stays closed, so the entries it holds are still found (counted
    as an outage, the errors opened the circuit and cut those lookups too)."""
    writer = _cache(redis_server, l2={"breaker_failures": 2, "breaker_backoff_s": 60, "watermark_check_s": 60})
    rng = np.random.default_rng(1)
    old = rng.normal(size=(5, 16)).astype(np.float32)
    for i, x in enumerate(old):
        assert writer.put("text", features=x, value=f"answer {i}")
    c = redis_server.client
    c.config_set("maxmemory-policy", "noeviction")
    c.config_set("maxmemory", str(int(c.info("memory")["used_memory"]) + 1024))
    try:
        for x in rng.normal(size=(4, 16)).astype(np.float32):
            writer.put("text", features=x, value="x" * 100_000)      # stored in L1, refused by a full Redis
        assert writer.metrics.value("cache_l2_errors_total", op="put") == 4 and writer.l2.available
        writer.l1.delete_tenant("default")                             # as if its L1 had evicted them
        assert [writer.get("text", features=x).value for x in old] == [f"answer {i}" for i in range(5)]
        assert writer.metrics.value("cache_l2_errors_total", op="circuit_open") == 0
    finally:
        c.config_set("maxmemory", "0")


def test_a_revision_reloaded_during_an_l2_outage_is_announced_once_it_is_back(redis_server):
    """A head without an export time is ranked by when it is first announced: reloaded while the breaker was
    open, its announce failed and was never tried again, so once Redis answered the replica took the old
    revision for the newest and served nothing of the new one for good."""
    import redis

    cfg = {"breaker_failures": 3, "breaker_backoff_s": 0.2, "breaker_max_backoff_s": 0.2}
    a, b = _cache(redis_server, "r1", l2=cfg), _cache(redis_server, "r1", l2=cfg)
    time.sleep(0.01)
    for _ in range(3):                       # a blip seen by replica a: its breaker opens
        a.l2._report(redis.ConnectionError("blip"))
    assert not a.l2.available
    a.reload(_head("r2"))
    time.sleep(0.3)                          # Redis answers again
    x = np.ones(16, np.float32)
    assert a.put("text", features=x, value="r2 answer")
    assert a.watermark.current and not b.watermark.current
    assert [m.decode() for m in redis_server.client.zrange("ushash:revisions", 0, -1)] == ["r1", "r2"]
    assert a.get("text", features=x).value == "r2 answer"


def test_a_replica_splitting_codes_into_other_chunks_is_refused_at_start(redis_server):
    """Bucket keys are per code chunk: a replica with another l2.chunks read buckets the others never write,
    and found none of the entries Redis held (0 of 50 exact repeats), without a word."""
    a = _cache(redis_server, l2={"prefix": "layout"})
    x = np.ones(16, np.float32)
    a.put("text", features=x, value="stored with 4 chunks")
    assert _cache(redis_server, l2={"prefix": "layout", "chunks": 4}).get("text", features=x) is not None
    with pytest.raises(ValueError, match=r"l2\.chunks gives chunks=8, but the entries under prefix 'layout' .* "
                                         r"chunks=4.*Set l2\.chunks=4, or use another l2\.prefix"):
        _cache(redis_server, l2={"prefix": "layout", "chunks": 8})
    assert _cache(redis_server, l2={"prefix": "layout-8", "chunks": 8}).get("text", features=x) is None


def _crowd(srv, n: int = 12, size: int = 40_000, z=None):
    """A request's code `q` and, in the L2, an entry at distance 0 that a text request is refused (an image
    entry, cross_modal off; or, with `z` (the request's), a text entry whose payload is far from it) and `n` text
    entries at distance 1 (payload `z`), each answer `size` characters; (q, the distance-1 entries' answers by id)."""
    a = _cache(srv, cross_modal=False)
    q = np.random.default_rng(4).integers(0, 256, 8, dtype=np.uint8)
    if z is None:
        a.store(a.query_from_code("image", q), "i" * size)
    else:
        a.store(a.query_from_code("text", q, -np.asarray(z)), "f" * size)
    for j in range(n):
        near = np.frombuffer(_flip(q.tobytes(), [j]), np.uint8)
        a.store(a.query_from_code("text", near, z), f"{j:02d}" * (size // 2))
    answers = {}
    for key in srv.client.keys("ushash:*:e:*"):
        row = srv.client.hmget(key, ["m", "v"])
        if row[0] == b"text" and row[1][:1] != b"f":
            answers[key.decode().rsplit(":", 1)[1]] = row[1].decode()
    assert len(answers) == n
    return q, answers


def test_a_lookup_reads_the_answer_it_serves_not_every_candidates(redis_server):
    """An L2 lookup fetched every candidate's whole entry, answer included, to serve one: among max_candidates
    near-duplicates of large answers it moved them all. It reads the nearest candidate's answer with it and
    another's only once the hit check chooses it: here the image entry's (nearest, refused) and the chosen
    text entry's, the one first by (distance, id), of 13 candidates."""
    q, answers = _crowd(redis_server)
    b = _cache(redis_server, cross_modal=False)
    sent = lambda: redis_server.client.info("stats")["total_net_output_bytes"]   # noqa: E731
    before = sent()
    hit = b.lookup(b.query_from_code("text", q))
    moved = sent() - before
    assert hit is not None and hit.tier == "l2" and hit.value == answers[min(answers)]
    assert moved < 2.5 * 40_000, moved   # reading every candidate's answer: 13 x 40 KB
    assert b.lookup(b.query_from_code("text", q)).value == hit.value   # promoted into L1 with its answer


def _unit_z(seed: int = 8) -> np.ndarray:
    z = np.random.default_rng(seed).normal(size=32).astype(np.float32)
    return z / np.linalg.norm(z)


def _on_fetch(cache, act) -> list[set]:
    """Wrap `cache`'s L2 entry reads (`RedisStore._fetch`): before each, `act(n, tenant, ids)` with n the
    read's number (1: the candidates; later: the answers of chosen entries). Returns the ids each read asked for."""
    fetch, asked = cache.l2._fetch, []

    def wrapped(tenant, fields):
        asked.append(set(fields))
        act(len(asked), tenant, fields)
        return fetch(tenant, fields)

    cache.l2._fetch = wrapped
    return asked


@pytest.mark.parametrize("change", ["corrupt", "gone", "expired"])
def test_a_chosen_entry_that_changes_before_its_answer_is_read_is_passed_over(redis_server, change):
    """Between reading the candidates and reading the chosen one's answer, the entry is made unreadable,
    dropped or expired: the next candidate by (distance, id) is served (its answer read in one more round
    trip), an unreadable entry counted as corrupt, and nothing of the changed entry is served or promoted. The
    nearest candidate's refusal is counted once, as in a lookup where nothing changes (choosing again counted
    it again)."""
    z = _unit_z()
    q, answers = _crowd(redis_server, z=z)
    first, second = sorted(answers)[:2]

    def refused(cache):
        return {s.labels["reason"]: s.value for metric in cache.metrics.registry.collect()
                if metric.name == "cache_rejections" for s in metric.samples if s.name == "cache_rejections_total"}

    plain = _cache(redis_server, cross_modal=False)
    assert plain.lookup(plain.query_from_code("text", q, z)).value == answers[first]
    assert refused(plain) == {"payload": 1.0}   # the nearest entry, its payload far from the request's z
    b = _cache(redis_server, cross_modal=False)
    key = b.l2.entry_key("default", first)

    def changing(n, tenant, fields):
        if n == 2:   # the chosen entry's answer, after the candidates were read
            {"corrupt": lambda: redis_server.client.hset(key, "k", b"zz"),
             "gone": lambda: redis_server.client.delete(key),
             "expired": lambda: redis_server.client.hset(key, "x", repr(b.l2.clock() - 1.0))}[change]()

    asked = _on_fetch(b, changing)
    hit = b.lookup(b.query_from_code("text", q, z))
    assert hit is not None and hit.value == answers[second]
    assert asked[1:] == [{first}, {second}]
    assert b.metrics.value("cache_l2_errors_total", op="corrupt") == (1 if change == "corrupt" else 0)
    assert refused(b) == refused(plain)


def test_a_traced_choice_made_again_is_traced_and_counted_once(redis_server):
    """With a tracer, the choice made again after the chosen entry is found gone is an `ushash.verify` span of
    its own (it was made by the untraced check), and the rejections are still counted once."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ushash.serving.cache.telemetry import configure_tracing

    z = _unit_z()
    q, answers = _crowd(redis_server, z=z)
    first, second = sorted(answers)[:2]
    b = _cache(redis_server, cross_modal=False)
    exporter = InMemorySpanExporter()
    b.trace(configure_tracing(exporter=exporter))
    _on_fetch(b, lambda n, tenant, fields: n == 2 and redis_server.client.delete(b.l2.entry_key(tenant, first)))
    assert b.lookup(b.query_from_code("text", q, z)).value == answers[second]
    verify = [s for s in exporter.get_finished_spans() if s.name == "ushash.verify"]
    assert [s.attributes["cache.hit"] for s in verify] == [True, True]   # the first choice, then the second
    assert b.metrics.value("cache_rejections_total", reason="payload") == 1
    b.trace(None)


def test_top_k_from_the_l2_reads_each_served_entrys_answer(redis_server):
    """check / store's top-k: every entry of the k served from the L2 comes with its answer, by (distance, id)."""
    q, answers = _crowd(redis_server)
    b = _cache(redis_server, cross_modal=False)
    hits = b.lookup_top(b.query_from_code("text", q), k=4)
    assert [h.value for h in hits] == [answers[i] for i in sorted(answers)[:4]]


def test_top_k_keeps_what_it_read_when_its_choices_keep_vanishing(redis_server):
    """Top-k from the L2 where every answer read after the candidates is gone by then (each round's choice
    deleted as it is fetched, through all FETCH_ROUNDS): the entries of the last choice whose answers came with
    the candidates are served, by (distance, id), not nothing (the query was dropped whole)."""
    from ushash.serving.cache.redis_store import FETCH_ROUNDS

    q, answers = _crowd(redis_server)
    b = _cache(redis_server, cross_modal=False)

    def vanishing(n, tenant, fields):
        if n > 1:   # after the candidates: each answer asked for is deleted first
            for eid in fields:
                redis_server.client.delete(b.l2.entry_key(tenant, eid))

    asked = _on_fetch(b, vanishing)
    hits = b.lookup_top(b.query_from_code("text", q), k=4)
    ids = sorted(answers)
    assert asked[1:] == [{i} for i in ids[3:3 + FETCH_ROUNDS]]   # the 4th, then each next in line, vanishes
    assert [h.value for h in hits] == [answers[i] for i in ids[:3]]


def test_the_l2_fetch_benchmark_serves_the_same_entry_both_ways(monkeypatch):
    """benchmarks/l2_fetch.py at small sizes: both ways serve the same entry with the same answer (it asserts so),
    and with 8 candidates of 1 KB answers the served-answer way moves under half the bytes."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("l2_fetch_bench",
                                                  Path(__file__).resolve().parents[1] / "benchmarks/l2_fetch.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "CANDIDATES", (1, 8))
    monkeypatch.setattr(bench, "SIZES", (1024,))
    rows = bench.measure(2)
    assert [(r["candidates"], r["nearest refused"]) for r in rows] == [(1, False), (8, False), (8, True)]
    eight = rows[1]
    assert eight["served answer bytes"] < 0.5 * eight["every answer bytes"]
    assert "| 8 | 1 KB | the nearest |" in bench.markdown(rows, 2)


def test_local_redis_answers_when_started_and_says_why_it_did_not_start(monkeypatch):
    """The tests' and benchmarks' throwaway Redis (ushash.serving.localhost.LocalRedis) answers PING once
    constructed and is gone once stopped; a server that exits at start (a bad argument) is a RuntimeError with
    its own message, and no redis-server on PATH a FileNotFoundError saying how to install it."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    with LocalRedis() as srv:
        assert srv.client.ping() and srv.url == f"redis://127.0.0.1:{srv.port}/0"
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=srv.port, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0)).ping()
    with pytest.raises(RuntimeError, match="exited with code"):
        LocalRedis("--no-such-option", "yes")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="apt-get install redis-server"):
        LocalRedis()


def test_stats_name_the_l2_without_its_credentials():
    """/v1/stats, which any token may read, showed a password given as ?password= (redis-py reads it there too):
    only the part after '@' was cut."""
    from ushash.serving.cache.cache import _url_host

    assert _url_host("redis://127.0.0.1:6379/0?password=s3cret") == "redis://127.0.0.1:6379/0"
    assert _url_host("rediss://user:s3cret@cache.internal:6380/2") == "rediss://cache.internal:6380/2"
    assert _url_host("redis://:s3cret@[::1]:6379") == "redis://[::1]:6379"
    assert _url_host("unix:///run/redis.sock?db=0&password=s3cret") == "unix:///run/redis.sock"
    assert _url_host("redis://h:notaport/0") == "redis://h/0"
