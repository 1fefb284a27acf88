"""Revisions under concurrency and data loss: a stream with reload() mid-flight and computes in flight
serves 0 stale hits, over L1 and over Redis with two instances; the revision watermark survives FLUSHALL,
a lost revisions key and replica restarts in any order."""

import random
import re
import threading
import time
from itertools import permutations

import numpy as np
import pytest
from test_cache_redis import REDIS, RedisServer

from ushash.serving.cache import SemanticCache
from ushash.serving.cache.lsh import LSHHead

REVS = ["rev-a", "rev-b", "rev-c", "rev-d"]


def _head(revision, created=None, seed=None):
    h = LSHHead({"image": 16, "text": 16}, bits=64, dim=32, aligned=True,
                seed=REVS.index(revision) if seed is None and revision in REVS else (seed or 0), revision=revision)
    if created is not None:
        h.manifest["created"] = created
    return h


def _stream(caches, reload_plan, n_workers=4, per_worker=400, seed=0):
    """Workers look up one of 24 requests on one of `caches`; a miss 'computes' (sleeps, so computes are in
    flight when reloads happen) and stores {"rev": the revision that encoded the request}. A hit is stale
    when its value was computed under another revision than the one it is filed and served under, or under
    another than the request's. Returns (hits, stale hits)."""
    xs = np.random.default_rng(seed).standard_normal((24, 16)).astype(np.float32)
    hits, stale = [0], [0]
    lock = threading.Lock()
    start = threading.Barrier(n_workers + 1)

    def worker(w):
        rng = random.Random(seed * 100 + w)
        start.wait()
        for _ in range(per_worker):
            cache = caches[rng.randrange(len(caches))]
            q = cache.query("text", features=xs[rng.randrange(len(xs))])
            hit = cache.lookup(q, "t")
            if hit is None:
                time.sleep(rng.random() * 0.002)  # a compute in flight
                cache.store(q, {"rev": q.revision}, "t")
                continue
            with lock:
                hits[0] += 1
                if hit.value["rev"] != hit.revision or hit.revision != q.revision:
                    stale[0] += 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(n_workers)]
    for t in threads:
        t.start()
    start.wait()
    for delay, cache, head in reload_plan:
        time.sleep(delay)
        cache.reload(head)
    for t in threads:
        t.join()
    return hits[0], stale[0]


def test_reload_mid_stream_serves_no_stale_hit_from_l1():
    cache = SemanticCache(_head("rev-a"), {"radius": 3, "payload_check": False})
    plan = [(0.05, cache, _head("rev-b")), (0.05, cache, _head("rev-c")), (0.05, cache, _head("rev-d"))]
    hits, stale = _stream([cache], plan)
    assert hits > 200 and stale == 0, (hits, stale)
    assert cache.metrics.value("cache_rejections_total", reason="query_revision") > 0  # the race did happen


def test_a_query_encoded_before_a_reload_is_neither_stored_nor_served():
    cache = SemanticCache(_head("rev-a"), {"radius": 3})
    x = np.ones(16, np.float32)
    q_old = cache.query("text", features=x)
    cache.reload(_head("rev-b"))
    assert not cache.store(q_old, "computed by rev-a", "t")
    assert cache.lookup(q_old, "t") is None
    q_new = cache.query("text", features=x)
    assert cache.store(q_new, "computed by rev-b", "t")
    assert cache.lookup(q_new, "t").value == "computed by rev-b" and cache.lookup(q_old, "t") is None


@pytest.mark.parametrize("first,then", [(("rev-b", None), ("rev-a", None)),
                                        (("rev-new", "2026-06-01T00:00:00Z"), ("rev-old", "2026-01-01T00:00:00Z"))])
def test_a_rollback_without_an_l2_serves_the_head_it_reloads(first, then):
    """Without an L2 the only newer revision a cache knows of is its own last head: reloading an older or
    lower-ranked one (a rollback) left it stale for good, every get a miss and every put refused."""
    cache = SemanticCache(_head(first[0], first[1], seed=0), {"radius": 3})
    x = np.ones(16, np.float32)
    cache.put("text", None, "old head's", features=x)
    cache.reload(_head(then[0], then[1], seed=0))
    assert cache.get("text", features=x) is None          # nothing of the old head
    assert cache.put("text", None, "rolled back", features=x) and cache.watermark.current
    assert cache.get("text", features=x).value == "rolled back"


