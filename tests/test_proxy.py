"""The caching proxy (ushash.serving.proxy) in front of a mock upstream: chat JSON with text and image
data URLs, a configurable JSON path, streamed answers, Cache-Control, tokens to tenants, X-Model-Revision,
and the 4xx answers."""

import base64
import hashlib
import json
import re
import time
from email.utils import formatdate

import httpx
import numpy as np
import orjson
import pytest
import torch
from conftest import asgi_request
from fastapi.testclient import TestClient

from ushash.serving.cache import SemanticCache
from ushash.serving.cache.lsh import LSHHead
from ushash.serving.proxy import create_proxy_app, extract_request

DIM = 32


def _feats(modality, data):
    if modality == "text":
        v = np.zeros(DIM, np.float32)
        for w in data.lower().split():
            v[int(hashlib.md5(w.encode()).hexdigest(), 16) % DIM] += 1
        return v
    return np.frombuffer(hashlib.sha512(data).digest(), np.uint8)[:DIM].astype(np.float32) / 255 - 0.5


class Upstream:
    def __init__(self):
        self.calls = []

    def __call__(self, request: httpx.Request):
        body = json.loads(request.content)
        self.calls.append((request.url.path, body, dict(request.headers)))
        n = len(self.calls)
        if body.get("stream"):
            chunks = [f"data: {json.dumps({'delta': f'part{i} of answer {n}'})}\n\n".encode() for i in range(3)]
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"".join(chunks) + b"data: [DONE]\n\n")
        if body.get("fail"):
            return httpx.Response(500, json={"error": "boom"})
        return httpx.Response(200, json={"answer": n}, headers={"Server-Timing": "model;dur=7"})


@pytest.fixture
def setup(monkeypatch):
    head = LSHHead({"image": DIM, "text": DIM}, bits=64, dim=24, aligned=True, seed=0)
    cache = SemanticCache(head, {"radius": 4, "payload_threshold": 0.9, "cross_modal": False})
    monkeypatch.setattr(cache, "query", lambda m, data=None, features=None: cache.encoder(m, None, _feats(m, data)))
    up = Upstream()
    tokens = {"a" * 16: "acme", "b" * 16: "globex"}
    app = create_proxy_app(cache, "http://upstream", tokens=tokens, transport=httpx.MockTransport(up),
                           max_body_bytes=4096)
    return TestClient(app), up, cache


def chat(text, image=None, **kw):
    content = [{"type": "text", "text": text}]
    if image is not None:
        content.append({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}})
    return {"model": "m1", "messages": [{"role": "user", "content": content}], **kw}


def H(tok="a", **kw):
    return {"Authorization": "Bearer " + tok * 16, **kw}


def test_miss_is_forwarded_and_stored_then_hits(setup):
    client, up, _ = setup
    r = client.post("/v1/chat/completions", json=chat("what is a frog"), headers=H())
    assert r.status_code == 200 and r.json() == {"answer": 1} and r.headers["x-cache"] == "miss"
    # the proxy's own timings, then the upstream's
    assert re.fullmatch(r"lookup;dur=\d+\.\d{3}, upstream;dur=\d+\.\d{3}, model;dur=7", r.headers["server-timing"])
    r = client.post("/v1/chat/completions", json=chat("what is a frog"), headers=H())
    assert r.json() == {"answer": 1} and r.headers["x-cache"] == "hit" and len(up.calls) == 1
    assert re.fullmatch(r"lookup;dur=\d+\.\d{3}", r.headers["server-timing"])
    assert "authorization" not in up.calls[0][2]          # the client's token never reaches the upstream
    # another tenant, model, path or revision never shares the answer
    for kw in ({"headers": H("b")}, {"json": {**chat("what is a frog"), "model": "m2"}},
               {"headers": H(**{"X-Model-Revision": "r2"})}):
        args = {"json": chat("what is a frog"), "headers": H(), **kw}
        assert client.post("/v1/chat/completions", **args).headers["x-cache"] == "miss"
    assert client.post("/v1/other", json=chat("what is a frog"), headers=H()).headers["x-cache"] == "miss"
    assert len(up.calls) == 5


def test_images_key_the_request_with_their_text(setup):
    client, up, _ = setup
    img = b"\x89PNG a picture"
    assert client.post("/v1/chat/completions", json=chat("what is this", img), headers=H()).headers["x-cache"] == "miss"
    assert client.post("/v1/chat/completions", json=chat("what is this", img), headers=H()).headers["x-cache"] == "hit"
    assert client.post("/v1/chat/completions", json=chat("how old is it", img), headers=H()).headers["x-cache"] == "miss"
    assert client.post("/v1/chat/completions", json=chat("what is this", b"other"), headers=H()).headers["x-cache"] == "miss"


def test_streamed_answers_pass_through_and_replay(setup):
    client, up, _ = setup
    with client.stream("POST", "/v1/chat/completions", json=chat("tell me", stream=True), headers=H()) as r:
        first = b"".join(r.iter_raw())
        assert r.headers["x-cache"] == "miss" and r.headers["content-type"].startswith("text/event-stream")
    assert first.count(b"data:") == 4
    r = client.post("/v1/chat/completions", json=chat("tell me", stream=True), headers=H())
    assert r.headers["x-cache"] == "hit" and r.content == first and len(up.calls) == 1
    # a non-streamed request is another entry
    assert client.post("/v1/chat/completions", json=chat("tell me"), headers=H()).headers["x-cache"] == "miss"


def test_cache_control(setup):
    client, up, _ = setup
    client.post("/v1/chat/completions", json=chat("q"), headers=H())
    r = client.post("/v1/chat/completions", json=chat("q"), headers=H(**{"Cache-Control": "no-cache"}))
    assert r.headers["x-cache"] == "bypass" and r.json() == {"answer": 2}
    assert client.post("/v1/chat/completions", json=chat("q"), headers=H()).json() == {"answer": 2}  # refreshed
    client.post("/v1/chat/completions", json=chat("other q"), headers=H(**{"Cache-Control": "no-store"}))
    assert client.post("/v1/chat/completions", json=chat("other q"), headers=H()).headers["x-cache"] == "miss"


def test_what_the_cache_cannot_encode_is_passed_through_not_refused(setup, monkeypatch):
    """An image over the cache's pixel limit, an undecodable one or a text over its length limit is the model's
    to answer: forwarded with X-Cache: bypass, never stored (it was a 400 from the proxy)."""
    client, up, cache = setup
    from ushash.serving.cache import RequestError
    keyed = cache.query

    def query(m, data=None, features=None):
        if m == "text" and len(data) > 50 or m == "image" and data.startswith(b"BOMB"):
            raise RequestError(f"{m} over the cache's limits")
        return keyed(m, data)

    monkeypatch.setattr(cache, "query", query)
    for body in (chat("a long question " * 10), chat("what is this", b"BOMB image")):
        for n in (1, 2):
            r = client.post("/v1/chat/completions", json=body, headers=H())
            assert r.status_code == 200 and r.headers["x-cache"] == "bypass", r.text
    assert len(up.calls) == 4          # each forwarded, none stored and served
    assert client.post("/v1/chat/completions", json=chat("short"), headers=H()).headers["x-cache"] == "miss"


