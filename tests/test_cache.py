"""SemanticCache (L1): hits within the radius, payload check, tenants, revisions, TTL, XFetch,
single-flight, the Bloom guard, byte capacity and metrics, on every search backend."""

import asyncio
import dataclasses
import random
import threading
import time

import numpy as np
import pytest

from ushash.serving.cache import CacheConfig, InvalidTenant, RequestError, SemanticCache, UnknownTenant
from ushash.serving.cache.lsh import LSHHead
from ushash.core.codes import hamming

BACKENDS = [
    pytest.param({"backend": "mindex", "mih_min_entries": 64}, id="mindex"),
    pytest.param({"backend": "flat"}, id="faiss-flat"),
    pytest.param({"backend": "mih"}, id="faiss-mih"),
    pytest.param({"backend": "torch", "device": "cpu"}, id="torch-cpu"),
    pytest.param({"backend": "torch", "device": "cuda"}, id="torch-cuda", marks=pytest.mark.gpu),
]


class FakeClock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


@pytest.fixture
def head():
    return LSHHead({"image": 24, "text": 24}, bits=64, dim=32, aligned=True, seed=0)


def _flip(code: bytes, bits) -> bytes:
    a = bytearray(code)
    for b in bits:
        a[b // 8] ^= 1 << (b % 8)
    return bytes(a)


def _unit(rng, dim=32):
    v = rng.normal(size=dim).astype(np.float32)
    return v / np.linalg.norm(v)


def test_hit_within_radius_and_miss_beyond(head):
    cache = SemanticCache(head, {"radius": 3, "payload_check": False})
    code = bytes(range(8))
    cache.store(cache.query_from_code("text", np.frombuffer(code, np.uint8)), "answer")
    for d in range(6):
        q = cache.query_from_code("text", np.frombuffer(_flip(code, range(0, 8 * d, 8)), np.uint8))
        hit = cache.lookup(q)
        assert (hit is not None) == (d <= 3), d
        if hit:
            assert hit.distance == d and hit.value == "answer" and hit.tier == "l1"
    m = cache.metrics
    assert m.value("cache_gets_total", result="hit") == 4
    assert m.value("cache_gets_total", result="miss") == 2


@pytest.mark.parametrize("opts", BACKENDS)
def test_lookups_match_a_naive_reference(head, opts):
    """Random stores and lookups around a few centres: every answer equals the brute-force rule
    (nearest within radius whose decoded payload has cosine >= threshold; ties by cosine)."""
    rng = np.random.default_rng(1)
    cache = SemanticCache(head, {"radius": 4, "payload_threshold": 0.5, "ttl_s": 0, "bloom": True, **opts})
    codec = head.payload
    centres = rng.integers(0, 256, size=(6, 8), dtype=np.uint8)
    zc = [_unit(rng) for _ in range(6)]
    entries = []  # (code, z_decoded, value, modality)
    for i in range(400):
        c = rng.integers(6)
        code = _flip(centres[c].tobytes(), rng.integers(0, 64, size=rng.integers(0, 5)))
        z = zc[c] + 0.6 * _unit(rng)
        z /= np.linalg.norm(z)
        mod = ["image", "text"][i % 2]
        q = cache.query_from_code(mod, np.frombuffer(code, np.uint8), z)
        if rng.random() < 0.5:
            hit = cache.lookup(q)
            ref = None
            if entries:
                codes = np.stack([np.frombuffer(e[0], np.uint8) for e in entries])
                d = hamming(np.frombuffer(code, np.uint8)[None], codes)[0]
                best = None
                for j in np.flatnonzero(d <= 4):
                    cos = float(np.dot(z, entries[j][1]) / np.linalg.norm(entries[j][1]))
                    if cos >= 0.5 - 1e-6:
                        key = (d[j], -cos)
                        if best is None or key < best[0]:
                            best = (key, entries[j][2])
                ref = None if best is None else best[1]
            assert (hit.value if hit else None) == ref, i
        else:
            cache.store(q, f"v{i}")
            dec = codec.decode(mod, codec.encode(mod, z[None]))[0]
            entries.append((code, dec, f"v{i}", mod))


def test_payload_check_rejects_a_near_code_with_a_far_embedding(head):
    rng = np.random.default_rng(2)
    cache = SemanticCache(head, {"radius": 2, "payload_threshold": 0.8})
    z = _unit(rng)
    code = np.arange(8, dtype=np.uint8)
    cache.store(cache.query_from_code("image", code, z), "img")
    assert cache.lookup(cache.query_from_code("text", code, z)).cosine > 0.95
    far = cache.lookup(cache.query_from_code("text", code, -z))
    assert far is None
    assert cache.metrics.value("cache_rejections_total", reason="payload") == 1
    # the threshold is configurable: -1 accepts anything
    loose = SemanticCache(head, {"radius": 2, "payload_threshold": -1.0})
    loose.store(loose.query_from_code("image", code, z), "img")
    assert loose.lookup(loose.query_from_code("text", code, -z)) is not None


def test_cross_modal_can_be_switched_off(head):
    x = np.ones(24, np.float32)
    on = SemanticCache(head, {})
    on.put("image", features=x, value=1)
    assert on.get("text", features=x) is not None
    off = SemanticCache(head, {"cross_modal": False})
    off.put("image", features=x, value=1)
    assert off.get("text", features=x) is None and off.get("image", features=x) is not None


def test_tenants_never_see_each_other(head):
    x = np.ones(24, np.float32)
    cache = SemanticCache(head, {"tenants": ["acme", "globex"]})
    cache.put("text", features=x, value="acme's", tenant="acme")
    assert cache.get("text", features=x, tenant="globex") is None
    assert cache.get("text", features=x, tenant="acme").value == "acme's"
    with pytest.raises(UnknownTenant, match="unknown tenant 'initech'"):
        cache.get("text", features=x, tenant="initech")
    with pytest.raises(InvalidTenant, match="tenant must be"):
        SemanticCache(head, {}).get("text", features=x, tenant="{acme}")


def test_revision_change_never_serves_older_entries(head):
    x = np.ones(24, np.float32)
    cache = SemanticCache(head, {})
    cache.put("text", features=x, value="old")
    hit = cache.get("text", features=x)
    assert hit.revision == head.revision
    new = LSHHead({"image": 24, "text": 24}, bits=64, dim=32, aligned=True, seed=0, revision="r2")
    cache.reload(new)
    assert cache.revision == "r2"
    assert cache.get("text", features=x) is None
    assert cache.metrics.value("cache_evictions_total", reason="revision") == 1
    cache.put("text", features=x, value="new")
    assert cache.get("text", features=x).revision == "r2"


def test_an_lsh_heads_revision_names_its_payload_codec():
    """Entries keep the codec's bytes: a head that reads them through another codec is another revision."""
    from ushash.serving.payload import PayloadCodec

    def lsh(codec=None):
        return LSHHead({"image": 24, "text": 24}, bits=64, dim=32, aligned=True, seed=0, payload=codec)

    int4 = PayloadCodec.default(32, ("image", "text"), {"all": {"kind": "int4", "scale": "group", "group_size": 8}})
    int4_g16 = PayloadCodec.default(32, ("image", "text"), {"all": {"kind": "int4", "scale": "group", "group_size": 16}})
    fp16 = PayloadCodec.default(32, ("image", "text"), {"all": {"kind": "fp16"}})
    assert lsh().revision == lsh().revision == lsh(PayloadCodec.default(32, ("image", "text"))).revision
    assert len({lsh(int4).revision, lsh(int4_g16).revision, lsh(fp16).revision, lsh().revision}) == 4
    assert LSHHead.over(lsh()).revision != LSHHead.over(lsh(fp16)).revision
    rng = np.random.default_rng(0)

    def channel(scale):   # int4 with per-channel scales fitted on a sample: the scales are the codec too
        codec = PayloadCodec.default(32, ("image", "text"), {"all": {"kind": "int4", "scale": "channel"}})
        return codec.fit({m: rng.normal(size=(64, 32)).astype(np.float32) * scale for m in ("image", "text")})

    assert lsh(channel(1.0)).revision != lsh(channel(3.0)).revision


def test_an_answer_is_kept_no_longer_than_its_origin_allows():
    """Freshness.within: the TTL given (None: the cache's; 0: none), cut to the seconds the origin says its answer
    stays fresh; an origin that says nothing leaves the TTL as given."""
    from ushash.serving.cache.freshness import Freshness

    hour = Freshness(ttl_s=3600)
    assert hour.within(None) is None and hour.within(None, 30) == 30 and hour.within(None, 0) == 0
    assert hour.within(60.0) == 60 and hour.within(7200.0) == 3600
    assert hour.within(60.0, 30) == 30 and hour.within(60.0, 0) == 60 and hour.within(10.0, 7200) == 10
    assert Freshness(ttl_s=None).within(60.0) == 60 and Freshness(ttl_s=None).within(None) is None
    for stale in (0.0, -1.0, float("nan")):   # never 0, which would store it with no expiry
        with pytest.raises(ValueError, match="stale"):
            hour.within(stale)
    with pytest.raises(ValueError, match="stale"):   # fresh for less than the shortest TTL: as good as stale
        hour.within(1e-300)


def test_a_ttl_too_short_to_outlive_the_store_is_refused_and_the_live_entry_kept():
    """A TTL of 1e-300 s expired as it was stored (now + ttl == now), and the store still said it stored it,
    after replacing the live entry of the same request: the request then missed. Below MIN_TTL_S it is refused."""
    from ushash.serving.cache.freshness import MIN_TTL_S

    cache = SemanticCache(LSHHead({"text": 8}, bits=64, dim=16), {"radius": 0}, clock=FakeClock())
    x = np.ones(8, dtype=np.float32)
    cache.put("text", features=x, value="live")
    for ttl in (1e-300, 1e-12, MIN_TTL_S / 2):
        with pytest.raises(ValueError, match="at least"):
            cache.put("text", features=x, value="gone", ttl_s=ttl)
    assert cache.get("text", features=x).value == "live"
    cache.put("text", features=x, value="short", ttl_s=MIN_TTL_S)
    assert cache.get("text", features=x).value == "short"


def test_ttl_with_jitter_expires_entries():
    clock = FakeClock()
    head = LSHHead({"text": 8}, bits=64, dim=16)
    cache = SemanticCache(head, {"ttl_s": 100, "ttl_jitter": 0.2, "xfetch_beta": 0, "radius": 0}, clock=clock,
                          rng=random.Random(0))
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(50, 8)).astype(np.float32)
    for x in xs:
        cache.put("text", features=x, value=1)
    exp = np.array([cache.get("text", features=x).expires for x in xs]) - clock.t
    assert (exp <= 100).all() and (exp > 80).all() and len(np.unique(exp)) == 50  # spread, never beyond ttl
    clock.t += 90
    alive = sum(cache.get("text", features=x) is not None for x in xs)
    assert alive == int((exp > 90).sum())
    assert cache.metrics.value("cache_evictions_total", reason="expired") == 50 - alive
    clock.t += 11
    assert all(cache.get("text", features=x) is None for x in xs) and len(cache) == 0
    # a hit does not extend an entry's life (no sliding TTL)
    cache.put("text", features=xs[0], value=2, ttl_s=10)
    expires = cache.get("text", features=xs[0]).expires
    while clock.t + 1 < expires:
        clock.t += 1
        assert cache.get("text", features=xs[0]).expires == expires
    clock.t = expires
    assert cache.get("text", features=xs[0]) is None


