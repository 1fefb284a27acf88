"""The check / store interface (RedisVL-style) on SemanticCache: top-k, metadata filters, batches, async
twins, positional put, media file paths, and tenant names."""

import asyncio

import numpy as np
import pytest

from ushash.serving.cache import InvalidTenant, RequestError, SemanticCache, UnknownTenant
from ushash.serving.cache.api import MAX_MEDIA_FILE_BYTES, read_media_file
from ushash.serving.cache.lsh import LSHHead


@pytest.fixture
def cache():
    head = LSHHead({"image": 24, "text": 24}, bits=64, dim=32, aligned=True, seed=0)
    return SemanticCache(head, {"radius": 6, "payload_threshold": 0.9})


def _near(rng, x, eps=0.02):
    return x + eps * rng.normal(size=x.shape).astype(np.float32)


def test_store_then_check_returns_redisvl_fields(cache):
    x = np.ones(24, np.float32)
    key = cache.store(None, "a tree frog", "text", features=x, metadata={"user": "ann"})
    assert isinstance(key, str) and len(key) == 32
    hits = cache.check(features=x)
    assert len(hits) == 1
    h = hits[0]
    assert h["response"] == "a tree frog" and h["metadata"] == {"user": "ann"} and h["entry_id"] == key
    assert h["hamming_distance"] == 0 and h["vector_distance"] == pytest.approx(0.0, abs=1e-3)
    assert h["entry_modality"] == "text" and h["tier"] == "l1"
    assert cache.check(features=-x) == []


def test_top_k_best_first_and_metadata_filters(cache):
    rng = np.random.default_rng(0)
    x = np.ones(24, np.float32)
    users = ["ann", "bob", "ann", "cy"]
    for i, u in enumerate(users):
        cache.store(None, f"answer {i}", features=_near(rng, x, 0.01 * (i + 1)), metadata={"user": u})
    top = cache.check(features=x, num_results=3)
    assert len(top) == 3
    keys = [(h["hamming_distance"], -h["cosine"]) for h in top]
    assert keys == sorted(keys)
    ann = cache.check(features=x, num_results=4, filters={"user": "ann"})
    assert {h["response"] for h in ann} == {"answer 0", "answer 2"}
    assert {h["metadata"]["user"] for h in cache.check(features=x, num_results=4, filters={"user": ["bob", "cy"]})} \
        == {"bob", "cy"}
    assert cache.check(features=x, filters=lambda m: m["user"] == "cy")[0]["response"] == "answer 3"
    assert cache.check(features=x, filters={"user": "dan"}) == []
    with pytest.raises(ValueError):
        cache.check(features=x, num_results=0)
    with pytest.raises(TypeError):
        cache.check(features=x, filters="user=ann")


def test_the_same_request_under_other_metadata_is_another_entry(cache):
    """Stored again under the same metadata a request replaces its answer; under other metadata (another
    model, user, setting) the answers stay side by side and `filters` finds each: one did not evict the
    other, so requests alternating between two models both hit."""
    x = np.ones(24, np.float32)
    for model in ("m1", "m2", "m1", "m2"):
        cache.store(None, f"answer of {model}", features=x, metadata={"model": model})
    for model in ("m1", "m2"):
        hits = cache.check(features=x, num_results=4, filters={"model": model})
        assert [h["response"] for h in hits] == [f"answer of {model}"]
    assert len(cache.check(features=x, num_results=4)) == 2
    cache.store(None, "newer answer of m1", features=x, metadata={"model": "m1"})      # a refresh replaces
    assert [h["response"] for h in cache.check(features=x, num_results=4, filters={"model": "m1"})] == ["newer answer of m1"]
    # metadata is compared as content, not by key order; no metadata is a scope of its own
    cache.store(None, "plain", features=x)
    cache.store(None, "m3 a", features=x, metadata={"model": "m3", "user": "u"})
    cache.store(None, "m3 b", features=x, metadata={"user": "u", "model": "m3"})
    assert sorted(h["response"] for h in cache.check(features=x, num_results=8)) == \
        ["answer of m2", "m3 b", "newer answer of m1", "plain"]
    # numbers equal as JSON (what filters compare by) are one scope: 1.0 then 1 is a refresh, not two answers
    cache.store(None, "v old", features=0.5 * x, metadata={"v": 1.0, "w": [-0.0, 1e2]})
    cache.store(None, "v new", features=0.5 * x, metadata={"v": 1, "w": [0, 100]})
    assert [h["response"] for h in cache.check(features=0.5 * x, num_results=8, filters={"v": 1})] == ["v new"]
    # a batch: the same request twice in one scope keeps the later, in two scopes keeps both
    cache.store_batch(None, ["b1", "b2", "b3"], features=np.stack([-x, -x, -x]),
                      metadata=[{"k": 1}, {"k": 1}, {"k": 2}])
    assert sorted(h["response"] for h in cache.check(features=-x, num_results=8)) == ["b2", "b3"]