def test_errors_and_auth(setup):
    client, up, _ = setup
    assert client.post("/v1/chat/completions", json=chat("q")).status_code == 401
    assert client.post("/v1/chat/completions", json=chat("q"), headers=H("z")).status_code == 401
    assert client.post("/v1/chat/completions", content=b"{not json", headers=H()).status_code == 400
    assert client.post("/v1/chat/completions", content=b"[1, 2]", headers=H()).status_code == 400
    deep = b"[" * 2000 + b"]" * 2000   # deeper than Python's recursion limit, under max_body_bytes
    assert client.post("/v1/chat/completions", content=deep, headers=H()).status_code == 400
    # JSON that orjson refuses and Python's json reads is forwarded as it was (the upstream judges it); text
    # with a lone surrogate escape has no UTF-8 to key it by: passed through
    for odd, label in ((b'{"messages": [{"role": "user", "content": "nan q"}], "temperature": NaN}', "miss"),
                       (b'{"messages": [{"role": "user", "content": "surrogate q \\ud800"}]}', "bypass")):
        r = client.post("/v1/chat/completions", content=odd, headers=H())
        assert r.status_code == 200 and r.headers["x-cache"] == label, odd
    assert client.post("/v1/chat/completions", content=b"x" * 5000, headers=H()).status_code == 413
    r = client.post("/v1/chat/completions", json={**chat("q"), "fail": True}, headers=H())
    assert r.status_code == 500 and r.headers["x-cache"] == "miss"
    assert client.post("/v1/chat/completions", json={**chat("q"), "fail": True}, headers=H()).status_code == 500  # not stored
    assert client.post("/v1/embeddings", json={"input": 3}, headers=H()).headers["x-cache"] == "bypass"
    # an escaped control character in the path is forwarded as it came (the upstream's to judge); what
    # Python's str() cannot read is the client's 400, not a 500
    r = client.post("/v1/chat%00", json=chat("q"), headers=H())
    assert r.status_code == 200 and up.calls[-1][0] == "/v1/chat\x00"   # the path as the upstream decodes it
    deep = "[" * 1000 + "]" * 1000   # within orjson's 1024 levels, past what str() of it can recurse
    body = '{"messages": [{"role": %s, "content": "q"}]}' % deep
    assert client.post("/v1/chat/completions", content=body.encode(), headers=H()).status_code == 400
    # a text part's `text` that is not a string is not read (never str()'d): passed through
    assert extract_request(orjson.loads('{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}'
                                        % deep)) is None
    # a header value outside ASCII (obs-text) is forwarded bytes for bytes
    r = client.post("/v1/embeddings", json={"input": 3}, headers={**H(), "X-Note": b"caf\xe9"})
    assert r.status_code == 200 and up.calls[-1][2]["x-note"] == "caf\xe9"


def test_json_path_for_other_apis():
    body = {"input": {"prompt": "a frog", "image": base64.b64encode(b"img").decode()}}
    e = extract_request(body, "input.prompt", "input.image")
    assert e.text == "a frog" and e.image == b"img"
    assert extract_request({"input": {}}, "input.prompt") is None
    assert extract_request({"messages": [{"role": "user", "content": "hi"}]}).text == "user: hi"


def test_a_near_request_is_served_the_stored_answer_and_a_different_one_is_not(setup):
    client, up, _ = setup
    assert client.post("/v1/chat/completions", json=chat("what is a big green tree frog"), headers=H()).json() == {"answer": 1}
    r = client.post("/v1/chat/completions", json=chat("what is a big green tree frog please"), headers=H())
    assert r.headers["x-cache"] == "hit" and r.json() == {"answer": 1}
    assert 0 < int(r.headers["x-cache-distance"]) <= 4          # other features, within the radius
    r = client.post("/v1/chat/completions", json=chat("what is a big green tree toad"), headers=H())
    assert r.headers["x-cache"] == "miss" and r.json() == {"answer": 2} and len(up.calls) == 2


def _image_chat(url, text="what is in this picture"):
    return {"model": "m1", "messages": [{"role": "user", "content": [{"type": "text", "text": text},
                                                                      {"type": "image_url", "image_url": {"url": url}}]}]}


def test_a_body_of_more_json_values_than_the_limit_is_forwarded_unparsed(monkeypatch):
    """Over max_json_values the proxy does not parse the body (8 MB of `{},` is ~200 MB of Python objects) and
    does not refuse it either: the upstream gets it byte for byte and answers; nothing is stored."""
    from ushash.serving import proxy, service

    head = LSHHead({"image": DIM, "text": DIM}, bits=64, dim=24, aligned=True, seed=0)
    cache = SemanticCache(head, {"radius": 4, "payload_threshold": 0.9, "cross_modal": False})
    monkeypatch.setattr(cache, "query", lambda m, data=None, features=None: cache.encoder(m, None, _feats(m, data)))
    up = Upstream()
    body = json.dumps(chat("what is a frog")).encode()
    parsed, loads = [], proxy.loads_json
    monkeypatch.setattr(proxy, "loads_json", lambda raw: parsed.append(raw) or loads(raw))
    client = TestClient(create_proxy_app(cache, "http://upstream", transport=httpx.MockTransport(up),
                                         max_json_values=service.json_values_bound(body)))
    # (what the proxy parses besides request bodies: the answers it stores, to see they are whole)
    assert client.post("/v1/chat/completions", content=body).headers["x-cache"] == "miss" and parsed[0] == body
    bigger = json.dumps(chat("what is a frog", extra=[0])).encode()
    for _ in range(2):
        r = client.post("/v1/chat/completions", content=bigger)
        assert r.status_code == 200 and r.headers["x-cache"] == "bypass" and r.json() == {"answer": len(up.calls)}
    assert [c[1] for c in up.calls[1:]] == [json.loads(bigger)] * 2 and bigger not in parsed


def test_requests_holding_what_the_proxy_cannot_key_pass_through(setup):
    """Keyed by the rest of the body, two requests that differ only in what the proxy cannot read would
    share an answer (the one about a.png served for b.png): such requests are passed through, never stored."""
    client, up, _ = setup
    turns, parts = [{}] * 256, ["p"] * 256   # small: the fixture's bodies are at most 4096 bytes
    pairs = [
        (_image_chat("https://example.com/a.png"), _image_chat("https://example.com/b.png")),   # remote images
        (_image_chat("data:image/png;base64,@@@@"), _image_chat("data:image/png;base64,!!!!")),  # bad base64
        ({"model": "m1", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "transcribe"}, {"type": "input_audio", "input_audio": {"data": d}}]}]}
         for d in ("AAAA", "BBBB")),                                                           # another part type
        ({"model": "m1", "messages": turns + [{"role": "user", "content": q}]}
         for q in ("the capital of France?", "delete my account")),                           # > 256 messages
        ({"model": "m1", "messages": [{"role": "user", "content": parts + [{"type": "text", "text": q}]}]}
         for q in ("alpha", "omega")),                                                         # > 256 parts
    ]
    for pair in pairs:
        for body in pair:
            assert extract_request(body) is None
            for _ in range(2):
                n = len(up.calls)
                r = client.post("/v1/chat/completions", json=body, headers=H())
                assert r.status_code == 200 and r.headers["x-cache"] == "bypass" and len(up.calls) == n + 1
    # a configured image path holding something that is not base64 is not keyed by the text alone
    for image in ("not base64!", 7):
        assert extract_request({"input": {"prompt": "a frog", "image": image}}, "input.prompt", "input.image") is None
    assert extract_request({"input": {"prompt": "a frog"}}, "input.prompt", "input.image").text == "a frog"


def test_cache_control_reads_every_header_line_and_whole_directives(setup):
    client, up, _ = setup
    two_lines = [("authorization", "Bearer " + "a" * 16), ("cache-control", "max-age=0"), ("cache-control", "no-store")]
    # max-age=0 asks for a fresh answer (no lookup), and the second line's no-store counted: not stored
    assert client.post("/v1/chat/completions", json=chat("q one"), headers=two_lines).headers["x-cache"] == "bypass"
    assert client.post("/v1/chat/completions", json=chat("q one"), headers=H()).headers["x-cache"] == "miss"
    client.post("/v1/chat/completions", json=chat("q two"), headers=H())
    r = client.post("/v1/chat/completions", json=chat("q two"), headers=H(**{"Cache-Control": "x-no-cache-hint"}))
    assert r.headers["x-cache"] == "hit"                         # another directive, not no-cache
    r = client.post("/v1/chat/completions", json=chat("q two"), headers=H(**{"Cache-Control": "max-age=0, No-Cache"}))
    assert r.headers["x-cache"] == "bypass"


@pytest.mark.parametrize("headers,stored", [({}, True), ({"cache-control": "max-age=60"}, True),
                                            ({"cache-control": "private, max-age=60"}, False),
                                            ({"cache-control": "No-Store"}, False), ({"cache-control": "no-cache"}, False),
                                            ({"vary": "Accept-Encoding"}, True), ({"vary": "Accept-Language"}, False),
                                            ({"vary": "*"}, False)])