@pytest.mark.skipif(REDIS is None, reason="redis-server not installed")
def test_a_reload_onto_wider_points_searches_the_l2_as_far():
    """The L2 store was kept across a reload with the old head's search radius: a replica reloaded onto a
    calibration of radius 6 searched its L2 at 1 and missed entries a fresh replica serves."""
    from ushash.serving.calibration import Calibration, PairPoint

    srv = RedisServer()
    try:
        cfg = {"radius": 1, "payload_threshold": -1.0, "l2": {"url": srv.url, "watermark_check_s": 0.0}}
        h1, h2 = _head("rev-a", "2026-01-01T00:00:00Z"), _head("rev-b", "2026-01-02T00:00:00Z")
        cal = Calibration("rev-b", 0.05, 0.95, {"text>text": PairPoint(True, 6, -1.0)})
        replica = SemanticCache(h1, cfg)
        writer = SemanticCache(h2, cfg, calibration=cal)
        code, z = np.zeros(8, np.uint8), np.ones(32, np.float32) / np.sqrt(32)
        near = code.copy()
        near[0] = 0b1111                                   # 4 bits from the query
        assert writer.store(writer.query_from_code("text", near, z), "answer", "t")
        replica.reload(h2, calibration=cal)
        assert (replica.l1.radius, replica.l2.radius) == (6, 6)
        hit = replica.lookup(replica.query_from_code("text", code, z), "t")
        assert hit is not None and (hit.value, hit.tier) == ("answer", "l2")
    finally:
        srv.stop()


@pytest.mark.skipif(REDIS is None, reason="redis-server not installed")
def test_reload_mid_stream_serves_no_stale_hit_over_redis_with_two_instances():
    srv = RedisServer()
    try:
        cfg = {"radius": 3, "payload_check": False, "l2": {"url": srv.url, "watermark_check_s": 0.0}}
        a = SemanticCache(_head("rev-a", "2026-01-01T00:00:00Z"), cfg)
        b = SemanticCache(_head("rev-a", "2026-01-01T00:00:00Z"), cfg)
        plan = [(0.1, a, _head("rev-b", "2026-01-02T00:00:00Z")), (0.03, b, _head("rev-b", "2026-01-02T00:00:00Z")),
                (0.1, b, _head("rev-c", "2026-01-03T00:00:00Z")), (0.03, a, _head("rev-c", "2026-01-03T00:00:00Z"))]
        hits, stale = _stream([a, b], plan)
        assert hits > 100 and stale == 0, (hits, stale)
        assert a.metrics.value("cache_hits_total", tier="l2") + b.metrics.value("cache_hits_total", tier="l2") > 0
    finally:
        srv.stop()


# --------------------------------------------------------------------------------------- watermark
OLD, NEW = ("rev-a", "2026-01-01T00:00:00Z"), ("rev-b", "2026-02-01T00:00:00Z")


def _replica(srv, rev):
    return SemanticCache(_head(*rev), {"radius": 3, "l2": {"url": srv.url, "watermark_check_s": 0.0}})


@pytest.fixture(scope="module")
def redis_srv():
    if REDIS is None:
        pytest.skip("redis-server not installed")
    srv = RedisServer()
    yield srv
    srv.stop()


@pytest.mark.parametrize("order", list(permutations(["old", "new"])))
def test_watermark_survives_flushall_and_fresh_restarts_in_any_order(redis_srv, order):
    redis_srv.client.flushall()
    old, new = _replica(redis_srv, OLD), _replica(redis_srv, NEW)
    assert new.watermark.current and not old.watermark.current
    redis_srv.client.flushall()  # Redis loses everything; both replicas restart with no memory
    started = {}
    for name in order:
        started[name] = _replica(redis_srv, OLD if name == "old" else NEW)
    for c in started.values():  # every replica checks once (watermark_check_s = 0: on every call)
        c.watermark.current
    assert started["new"].watermark.current
    assert not started["old"].watermark.current
    x = np.ones(16, np.float32)
    assert not started["old"].put("text", features=x, value="stale write")
    assert started["new"].put("text", features=x, value="new")