def test_xfetch_refreshes_hot_entries_early_once():
    clock = FakeClock()
    head = LSHHead({"text": 8}, bits=64, dim=16)
    cache = SemanticCache(head, {"ttl_s": 100, "ttl_jitter": 0, "xfetch_beta": 1.0}, clock=clock,
                          rng=random.Random(0))
    x = np.ones(8, np.float32)
    calls = []

    def compute():
        calls.append(1)
        clock.t += 5.0  # recomputation takes 5 s of this clock
        return len(calls)

    assert cache.get_or_compute("text", features=x, compute=compute).computed
    clock.t += 50
    refreshed = sum(cache.get("text", features=x).refresh for _ in range(200))
    assert refreshed < 10  # P = exp(-(45)/5) ~ 1e-4
    clock.t += 44  # 1 s before expiry: refresh with P = 1 - exp(-1/5) per hit... most hits ask
    res = [cache.get_or_compute("text", features=x, compute=compute) for _ in range(30)]
    assert any(r.computed for r in res)
    assert cache.metrics.value("cache_early_refresh_total") >= 1
    assert cache.get("text", features=x).expires > clock.t + 50  # the refreshed entry is fresh


def test_single_flight_threads_compute_once():
    head = LSHHead({"text": 8}, bits=64, dim=16)
    cache = SemanticCache(head, {})
    x = np.ones(8, np.float32)
    calls = []
    barrier = threading.Barrier(8)

    def compute():
        calls.append(1)
        time.sleep(0.2)
        return "v"

    out = []

    def worker():
        barrier.wait()
        out.append(cache.get_or_compute("text", features=x, compute=compute))

    ts = [threading.Thread(target=worker) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(calls) == 1
    assert [r.value for r in out] == ["v"] * 8
    assert sum(r.waited for r in out) == 7
    assert cache.metrics.value("cache_singleflight_waits_total") == 7


def test_single_flight_asyncio_compute_once():
    head = LSHHead({"text": 8}, bits=64, dim=16)
    cache = SemanticCache(head, {})
    x = np.ones(8, np.float32)
    calls = []

    async def compute():
        calls.append(1)
        await asyncio.sleep(0.05)
        return "v"

    async def main():
        return await asyncio.gather(*[cache.aget_or_compute("text", features=x, compute=compute) for _ in range(10)])

    res = asyncio.run(main())
    assert len(calls) == 1 and all(r.value == "v" for r in res)


def test_an_l1_alone_keeps_no_bloom_filter(head):
    """The filter's "no entry" is only ever used for the L2 behind the L1 (an L1 has searched already): without
    an L2 there is none to keep up on every put and probe on every miss (tests/test_cache_redis.py has it)."""
    cache = SemanticCache(head, {"radius": 3, "bloom": True})
    assert cache.bloom is None
    cache.store(cache.query_from_code("text", np.zeros(8, np.uint8)), 1)
    assert cache.lookup(cache.query_from_code("text", np.full(8, 255, np.uint8))) is None
    assert cache.metrics.value("cache_bloom_skips_total") == 0


def test_capacity_is_bytes_and_evictions_are_counted(head):
    rng = np.random.default_rng(4)
    for policy in ("lru", "lfu", "wtinylfu", "lruk"):
        cache = SemanticCache(head, {"capacity_bytes": 20_000, "policy": policy})
        for i in range(400):
            cache.put("text", features=rng.normal(size=24).astype(np.float32), value="x" * int(rng.integers(10, 200)))
            assert cache.policy.used_bytes <= 20_000
        m = cache.metrics
        assert m.value("cache_size_bytes") == cache.policy.used_bytes > 10_000
        evicted = m.value("cache_evictions_total", reason="capacity") + m.value("cache_rejections_total", reason="admission")
        assert evicted + len(cache) == 400
        # bytes = codes + payloads + values of what is held
        t = cache.table
        held = sum(8 + int(t.plen[s]) + int(t.vlen[s]) for s in t.live_slots())
        assert held == cache.policy.used_bytes
    with pytest.raises(ValueError, match="unknown eviction policy"):
        CacheConfig(policy="fifo")


def test_values_bytes_str_json(head):
    cache = SemanticCache(head, {"radius": 0})
    rng = np.random.default_rng(5)
    for v in (b"\x00\xffraw", "text ☃", {"answer": [1, 2.5, None]}, 7):
        x = rng.normal(size=24).astype(np.float32)
        cache.put("text", features=x, value=v)
        assert cache.get("text", features=x).value == v
    with pytest.raises(TypeError, match="JSON"):
        cache.put("text", features=np.ones(24, np.float32), value=object())


def test_bad_requests_raise_request_error(head):
    cache = SemanticCache(head, {})
    with pytest.raises(RequestError, match="modality 'video' is not served"):
        cache.get("video", features=np.ones(24))
    with pytest.raises(RequestError, match="vector of 24"):
        cache.get("text", features=np.ones(23))
    with pytest.raises(RequestError, match="finite"):
        cache.get("text", features=np.full(24, np.nan))
    with pytest.raises(RequestError, match="exactly one"):
        cache.get("text")


def test_metric_names(head):
    cache = SemanticCache(head, {})
    cache.put("text", features=np.ones(24, np.float32), value=1)
    cache.get("text", features=np.ones(24, np.float32))
    cache.get("text", features=-np.ones(24, np.float32))
    text = cache.metrics.text().decode()
    for name in ("cache_gets_total{result=\"hit\"}", "cache_gets_total{result=\"miss\"}", "cache_puts_total",
                 "cache_evictions_total", "cache_size_bytes", "cache_lookup_duration_seconds_bucket",
                 "cache_put_duration_seconds_bucket", "cache_nearest_hamming_distance_bucket{le=\"0.0\",result=\"hit\"}",
                 "cache_nearest_hamming_distance_count{result=\"miss\"}"):
        assert name in text, name
    # two caches never share series
    other = SemanticCache(head, {})
    assert other.metrics.value("cache_puts_total") == 0


# ------------------------------------------------------------------------------------------ shared pieces

def test_one_entry_record_for_l1_and_redis():
    """L1 columns and the Redis hash both hold every field of `Entry`, and give it back unchanged."""
    import math

    from ushash.serving.cache.entries import EntryTable, Entry
    from ushash.serving.cache.redis_store import REDIS_FIELDS, from_hash, to_hash

    e = Entry(code=bytes(range(8)), payload=b"\x01\x02", modality="image", value=b'{"a":1}', kind="j",
              revision="r1", created=1.5, expires=math.inf, compute_s=0.25, id="abc", scope=b"s" * 16)
    t = EntryTable(8, payload_bytes=2)
    slot = t.alloc()
    t.write(slot, e, tenant=0, modality=0)
    assert t.read(slot, ["image"], "r1") == e
    pairs = to_hash(e)
    row = [v if isinstance(v, bytes) else str(v).encode() for v in pairs[1::2]]   # what HMGET returns
    assert pairs[0::2] == [name for name, _, _ in REDIS_FIELDS.values()]
    assert from_hash("abc", row) == e
    assert e.nbytes == 8 + 2 + 7 + 16
    # an entry an older release wrote to Redis has no scope field: read as none
    legacy = row[:-1] + [None]
    assert from_hash("abc", legacy).scope == b""
    plain = dataclasses.replace(e, scope=b"")
    slot2 = t.alloc()
    t.write(slot2, plain, tenant=0, modality=0)
    assert t.read(slot2, ["image"], "r1") == plain and t.read_many([slot, slot2], ["image"], "r1") == [e, plain]
    t.release(slot)
    assert slot not in t.scope


def test_bloom_and_redis_probe_the_same_pigeonhole_chunks():
    from ushash.serving.cache.protection import BloomGuard, chunk_bounds, chunk_values, probe_masks
    from ushash.serving.cache.redis_store import RedisStore, revision_tag

    class Client:
        def register_script(self, script):
            return lambda **kw: 1

    store = RedisStore(bits=64, chunks=4, client=Client())
    bloom = BloomGuard(64, radius=5, chunks=4)
    rng = np.random.default_rng(7)
    code = rng.integers(0, 256, 8, dtype=np.uint8).tobytes()
    values = chunk_values(int.from_bytes(code, "little"), chunk_bounds(64, 4))
    masks = probe_masks(chunk_bounds(64, 4), 5 // 4)
    assert [len(m) for m in masks] == [17] * 4 and all(m[0] == 0 for m in masks)   # 16 one-bit flips + itself
    rtag = revision_tag("r")
    want = [store.bucket_key("t", rtag, j, v ^ m) for j, v in enumerate(values) for m in masks[j]]
    assert store.probe_keys("t", "r", code, 5) == want
    assert bloom._masks == masks
    # a chunking that would probe millions of values a lookup is refused before the masks are built (one chunk
    # of 64 bits within 6: 83 million Python ints, the process killed for memory)
    with pytest.raises(ValueError, match=r"probes 83,278,001 chunk values .*over 65,536: cut codes into more chunks"):
        BloomGuard(64, radius=6, chunks=1)
    with pytest.raises(ValueError, match=r"cut codes into more chunks \(cache.bloom_chunks, cache.l2.chunks"):
        RedisStore(bits=64, chunks=1, radius=6, client=Client())
    # every code within the radius shares a probed chunk value
    bloom.add(0, code)
    for _ in range(50):
        near = _flip(code, rng.choice(64, 5, replace=False))
        assert bloom.may_contain(0, near)


def test_redis_breaker_absorbs_failures_backs_off_and_never_serialises_calls():
    import redis

    from ushash.serving.cache.redis_store import L2Unavailable, RedisStore
    from ushash.serving.cache.telemetry import CacheMetrics

    class Client:
        def register_script(self, script):
            return lambda **kw: 1

    m = CacheMetrics(64)
    store = RedisStore(bits=64, client=Client(), breaker_failures=2, breaker_backoff_s=0.1, breaker_max_backoff_s=0.3,
                       metrics=m)

    def down():
        raise redis.ConnectionError("down")

    # two threads inside a Redis call at once: pybreaker's own call would hold its lock across the call
    barrier = threading.Barrier(2, timeout=5)
    out = []
    ts = [threading.Thread(target=lambda: out.append(store._call("lookup", lambda: barrier.wait()))) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(out) == 2
    for _ in range(2):
        with pytest.raises(L2Unavailable):
            store._call("lookup", down)
    assert not store.available and m.value("cache_l2_errors_total", op="lookup") == 2
    with pytest.raises(L2Unavailable):
        store._call("lookup", lambda: 1)  # open: not even tried
    assert m.value("cache_l2_errors_total", op="circuit_open") == 1
    time.sleep(0.12)
    assert store.available
    with pytest.raises(L2Unavailable):
        store._call("lookup", down)  # the trial call fails: open again, twice as long
    assert store._breaker.reset_timeout == pytest.approx(0.2)
    time.sleep(0.22)
    assert store._call("lookup", lambda: "back") == "back"
    assert store.available and store._breaker.reset_timeout == pytest.approx(0.1)


# ------------------------------------------------------------------------------------------ batches

@pytest.mark.parametrize("opts", BACKENDS)
def test_batches_equal_single_calls(head, opts):
    """lookup_many / store_many give what lookup / store one at a time give, ties (equal distance and
    equal cosine: duplicated entries) and repeated queries included, and leave the same cache."""
    rng = np.random.default_rng(3)
    cfg = {"radius": 4, "payload_threshold": 0.5, "ttl_s": 0, "max_candidates": 8, **opts}
    one, many = SemanticCache(head, cfg, rng=random.Random(0)), SemanticCache(head, cfg, rng=random.Random(0))
    centres = rng.integers(0, 256, size=(4, 8), dtype=np.uint8)
    zc = [_unit(rng) for _ in range(4)]
    qs = []
    for i in range(300):
        c = rng.integers(4)
        code = _flip(centres[c].tobytes(), rng.integers(0, 64, size=rng.integers(0, 4)))
        z = zc[c] + 0.5 * _unit(rng)
        qs.append(one.query_from_code(["image", "text"][i % 2], np.frombuffer(code, np.uint8),
                                      None if i % 7 == 0 else z))
    qs += qs[:20]  # the same requests again: replaced in place
    values = [f"v{i}" for i in range(len(qs))]
    for start in range(0, 200, 50):
        batch = slice(start, start + 50)
        assert many.store_many(qs[batch], values[batch]) == [one.store(q, v) for q, v in zip(qs[batch], values[batch])]
        probe = qs[200:] + qs[:10]
        got = many.lookup_many(probe)
        ref = [one.lookup(q) for q in probe]
        assert [(h.value, h.distance, h.cosine, h.entry) if h else None for h in got] == \
               [(h.value, h.distance, h.cosine, h.entry) if h else None for h in ref]
    assert len(one) == len(many) and one.policy.used_bytes == many.policy.used_bytes
    assert many.lookup_many([]) == []


def test_get_many_and_put_many_with_features(head):
    rng = np.random.default_rng(4)
    cache = SemanticCache(head, {"radius": 2})
    feats = rng.normal(size=(20, 24)).astype(np.float32)
    assert cache.put_many("text", features=feats[:10], values=list(range(10))) == [True] * 10
    hits = cache.get_many("text", features=feats)
    assert [h.value if h else None for h in hits] == list(range(10)) + [None] * 10
    assert [h.value if h else None for h in hits[:10]] == [cache.get("text", features=f).value for f in feats[:10]]
    with pytest.raises(RequestError):
        cache.get_many("text", features=feats[:, :5])


# ------------------------------------------------------------------------------------------ memory bounds

def test_expiry_records_and_tenant_indexes_are_bounded(head):
    """300 puts per slot of capacity: the expiry heap keeps about one record per live entry, and a
    tenant's index goes with its last entry."""
    clock = FakeClock()
    cache = SemanticCache(head, {"capacity_bytes": 4096, "ttl_s": 10 * 365 * 86400, "payload_check": False,
                                 "policy": "lru"}, clock=clock)
    rng = np.random.default_rng(5)
    for i in range(6000):
        code = rng.integers(0, 256, 8, dtype=np.uint8)
        cache.store(cache.query_from_code("text", code), "x" * 24, tenant=f"t{i}")
    assert 0 < len(cache) <= 4096 // 32
    assert len(cache.l1._expiry) <= 2 * len(cache) + 1024
    assert cache.l1.tenants == len({int(cache.table.tenant[s]) for s in cache.table.live_slots()}) <= len(cache)
    assert cache.delete_tenant(cache.l1._tenant_names[int(cache.table.tenant[cache.table.live_slots()[0]])]) == 1
    assert cache.l1.tenants == len(cache)


@pytest.mark.parametrize("cross_modal", [True, False])
def test_fused_l1_path_equals_the_general_path(cross_modal):
    """On the own multi-index with int4 payloads, L1 decides a batch in one compiled call (l1._find_fused);
    it must give exactly the general path's answers (value, distance, cosine, entry, nearest) and refusal
    counts: ties (duplicate entries), expiring entries, queries without z, payload refusals,
    max_candidates cutting a run, an observe radius beyond the radius, single lookups and batches."""
    from ushash.serving.cache.l1 import L1Tier
    from ushash.serving.payload import PayloadCodec

    codec = PayloadCodec.default(32, ("image", "text"), {"all": {"kind": "int4", "scale": "group", "group_size": 8}})
    hd = LSHHead({"image": 24, "text": 24}, bits=64, dim=32, aligned=True, seed=0, payload=codec)
    rng = np.random.default_rng(11)
    clock = FakeClock()
    cfg = {"radius": 4, "observe_radius": 6, "payload_threshold": 0.3, "ttl_s": 50, "ttl_jitter": 0.5,
           "max_candidates": 3, "mih_min_entries": 64, "backend": "mindex", "cross_modal": cross_modal}
    fused, general = (SemanticCache(hd, cfg, clock=clock, rng=random.Random(0)) for _ in range(2))
    general.l1._fused_params = lambda check: None
    centres = rng.integers(0, 256, size=(5, 8), dtype=np.uint8)
    zc = [_unit(rng) for _ in range(5)]
    qs = []
    for i in range(500):
        c = rng.integers(5)
        code = _flip(centres[c].tobytes(), rng.integers(0, 64, size=rng.integers(0, 5)))
        z = zc[c] + 0.7 * _unit(rng)
        qs.append(fused.query_from_code(["image", "text"][i % 2], np.frombuffer(code, np.uint8),
                                        None if i % 9 == 0 else z))
    seen_fused = 0
    for start in range(0, 400, 40):
        for cache in (fused, general):
            cache.store_many(qs[start:start + 40], [f"v{start + j}" for j in range(40)])
            cache.store_many(qs[start:start + 5], [f"w{start + j}" for j in range(5)])   # replaced
            if start % 80 == 0:   # a duplicate, stored separately: an exact tie
                cache.store(qs[start + 7], f"d{start}")
        clock.t += 9.0   # earlier entries expire as the stream goes on
        probe = qs[start + 40:start + 80] + qs[:30:3]
        fused.l1.lock.acquire()
        seen_fused += fused.l1._fused_params(fused.hit_check) is not None
        fused.l1.lock.release()
        a = fused.lookup_many(probe) + [fused.lookup(q) for q in probe[:10]]
        b = general.lookup_many(probe) + [general.lookup(q) for q in probe[:10]]
        assert [(h.value, h.distance, h.cosine, h.entry) if h else None for h in a] == \
               [(h.value, h.distance, h.cosine, h.entry) if h else None for h in b]
        fa = fused.l1.find_many(probe, "default", fused.revision, fused.hit_check, clock.t)
        fb = general.l1.find_many(probe, "default", general.revision, general.hit_check, clock.t)
        assert fa == fb
    assert seen_fused
    for reason in ("revision", "expired", "payload"):
        assert fused.metrics.value("cache_rejections_total", reason=reason) == \
               general.metrics.value("cache_rejections_total", reason=reason), reason
    assert fused.metrics.value("cache_rejections_total", reason="payload") > 0
    assert fused.metrics.value("cache_evictions_total", reason="expired") > 0
    assert isinstance(fused.l1, L1Tier)