def test_an_answer_the_upstream_marks_unshareable_is_relayed_not_stored(headers, stored):
    """A user's private answer (Cache-Control: private) or one that varies on a request header the proxy does
    not key by (Vary: Accept-Language) was stored and served to the next request that looked the same."""
    head = LSHHead({"image": DIM, "text": DIM}, bits=64, dim=24, aligned=True, seed=0)
    cache = SemanticCache(head, {"radius": 4, "payload_threshold": 0.9, "cross_modal": False})
    cache.query = lambda m, data=None, features=None: cache.encoder(m, None, _feats(m, data))
    calls = []

    def up(request):
        calls.append(request)
        return httpx.Response(200, json={"answer": len(calls)}, headers=headers)

    client = TestClient(create_proxy_app(cache, "http://upstream", transport=httpx.MockTransport(up)))
    first = client.post("/v1/chat/completions", json=chat("my account balance"))
    assert first.json() == {"answer": 1} and first.headers["x-cache"] == "miss"
    again = client.post("/v1/chat/completions", json=chat("my account balance"))
    assert again.headers["x-cache"] == ("hit" if stored else "miss") and len(calls) == (1 if stored else 2)


def _proxy_at(clock, up, **kw):
    head = LSHHead({"image": DIM, "text": DIM}, bits=64, dim=24, aligned=True, seed=0)
    cache = SemanticCache(head, {"radius": 4, "payload_threshold": 0.9, "cross_modal": False, "ttl_jitter": 0.0},
                          clock=lambda: clock[0])
    cache.query = lambda m, data=None, features=None: cache.encoder(m, None, _feats(m, data))
    return TestClient(create_proxy_app(cache, "http://upstream", transport=httpx.MockTransport(up), **kw))


def test_an_answer_without_a_date_is_judged_at_one_time_for_storing_and_keeping():
    """An answer with Expires and no Date is fresh until Expires less the time now: the proxy read the clock
    twice, once to decide it may be stored and once for its TTL, so an answer that went stale in between was
    stored with a TTL of 0 (no expiry) or below. Both are read at the one time given."""
    from ushash.serving.proxy import answer_lifetime, answer_storable

    headers = httpx.Headers({"expires": "Sun, 06 Dec 2026 10:01:00 GMT"})
    at = 1796551260.0   # 2026-12-06 10:01:00 UTC
    assert answer_lifetime(headers, at - 5) == 5 and answer_storable(headers, at - 5)
    assert answer_lifetime(headers, at) == 0 and not answer_storable(headers, at)
    assert answer_lifetime(httpx.Headers({"cache-control": "max-age=60"}), at) == 60


@pytest.mark.parametrize("headers,later,hit", [
    ({"cache-control": "max-age=0"}, 1, False), ({"cache-control": "must-revalidate, max-age=0"}, 1, False),
    ({"cache-control": "max-age=60"}, 30, True), ({"cache-control": "max-age=60"}, 120, False),
    ({"cache-control": "s-maxage=0, max-age=600"}, 1, False), ({"cache-control": "max-age=600, s-maxage=60"}, 120, False),
    ({"cache-control": "max-age=600"}, 120, True), ({"cache-control": "max-age=100", "age": "90"}, 30, False),
    ({"cache-control": "max-age=soon"}, 1, False),
    ({"date": "{now}", "expires": "{now+60}"}, 30, True), ({"date": "{now}", "expires": "{now+60}"}, 90, False),
    ({"expires": "0"}, 1, False), ({}, 3000, True), ({}, 4000, False),
])
def test_an_answer_is_kept_no_longer_than_the_upstream_allows(headers, later, hit):
    """The upstream's freshness (RFC 9111: s-maxage, else max-age, else Expires less Date, less Age) bounds
    the entry's TTL: an answer of max-age=60 was served for the cache's whole hour, one of max-age=0 too.
    Without any, the cache's TTL (3600 s) holds."""
    clock, calls = [1_000_000.0], []

    def up(request):
        calls.append(request)
        # a Date is the wall clock's (the proxy judges it by time.time(); the cache's own clock is simulated)
        now = time.time()
        return httpx.Response(200, json={"price": len(calls)}, headers={
            k: {"{now}": http_date(now), "{now+60}": http_date(now + 60)}.get(v, v) for k, v in headers.items()})

    client = _proxy_at(clock, up)
    assert client.post("/v1/chat/completions", json=chat("price of gold")).headers["x-cache"] == "miss"
    clock[0] += later
    again = client.post("/v1/chat/completions", json=chat("price of gold"))
    assert again.headers["x-cache"] == ("hit" if hit else "miss") and len(calls) == (1 if hit else 2)


@pytest.mark.parametrize("headers", [{"Cache-Control": "max-age=0"}, {"Pragma": "no-cache"}])
def test_a_request_asking_for_a_fresh_answer_skips_the_lookup(setup, headers):
    client, up, _ = setup
    client.post("/v1/chat/completions", json=chat("q"), headers=H())
    r = client.post("/v1/chat/completions", json=chat("q"), headers=H(**headers))
    assert r.headers["x-cache"] == "bypass" and len(up.calls) == 2
    # Pragma is HTTP/1.0's: a Cache-Control line of the request takes its place
    r = client.post("/v1/chat/completions", json=chat("q"), headers=H(Pragma="no-cache", **{"Cache-Control": "max-age=5"}))
    assert r.headers["x-cache"] == "hit"


def test_a_request_max_age_refuses_an_older_hit_and_a_hit_states_its_age():
    """A request's `Cache-Control: max-age=N` takes no stored answer older than N s (RFC 9111 5.2.1.1): only
    max-age=0 was read, so an hour-old answer was served to a client that asked for one of at most 10 s; and
    a hit said nothing of its age (`Age`, whole seconds since it was stored, on the cache's clock)."""
    clock, calls = [1_000_000.0], []

    def up(request):
        calls.append(request)
        return httpx.Response(200, json={"price": len(calls)})

    client = _proxy_at(clock, up)
    assert "age" not in client.post("/v1/chat/completions", json=chat("price of gold")).headers
    clock[0] += 30.5
    r = client.post("/v1/chat/completions", json=chat("price of gold"), headers={"Cache-Control": "max-age=60"})
    assert r.headers["x-cache"] == "hit" and r.headers["age"] == "30" and len(calls) == 1
    # too old for max-age=10: forwarded, and the fresh answer stored
    r = client.post("/v1/chat/completions", json=chat("price of gold"), headers={"Cache-Control": "max-age=10"})
    assert r.headers["x-cache"] == "miss" and r.json() == {"price": 2} and "age" not in r.headers
    r = client.post("/v1/chat/completions", json=chat("price of gold"), headers={"Cache-Control": "max-age=10"})
    assert r.headers["x-cache"] == "hit" and r.json() == {"price": 2} and r.headers["age"] == "0" and len(calls) == 2



def test_the_fresh_answer_a_max_age_asked_for_is_the_one_served_from_then_on():
    """A near request refusing a hit for its max-age stored the fresh answer as a second entry beside the old
    one, which the original wording was served on (at distance 0) from then on: RFC 9111 4 says the most
    recent stored answer. The refused entry is dropped once the fresh one is stored, and kept when it is not
    (no-store)."""
    clock, calls = [1_000_000.0], []

    def up(request):
        calls.append(request)
        return httpx.Response(200, json={"answer": len(calls)})

    client = _proxy_at(clock, up)
    frog, please = "what is a big green tree frog", "what is a big green tree frog please"
    assert client.post("/v1/chat/completions", json=chat(frog)).json() == {"answer": 1}
    clock[0] += 30
    r = client.post("/v1/chat/completions", json=chat(please), headers={"Cache-Control": "max-age=10"})
    assert r.headers["x-cache"] == "miss" and r.json() == {"answer": 2}
    r = client.post("/v1/chat/completions", json=chat(frog))
    assert r.headers["x-cache"] == "hit" and r.json() == {"answer": 2} and r.headers["age"] == "0"
    assert int(r.headers["x-cache-distance"]) > 0 and len(calls) == 2
    # not stored (no-store): the refused answer stays the one served
    clock[0] += 30
    r = client.post("/v1/chat/completions", json=chat(frog), headers={"Cache-Control": "max-age=10, no-store"})
    assert r.headers["x-cache"] == "miss" and r.json() == {"answer": 3}
    r = client.post("/v1/chat/completions", json=chat(frog))
    assert r.headers["x-cache"] == "hit" and r.json() == {"answer": 2} and r.headers["age"] == "30"

