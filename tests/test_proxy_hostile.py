"""The caching proxy (ushash.serving.proxy) against requests and answers that once broke it: a model name
that cannot be stored, a failed store, the query string, content parts it neither keyed nor passed through,
a text at `text_path` that is not a string, a tenant it does not serve, an answer too large to hold."""

import asyncio
import base64
import json
import logging

import httpx
import pytest
from fastapi.testclient import TestClient

from test_proxy import DIM, H, Upstream, _feats, chat, setup  # noqa: F401  (setup: the fixture)
from ushash.serving.cache import SemanticCache
from ushash.serving.cache.lsh import LSHHead
from ushash.serving.proxy import create_proxy_app

URL = "/v1/chat/completions"


def _cache(monkeypatch, **cfg):
    head = LSHHead({"image": DIM, "text": DIM}, bits=64, dim=24, aligned=True, seed=0)
    cache = SemanticCache(head, {"radius": 4, "payload_threshold": 0.9, "cross_modal": False, **cfg})
    monkeypatch.setattr(cache, "query", lambda m, data=None, features=None: cache.encoder(m, None, _feats(m, data)))
    return cache


def _durl(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_a_model_name_the_cache_cannot_store_is_passed_through(setup):
    """A lone surrogate escape in `model` has no UTF-8 to store it by: passed through, not a 500 after the
    upstream answered."""
    client, up, _ = setup
    body = b'{"model": "m\\ud800", "messages": [{"role": "user", "content": "hi there"}]}'
    for n in (1, 2):
        r = client.post(URL, content=body, headers=H())
        assert r.status_code == 200 and r.headers["x-cache"] == "bypass" and r.json() == {"answer": n}
    assert len(up.calls) == 2


def test_a_failed_store_never_fails_the_upstreams_answer(setup, monkeypatch, caplog):
    """The store raising after the upstream answered: the client still gets that answer (a streamed one to
    its end), and the failure is logged at warning with its reason."""
    client, up, cache = setup

    def broken(*args, **kw):
        raise TypeError("cache values must be valid Unicode text")

    monkeypatch.setattr(cache, "store_response", broken)
    with caplog.at_level(logging.WARNING, logger="ushash.serving.proxy"):
        r = client.post(URL, json=chat("what is a frog"), headers=H())
        assert r.status_code == 200 and r.json() == {"answer": 1} and r.headers["x-cache"] == "miss"
        r = client.post(URL, json=chat("tell me", stream=True), headers=H())
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") and r.text.count("data:") == 4
    failures = [rec for rec in caplog.records if "not stored" in rec.getMessage()]
    assert len(failures) == 2 and all(rec.levelno == logging.WARNING for rec in failures)
    assert "TypeError: cache values must be valid Unicode text" in failures[0].getMessage()
    assert client.post(URL, json=chat("what is a frog"), headers=H()).headers["x-cache"] == "miss"


def test_the_query_string_is_forwarded_as_it_came_and_keys_the_request(monkeypatch):
    seen = []

    def upstream(request):
        seen.append((request.url.raw_path, request.extensions.get("target")))
        return httpx.Response(200, json={"answer": len(seen)})

    client = TestClient(create_proxy_app(_cache(monkeypatch), "http://upstream/base",
                                         transport=httpx.MockTransport(upstream)))
    body = chat("what is a frog")
    assert client.post("/ok?api-version=1", json=body).headers["x-cache"] == "miss"
    assert client.post("/ok?api-version=2", json=body).headers["x-cache"] == "miss"
    assert client.post("/ok?api-version=1", json=body).headers["x-cache"] == "hit"
    # an escaped "?" is part of the path, not a query: neither decoded nor keyed as /ok?api-version=3
    assert client.post("/ok%3Fapi-version=3", json=body).headers["x-cache"] == "miss"
    assert client.post("/ok?api-version=3", json=body).headers["x-cache"] == "miss"
    assert seen == [(t, t) for t in (b"/base/ok?api-version=1", b"/base/ok?api-version=2",
                                     b"/base/ok%3Fapi-version=3", b"/base/ok?api-version=3")]


def _parts(*parts):
    return {"model": "m1", "messages": [{"role": "user", "content": list(parts)}]}


def _text(t, **kw):
    return {"type": "text", "text": t, **kw}


def _image(url, **kw):
    return {"type": "image_url", "image_url": {"url": url, **kw}}


@pytest.mark.parametrize("first,second,label", [
    (_parts(_text("describe"), _image(_durl(b"img"), detail="low")),
     _parts(_text("describe"), _image(_durl(b"img"), detail="high")), "miss"),
    (_parts(_text("describe"), _image(_durl(b"img"))),
     _parts(_text("describe"), _image(_durl(b"img", "application/pdf"))), "miss"),
    (_parts(_text("hey")), _parts(_text("hey", cache_control={"type": "ephemeral"})), "miss"),
    (_parts(_text("A"), _image(_durl(b"img")), _text("B")), _parts(_image(_durl(b"img")), _text("A"), _text("B")),
     "miss"),
    (_parts(_text("None")), _parts(_text(None)), "bypass"),
    (_parts(_text("5")), _parts(_text(5)), "bypass"),
], ids=["detail", "media-type", "extra-key", "part-order", "text-null", "text-number"])
def test_a_request_differing_only_in_the_form_of_its_content_is_not_served_anothers_answer(setup, first, second,
                                                                                          label):
    """Everything in a message's content but its texts and images keys the request (the parts' order, an
    image's media type and detail, any other key of a part); a text that is not a string is not read, so
    the request is passed through."""
    client, up, _ = setup
    assert client.post(URL, json=first, headers=H()).headers["x-cache"] == "miss"
    assert client.post(URL, json=first, headers=H()).headers["x-cache"] == "hit"
    r = client.post(URL, json=second, headers=H())
    assert r.headers["x-cache"] == label and r.json() == {"answer": 2} and len(up.calls) == 2


def test_a_value_at_text_path_that_is_not_a_string_is_passed_through(monkeypatch):
    up = Upstream()
    client = TestClient(create_proxy_app(_cache(monkeypatch), "http://upstream", text_path="input.prompt",
                                         image_path="input.image", transport=httpx.MockTransport(up)))
    image = base64.b64encode(b"an image").decode()
    for prompt in (1, 5, {"q": "other question"}, ["x"], None):
        for _ in range(2):
            r = client.post("/v1/generate", json={"model": "m1", "input": {"prompt": prompt, "image": image}})
            assert r.status_code == 200 and r.headers["x-cache"] == "bypass", prompt
    assert len(up.calls) == 10
    # no prompt at all: looked up by the image alone, as before
    for label in ("miss", "hit"):
        r = client.post("/v1/generate", json={"model": "m1", "input": {"image": image}})
        assert r.headers["x-cache"] == label


def test_a_tenant_the_cache_does_not_serve_is_refused_at_start(monkeypatch):
    """Every request of a tenant the cache does not list would be a 404 (and a no-cache one a 500 after the
    upstream answered): refused when the app is made, in one line naming the setting and the fix."""
    cache = _cache(monkeypatch, tenants=["acme"])
    with pytest.raises(ValueError, match=r"^without tokens every request is tenant 'default', which "
                                         r"cache.tenants=\['acme'\] does not list: add default to cache.tenants"):
        create_proxy_app(cache, "http://upstream")
    with pytest.raises(ValueError, match="tokens map a token to tenant 'initech', which cache.tenants"):
        create_proxy_app(cache, "http://upstream", tokens={"a" * 16: "acme", "b" * 16: "initech"})
    create_proxy_app(cache, "http://upstream", tokens={"a" * 16: "acme"})
    create_proxy_app(_cache(monkeypatch, tenants=["default"]), "http://upstream")


class _Chunks(httpx.AsyncByteStream):
    """An upstream answer of `n` chunks of `size` bytes, counting how many the proxy has taken."""

    def __init__(self, n: int, size: int):
        self.n, self.size, self.taken = n, size, 0

    async def __aiter__(self):
        for _ in range(self.n):
            self.taken += 1
            yield b"0" * self.size


def _post(app, body: bytes, taken) -> tuple[int, dict, bytes, int]:
    """(status, headers, body, chunks the upstream had given when the first body bytes went out) of a POST
    sent to the proxy's ASGI app."""
    sent, first, requests = [], [], [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():   # the body, then nothing until the app is done (the client stays)
        if requests:
            return requests.pop()
        await asyncio.Event().wait()

    async def send(msg):
        sent.append(msg)
        if msg["type"] == "http.response.body" and msg.get("body") and not first:
            first.append(taken())

    scope = {"type": "http", "method": "POST", "path": URL, "raw_path": URL.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, out, first[0]


@pytest.mark.parametrize("declared", [False, True])
def test_an_answer_over_max_answer_bytes_is_relayed_as_it_arrives_not_held_whole(monkeypatch, declared):
    """Never stored, an answer over max_answer_bytes is not read whole first (300 MB of it held 650 MB):
    the proxy starts relaying it once it (or its Content-Length) is over the bound; its status and headers
    are the upstream's. One within the bound is still read whole, stored and sent with its length."""
    streams = []

    def upstream(request):
        n = 50 if b"big" in request.content else 5
        streams.append(_Chunks(n, 100))
        headers = {"content-type": "application/octet-stream", "x-up": "1"}   # bytes: whole as they are
        if declared:
            headers["content-length"] = str(n * 100)
        return httpx.Response(201 if n == 50 else 200, headers=headers, stream=streams[-1])

    app = create_proxy_app(_cache(monkeypatch), "http://upstream", transport=httpx.MockTransport(upstream),
                           max_answer_bytes=1000)
    big = json.dumps(chat("a big answer")).encode()
    status, headers, body, taken = _post(app, big, lambda: streams[-1].taken)
    assert status == 201 and headers["x-up"] == "1" and headers["x-cache"] == "miss" and len(body) == 5000
    assert taken <= (1 if declared else 11), taken          # relayed while the upstream was still sending
    status, headers, body, taken = _post(app, big, lambda: streams[-1].taken)
    assert headers["x-cache"] == "miss" and len(streams) == 2          # never stored
    small = json.dumps(chat("a small answer")).encode()
    status, headers, body, taken = _post(app, small, lambda: streams[-1].taken)
    assert status == 200 and headers["content-length"] == "500" and taken == 5
    assert _post(app, small, lambda: streams[-1].taken)[1]["x-cache"] == "hit"
