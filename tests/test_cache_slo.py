"""The design's SLO metrics checked against hand-computed values, the Grafana dashboard's schema and
queries, and the OpenTelemetry spans of a lookup, verification and computation (in-memory exporter)."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ushash.serving.cache import SemanticCache
from ushash.serving.cache.lsh import LSHHead
from ushash.serving.cache.telemetry import SLOCollector, SLOWindow, configure_tracing, key_hash

ROOT = Path(__file__).resolve().parents[1]


def test_slo_metrics_by_hand():
    w = SLOWindow(window_s=60.0, jitter_s=300.0, clock=lambda: 0.0)
    for s in range(60):                    # the window before: 1 service read per second (1 QPS)
        w.record_read(1, now=s + 0.5)
    for s in range(60, 120):               # this window: 3 reads per second (3 QPS) ...
        w.record_read(3, now=s + 0.5)
    w.record_evictions(4, now=70.0)        # ... and 10 keys evicted
    w.record_evictions(6, now=119.0)
    # 100 requests in this window: 75 hits, 5 of them stale; latencies: one per second, 0.1 / 0.2 / 0.3 s
    for i in range(100):
        w.record_request(hit=i < 75, stale=i < 5, latency_s=(0.1, 0.2, 0.3)[i % 3], now=117.0 + (i % 3))
    now = 119.5   # this window: the seconds 60..119, the one before: 0..59
    assert w.hit_ratio(now) == pytest.approx(0.75)
    assert w.stale_ratio(now) == pytest.approx(0.05)
    assert w.cdi(now) == pytest.approx(10 * (3 - 1) / 60)               # CDI = evicted x QPS increase / 60 s
    # per-second p99: 0.1, 0.2, 0.3 (each second holds one latency value); std / mean = sqrt(2/3) * 0.1 / 0.2
    assert w.p99_jitter_rate(now) == pytest.approx(math.sqrt(2 / 3) * 0.1 / 0.2)
    w.record_memory(rss_bytes=1000, accounted_bytes=100, now=0.0)
    w.record_memory(rss_bytes=1300, accounted_bytes=200, now=5.0)
    w.record_memory(rss_bytes=1600, accounted_bytes=300, now=10.0)
    assert w.hidden_memory_growth_rate() == pytest.approx((600 - 200) / 200)   # (dRSS - d accounted) / d accounted
    # a read QPS that falls gives no disruption; the previous window's evictions do not count
    assert w.cdi(180.0) == 0.0 and w.hit_ratio(1000.0) == 0.0
    reg = CollectorRegistry()
    w2 = SLOWindow(clock=lambda: 119.5)
    w2._sec, w2._mem = w._sec, w._mem
    reg.register(SLOCollector(w2))
    text = generate_latest(reg).decode()
    assert re.search(r"^cache_disruption_index 0\.333", text, re.M)
    assert re.search(r"^cache_hit_ratio 0\.75$", text, re.M)
    assert re.search(r"^cache_hidden_memory_growth_rate 2\.0$", text, re.M)


def test_the_cache_exports_its_slo_and_hot_key_series():
    head = LSHHead({"text": 24}, bits=64, dim=32, aligned=True, seed=0)
    now = [1000.0]
    cache = SemanticCache(head, {"payload_check": False})
    cache.metrics.slo.clock = lambda: now[0]
    cache.track_hot_keys(window_s=60.0, clock=lambda: now[0])
    rng = np.random.default_rng(0)
    f = rng.normal(size=(3, 24)).astype(np.float32)
    cache.put("text", features=f[0], value="a")
    for i in (0, 0, 0, 1):
        cache.get("text", features=f[i])
    text = cache.metrics.text().decode()
    assert re.search(r"^cache_hit_ratio 0\.75$", text, re.M)
    assert re.search(r'^cache_hot_key_requests\{rank="1"\} 3\.0$', text, re.M)
    assert re.search(r"^cache_hot_keys_share 1\.0$", text, re.M)   # 4 lookups, 2 keys, both in the top 10
    for name in ("cache_stale_ratio", "cache_disruption_index", "cache_p99_jitter_rate",
                 "cache_hidden_memory_growth_rate"):
        assert re.search(rf"^{name} ", text, re.M), name


def _dashboard():
    return json.loads((ROOT / "docs" / "grafana" / "ushash.json").read_text())


DASHBOARD_SCHEMA = {
    "type": "object",
    "required": ["title", "uid", "schemaVersion", "panels", "time", "templating"],
    "properties": {
        "title": {"type": "string", "minLength": 1},
        "uid": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,40}$"},
        "schemaVersion": {"type": "integer", "minimum": 30},
        "time": {"type": "object", "required": ["from", "to"]},
        "templating": {"type": "object", "required": ["list"]},
        "panels": {"type": "array", "minItems": 5, "items": {
            "type": "object", "required": ["id", "type", "title", "gridPos", "targets", "datasource"],
            "properties": {
                "id": {"type": "integer"},
                "type": {"enum": ["timeseries", "stat", "gauge", "table", "bargauge"]},
                "title": {"type": "string", "minLength": 1},
                "gridPos": {"type": "object", "required": ["x", "y", "w", "h"],
                            "properties": {k: {"type": "integer", "minimum": 0} for k in "xywh"}},
                "targets": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["expr", "refId"],
                    "properties": {"expr": {"type": "string", "minLength": 1}, "refId": {"type": "string"}}}},
            }}},
    },
}


def test_the_grafana_dashboard_is_valid_and_queries_only_series_the_cache_exports():
    import jsonschema

    d = _dashboard()
    jsonschema.validate(d, DASHBOARD_SCHEMA)
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
    head = LSHHead({"text": 24}, bits=64, dim=32, aligned=True, seed=0)
    cache = SemanticCache(head, {"payload_check": False})
    cache.track_hot_keys()
    exported = set(re.findall(r"^# TYPE (\w+) ", cache.metrics.text().decode(), re.M))
    suffixes = ("_total", "_bucket", "_sum", "_count", "_created")
    queried = set()
    for p in d["panels"]:
        for t in p["targets"]:
            queried |= set(re.findall(r"\b(cache_\w+)", t["expr"]))
    assert queried
    for name in queried:
        base = next((name[: -len(s)] for s in suffixes if name.endswith(s)), name)
        assert name in exported or base in exported, name
    titles = " ".join(p["title"].lower() for p in d["panels"])
    for what in ("hit rate", "stale ratio", "disruption index", "p99 jitter", "hidden memory growth"):
        assert what in titles, what


def test_tracing_spans_and_attributes_with_the_in_memory_exporter():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    assert configure_tracing() is None                    # off by default
    exporter = InMemorySpanExporter()
    head = LSHHead({"text": 24}, bits=64, dim=32, aligned=True, seed=0)
    now = [1000.0]
    cache = SemanticCache(head, {"ttl_s": 600, "ttl_jitter": 0.0, "xfetch_beta": 0.0}, clock=lambda: now[0])
    cache.trace(configure_tracing(exporter=exporter))
    f = np.random.default_rng(0).normal(size=24).astype(np.float32)
    res = cache.get_or_compute("text", features=f, compute=lambda: "answer")
    assert res.computed
    spans = exporter.get_finished_spans()
    names = [s.name for s in spans]
    assert names == ["ushash.encode", "ushash.search", "ushash.compute"]
    search = spans[1]
    assert search.attributes["cache.hit"] is False and search.attributes["cache.strategy"] == "l1"
    code = cache.query("text", features=f).code
    assert search.attributes["cache.key.hash"] == key_hash(code) == spans[2].attributes["cache.key.hash"]
    assert spans[2].attributes["cache.strategy"] == "compute"
    exporter.clear()
    now[0] += 100.0
    res = cache.get_or_compute("text", features=f, compute=lambda: "other")
    assert not res.computed and res.value == "answer"
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"ushash.encode", "ushash.search", "ushash.verify"}
    s = spans["ushash.search"]
    assert s.attributes["cache.hit"] is True and s.attributes["cache.ttl.remaining_ms"] == pytest.approx(500_000.0)
    assert spans["ushash.verify"].parent.span_id == s.context.span_id   # verify runs inside the search
    assert spans["ushash.verify"].attributes["cache.candidates"] == 1
    cache.trace(None)
    exporter.clear()
    cache.get("text", features=f)
    assert exporter.get_finished_spans() == ()


def test_batched_request_records_equal_one_at_a_time():
    """record_requests (a lookup_many's answers, one latency) leaves the buckets and the latency reservoir
    exactly as record_request of each answer in turn, past the reservoir's size too."""
    import random

    one, many = (SLOWindow(clock=lambda: 5.0) for _ in range(2))
    rng = np.random.default_rng(2)
    batches = [[bool(x) for x in rng.random(int(rng.integers(1, 400))) < 0.6] for _ in range(6)]
    random.seed(9)
    for i, hits in enumerate(batches):
        for h in hits:
            one.record_request(h, 0.001 * (i + 1), read=not h)
    random.seed(9)
    for i, hits in enumerate(batches):
        many.record_requests(hits, 0.001 * (i + 1))
    assert sum(map(len, batches)) > SLOWindow.SAMPLE
    assert one._sec == many._sec


def test_stored_json_values_decode_as_json_does():
    from ushash.serving.cache.entries import decode_value, encode_value

    for v in ({"id": 3, "x": [1.5, None, "é"]}, 2 ** 70, -(2 ** 64), 10 ** 18, -(2 ** 63), 0.1, [1e308, -0.0, 5e-324],
              {"a": [2 ** 64 + 1]}, "s", 1.2345678901234567e-300):
        kind, data = encode_value(v)
        assert decode_value(kind, data) == v and type(decode_value(kind, data)) is type(v)


def test_values_json_would_change_are_refused_rather_than_changed():
    """A hit hands back what was stored: {7: "a"} would come back as {"7": "a"} and a tuple as a list, so
    such values are refused at store time, naming the place and the fix."""
    from ushash.serving.cache.entries import encode_value

    with pytest.raises(TypeError, match="the value key 7 is not a string.*use '7'"):
        encode_value({7: "a"})
    with pytest.raises(TypeError, match=r"the value\['a'\]\[1\] is a tuple.*pass a list"):
        encode_value({"a": [1, (2, 3)]})
    with pytest.raises(TypeError, match="is a float32, not a JSON value"):
        encode_value([np.float32(1.5)])
    assert encode_value({"a": [1, True, None, 2.5]}) == ("j", b'{"a":[1,true,null,2.5]}')


def test_loads_json_reads_long_digit_runs_as_json_does():
    """A run of 19 or more digits outside a string is an integer orjson may make a float; loads_json must read
    every body holding one as json.loads does, wherever the run sits (first, last, deep, beside a string of
    digits, after more values than its reading is looked through), and the rest with orjson alike. Checked
    against json.loads on seeded bodies, runs of 17 to 21 digits."""
    import json

    from ushash.serving.cache.entries import loads_json

    rng = np.random.default_rng(7)
    many = ", ".join(["0.5"] * 300)   # past the values the reading is looked through: the bytes are scanned
    for _ in range(600):
        n = int(rng.integers(17, 22))
        big = int("9" * n) - int(rng.integers(0, 10))
        doc = rng.choice([f"{big}", f"-{big}", f"[{big}]", f'{{"a": "{big}", "b": -{big}}}',
                          f'["{"7" * 30}", {big}, 1e3]', f'{{"x": [0.5, {big}]}}', f'[{many}, {big}]',
                          f'{{"f": [{many}], "s": "{big}"}}', f'[[[{{"d": [{big}]}}]]]', f'"{big}"',
                          f"[{big}.0, 1e400, -1e19]"])
        for body in (doc.encode(), bytearray(doc.encode()), memoryview(doc.encode())):
            got, want = loads_json(body), json.loads(doc)
            assert got == want and json.dumps(got) == json.dumps(want), doc


def test_long_integer_literal_scan_matches_a_regex_reference():
    """The byte-class scan behind loads_json against a plain regex of what it looks for: a run of 19 or more
    digits after none of [0-9.eE] and before none of [.eE] (a fraction's digits, as in 0.0000123..., and a
    float's integer part are not integer literals). Seeded strings of digit runs around 19 long, points,
    exponents, signs and letters, runs at the very start and end included."""
    import re

    from ushash.serving.cache.entries import _long_integer_literal

    ref = re.compile(rb"(?<![0-9.eE])[0-9]{19,}(?![0-9.eE])")
    rng = np.random.default_rng(3)
    pieces = [b".", b"e", b"E", b"-", b" ", b",", b"[", b'"', b"a", b"0."]
    found = 0
    for _ in range(3000):
        parts = []
        for _ in range(int(rng.integers(1, 5))):
            parts.append(pieces[int(rng.integers(len(pieces)))])
            parts.append(bytes(rng.integers(48, 58, int(rng.integers(15, 23)), dtype=np.uint8)))
        if rng.random() < 0.5:
            parts.append(pieces[int(rng.integers(len(pieces)))])
        data = b"".join(parts)
        want = ref.search(data) is not None
        found += want
        assert _long_integer_literal(data) == want, data
    assert 300 < found < 2700   # both answers well represented