def test_a_hit_is_as_old_as_the_age_it_came_with_plus_its_time_in_the_cache():
    """RFC 9111 4.2.3: a stored answer's age is the upstream's `Age` when it came plus its time in the cache.
    Only the time in the cache was counted: an answer 100 s old when it came, stored 5 s ago, was served with
    `Age: 5` and to a client asking for one of at most 104 s (max-age). Its TTL (max-age=600 less its Age, as
    before) ends as its Age reaches 600: nothing counted twice."""
    clock, calls = [1_000_000.0], []

    def up(request):
        calls.append(request)
        return httpx.Response(200, json={"price": len(calls)}, headers={"cache-control": "max-age=600", "age": "100"})

    client = _proxy_at(clock, up)
    r = client.post("/v1/chat/completions", json=chat("price of gold"))
    assert r.headers["x-cache"] == "miss" and r.headers["age"] == "100"   # the upstream's, relayed
    clock[0] += 5.5
    r = client.post("/v1/chat/completions", json=chat("price of gold"))
    assert r.headers["x-cache"] == "hit" and r.headers["age"] == "105" and len(calls) == 1
    r = client.post("/v1/chat/completions", json=chat("price of gold"), headers={"Cache-Control": "max-age=106"})
    assert r.headers["x-cache"] == "hit" and r.json() == {"price": 1}
    # 105.5 s old: too old for max-age=104, forwarded, and the fresh answer (again 100 s old) stored
    r = client.post("/v1/chat/completions", json=chat("price of gold"), headers={"Cache-Control": "max-age=104"})
    assert r.headers["x-cache"] == "miss" and r.json() == {"price": 2} and len(calls) == 2
    clock[0] += 499
    r = client.post("/v1/chat/completions", json=chat("price of gold"))
    assert r.headers["x-cache"] == "hit" and r.json() == {"price": 2} and r.headers["age"] == "599"
    clock[0] += 1
    assert client.post("/v1/chat/completions", json=chat("price of gold")).headers["x-cache"] == "miss"


@pytest.mark.parametrize("age,served", [("7", "12"), ("soon", "5"), ("-3", "5"), ("1.5", "5"), ("", "5")])
def test_only_an_age_of_delta_seconds_from_the_upstream_counts(age, served):
    """An upstream's Age that is not delta-seconds counts as 0, as the lifetime reads it (`answer_lifetime`): the
    hit is as old as its time in the cache; a valid one is added to it (it was not)."""
    clock = [1_000_000.0]
    client = _proxy_at(clock, lambda request: httpx.Response(200, json={"price": 1}, headers={"age": age}))
    client.post("/v1/chat/completions", json=chat("price of gold"))
    clock[0] += 5
    r = client.post("/v1/chat/completions", json=chat("price of gold"))
    assert r.headers["x-cache"] == "hit" and r.headers["age"] == served


def http_date(t: float) -> str:
    return formatdate(t, usegmt=True)


@pytest.mark.parametrize("date_ago,max_age,later,hit,served_age", [
    (3600, 60, 1, False, None),     # dated an hour ago, fresh for a minute: stale as it comes, not stored
    (30, 60, 20, True, "50"),       # 30 s old as it comes: 20 s later it is 50 s old, and still fresh
    (30, 60, 40, False, None),      # 40 s later it would be 70 s old: expired after 30 s in the cache
    (-600, 60, 30, True, "30"),     # a Date ahead of the proxy's clock: an apparent age of 0, not below
])
def test_an_answer_is_as_old_as_its_date_says_without_an_age(date_ago, max_age, later, hit, served_age):
    """RFC 9111 4.2.3: an answer's age as it comes is the larger of its Age and the time since its Date. The proxy
    read only Age, so behind a cache that sets none an answer dated an hour ago with max-age=60 was kept and
    served for a minute more (and its hits' Age left out the hour)."""
    clock, calls = [1_000_000.0], []

    def up(request):
        calls.append(request)
        return httpx.Response(200, json={"price": len(calls)},
                              headers={"date": http_date(time.time() - date_ago), "cache-control": f"max-age={max_age}"})

    client = _proxy_at(clock, up)
    assert client.post("/v1/chat/completions", json=chat("price of gold")).headers["x-cache"] == "miss"
    clock[0] += later
    again = client.post("/v1/chat/completions", json=chat("price of gold"))
    assert again.headers["x-cache"] == ("hit" if hit else "miss") and len(calls) == (1 if hit else 2)
    if hit:   # whole seconds: the Date has no fraction, and a slow test run may add one
        assert int(again.headers["age"]) - int(served_age) in (0, 1)


def test_an_age_beyond_the_dates_counts_with_the_time_the_request_took():
    """The larger of the two is taken: an Age of 100 from a cache upstream outweighs a Date of now."""
    from ushash.serving.proxy import initial_age

    now = 1796551260.0
    headers = httpx.Headers({"date": http_date(now - 5), "age": "100"})
    assert initial_age(headers, now, asked=now - 2) == 102
    assert initial_age(httpx.Headers({"date": http_date(now - 500), "age": "100"}), now, asked=now - 2) == 500
    assert initial_age(httpx.Headers({"date": "not a date"}), now) == 0


def test_a_date_without_a_zone_is_gmt_whatever_the_machines_zone(monkeypatch):
    """asctime's form has no zone (RFC 9110 5.6.7: recipients accept it); it was read as local time, so on a
    machine in Tokyo an answer dated now was 9 hours old, and none was stored."""
    from ushash.serving.proxy import answer_storable, initial_age

    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        now = 1796551260.0
        asctime = time.strftime("%a %b %d %H:%M:%S %Y", time.gmtime(now - 30))
        headers = httpx.Headers({"date": asctime, "cache-control": "max-age=60"})
        assert abs(initial_age(headers, now) - 30) < 1e-6 and answer_storable(headers, now)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_a_ttl_under_the_caches_shortest_is_refused_at_start():
    """ttl_s=0.0005 started, then failed every store with a warning: refused at start now."""
    head = LSHHead({"image": DIM, "text": DIM}, bits=64, dim=24, aligned=True, seed=0)
    with pytest.raises(ValueError, match="ttl_s"):
        create_proxy_app(SemanticCache(head, {"radius": 4}), "http://upstream", ttl_s=0.0005)


def test_delta_seconds_past_2_to_the_31_are_2_to_the_31():
    """RFC 9111 1.2.2: a max-age and an Age of 400 digits each were infinity less infinity, a lifetime that was not
    a number: `answer_storable` took it for fresh and the TTL check raised while storing. Now each is 2^31, the
    answer is stale (2^31 - 2^31 = 0), relayed and not stored; a max-age of 400 digits alone is kept 2^31 s at
    most (the cache's TTL below it)."""
    from ushash.serving.proxy import MAX_DELTA_SECONDS, answer_lifetime, answer_storable

    huge = "9" * 400
    both = httpx.Headers({"cache-control": f"max-age={huge}", "age": huge})
    assert answer_lifetime(both, 0.0) == 0 and not answer_storable(both, 0.0)
    assert answer_lifetime(httpx.Headers({"cache-control": f"max-age={huge}"}), 0.0) == MAX_DELTA_SECONDS
    clock, calls = [1_000_000.0], []

    def up(request):
        calls.append(request)
        return httpx.Response(200, json={"price": len(calls)}, headers={"cache-control": f"max-age={huge}", "age": huge})

    client = _proxy_at(clock, up)
    for n in (1, 2):
        r = client.post("/v1/chat/completions", json=chat("price of gold"))
        assert r.status_code == 200 and r.headers["x-cache"] == "miss" and r.json() == {"price": n}


def _asgi_post(app, body: dict, headers: list = ()) -> tuple[int, dict, bytes]:
    """POST a chat body straight to the ASGI app (conftest.asgi_request)."""
    import json as _json

    return asgi_request(app, "POST", "/v1/chat/completions", _json.dumps(body).encode(), headers)


