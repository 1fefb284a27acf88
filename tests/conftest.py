import os

# Tests never reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)


# A tiny exported head over the tiny random-init encoder: the cache and service tests load it.
ENC_CFG = {"name": "tiny", "dim": 16, "seed": 0}


def asgi_request(app, method: str, path: str, body: bytes = b"", headers=(), query: bytes = b""):
    """One request straight to an ASGI app, header bytes as given both ways (a test client re-encodes a
    request's non-ASCII header bytes and cannot read a response's): (status, {name: value bytes}, body)."""
    import asyncio

    sent, got = [{"type": "http.request", "body": body, "more_body": False}], []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
             "server": ("t", 80), "client": ("127.0.0.1", 1),
             "headers": [(b"host", b"t"), *([(b"content-type", b"application/json"),
                                             (b"content-length", str(len(body)).encode())] if body else []), *headers]}

    async def receive():
        return sent.pop(0) if sent else {"type": "http.disconnect"}

    async def send(message):
        got.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in got if m["type"] == "http.response.start")
    return (start["status"], {k.lower(): v for k, v in start["headers"]},
            b"".join(m.get("body", b"") for m in got if m["type"] == "http.response.body"))


def write_tiny_export(out, in_dims=None, dim=32, encoder=None):
    """A seeded 64-bit export of a small random head: on the tiny encoder (its input sizes and identity), or on
    `in_dims` under another `encoder` identity ({"name", "fingerprint", "config"}) when only features are fed."""
    import torch

    from ushash.encoders import build_encoder
    from ushash.serving.export import write_export
    from ushash.hashing.heads import USHash

    if encoder is None:
        enc = build_encoder({**ENC_CFG, "device": "cpu"})
        in_dims, encoder = dict(enc.dims), {"name": "tiny", "fingerprint": enc.fingerprint, "config": ENC_CFG}
    torch.manual_seed(0)
    model = USHash(dict(in_dims), bits=64, dim=dim, hidden=32).eval()
    write_export(model, out, encoder)
    return out


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    """A tiny 64-bit export (write_tiny_export), one per test module."""
    return write_tiny_export(tmp_path_factory.mktemp("export") / "tiny-64b")


@pytest.fixture(scope="module")
def head(export_dir):
    """`export_dir` loaded (ushash.serving.artifact.load_export)."""
    from ushash.serving.artifact import load_export

    return load_export(export_dir)


def clustered_pool(rng, n_classes, members, spread, confusable):
    """A sim Pool of clustered 24-d image and text features, `members` per class and modality; `confusable`
    of the classes share a centre with another class."""
    import numpy as np

    from ushash.sim.pool import Pool, feature_key

    pool = Pool()
    centres = rng.normal(size=(n_classes, 24)).astype(np.float32)
    for c in range(int(confusable * n_classes)):
        centres[c] = centres[c + 1] + 0.05 * rng.normal(size=24)
    for c in range(n_classes):
        for m in ("image", "text"):
            for _ in range(members):
                x = centres[c] + spread * rng.normal(size=24).astype(np.float32)
                pool.add(m, x, c, "original", feature_key(m, x))
    return pool