def test_filters_compare_json_values_exactly_and_never_raise_on_one(cache):
    """A bool is not a number (1 and 1.0 are one JSON number); a dict- or list-valued field is compared as
    a whole, never raising; a list filter value means one of its values, so a list field is given inside one."""
    x = np.ones(24, np.float32)
    cache.store(None, "A", features=x, metadata={"flag": True, "n": 1, "opts": {"t": 0}, "tags": ["a", "b"],
                                                 "grid": [[1, 2], [3]], "none": None})
    def got(filters):
        return [h["response"] for h in cache.check(features=x, filters=filters)]
    assert got({"flag": 1}) == [] and got({"flag": 1.0}) == [] and got({"flag": True}) == ["A"]
    assert got({"n": True}) == [] and got({"n": 1.0}) == ["A"] and got({"n": "1"}) == []
    assert got({"opts": "x"}) == [] and got({"opts": [{"t": 0}]}) == ["A"] and got({"opts": [{"t": False}]}) == []
    assert got({"tags": "a"}) == [] and got({"tags": ["a", "b"]}) == [] and got({"tags": [["a", "b"]]}) == ["A"]
    assert got({"grid": [[[1, 2], [3]]]}) == ["A"] and got({"grid": [[1, 2]]}) == []
    assert got({"none": None}) == ["A"] and got({"none": 0}) == [] and got({"flag": [False, True]}) == ["A"]
    with pytest.raises(ValueError, match="filters key 7 is not a string.*use '7'"):
        got({7: "seven"})


def test_metadata_must_be_json_and_is_refused_rather_than_changed(cache):
    x = np.ones(24, np.float32)
    with pytest.raises(ValueError, match="metadata key 7 is not a string: it is stored as JSON, whose keys are strings; use '7'"):
        cache.store(None, "r", features=x, metadata={7: "seven"})
    with pytest.raises(ValueError, match="metadata key 7 is not a string"):
        cache.store(None, "r", features=x, metadata={7: "a", "b": 1})           # mixed keys: no TypeError
    with pytest.raises(ValueError, match=r"metadata\['cfg'\]\['tup'\] is a tuple.*pass a list"):
        cache.store(None, "r", features=x, metadata={"cfg": {"tup": (1, 2)}})
    with pytest.raises(ValueError, match=r"metadata\['v'\] is a int64, not a JSON value"):
        cache.store_batch(None, ["r"], features=x[None], metadata={"v": np.int64(1)})
    with pytest.raises(ValueError, match="no NaN"):
        cache.store(None, "r", features=x, metadata={"v": float("nan")})
    assert cache.check(features=x) == []                                         # nothing was stored
    meta = {"7": "seven", "l": [1, [2.5, None]], "d": {"b": False}}
    cache.store(None, "r", features=x, metadata=meta)
    assert cache.check(features=x)[0]["metadata"] == meta

def test_batches_and_async_twins(cache):
    rng = np.random.default_rng(1)
    f = rng.normal(size=(3, 24)).astype(np.float32)
    ids = cache.store_batch(None, ["r0", "r1", "r2"], features=f, metadata=[{"i": 0}, {"i": 1}, {"i": 2}])
    assert len(ids) == 3 and all(ids)
    got = cache.check_batch(features=f)
    assert [g[0]["response"] for g in got] == ["r0", "r1", "r2"]
    with pytest.raises(ValueError, match="3 inputs but 2 responses"):
        cache.store_batch(None, ["a", "b"], features=f)

    async def run():
        g = rng.normal(size=(2, 24)).astype(np.float32)
        k = await cache.astore(None, "async", features=g[0], metadata={"a": 1})
        hit = await cache.acheck(features=g[0], filters={"a": 1})
        both = await cache.astore_batch(None, ["x", "y"], features=g)
        many = await cache.acheck_batch(features=g)
        return k, hit, both, many

    k, hit, both, many = asyncio.run(run())
    assert hit[0]["entry_id"] == k and len(both) == 2 and len(many) == 2 and many[1][0]["response"] == "y"


def test_put_is_positional_and_get_returns_the_envelope(cache):
    x = np.full(24, 0.5, np.float32)
    assert cache.put("text", None, {"answer": 42}, features=x)
    assert cache.get("text", features=x).value == {"answer": 42}
    with pytest.raises(TypeError, match="needs the value"):
        cache.put("text", None, features=x)
    cache.store(None, "wrapped", features=-x)
    assert cache.get("text", features=-x).value["response"] == "wrapped"
    with pytest.raises(TypeError, match="JSON values"):
        cache.store(None, b"raw", features=x)