def test_numbers_that_are_not_ascii_digits_count_as_invalid_not_as_a_500():
    """"²" is a digit to str.isdigit but not to float() and int(): a request's max-age of it (latin-1 byte 0xb2),
    an upstream's Age, max-age or Content-Length of it were a 500. Each is now an invalid value: a max-age of 0
    (stale: the request bypasses the lookup, the answer is not stored), an Age of 0, a length not declared."""
    ok = lambda request: httpx.Response(200, json={"a": 1})
    assert _asgi_post(_proxy_at([1e6], ok).app, chat("q"), [(b"cache-control", b"max-age=\xb2")])[0] == 200
    from ushash.serving.proxy import _MISSING, _at
    assert _at({"a": [1, 2]}, "a.1") == 2 and _at({"a": [1, 2]}, "a.²") is _MISSING   # a configured JSON path
    for header in ((b"age", "²".encode()), (b"cache-control", "max-age=¹".encode()), (b"content-length", "²".encode())):
        app = _proxy_at([1e6], lambda request, h=header: httpx.Response(200, headers=[h], content=b'{"a":1}')).app
        assert [_asgi_post(app, chat("q"))[0] for _ in range(2)] == [200, 200]


def test_upstream_header_bytes_outside_latin_1_are_relayed_as_they_came():
    """httpx reads a UTF-8 header value as UTF-8; Starlette sends str headers as latin-1, so "X-Note: €" (and a
    Content-Type with €, on the miss and on every later hit) was a 500, after the answer was stored. The bytes
    are relayed as they came, on the miss and on the hit."""
    ctype = "application/json; note=€".encode()
    app = _proxy_at([1e6], lambda request: httpx.Response(200, headers=[
        (b"x-note", "€".encode()), (b"content-type", ctype), (b"server-timing", "db;desc=€".encode())],
        content=b'{"a":1}')).app
    (s1, h1, b1), (s2, h2, b2) = (_asgi_post(app, chat("q")) for _ in range(2))
    assert (s1, h1[b"x-cache"], s2, h2[b"x-cache"]) == (200, b"miss", 200, b"hit") and b1 == b2 == b'{"a":1}'
    assert h1[b"x-note"] == "€".encode() and h1[b"content-type"] == h2[b"content-type"] == ctype
    assert h1[b"server-timing"].endswith(b", " + "db;desc=€".encode())   # after the proxy's own
    from ushash.serving.proxy import _latin1
    assert _latin1("text/plain") == "text/plain" and _latin1("a €").encode("latin-1") == "a €".encode()


