"""ushash.serve's answer to a JSON body sent with another Content-Type (curl -d's default form type, text/plain,
none): a 415 that names it and the fix, not a 422 saying the body is not an object."""

import json

import pytest
from fastapi.testclient import TestClient

from ushash.serving.cache import SemanticCache
from ushash.serving.cache.lsh import LSHHead
from ushash.serving.service import create_app

BODY = json.dumps({"modality": "text", "features": [0.1] * 16}).encode()


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app(SemanticCache(LSHHead({"text": 16}, bits=64))))


@pytest.mark.parametrize("route", ["/v1/lookup", "/v1/store"])
@pytest.mark.parametrize("ctype,got", [
    ("application/x-www-form-urlencoded", "Content-Type 'application/x-www-form-urlencoded'"),
    ("text/plain", "Content-Type 'text/plain'"), (None, "no Content-Type")])
def test_a_body_sent_without_a_json_content_type_is_a_415_naming_it(client, route, ctype, got):
    r = client.post(route, content=BODY, headers={"Content-Type": ctype} if ctype else {})
    assert r.status_code == 415
    assert r.json() == {"error": f"the request body was sent with {got}: send it as JSON with "
                                 f"Content-Type: application/json"}


@pytest.mark.parametrize("ctype", ["application/json", "application/json; charset=utf-8", "application/vnd.x+json"])
def test_a_json_content_type_is_read_and_a_malformed_body_is_still_a_422(client, ctype):
    assert client.post("/v1/lookup", content=BODY, headers={"Content-Type": ctype}).json() == {"hit": False}
    r = client.post("/v1/lookup", content=b'{"modality": "text"', headers={"Content-Type": ctype})
    assert r.status_code == 422 and r.json()["error"].startswith("invalid request")
