"""The caching proxy (ushash.serving.proxy) in front of a mock upstream: chat JSON with text and image
data URLs, a configurable JSON path, streamed answers, Cache-Control, tokens to tenants, X-Model-Revision,
and the 4xx answers."""

import base64
import hashlib
import json
import re

import httpx
import numpy as np
import pytest
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