@pytest.mark.parametrize("stream,declared", [(True, None), (False, str(1 << 30))])
def test_a_streamed_answer_whose_body_does_not_decode_is_a_502(stream, declared):
    """A streamed answer (`stream: true`, or one declared over max_answer_bytes) whose first bytes fail to
    decode (a gzip that is not) failed after its 200 was sent: a torn connection. Its first chunk is read
    before the status goes out, so it is a 502, as when the answer is read whole."""
    class NotGzip(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b"not gzip"

    headers = {"content-encoding": "gzip", **({"content-length": declared} if declared else {})}
    client = _proxy_at([1e6], lambda request: httpx.Response(200, headers=headers, stream=NotGzip()))
    r = client.post("/v1/chat/completions", json=chat("q", stream=True) if stream else chat("q"))
    assert r.status_code == 502 and "upstream failed while sending its answer" in r.text


def test_an_entry_stored_without_the_upstreams_age_reads_as_age_0():
    """Entries stored before the proxy kept the upstream's Age (an older proxy's, through a shared L2) have none:
    0, as a value that is not delta-seconds; the one kept is capped at 2^31 (RFC 9111 1.2.2) to be stored."""
    from ushash.serving.proxy import MAX_DELTA_SECONDS, stored_age

    assert stored_age({"body": "{}", "content_type": "application/json"}) == 0
    assert stored_age({"body": "{}", "content_type": "application/json", "age": 100}) == 100
    assert stored_age({"age": "1e3"}) == stored_age({"age": -5}) == stored_age({"age": None}) == 0
    assert stored_age("an answer stored as text") == 0
    clock = [1_000_000.0]
    client = _proxy_at(clock, lambda request: httpx.Response(200, json={"price": 1}, headers={"age": "9" * 400}))
    client.post("/v1/chat/completions", json=chat("price of gold"))
    r = client.post("/v1/chat/completions", json=chat("price of gold"))
    assert r.headers["x-cache"] == "hit" and r.headers["age"] == str(MAX_DELTA_SECONDS)


def test_a_stream_that_reports_an_error_inside_its_200_is_relayed_not_stored():
    """vLLM and OpenAI-compatible servers report a failure mid-generation as an event whose data holds an
    `error`, then end the stream as usual: that answer was stored and replayed to every later request."""
    clock, calls = [1_000_000.0], []

    def up(request):
        calls.append(request)
        events = ([b'data: {"delta": "The capital"}\n\n', b'data: {"error": {"message": "out of memory"}}\n\n']
                  if len(calls) == 1 else [b'data: {"delta": "Paris", "error": null}\n\n'])
        return httpx.Response(200, headers={"content-type": "text/event-stream; charset=utf-8"},
                              content=b"".join(events) + b"data: [DONE]\n\n")

    client = _proxy_at(clock, up)
    body = chat("capital of France", stream=True)
    first = client.post("/v1/chat/completions", json=body)
    assert first.headers["x-cache"] == "miss" and b"out of memory" in first.content
    second = client.post("/v1/chat/completions", json=body)
    assert second.headers["x-cache"] == "miss" and b"Paris" in second.content and len(calls) == 2
    third = client.post("/v1/chat/completions", json=body)
    assert third.headers["x-cache"] == "hit" and third.content == second.content and len(calls) == 2


@pytest.mark.parametrize("ctype,answer,stored", [
    # an OpenAI Responses error event, and a response.failed one with the error under response.error
    ("text/event-stream", b'event: error\ndata: {"type":"error","code":"server_error","message":"failed"}\n\n', False),
    ("text/event-stream", b'event: response.created\ndata: {"type":"response.created"}\n\nevent: response.failed\n'
                          b'data: {"type":"response.failed","response":{"status":"failed","error":{"code":"x"}}}\n\n', False),
    # one event's JSON over two data lines (joined with a line feed), CRLF line ends
    ("text/event-stream", b'data: {"delta": "The"}\r\n\r\ndata: {"error":\r\ndata:  {"message": "CUDA OOM"}}\r\n\r\n', False),
    ("text/event-stream", b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
                          b'"delta":"error","response":{"error":null}}\n\n', True),
    # a JSON answer that is not streamed is read by the same rule
    ("application/json", b'{"error": {"message": "rate limited upstream", "code": 429}}', False),
    ("application/json", b'{"type": "error", "error": {"type": "overloaded_error"}}', False),
    ("application/json", b'{"answer": "no error", "error": null}', True),
    # llama.cpp's server: a line of the field `error` (not an SSE field), then the stream ends as a whole one
    ("text/event-stream", b'data: {"choices":[{"delta":{"content":"The capital"}}]}\n\nerror: {"code":500,'
                          b'"message":"llama_decode failed","type":"server_error"}\n\ndata: [DONE]\n\n', False),
    # cut off: an upstream that ends its body by closing the connection and fails mid-answer ends it as a whole
    # one (no Content-Length, not chunked: httpx reads a normal end)
    ("text/event-stream", b'data: {"delta": "The answer is"}\n\ndata: {"del', False),
    ("text/event-stream", b'data: {"delta": "Paris"}\r\n', False),
    ("text/event-stream", b'data: {"delta": "Paris"}\r\rdata: [DONE]\r\r', True),
    ("application/json", b'{"choices": [{"message": {"content": "The answer is', False),
    ("text/plain", b'The answer is', True),
], ids=["responses-error-event", "responses-failed", "split-data-lines", "delta-saying-error", "json-error",
        "json-type-error", "json-error-null", "llama-cpp-error-field", "stream-cut-mid-event",
        "stream-without-its-last-blank-line", "stream-cr-line-ends", "json-cut-off", "plain-text"])
def test_an_answer_that_reports_an_error_inside_its_200_is_relayed_not_stored(ctype, answer, stored):
    """Only a `data:` line whose own JSON held a top-level `error` was read: a Responses `error` or
    `response.failed` event, or an error event's JSON split over data lines, was stored and replayed; so was a
    200 JSON answer (not streamed) holding an `error`, llama.cpp's `error:` line, and an answer cut off
    mid-body (relayed as it came, and stored: replayed to every later request)."""
    clock, calls = [1_000_000.0], []

    def up(request):
        calls.append(request)
        return httpx.Response(200, headers={"content-type": ctype}, content=answer)

    client = _proxy_at(clock, up)
    body = chat("capital of France", stream=ctype == "text/event-stream")
    first = client.post("/v1/chat/completions", json=body)
    assert first.headers["x-cache"] == "miss" and first.content == answer
    again = client.post("/v1/chat/completions", json=body)
    assert again.headers["x-cache"] == ("hit" if stored else "miss") and again.content == answer
    assert len(calls) == (1 if stored else 2)


def test_headers_the_connection_header_names_are_not_forwarded_either_way():
    """RFC 9110 7.6.1: the headers a Connection header names are the hop's, as is HTTP/1.0's Proxy-Connection;
    both went through, to the upstream and back to the client. An X-Model-Revision so named is not forwarded,
    and so does not key the request either (the upstream answered without it)."""
    clock, seen = [1_000_000.0], []

    def up(request):
        seen.append(request.headers)
        return httpx.Response(200, json={"a": len(seen)}, headers={
            "Connection": "close, X-Upstream-Hop", "X-Upstream-Hop": "secret", "Proxy-Connection": "keep-alive",
            "X-Kept": "1"})

    client = _proxy_at(clock, up)
    r = client.post("/v1/chat/completions", json=chat("hi"), headers=[
        ("Connection", "keep-alive, X-Client-Hop"), ("Connection", "X-Model-Revision"), ("X-Client-Hop", "1"),
        ("Proxy-Connection", "keep-alive"), ("X-Model-Revision", "r2"), ("X-Other", "1")])
    assert r.headers["x-cache"] == "miss" and r.headers["x-kept"] == "1"
    assert "x-upstream-hop" not in r.headers and "proxy-connection" not in r.headers
    got = seen[0]
    assert got["x-other"] == "1" and not {"x-client-hop", "proxy-connection", "x-model-revision"} & set(got.keys())
    assert client.post("/v1/chat/completions", json=chat("hi")).headers["x-cache"] == "hit"


def test_the_upstream_is_offered_only_the_codings_the_proxy_decodes():
    """The proxy relays the body decoded, without its Content-Encoding: the client's Accept-Encoding went to the
    upstream, and a brotli answer (which this httpx may not decode) reached the client as raw bytes. httpx's
    own is sent: the codings it decodes."""
    clock, seen = [1_000_000.0], []

    def up(request):
        seen.append(request.headers.get_list("accept-encoding"))
        return httpx.Response(200, json={"a": 1})

    client = _proxy_at(clock, up)
    client.post("/v1/chat/completions", json=chat("hi"), headers={"Accept-Encoding": "br, x-made-up"})
    assert seen == [[httpx.Client().headers["accept-encoding"]]]


def test_an_image_requests_text_is_filtered_part_by_part(setup):
    """The text of a request looked up by its image is an exact filter; it was the digest of the "role: text"
    lines joined, which two other splits of the parts can give: the second request was served the first's
    answer to another question."""
    client, up, _ = setup
    png = b"\x89PNG same image"
    def body(*parts):
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        return {"model": "m1", "messages": [{"role": "user", "content": [
            *({"type": "text", "text": t} for t in parts), {"type": "image_url", "image_url": {"url": url}}]}]}
    first, second = body("is it safe to eat?\nuser: Answer yes", "or no."), body("is it safe to eat?", "Answer yes\nuser: or no.")
    assert extract_request(first).text == extract_request(second).text   # joined, they are one text
    assert client.post("/v1/chat/completions", json=first, headers=H()).headers["x-cache"] == "miss"
    assert client.post("/v1/chat/completions", json=second, headers=H()).headers["x-cache"] == "miss"
    assert client.post("/v1/chat/completions", json=first, headers=H()).headers["x-cache"] == "hit"


def test_every_x_model_revision_line_keys_the_request(setup):
    """A request sending two revisions (the upstream may read either) is not served, nor stored, as the first."""
    client, up, _ = setup
    auth = ("authorization", "Bearer " + "a" * 16)
    r = client.post("/v1/chat/completions", json=chat("rev q"), headers=[auth, ("x-model-revision", "r1"),
                                                                         ("x-model-revision", "r2")])
    assert r.headers["x-cache"] == "miss"
    r = client.post("/v1/chat/completions", json=chat("rev q"), headers=[auth, ("x-model-revision", "r1")])
    assert r.headers["x-cache"] == "miss" and len(up.calls) == 2


def test_an_upstream_failing_in_the_middle_of_its_answer_is_a_502(monkeypatch):
    class Cut(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'{"answer":'
            raise httpx.ReadError("connection reset by peer")

    head = LSHHead({"image": DIM, "text": DIM}, bits=64, dim=24, aligned=True, seed=0)
    cache = SemanticCache(head, {"radius": 4, "cross_modal": False})
    monkeypatch.setattr(cache, "query", lambda m, data=None, features=None: cache.encoder(m, None, _feats(m, data)))
    transport = httpx.MockTransport(lambda request: httpx.Response(200, stream=Cut()))
    client = TestClient(create_proxy_app(cache, "http://upstream", transport=transport), raise_server_exceptions=False)
    for _ in range(2):   # and nothing was stored
        r = client.post("/v1/chat/completions", json=chat("cut q"))
        assert r.status_code == 502 and r.json() == {"error": "upstream failed while sending its answer: ReadError"}


def test_every_other_setting_of_the_body_keys_the_request_too(setup):
    """An answer depends on the model's settings and the turns' roles as much as on the text: a request that
    differs only there (temperature, max_tokens, tools, response_format, a system turn's role, the user) is
    not served another's answer; the same body is."""
    client, up, _ = setup
    base = chat("what is a big green tree frog", temperature=0.2)
    assert client.post("/v1/chat/completions", json=base, headers=H()).headers["x-cache"] == "miss"
    assert client.post("/v1/chat/completions", json=dict(base), headers=H()).headers["x-cache"] == "hit"
    system = {**base, "messages": [{**base["messages"][0], "role": "system"}]}
    for other in ({**base, "temperature": 1.5}, {**base, "max_tokens": 5}, {**base, "user": "u2"},
                  {**base, "tools": [{"type": "function", "function": {"name": "delete_account"}}]},
                  {**base, "response_format": {"type": "json_object"}}, system):
        n = len(up.calls)
        r = client.post("/v1/chat/completions", json=other, headers=H())
        assert r.headers["x-cache"] == "miss" and len(up.calls) == n + 1, other
    # a near text with the same settings still hits: only what is compared by meaning may differ
    r = client.post("/v1/chat/completions", json=chat("what is a big green tree frog please", temperature=0.2), headers=H())
    assert r.headers["x-cache"] == "hit"
    # `stream` is a JSON boolean: "no" is not a streamed request (and is another entry than false)
    assert client.post("/v1/chat/completions", json={**base, "stream": "no"}, headers=H()).headers["x-cache"] == "miss"


def test_the_rest_of_a_json_path_body_keys_the_request_too():
    from ushash.serving.proxy import request_params

    body = {"input": {"prompt": "a frog", "image": "aW1n"}, "parameters": {"steps": 20}}
    same = {"input": {"prompt": "a toad", "image": "b3RoZXI="}, "parameters": {"steps": 20}}
    assert request_params(body, "input.prompt", "input.image") == request_params(same, "input.prompt", "input.image")
    other = {**body, "parameters": {"steps": 50}}
    assert request_params(other, "input.prompt", "input.image") != request_params(body, "input.prompt", "input.image")
    # list indices in the path; a path that leads nowhere removes nothing
    listed = {"inputs": [{"text": "a"}, {"text": "b"}]}
    assert request_params(listed, "inputs.1.text") == request_params({"inputs": [{"text": "a"}, {"text": "z"}]}, "inputs.1.text")
    assert request_params(listed, "inputs.0.text") != request_params({"inputs": [{"text": "a"}, {"text": "z"}]}, "inputs.0.text")
    assert request_params({"a": 1}, "b.c") == request_params({"a": 1})


def test_tokens_are_read_as_the_service_reads_them(setup):
    """The scheme case-insensitive and the credentials stripped, as ushash.serve (and HTTPBearer) reads them."""
    client, up, _ = setup
    for auth in ("bearer " + "a" * 16, "Bearer  " + "a" * 16, "BEARER " + "a" * 16 + " "):
        assert client.post("/v1/chat/completions", json=chat("tok q"), headers={"Authorization": auth}).status_code == 200
    for auth in ("Basic " + "a" * 16, "Bearer", "Bearer " + "a" * 15, "a" * 16):
        assert client.post("/v1/chat/completions", json=chat("tok q"), headers={"Authorization": auth}).status_code == 401


@pytest.mark.parametrize("verb,value,shown", [("serve", "{%s:[acme,globex]}", {"T": ["acme", "globex"]}),
                                              ("proxy", "{%s:acme}", {"T": "acme"})])
def test_tokens_can_be_set_on_the_command_line(verb, value, shown):
    """`tokens=` composes (a typed Optional[Dict] schema refused every override of it) and a wrong shape is
    a one-line refusal at start."""
    import ushash.serving.proxy  # noqa: F401  (registers the verbs' schemas)
    import ushash.serving.service  # noqa: F401
    from ushash.config import compose
    from ushash.serving.service import check_binding, tokens_of

    tok = "t" * 20
    args = ["export=e", "upstream=http://127.0.0.1:1"] if verb == "proxy" else ["export=e"]
    cfg = compose(verb, [*args, "tokens=" + value % tok])
    assert tokens_of(cfg) == {tok: v for v in shown.values()}
    assert tokens_of(compose(verb, args)) is None
    check_binding("0.0.0.0", None, tokens_of(cfg))        # a tokens map is enough to bind beyond loopback
    for bad in ("[a,b]", "3"):
        with pytest.raises(SystemExit, match="tokens must map each bearer token"):
            check_binding("127.0.0.1", None, tokens_of(compose(verb, [*args, "tokens=" + bad])))


def test_the_images_after_the_first_key_the_request_too(setup):
    """Looked up by its first image, a request also filters on the others: sharing only the first image
    with a stored request is not enough for its answer."""
    client, up, _ = setup
    def two(second):
        content = [{"type": "text", "text": "which is bigger"}] + [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b).decode()}}
            for b in (b"first image", second)]
        return {"model": "m1", "messages": [{"role": "user", "content": content}]}
    assert client.post("/v1/chat/completions", json=two(b"second"), headers=H()).headers["x-cache"] == "miss"
    assert client.post("/v1/chat/completions", json=two(b"second"), headers=H()).headers["x-cache"] == "hit"
    assert client.post("/v1/chat/completions", json=two(b"third"), headers=H()).headers["x-cache"] == "miss"
    assert len(up.calls) == 2