def test_tenants_invalid_is_a_value_error_and_unknown_a_key_error():
    head = LSHHead({"text": 24}, bits=64, dim=32, seed=0)
    cache = SemanticCache(head, {"tenants": ["acme"]})
    x = np.ones(24, np.float32)
    with pytest.raises(ValueError, match="tenant must be"):
        cache.check(features=x, tenant="a b")
    with pytest.raises(InvalidTenant):
        cache.store(None, "r", features=x, tenant="x" * 65)
    with pytest.raises(UnknownTenant):
        cache.check(features=x, tenant="globex")
    cache.store(None, "r", features=x, tenant="acme")
    assert cache.check(features=x, tenant="acme")[0]["response"] == "r"


def test_media_file_paths_are_read_and_bounded(tmp_path):
    p = tmp_path / "cat.png"
    p.write_bytes(b"\x89PNG fake")
    assert read_media_file("image", p) == b"\x89PNG fake"
    assert read_media_file("image", str(p)) == b"\x89PNG fake"
    with pytest.raises(RequestError, match="cannot read"):
        read_media_file("image", tmp_path / "missing.png")
    with pytest.raises(RequestError, match="not a file"):
        read_media_file("audio", tmp_path)
    big = tmp_path / "big.wav"
    with open(big, "wb") as f:
        f.truncate(MAX_MEDIA_FILE_BYTES + 1)
    with pytest.raises(RequestError, match="over"):
        read_media_file("audio", big)


def test_top_k_is_traced_and_serves_only_the_revision_that_encoded_the_query(cache):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ushash.serving.cache.telemetry import configure_tracing

    exporter = InMemorySpanExporter()
    cache.trace(configure_tracing(exporter=exporter))
    rng = np.random.default_rng(2)
    x = np.ones(24, np.float32)
    for i in range(3):
        cache.store(None, f"answer {i}", features=_near(rng, x, 0.01 * (i + 1)))
    assert len(cache.check(features=x, num_results=3)) == 3
    verify = [s for s in exporter.get_finished_spans() if s.name == "ushash.verify"]
    assert verify and verify[-1].attributes["cache.hits"] == 3
    q = cache.query("text", features=x)
    assert len(cache.lookup_top(q, k=3)) == 3
    cache.reload(LSHHead({"image": 24, "text": 24}, bits=64, dim=32, aligned=True, seed=0, revision="next"))
    assert cache.lookup_top(q, k=3) == []          # encoded by the head served before the reload
    assert cache.metrics.value("cache_rejections_total", reason="query_revision") >= 1


def test_drop_removes_the_entry_a_check_or_a_get_served(cache):
    """RedisVL's `drop`: given what a lookup served (a check result, by its `key`, or a Hit), that entry leaves
    L1 (its index, its bytes, the count), and a later lookup misses; the async twin does the same."""
    x, y = np.ones(24, np.float32), np.linspace(-1, 1, 24).astype(np.float32)
    cache.store(None, "a tree frog", "text", features=x, metadata={"user": "ann"})
    cache.put("text", features=y, value="a toad")
    h = cache.check(features=x)[0]
    assert cache.drop({**h, "key": "l1:²"}) == 0             # not a slot (int() refuses "²"): nothing, no error
    assert h["key"].startswith("l1:") and cache.drop(h) == 1
    assert cache.check(features=x) == [] and cache.get("text", features=x) is None
    assert len(cache) == 1 and cache.drop(h) == 0            # already gone: nothing more removed, no error
    assert asyncio.run(cache.adrop([cache.get("text", features=y)])) == 1
    assert cache.get("text", features=y) is None and len(cache) == 0 and cache.policy.used_bytes == 0
    with pytest.raises(TypeError):
        cache.drop("l1:0")


def test_drop_never_removes_another_entry_that_took_the_slot_since():
    """Slots are reused: a hit's `l1:<slot>` may hold another entry by the time it is dropped (the same request
    stored again, or another one in a freed slot; here at the same clock time, so only the value tells them
    apart). That entry stays and drop says 0."""
    head = LSHHead({"image": 24, "text": 24}, bits=64, dim=32, aligned=True, seed=0)
    cache = SemanticCache(head, {"radius": 6, "payload_threshold": 0.9}, clock=lambda: 1000.0)
    x, y = np.ones(24, np.float32), np.linspace(-1, 1, 24).astype(np.float32)
    cache.put("text", features=x, value="old")
    old = cache.get("text", features=x)
    cache.put("text", features=x, value="new")                # replaces it, in the same slot
    new = cache.get("text", features=x)
    assert old.entry == new.entry and old.created == new.created
    assert cache.drop(old) == 0 and cache.get("text", features=x).value == "new"
    assert cache.drop(new) == 1 and len(cache) == 0
    cache.store(None, "another request's answer", "text", features=y)   # takes the freed slot
    assert cache.check(features=y)[0]["key"] == new.entry
    assert cache.drop(new) == 0 and cache.check(features=y)[0]["response"] == "another request's answer"
    assert cache.drop(cache.check(features=y)) == 1 and len(cache) == 0
