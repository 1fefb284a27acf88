"""The HTTP service: lookup/store/metrics/health, bearer tokens, and 4xx (never 500) for bad input."""

import base64
import io
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import orjson
import pytest
from conftest import asgi_request, write_tiny_export
from fastapi.testclient import TestClient
from PIL import Image

from ushash.serving import connection
from ushash.serving.cache import SemanticCache
from ushash.serving.localhost import LocalRedis, free_port, wait_until_up
from ushash.serving.service import check_binding, create_app, is_loopback, json_values_bound

TOKEN = "s3cret-token-0123456789"


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    return write_tiny_export(tmp_path_factory.mktemp("export") / "tiny-64b")


@pytest.fixture
def client(export_dir):
    cache = SemanticCache.from_export(export_dir, {"radius": 4, "tenants": ["default", "acme"]})
    with TestClient(create_app(cache, max_body_bytes=200_000)) as c:
        yield c


def _b64_png(color=(10, 200, 30)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (24, 24), color).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_store_then_lookup_text_image_features(client):
    r = client.post("/v1/lookup", json={"modality": "text", "text": "a green frog"})
    assert r.status_code == 200 and r.json() == {"hit": False}
    r = client.post("/v1/store", json={"modality": "text", "text": "a green frog", "value": {"answer": 42}})
    assert r.status_code == 200 and r.json()["stored"] is True
    r = client.post("/v1/lookup", json={"modality": "text", "text": "a green frog"})
    body = r.json()
    assert body["hit"] and body["value"] == {"answer": 42} and body["distance"] == 0 and body["tier"] == "l1"
    png = _b64_png()
    assert client.post("/v1/store", json={"modality": "image", "data_b64": png, "value": "frog.png",
                                          "tenant": "acme"}).json()["stored"]
    assert client.post("/v1/lookup", json={"modality": "image", "data_b64": png, "tenant": "acme"}).json()["hit"]
    assert not client.post("/v1/lookup", json={"modality": "image", "data_b64": png}).json()["hit"]  # other tenant
    feats = list(np.linspace(-1, 1, 16))
    client.post("/v1/store", json={"modality": "audio", "features": feats, "value": "beep"})
    assert client.post("/v1/lookup", json={"modality": "audio", "features": feats}).json()["value"] == "beep"
    m = client.get("/metrics")
    assert m.status_code == 200 and 'cache_gets_total{result="hit"} 3.0' in m.text
    assert client.get("/healthz").json() == {"status": "ok"}


@pytest.mark.parametrize("payload,status,message", [
    ({"modality": "video", "features": [0.0] * 16}, 400, "modality 'video' is not served"),
    ({"modality": "image", "data_b64": base64.b64encode(b"\x89PNG\r\n\x1a\nbroken").decode()}, 400, "undecodable image"),
    ({"modality": "audio", "data_b64": base64.b64encode(b"RIFF0000WAVEjunk").decode()}, 400, "undecodable audio"),
    ({"modality": "image", "data_b64": "***not base64***"}, 400, "not valid base64"),
    ({"modality": "text", "text": "hi", "tenant": "initech"}, 404, "unknown tenant 'initech'"),
    ({"modality": "text", "text": "hi", "tenant": "{bad}"}, 422, "tenant"),
    ({"modality": "text"}, 400, "exactly one of"),
    ({"modality": "text", "text": "a", "features": [1.0]}, 400, "exactly one of"),
    ({"modality": "text", "features": [1.0, 2.0]}, 400, "vector of 16"),
    ({"modality": "text", "text": "   "}, 400, "empty caption"),
    ({"modality": "image", "text": "a cat"}, 400, "'text' is for modality text"),
    ({"modality": "text", "text": "hi", "surprise": 1}, 422, "surprise"),
    ({"modality": 3, "text": "hi"}, 422, "modality"),
])
def test_bad_input_gets_a_4xx_with_a_clear_message(client, payload, status, message):
    r = client.post("/v1/lookup", json=payload)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]