def test_the_model_service_bounds_an_image_before_decoding_it():
    """The proxy passes images over the cache's limits to the model; the model service bounds its own: a
    PNG whose header says 5000 x 5000 is refused from its header (a 400 naming the limit), not decoded, and
    a JPEG whose header is a flood of markers from its bytes."""
    import io
    import types

    from PIL import Image

    from ushash.serving.model_service import MODEL_LIMITS, Classifier, create_model_app

    buf = io.BytesIO()
    Image.new("1", (5000, 5000)).save(buf, "PNG")         # 25 MP in a few kB
    assert 5000 * 5000 > MODEL_LIMITS.max_pixels and len(buf.getvalue()) < 50_000
    not_loaded = types.SimpleNamespace()                  # no model: the check must come before any decoding
    app = create_model_app(lambda data: Classifier.__call__(not_loaded, data))
    r = TestClient(app).post("/v1/chat/completions", json=chat("what is this", buf.getvalue()))
    assert r.status_code == 400 and "max_pixels" in r.json()["error"], r.text
    import hostile_corpus as hc                           # 8 x 8 pixels behind 1.4 million empty markers

    flood = dict(hc.header_floods(5_600_000))["jpeg_app_marker_flood"]
    r = TestClient(app).post("/v1/chat/completions", json=chat("what is this", flood))
    assert r.status_code == 400 and "max_image_segments" in r.json()["error"], r.text
    buf = io.BytesIO()
    Image.new("RGB", (6000, 1)).save(buf, "PNG")          # 97 bytes that the transform made 2.3 GB of
    r = TestClient(app).post("/v1/chat/completions", json=chat("what is this", buf.getvalue()))
    assert r.status_code == 400 and "max_aspect" in r.json()["error"], r.text


def test_the_model_service_refuses_other_formats_and_deep_bodies_with_a_400():
    """An image format the cache does not decode (TIFF, EPS: Pillow would run Ghostscript for it) and a body
    nested past the interpreter's limit are 400s naming the problem, not a decode and a 500."""
    import io
    import types

    from PIL import Image

    from ushash.serving.model_service import Classifier, create_model_app

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "TIFF")
    app = create_model_app(lambda data: Classifier.__call__(types.SimpleNamespace(), data))
    client = TestClient(app)
    r = client.post("/v1/chat/completions", json=chat("what is this", buf.getvalue()))
    assert r.status_code == 400 and "cannot identify image" in r.json()["error"], r.text
    for body in (b"[" * 200_000, b"[" * 5000 + b"]" * 5000):
        r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json() == {"error": "the body is not JSON"}, r.text


def test_integers_beyond_64_bits_key_the_request_as_they_are(setup):
    """orjson reads 2**64 and 2**64 + 1 as the same float: two requests differing only in such a seed were
    one entry. The body is read as json.loads reads it, so each is its own."""
    client, up, _ = setup
    for seed, cached in ((2**64, "miss"), (2**64 + 1, "miss"), (2**64 + 1, "hit"), (2**64, "hit")):
        raw = b'{"model":"m1","seed":%d,"messages":[{"role":"user","content":"a poem about frogs"}]}' % seed
        r = client.post("/v1/chat/completions", content=raw, headers=H(**{"content-type": "application/json"}))
        assert r.headers["x-cache"] == cached, (seed, cached)
    assert [c[1]["seed"] for c in up.calls] == [2**64, 2**64 + 1]


@pytest.mark.parametrize("kw", [{"max_body_bytes": 0}, {"max_json_values": -1}, {"max_answer_bytes": True},
                                {"max_json_values": 2.5}])
def test_proxy_bounds_are_checked_when_the_app_is_made(kw):
    """A bound on what one request may cost that is not a positive integer is refused, naming it (a zero
    `max_json_values` once forwarded every body unparsed, so nothing was ever cached)."""
    cache = SemanticCache(LSHHead({"text": 16}, bits=64))
    with pytest.raises(ValueError, match=f"{next(iter(kw))} must be a positive integer"):
        create_proxy_app(cache, "http://upstream", **kw)


def test_proxy_bounds_are_checked_before_the_export_is_loaded():
    import ushash.serving.proxy as proxy
    from ushash.config import compose

    cfg = compose("proxy", ["export=does/not/exist", "upstream=http://127.0.0.1:1", "max_answer_bytes=0"])
    with pytest.raises(SystemExit, match="max_answer_bytes must be a positive integer; got 0"):
        proxy.build(cfg)


def test_the_proxy_warms_its_cache_up_before_the_first_request(monkeypatch):
    """As ushash.serve does: what the cache loads once (its compiled kernels) is loaded when the app is made,
    not by the first request."""
    head = LSHHead({"text": DIM}, bits=64, dim=24, seed=0)
    cache = SemanticCache(head, {"radius": 4})
    warmed = []
    monkeypatch.setattr(cache, "warm_up", lambda: warmed.append(True))
    create_proxy_app(cache, "http://upstream", transport=httpx.MockTransport(Upstream()))
    assert warmed == [True]


def test_the_proxy_asks_its_cache_in_its_worker_threads_and_stops_them_at_shutdown(monkeypatch):
    """The encoding, the search and the store (which may ask a Redis L2) run off the event loop, in the proxy's
    `Workers`, which its shutdown closes."""
    import asyncio
    import threading

    head = LSHHead({"image": DIM, "text": DIM}, bits=64, dim=24, aligned=True, seed=0)
    cache = SemanticCache(head, {"radius": 4, "payload_threshold": 0.9, "cross_modal": False})
    threads = []

    def on_thread(name, fn):
        def call(*args, **kwargs):
            threads.append((name, threading.current_thread().name))
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(cache, "query", on_thread("query", lambda m, data=None, features=None:
                                                  cache.encoder(m, None, _feats(m, data))))
    monkeypatch.setattr(cache, "check_query", on_thread("check", cache.check_query))
    monkeypatch.setattr(cache, "store_response", on_thread("store", cache.store_response))
    app = create_proxy_app(cache, "http://upstream", transport=httpx.MockTransport(Upstream()))
    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", json=chat("what is a frog")).headers["x-cache"] == "miss"
        assert client.post("/v1/chat/completions", json=chat("what is a frog", stream=True)).headers["x-cache"] == "miss"
        assert client.post("/v1/chat/completions", json=chat("what is a frog")).headers["x-cache"] == "hit"
    assert [name for name, _ in threads] == ["query", "check", "store"] * 2 + ["query", "check"]
    assert all(t.startswith("ushash-worker") for _, t in threads), threads
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(app.state.workers.run(lambda: None))