@pytest.mark.parametrize("loss", ["flushall", "del_revisions_key"])
def test_a_running_new_replica_restores_the_watermark_after_data_loss(redis_srv, loss):
    redis_srv.client.flushall()
    new = _replica(redis_srv, NEW)
    old = _replica(redis_srv, OLD)
    assert not old.watermark.current
    if loss == "flushall":
        redis_srv.client.flushall()
    else:  # what allkeys-lru may evict
        redis_srv.client.delete(new.l2.rev_key())
    again = _replica(redis_srv, OLD)  # an old replica starts again first, on an empty watermark
    assert not old.watermark.current  # the old one running remembers the newer revision and re-announces it
    assert not again.watermark.current
    assert new.watermark.current
    assert redis_srv.client.zrevrange(new.l2.rev_key(), 0, 0) == [NEW[0].encode()]


def test_a_head_without_a_creation_time_keeps_its_first_rank_after_data_loss(redis_srv):
    """A head without `created` (an LSH head) is ranked by its first announcement; after the L2 lost the set,
    the old replica announced its own revision again at the time of that check, above the newer one: the old
    model served again and the new one went stale."""
    redis_srv.client.flushall()
    old = _replica(redis_srv, ("rev-a", None))
    time.sleep(0.01)
    new = _replica(redis_srv, ("rev-b", None))
    assert new.watermark.current and not old.watermark.current
    time.sleep(0.01)
    redis_srv.client.delete(new.l2.rev_key())
    assert not old.watermark.current   # the old replica checks first: it announces the newer one, and itself below
    assert new.watermark.current and not old.watermark.current
    assert redis_srv.client.zrevrange(new.l2.rev_key(), 0, 0) == [b"rev-b"]


def test_a_rollback_raises_the_older_revisions_rank(redis_srv):
    """The documented rollback: the older revision's rank raised above the newer one's (ZADD with the time now),
    then the newer replicas reloaded to the older export. Removing the newer revision (ZREM) instead is undone
    by every replica that knew it, as it undoes a loss of the set."""
    redis_srv.client.flushall()
    new, other = _replica(redis_srv, NEW), _replica(redis_srv, NEW)
    key = new.l2.rev_key()
    redis_srv.client.zadd(key, {OLD[0]: time.time() * 1000})
    assert not new.watermark.current and not other.watermark.current   # rolled back: the newer model stops serving
    new.reload(_head(*OLD))
    fresh = _replica(redis_srv, OLD)
    assert new.watermark.current and fresh.watermark.current and not other.watermark.current
    redis_srv.client.delete(key)   # and a loss of the set after it keeps the rollback
    assert not other.watermark.current and new.watermark.current
    assert _replica(redis_srv, NEW).watermark.current is False
    x = np.ones(16, np.float32)
    assert new.put("text", features=x, value="answer of the older model")


def test_two_exports_made_in_one_second_are_ranked_by_the_millisecond(redis_srv):
    """`created` was written to the second: two exports made in one second (a re-export with a fix right after
    the first) tied, and the revision id that sorted higher won, here the older export: it kept serving and
    the one rolled out stored nothing. Exports now write milliseconds, and a manifest to the second still ranks."""
    from ushash.serving.cache.freshness import revision_rank
    from ushash.serving.export import created_now

    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", created_now())
    assert revision_rank(_head("rev-a", "2026-01-01T00:00:01Z")) == revision_rank(_head("rev-a", "2026-01-01T00:00:01.000Z"))
    redis_srv.client.flushall()
    first, second = ("rev-z", "2026-03-01T10:00:00.120Z"), ("rev-a", "2026-03-01T10:00:00.870Z")   # "rev-z" > "rev-a"
    new = _replica(redis_srv, second)
    old = _replica(redis_srv, first)     # an old replica (re)starting after the new one: ranked by its export's time
    assert new.watermark.current and not old.watermark.current
    x = np.ones(16, np.float32)
    assert new.put("text", features=x, value="the fixed model") and not old.put("text", features=x, value="stale")


def test_old_replica_that_started_first_goes_stale_when_the_new_one_checks(redis_srv):
    redis_srv.client.flushall()
    new = _replica(redis_srv, NEW)
    redis_srv.client.flushall()
    old = _replica(redis_srv, OLD)
    assert old.watermark.current  # nothing newer is known to Redis yet
    assert new.watermark.current  # ... until the new replica checks and announces again
    assert not old.watermark.current