def test_malformed_and_oversized_bodies(client):
    r = client.post("/v1/lookup", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "invalid request" in r.json()["error"]
    big = {"modality": "image", "data_b64": "A" * 300_000}
    r = client.post("/v1/lookup", json=big)
    assert r.status_code == 413 and "over 200000 bytes" in r.json()["error"]

    def chunks():  # no Content-Length: counted while streaming
        for _ in range(30):
            yield b"x" * 10_000

    r = client.post("/v1/lookup", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = client.post("/v1/store", json={"modality": "text", "text": "x", "value": 1, "ttl_s": -5})
    assert r.status_code == 422
    # a TTL that expires as it is stored (1e-300 s: now + ttl == now) is refused, and the live entry stays
    client.post("/v1/store", json={"modality": "text", "text": "x", "value": "live"})
    r = client.post("/v1/store", json={"modality": "text", "text": "x", "value": "gone", "ttl_s": 1e-300})
    assert r.status_code == 422 and "ttl_s" in r.json()["error"]
    assert client.post("/v1/lookup", json={"modality": "text", "text": "x"}).json()["value"] == "live"
    r = client.get("/nope")
    assert r.status_code == 404


def test_a_body_of_more_json_values_than_the_limit_is_refused_before_it_is_parsed(export_dir):
    """max_json_values bounds what a body parses to (8 MB of `0,0,...` once became 216 MB of Python objects):
    over it, a 413 naming the setting on every route, the features fast path included; at it, answered."""
    cache = SemanticCache.from_export(export_dir, {"radius": 4})
    feats = [0.5] * 16
    lookup = {"modality": "text", "features": feats}
    at = json_values_bound(orjson.dumps(lookup))
    assert at == 19                                    # the object, "text", the list and its 16 numbers
    with TestClient(create_app(cache, max_json_values=at)) as c:
        assert c.post("/v1/lookup", json=lookup).json() == {"hit": False}
        for route, body in (("/v1/lookup", {**lookup, "features": feats + [0.5]}),
                            ("/v1/lookup_batch", {"modality": "text", "features": [feats]}),
                            ("/v1/store", {**lookup, "value": 1})):
            r = c.post(route, content=orjson.dumps(body), headers={"content-type": "application/json"})
            assert r.status_code == 413 and "max_json_values" in r.json()["error"], (route, r.text)
    assert cache.stats()["entries"] == 0


def test_the_json_values_bound_is_counted_once_per_request(export_dir, monkeypatch):
    """A /v1/lookup body the features fast path passes on to the app (text, data_b64) is not counted again;
    a body shorter than max_json_values bytes is not counted at all (it cannot hold more values)."""
    from ushash.serving import service

    counted, bound = [], service.json_values_bound
    monkeypatch.setattr(service, "json_values_bound", lambda raw: counted.append(len(raw)) or bound(raw))
    bodies = (("/v1/lookup", {"modality": "text", "text": "a frog"}),
              ("/v1/lookup", {"modality": "text", "features": [0.1] * 16}),
              ("/v1/store", {"modality": "text", "text": "a frog", "value": 1}))
    for limit, times in ((30, 1), (1 << 20, 0)):   # every body here is over 30 bytes and under 1 MB
        cache = SemanticCache.from_export(export_dir, {"radius": 4})
        with TestClient(create_app(cache, max_json_values=limit)) as c:
            for route, body in bodies:
                counted.clear()
                assert c.post(route, json=body).status_code == 200
                assert len(counted) == times, (route, limit)


def test_a_body_shorter_than_the_limit_is_never_over_it():
    """The short cut is exact: a body of n bytes has a bound of at most n + 1 (n = 0 too)."""
    from ushash.serving.service import too_many_values

    for raw in (b"", b"{", b",,,,", b"[[[[", b"[{},{}]", b"{,[" * 50):
        assert json_values_bound(raw) <= len(raw) + 1
        assert too_many_values(raw, len(raw) + 1) is None
        assert (too_many_values(raw, len(raw)) is None) == (json_values_bound(raw) <= len(raw)), raw


def test_the_json_values_bound_is_an_upper_bound():
    """Against a count of the parsed values, on seeded random documents whose strings hold commas and
    brackets; exact when no string does and no container is empty."""
    import json
    import random

    def count(x):
        if isinstance(x, list):
            return 1 + sum(count(v) for v in x)
        if isinstance(x, dict):
            return 1 + sum(count(v) for v in x.values())
        return 1

    def doc(rng, depth=0):
        r = rng.random()
        if depth < 4 and r < 0.3:
            return [doc(rng, depth + 1) for _ in range(rng.randrange(4))]
        if depth < 4 and r < 0.5:
            return {f"k{i}": doc(rng, depth + 1) for i in range(rng.randrange(4))}
        return rng.choice([0, 1.5, None, True, "", "a", "x,y", "[{", "]},"])

    rng = random.Random(0)
    exact = 0
    for _ in range(2000):
        d = doc(rng)
        raw = json.dumps(d).encode()
        n, bound = count(d), json_values_bound(raw)
        assert bound >= n, raw
        if not any(ch in s for s in _strings(d) for ch in ",[{") and b"[]" not in raw and b"{}" not in raw:
            assert bound == n, raw
            exact += 1
    assert exact > 500


def _strings(x):
    if isinstance(x, list):
        return [s for v in x for s in _strings(v)]
    if isinstance(x, dict):
        return list(x) + [s for v in x.values() for s in _strings(v)]
    return [x] if isinstance(x, str) else []


@pytest.mark.parametrize("raw", [b"[]", b"null", b"42", b'"text"', b'{"modality": null}',
                                 b'{"modality": "text", "features": [NaN, 1]}', b'{"modality": "text", "features": "abc"}',
                                 b'{"modality": "text", "text": "x", "value": NaN}', b'{"modality": {"a": 1}}',
                                 b'{"modality": "image", "data_b64": ""}', b'{"modality": "audio", "data_b64": "AAAA"}',
                                 b'{"modality": "text", "features": [1e309]}', b'{"tenant": "' + b"a" * 100 + b'"}'])
@pytest.mark.parametrize("route", ["/v1/lookup", "/v1/store"])
def test_odd_bodies_never_give_a_500(client, raw, route):
    r = client.post(route, content=raw, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert r.json()["error"]


def test_bearer_token(export_dir):
    cache = SemanticCache.from_export(export_dir, {})
    with TestClient(create_app(cache, token=TOKEN)) as c:
        body = {"modality": "text", "text": "x"}
        assert c.post("/v1/lookup", json=body).status_code == 401
        assert c.post("/v1/lookup", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/metrics").status_code == 401
        assert c.get("/healthz").status_code == 200
        ok = c.post("/v1/lookup", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200


def test_binding_rules():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    check_binding("127.0.0.1", None)
    with pytest.raises(SystemExit, match="without a bearer token"):
        check_binding("0.0.0.0", None)
    with pytest.raises(SystemExit, match="at least 16"):
        check_binding("0.0.0.0", "short")
    check_binding("0.0.0.0", TOKEN)
    check_binding("0.0.0.0", None, {"t" * 16: "acme"})  # the proxy's tokens map (token -> tenant) is enough
    with pytest.raises(SystemExit, match="at least 16"):
        check_binding("0.0.0.0", None, {"short": "acme"})


@pytest.mark.slow
def test_entry_point_serves_on_loopback_and_refuses_public_binding(export_dir):
    import httpx

    r = subprocess.run([sys.executable, "-m", "ushash.serve", f"export={export_dir}", "host=0.0.0.0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "without a bearer token" in r.stderr + r.stdout
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ushash.serve", f"export={export_dir}", f"port={port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_up(f"http://127.0.0.1:{port}/healthz", proc)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/store", json={"modality": "text", "text": "hi", "value": 1})
        assert r.json()["stored"]
        assert httpx.post(f"http://127.0.0.1:{port}/v1/lookup", json={"modality": "text", "text": "hi"}).json()["hit"]
    finally:
        proc.terminate()
        proc.wait(10)


def test_serve_and_cache_configs_take_their_defaults_from_the_schemas():
    import dataclasses

    from ushash.config import compose, to_dict
    from ushash.serving.cache import CacheConfig, L2Config
    from ushash.serving.service import ServeConfig

    cfg = to_dict(compose("serve", ["export=e"]))
    assert cfg["cache"] == dataclasses.asdict(CacheConfig())
    assert {k: cfg[k] for k in ("host", "port", "token", "max_body_bytes", "device", "log_level")} == \
        {k: getattr(ServeConfig, k) for k in ("host", "port", "token", "max_body_bytes", "device", "log_level")}
    redis = to_dict(compose("serve", ["export=e", "cache=redis", "cache.l2.timeout_s=0.2"]))["cache"]["l2"]
    assert redis == {**dataclasses.asdict(L2Config()), "timeout_s": 0.2}
    with pytest.raises(Exception, match="radius"):
        compose("serve", ["export=e", "cache.radius=three"])
    with pytest.raises(Exception, match="raduis"):
        compose("serve", ["export=e", "cache.raduis=3"])


def test_bearer_scheme_is_case_insensitive_and_other_schemes_are_refused(export_dir):
    cache = SemanticCache.from_export(export_dir, {})
    with TestClient(create_app(cache, token=TOKEN)) as c:
        body = {"modality": "text", "text": "x"}
        assert c.post("/v1/lookup", json=body, headers={"Authorization": f"bearer  {TOKEN} "}).status_code == 200
        r = c.post("/v1/lookup", json=body, headers={"Authorization": f"Basic {TOKEN}"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"error": "missing or wrong bearer token"}


def test_lookup_batch_answers_each_row_as_a_single_lookup(client):
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(6, 16)).round(3).tolist()
    for i, f in enumerate(feats[:3]):
        client.post("/v1/store", json={"modality": "audio", "features": f, "value": i})
    r = client.post("/v1/lookup_batch", json={"modality": "audio", "features": feats})
    assert r.status_code == 200
    singles = [client.post("/v1/lookup", json={"modality": "audio", "features": f}).json() for f in feats]
    got = r.json()["results"]
    # the batch's z comes from one forward pass of the head: equal to the single ones to float32 rounding
    for g, one in zip(got, singles):
        assert g.pop("cosine", None) == pytest.approx(one.pop("cosine", None), abs=1e-5)
    assert got == singles and [x["hit"] for x in singles] == [True] * 3 + [False] * 3
    assert client.post("/v1/lookup_batch", json={"modality": "audio", "features": []}).json() == {"results": []}
    for bad, status in [({"modality": "audio", "features": [[1.0, 2.0], [1.0]]}, 400),
                        ({"modality": "audio", "features": [[1.0] * 5]}, 400),
                        ({"modality": "smell", "features": [[1.0] * 16]}, 400),
                        ({"modality": "audio", "features": [[1.0] * 16], "tenant": "nobody"}, 404),
                        ({"modality": "audio", "features": "x"}, 422)]:
        assert client.post("/v1/lookup_batch", json=bad).status_code == status, bad


def test_bytes_values_from_a_python_replica_come_back_as_base64(export_dir):
    cache = SemanticCache.from_export(export_dir, {"radius": 4})
    cache.put("text", "raw bytes", value=b"\x00\xff")
    with TestClient(create_app(cache)) as c:
        body = c.post("/v1/lookup", json={"modality": "text", "text": "raw bytes"}).json()
    assert body["value_encoding"] == "base64" and base64.b64decode(body["value"]) == b"\x00\xff"


@pytest.mark.parametrize("kw,match", [({"max_body_bytes": 0}, "max_body_bytes"), ({"max_body_bytes": -5}, "max_body_bytes"),
                                      ({"max_json_values": 0}, "max_json_values"),
                                      ({"max_json_values": True}, "max_json_values"),
                                      ({"tokens": {"short": ["acme"]}}, "16 printable"),
                                      ({"tokens": {"x" * 20: "acme"}}, "list of tenant"),
                                      ({"tokens": {"x" * 20: ["initech"]}}, "not served"),
                                      ({"tokens": {"x" * 20: []}}, "not served"),
                                      ({"token": TOKEN, "tokens": {TOKEN: ["acme"]}}, "also listed")])
def test_serve_settings_are_checked_when_the_app_is_made(export_dir, kw, match):
    cache = SemanticCache.from_export(export_dir, {"tenants": ["default", "acme"]})
    with pytest.raises(ValueError, match=match):
        create_app(cache, **kw)


def test_bodies_orjson_refuses_mean_what_json_loads_makes_of_them(client):
    """Bodies are parsed by orjson, and by json.loads where orjson refuses one, so each means what it meant
    before: an integer beyond 64 bits in a value is stored and answered, a lone surrogate is the cache's 400
    (not a JSON error), NaN features and a cut-off body are still 4xx."""
    def post(route, raw):
        return client.post(route, content=raw, headers={"content-type": "application/json"})

    f = np.random.default_rng(9).normal(size=16).round(3).tolist()
    big = {"big": 2 ** 70, "edge": 2 ** 64, "long": 12345678901234567890123}   # orjson made the last two floats
    assert post("/v1/store", ('{"modality": "image", "features": %s, "value": %s}' % (f, json.dumps(big))).encode()
                ).json()["stored"]
    assert client.post("/v1/lookup", json={"modality": "image", "features": f}).json()["value"] == big
    r = post("/v1/store", ('{"modality": "image", "features": %s, "value": "\\ud800x"}' % f).encode())
    assert r.status_code == 400 and "lone surrogate" in r.json()["error"]
    r = post("/v1/lookup", b'{"modality": "image", "features": [NaN' + b", 1" * 15 + b"]}")
    assert 400 <= r.status_code < 500
    r = post("/v1/lookup", b'{"modality": "image", "features": [1,')
    assert r.status_code in (400, 422) and "JSON" in r.text


def test_a_scoped_token_uses_only_its_tenants(export_dir):
    cache = SemanticCache.from_export(export_dir, {"radius": 4, "tenants": ["default", "acme", "globex"]})
    acme, both = "acme-only-0123456789", "acme-and-globex-0123"
    with TestClient(create_app(cache, token=TOKEN, tokens={acme: ["acme"], both: ["acme", "globex"]})) as c:
        def post(route, tok, tenant, **kw):
            return c.post(route, json={"modality": "text", "text": "q", "tenant": tenant, **kw},
                          headers={"Authorization": f"Bearer {tok}"})
        assert post("/v1/store", TOKEN, "default", value="d").json()["stored"]
        r = post("/v1/lookup", acme, "default")
        assert r.status_code == 403 and r.json() == {"error": "this token may not use tenant 'default'"}
        assert post("/v1/store", acme, "default", value="poison").status_code == 403
        assert post("/v1/store", acme, "acme", value="a").json()["stored"]
        assert post("/v1/lookup", both, "acme").json()["value"] == "a"
        assert post("/v1/store", both, "globex", value="g").json()["stored"]
        assert post("/v1/lookup", acme, "globex").status_code == 403
        assert post("/v1/lookup", TOKEN, "default").json()["value"] == "d"
        assert post("/v1/lookup", TOKEN, "globex").json()["value"] == "g"
        assert post("/v1/lookup", "acme-only-012345678X", "acme").status_code == 401


def test_a_scoped_token_is_refused_other_tenants_without_learning_which_exist(export_dir):
    """A tenant not its own is a 403 for a scoped token, whether the cache serves that tenant or not (a 404
    would tell it which names exist), on every route and on the features fast path; the all-tenants token
    still gets the 404."""
    cache = SemanticCache.from_export(export_dir, {"radius": 4, "tenants": ["default", "acme"]})
    scoped = "acme-only-0123456789"
    with TestClient(create_app(cache, token=TOKEN, tokens={scoped: ["acme"]})) as c:
        f = [0.1] * 16
        for tenant in ("default", "initech"):
            for route, body in (("/v1/lookup", {"modality": "text", "text": "q"}),
                                ("/v1/lookup", {"modality": "text", "features": f}),
                                ("/v1/lookup_batch", {"modality": "text", "features": [f]}),
                                ("/v1/store", {"modality": "text", "text": "q", "value": 1})):
                r = c.post(route, json={**body, "tenant": tenant}, headers={"Authorization": f"Bearer {scoped}"})
                assert r.status_code == 403, (route, r.text)
                assert r.json() == {"error": f"this token may not use tenant {tenant!r}"}
                r = c.post(route, json={**body, "tenant": tenant}, headers={"Authorization": f"Bearer {TOKEN}"})
                assert r.status_code == (200 if tenant == "default" else 404), (route, r.text)


def test_an_empty_batch_is_still_checked_for_its_modality(client):
    r = client.post("/v1/lookup_batch", json={"modality": "smell", "features": []})
    assert r.status_code == 400 and "modality 'smell' is not served" in r.json()["error"]
    assert client.post("/v1/lookup_batch", json={"modality": "audio", "features": []}).json() == {"results": []}


def test_a_wrong_token_is_refused_before_the_body_is_read(export_dir):
    """The bearer check is a dependency of every token-checked route: a wrong or missing token is a 401
    whatever the body, a malformed one included; the right one then gets the body's own 4xx."""
    cache = SemanticCache.from_export(export_dir, {})
    with TestClient(create_app(cache, token=TOKEN)) as c:
        for route in ("/v1/lookup", "/v1/lookup_batch", "/v1/store"):
            for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": f"Basic {TOKEN}"},
                            {"Authorization": "Bearer"}, {"Authorization": f"Bearer{TOKEN}"}):
                r = c.post(route, content=b'{"modality": ', headers={"content-type": "application/json", **headers})
                assert r.status_code == 422, (route, headers, r.status_code)    # malformed JSON: FastAPI's, first
                r = c.post(route, json={"modality": 3}, headers=headers)
                assert r.status_code == 401 and r.json() == {"error": "missing or wrong bearer token"}, (route, headers)
            r = c.post(route, json={"modality": 3}, headers={"Authorization": f"BEARER   {TOKEN}  "})
            assert r.status_code == 422, route
        for route in ("/metrics", "/v1/stats"):
            assert c.get(route).status_code == 401
            assert c.get(route, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_without_a_token_any_authorization_header_is_ignored(export_dir):
    cache = SemanticCache.from_export(export_dir, {"radius": 4})
    with TestClient(create_app(cache)) as c:
        f = np.random.default_rng(3).normal(size=16).round(3).tolist()
        for headers in ({}, {"Authorization": "Bearer whatever"}, {"Authorization": "Basic x"}):
            assert c.post("/v1/store", json={"modality": "image", "features": f, "value": 1}, headers=headers).json()["stored"]
            assert c.post("/v1/lookup", json={"modality": "image", "features": f}, headers=headers).json()["value"] == 1
            got = c.post("/v1/lookup_batch", json={"modality": "image", "features": [f]}, headers=headers).json()
            assert got["results"][0]["value"] == 1
            assert c.get("/metrics", headers=headers).status_code == 200
            assert c.get("/v1/stats", headers=headers).status_code == 200
        assert c.get("/v1/stats").json()["pid"] == os.getpid()   # the process that answered
        assert c.post("/v1/lookup", json={"modality": "image", "features": f, "allowed": None}).status_code == 422


@pytest.mark.parametrize("overrides,match", [(["workers=0"], "positive integer"), (["workers=-2"], "positive integer"),
                                             (["workers=2"], "shared L2")])
def test_workers_are_checked_before_anything_starts(overrides, match):
    from ushash.config import compose
    from ushash.serving.service import run_serve

    with pytest.raises(SystemExit, match=match):
        run_serve(compose("serve", ["export=does-not-exist", *overrides]))


def test_a_worker_builds_its_app_from_the_config_in_the_environment(export_dir, monkeypatch):
    from omegaconf import OmegaConf

    from ushash.config import compose
    from ushash.serving.service import WORKER_CONFIG_ENV, worker_app

    monkeypatch.delenv(WORKER_CONFIG_ENV, raising=False)
    with pytest.raises(RuntimeError, match=WORKER_CONFIG_ENV):
        worker_app()
    cfg = compose("serve", [f"export={export_dir}", "cache.radius=5", "max_body_bytes=4096"])
    monkeypatch.setenv(WORKER_CONFIG_ENV, OmegaConf.to_yaml(cfg, resolve=True))
    app = worker_app()
    assert app.state.cache.config.radius == 5
    with TestClient(app) as c:
        f = np.random.default_rng(4).normal(size=16).round(3).tolist()
        assert c.post("/v1/store", json={"modality": "image", "features": f, "value": "w"}).json()["stored"]
        assert c.post("/v1/lookup", json={"modality": "image", "features": f}).json()["value"] == "w"
        assert c.post("/v1/lookup", content=b"x" * 5000, headers={"content-type": "application/json"}).status_code == 413


def test_threads_sets_torchs_threads_and_is_checked(export_dir):
    """`threads` (1 by default) is torch's intra-op thread count in the serving process; 0 is refused."""
    import torch

    from ushash.config import compose
    from ushash.serving import service

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        service.build(compose("serve", [f"export={export_dir}"]))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        service.build(compose("serve", [f"export={export_dir}", "threads=null"]))
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError, match="threads must be a positive integer"):
            service.build(compose("serve", [f"export={export_dir}", "threads=0"]))
    finally:
        torch.set_num_threads(before)


def test_relative_export_and_calibration_paths_hang_off_the_root(export_dir, tmp_path, monkeypatch):
    """`export=` and `cache.calibration=` relative to `paths.root`, not to the directory serve or the proxy
    was started in (a calibration written by python -m ushash.calibrate is found from anywhere)."""
    import shutil

    from ushash.config import compose
    from ushash.serving import proxy, service
    from ushash.serving.artifact import load_export
    from ushash.serving.calibration import Calibration, PairPoint

    root = tmp_path / "repo"
    shutil.copytree(export_dir, root / "exports" / "tiny")
    head = load_export(root / "exports" / "tiny")
    Calibration(head.revision, 0.01, 0.95, {"text>text": PairPoint(True, 7, 0.5)}).save(root / "cal.json")
    monkeypatch.chdir(tmp_path)   # not the root: a path read from here would not be found
    args = [f"paths.root={root}", "export=exports/tiny", "cache.calibration=cal.json"]
    cache = service.build(compose("serve", args))[0].state.cache
    assert cache.budget.calibration.pairs["text>text"].radius == 7
    cache = proxy.build(compose("proxy", [*args, "upstream=http://127.0.0.1:9"]))[3]
    assert cache.budget.calibration.pairs["text>text"].radius == 7


@pytest.mark.slow
@pytest.mark.skipif(not __import__("shutil").which("redis-server"), reason="redis-server not installed")
def test_several_workers_start_share_the_l2_and_answer(export_dir, tmp_path):
    """workers=2 over a real redis-server: two uvicorn worker processes on one port; an entry stored through
    one is found through the other (from the L2), over fresh connections that the kernel spreads across them."""
    import httpx

    port, redis = free_port(), LocalRedis()
    proc = subprocess.Popen([sys.executable, "-m", "ushash.serve", f"export={export_dir}", f"port={port}", "workers=2",
                             "cache=redis", f"cache.l2.url={redis.url}", f"hydra.run.dir={tmp_path}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(f"{url}/healthz", proc)
        workers = []
        for _ in range(600):  # both workers up: the parent has two worker children besides multiprocessing's tracker
            kids = [int(k) for k in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
            workers = [k for k in kids if "resource_tracker" not in open(f"/proc/{k}/cmdline").read()]
            if len(workers) == 2:
                break
            time.sleep(0.1)
        assert len(workers) == 2, workers
        f = np.random.default_rng(5).normal(size=16).round(3).tolist()
        assert httpx.post(f"{url}/v1/store", json={"modality": "image", "features": f, "value": 42}).json()["stored"]
        tiers = set()
        for _ in range(300):   # a new connection each time: the kernel hands it to either worker
            hit = httpx.post(f"{url}/v1/lookup", json={"modality": "image", "features": f}, timeout=30).json()
            assert hit["hit"] and hit["value"] == 42
            tiers.add(hit["tier"])
            if "l2" in tiers:
                break
        assert "l2" in tiers   # the worker that did not store it found it in Redis
        pids = {httpx.get(f"{url}/v1/stats").json()["pid"] for _ in range(100)}   # each worker answers for itself
        assert pids <= set(workers) and pids, (pids, workers)
        assert httpx.post(f"{url}/v1/lookup", json={"modality": "image", "features": [0.5] * 16}).json() == {"hit": False}
    finally:
        proc.terminate()
        proc.wait(60)
        redis.stop()


def test_workers_set_tcp_nodelay_on_each_connection():
    """uvicorn's parent binds the workers' socket with protocol 0, so asyncio leaves Nagle on for what they
    accept; the protocol the workers run sets TCP_NODELAY itself."""
    import asyncio

    from uvicorn.importer import import_from_string
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    cls = import_from_string(connection.PROTOCOL)
    assert issubclass(cls, AutoHTTPProtocol) and cls is import_from_string(connection.PROTOCOL)

    async def main():
        listener = socket.socket(socket.AF_INET)          # as uvicorn's Config.bind_socket makes it
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        seen = []

        class Probe(cls):
            def __init__(self):
                pass

            def connection_made(self, transport):
                try:
                    super().connection_made(transport)
                except AttributeError:
                    pass                                   # the rest of uvicorn's setup needs a server config
                seen.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        _, w = await asyncio.open_connection(*listener.getsockname())
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        w.close()
        server.close()
        return seen

    assert asyncio.run(main()) == [1]


def test_features_lookups_on_the_fast_path_answer_as_the_route_does(export_dir, monkeypatch):
    """POST /v1/lookup with features and Content-Type application/json is answered by `_FeaturesLookup`
    (the route's own model, token check and answer, without FastAPI's routing); the same requests sent as
    application/vnd.x+json (JSON to FastAPI, not to the fast path) reach the route. Over two caches given the
    same stores, every answer is the same bytes and status: hits, misses, other tenants, wrong and scoped
    tokens, bodies the model refuses, malformed JSON, bad features, a text request."""
    from ushash.serving import service

    seen = []

    class Counting(service.LookupBody):
        @classmethod
        def model_validate(cls, obj, **kw):
            seen.append(obj)
            return super().model_validate(obj, **kw)

    scoped = "acme-only-0123456789"
    rng = np.random.default_rng(11)
    stored = [rng.normal(size=16).round(3).tolist() for _ in range(6)]
    answers = {}
    for ctype in ("application/json", "application/vnd.x+json"):
        cache = SemanticCache.from_export(export_dir, {"radius": 4, "tenants": ["default", "acme"]})
        monkeypatch.setattr(service, "LookupBody", Counting)
        with TestClient(create_app(cache, token=TOKEN, tokens={scoped: ["acme"]})) as c:
            auth = {"Authorization": f"Bearer {TOKEN}"}
            for i, f in enumerate(stored):
                assert c.post("/v1/store", json={"modality": "image", "features": f, "value": {"i": i},
                                                 "tenant": ["default", "acme"][i % 2]}, headers=auth).json()["stored"]
            near = [[x + 0.001 for x in f] for f in stored]
            bodies = [{"modality": "image", "features": f} for f in stored + near] + [
                {"modality": "image", "features": f, "tenant": "acme"} for f in stored] + [
                {"modality": "image", "features": stored[0], "tenant": "initech"},
                {"modality": "image", "features": stored[0], "text": None, "data_b64": None},
                {"modality": "image", "features": [1.0, 2.0]},
                {"modality": "video", "features": stored[0]},
                {"modality": "image", "features": stored[0], "surprise": 1},
                {"modality": "text", "text": "a cat"},
                {"modality": "image", "features": [1e39] * 16},
                [1, 2]]
            out = []
            for headers in (auth, {"Authorization": f"Bearer {scoped}"}, {"Authorization": "Bearer wrong-0123456789abc"}, {}):
                for b in bodies:
                    raw = service.json.dumps(b).encode()
                    r = c.post("/v1/lookup", content=raw, headers={"content-type": ctype, **headers})
                    out.append((r.status_code, r.content))
                r = c.post("/v1/lookup", content=b'{"modality": "image", "features": [1,', headers={"content-type": ctype, **headers})
                out.append((r.status_code, r.content))
            answers[ctype] = out
        monkeypatch.undo()
        if ctype == "application/json":
            assert len(seen) >= len(bodies), "the fast path was not taken"
            seen.clear()
        else:
            assert not seen, "a +json body reached the fast path"
    fast, route = answers.values()
    assert fast == route
    statuses = {s for s, _ in fast}
    assert {200, 400, 401, 403, 404, 422} <= statuses, statuses
    assert sum(b'"hit":true' in body for _, body in fast) >= 12


@pytest.mark.parametrize("value,status", [(b"-1", 400), (b"+2", 400), (b"2_0", 400), (b" 2", 400), (b"", 400),
                                          (b"abc", 400), ("²".encode(), 400), (b"99999", 413), (b"2", 200),
                                          (b"0" * 4990 + b"2", 200), (b"9" * 4990, 413), (b"1" + b"0" * 19, 413)])
def test_a_content_length_that_is_not_digits_is_a_400(value, status):
    """The body limit reads Content-Length as RFC 9110 writes it (1*DIGIT): int() alone took "-1", "+2",
    "2_0" and spaces, so a negative length passed the limit (servers that do not check it themselves). One of
    more than 4,300 digits (uvicorn's parser lets 4,990 zeros and a 2 through) raised out of int(), a 500 from
    this outermost layer: past 19 digits, leading zeros aside, it is over the limit."""
    import asyncio

    from ushash.serving.service import _BodyLimit

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sent = []

    async def send(msg):
        sent.append(msg)

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    scope = {"type": "http", "headers": [(b"content-length", value)]}
    asyncio.run(_BodyLimit(app, 1000)(scope, receive, send))
    assert sent[0]["status"] == status


def test_a_trailing_slash_is_a_404_and_a_huge_integer_a_422_not_a_500(client):
    """A path with a trailing slash was redirected, and the redirect re-read the query string as UTF-8 (bytes
    that are not: a 500 before the token check); redirects are off, so it is a plain 404. A JSON integer past
    Python's 4,300 digits was FastAPI's bare 400: a 422 that says so."""
    assert asgi_request(client.app, "GET", "/v1/lookup/", query=b"a=\xff")[0] == 404
    r = client.post("/v1/lookup", content=b'{"modality": "text", "text": ' + b"1" * 4400 + b"}",
                    headers={"content-type": "application/json"})
    assert r.status_code == 422 and "number" in r.json()["error"]


def test_a_text_lookup_is_encoded_in_the_worker_threads_and_a_features_one_on_the_loop(export_dir, monkeypatch):
    """Text and media go through an encoder in the service's `Workers` (never on the event loop); precomputed
    features are answered on the loop (the handoff costs more than the work). The shutdown closes the workers."""
    import asyncio
    import threading

    cache = SemanticCache.from_export(export_dir, {"radius": 4})
    seen, lookup = [], cache.lookup
    monkeypatch.setattr(cache, "lookup", lambda *a, **k: seen.append(threading.current_thread().name) or lookup(*a, **k))
    app = create_app(cache)
    with TestClient(app) as c:
        assert c.post("/v1/lookup", json={"modality": "text", "text": "a frog"}).json() == {"hit": False}
        assert c.post("/v1/lookup", json={"modality": "text", "features": [0.1] * 16}).json() == {"hit": False}
    assert len(seen) == 2 and seen[0].startswith("ushash-worker") and not seen[1].startswith("ushash-worker")
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(app.state.workers.run(lambda: None))