def test_another_method_is_a_405_and_the_post_route_is_in_the_schema(setup):
    """As when the proxy's POST was a FastAPI route: any other method on any path is FastAPI's 405 (Allow: POST)."""
    client, up, _ = setup
    for method, path in (("GET", "/v1/chat/completions"), ("PUT", "/x"), ("DELETE", "/v1/models")):
        r = client.request(method, path, headers=H())
        assert r.status_code == 405 and r.headers["allow"] == "POST", (method, path)
    assert client.get("/healthz").json()["ok"] is True
    assert "post" in client.get("/openapi.json").json()["paths"]["/{path}"]
    assert up.calls == []


class _BagOfWords(torch.nn.Module):
    """A stand-in for MiniLM in the model service's text task: hashed word counts, unit rows."""

    dim = 512

    def collate(self, texts):
        x = torch.zeros(len(texts), self.dim)
        for i, t in enumerate(texts):
            for w in re.findall(r"[a-z]+", t.lower()):
                x[i, int(hashlib.md5(w.encode()).hexdigest(), 16) % self.dim] += 1
        return x

    def forward(self, x):
        return torch.nn.functional.normalize(x, dim=-1)


def test_the_model_service_answers_a_text_with_the_nearest_imagenet_class():
    """Text-only chat requests get the ImageNet description nearest to the text (checked against a brute-force
    cosine over every description, first index on ties); an image is still the image model's; a text over the
    model's limit is a 400 naming it."""
    from ushash.serving.model_service import MODEL_LIMITS, TextClassifier, create_model_app

    tc = TextClassifier(encoder=_BagOfWords())
    enc = _BagOfWords()
    table = np.stack([enc(enc.collate([c]))[0].numpy() for c in tc.classes])
    for text in ("user: tree frog", "user: a fire truck", "user: an electric guitar", "user: zzz qqq"):
        q = enc(enc.collate([text]))[0].numpy()
        want = tc.classes[int(np.argmax(table @ q))]
        assert tc(text)[0] == want, text
    assert tc("user: tree frog")[0] == "tree frog, tree-frog"
    app = create_model_app(lambda data: ("image answer", 0.0), text_classifier=tc)
    client = TestClient(app)
    r = client.post("/v1/chat/completions", json=chat("tree frog"))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "tree frog, tree-frog"
    r = client.post("/v1/chat/completions", json=chat("tree frog", stream=True))
    assert r.status_code == 200 and "tree frog, tree-frog" in r.text and r.text.endswith("data: [DONE]\n\n")
    r = client.post("/v1/chat/completions", json=chat("what is this", b"\x89PNG any bytes"))
    assert r.json()["choices"][0]["message"]["content"] == "image answer"
    r = client.post("/v1/chat/completions", json=chat("x" * (MODEL_LIMITS.max_text_chars + 1)))
    assert r.status_code == 400 and "max_text_chars" in r.json()["error"], r.text
    r = client.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400
    assert client.get("/v1/stats").json()["calls"] == 3


def test_metrics_count_each_answer_by_outcome_and_need_a_token(setup):
    """GET /metrics: the cache's series and the proxy's own, counted against what the responses said."""
    client, up, _ = setup
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=H("z")).status_code == 401
    said = []
    for body, headers in ((chat("q1"), H()), (chat("q1"), H()), (chat("q2"), H(**{"Cache-Control": "no-cache"})),
                          ({"input": 3}, H()), (chat("q1"), H("z")), ({**chat("q3"), "fail": True}, H())):
        r = client.post("/v1/chat/completions", json=body, headers=headers)
        said.append(r.headers.get("x-cache") or "refused")
    up_fail = httpx.MockTransport(lambda req: (_ for _ in ()).throw(httpx.ConnectError("down")))
    client.app.state.client._transport = up_fail
    r = client.post("/v1/chat/completions", json=chat("q4"), headers=H())
    assert r.status_code == 502
    said.append("upstream_error")
    text = client.get("/metrics", headers=H("b")).text
    got = {m[0]: float(m[1]) for m in re.findall(r'^proxy_requests_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}
    want = {o: float(said.count(o)) for o in ("hit", "miss", "bypass", "refused", "upstream_error")}
    assert got == want and want == {"hit": 1, "miss": 2, "bypass": 2, "refused": 1, "upstream_error": 1}
    assert re.search(r"^proxy_upstream_duration_seconds_count 4\.0$", text, re.M)  # the forwarded ones that were answered
    assert re.search(r'^cache_gets_total\{result="hit"\} 1\.0$', text, re.M)  # the cache's own series beside them


def test_a_text_requests_earlier_turns_are_matched_exactly():
    """A text request was looked up by all its messages' texts together, by meaning: system prompts saying
    opposite things in the same words before one question got one answer. The texts of every message but the
    last are an exact filter (a changed turn of the conversation so far, too); the last is matched by meaning."""
    clock, calls = [1_000_000.0], []

    def up(request):
        calls.append(request)
        return httpx.Response(200, json={"answer": len(calls)})

    def conv(system, question, *earlier):
        return {"model": "m1", "messages": [{"role": "system", "content": system}, *earlier,
                                            {"role": "user", "content": question}]}

    client = _proxy_at(clock, up)
    french, english = "answer in french not english", "answer in english not french"   # one bag of words
    ask = lambda body: client.post("/v1/chat/completions", json=body)                   # noqa: E731
    assert ask(conv(french, "what is a frog")).json() == {"answer": 1}
    assert ask(conv(english, "what is a frog")).json() == {"answer": 2}                 # not the French answer
    r = ask(conv(french, "a frog is what"))                                              # by meaning: served
    assert r.headers["x-cache"] == "hit" and r.json() == {"answer": 1}
    said = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi, ask away"}]
    other = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "ask away, hi"}]
    assert ask(conv(french, "what is a frog", *said)).json() == {"answer": 3}
    assert ask(conv(french, "what is a frog", *other)).json() == {"answer": 4}         # another conversation
    assert ask(conv(french, "what is a frog", *said)).headers["x-cache"] == "hit" and len(calls) == 4


def test_request_headers_that_change_the_answer_key_it_too():
    """Anthropic's `anthropic-version` / `anthropic-beta` and OpenAI's `OpenAI-Beta` change what the API answers
    (a beta feature, another API version) and were not part of the key: a request with one was served the
    answer to a request without it. `key_headers` (those by default) are exact filters, every line as
    forwarded; other headers are not."""
    clock, calls = [1_000_000.0], []

    def up(request):
        calls.append(request)
        return httpx.Response(200, json={"answer": len(calls)})

    client = _proxy_at(clock, up)
    ask = lambda **h: client.post("/v1/messages", json=chat("what is a frog"), headers=h)   # noqa: E731
    assert ask().json() == {"answer": 1}
    assert ask(**{"anthropic-beta": "extended-cache-ttl-2025-04-11"}).json() == {"answer": 2}
    assert ask(**{"Anthropic-Beta": "extended-cache-ttl-2025-04-11"}).headers["x-cache"] == "hit"   # any case
    assert ask(**{"anthropic-version": "2023-06-01"}).json() == {"answer": 3}
    assert ask(**{"OpenAI-Beta": "assistants=v2"}).json() == {"answer": 4}
    r = ask(**{"X-Request-Id": "abc"})                                        # not a key header: served
    assert r.headers["x-cache"] == "hit" and r.json() == {"answer": 1} and len(calls) == 4
    none = _proxy_at(clock, up, key_headers=())
    assert none.post("/v1/messages", json=chat("what is a frog")).json() == {"answer": 5}
    r = none.post("/v1/messages", json=chat("what is a frog"), headers={"anthropic-beta": "x"})
    assert r.headers["x-cache"] == "hit" and len(calls) == 5                   # key_headers=(): not keyed
