"""python -m ushash.serve export=exports/<name> [host=127.0.0.1] [port=8470] [cache=redis cache.l2.url=...]

An HTTP service around one `SemanticCache` (FastAPI + uvicorn):

    POST /v1/lookup   {"tenant", "modality", one of "text" | "data_b64" | "features"}
                      -> {"hit": true, "value", "distance", "cosine", "tier", "revision", "entry_modality"}
                         or {"hit": false}
    POST /v1/lookup_batch  {"tenant", "modality", "features": [[...], ...]} (at most 4096 rows)
                      -> {"results": [one /v1/lookup answer per row, in order]}: one search for the batch
    POST /v1/store    the same plus "value" (any JSON) and optional "ttl_s" -> {"stored": bool}
    GET  /metrics     Prometheus text (this cache's registry)
    GET  /healthz     {"status": "ok"} (no token needed; says nothing else)

`data_b64` is an encoded image or audio file (PNG, JPEG, SVG, WAV, OGG, FLAC ...), base64; `text` a
caption; `features` precomputed encoder features. Binds to 127.0.0.1 by default; bound anywhere else it
refuses to start without a bearer token (`token=` or USHASH_SERVE_TOKEN), and every route but /healthz
then needs `Authorization: Bearer <token>`. Bad input gets a 4xx with {"error": "..."}: 400 bad media
or modality or features, 401 no/wrong token, 404 unknown tenant, 413 body too large, 422 malformed JSON.
"""

# No `from __future__ import annotations` here: FastAPI reads the route annotations at runtime.
import base64
import binascii
import hmac
import ipaddress
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from omegaconf import DictConfig
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ushash.config import to_dict
from ushash.serving.cache import TENANT_PATTERN, RequestError, UnknownTenant
from ushash.serving.cache.config import CacheConfig

log = logging.getLogger(__name__)

TOKEN_ENV = "USHASH_SERVE_TOKEN"
LOOPBACK_NAMES = ("localhost",)


@dataclass
class ServeConfig:
    """python -m ushash.serve (configs/serve.yaml): every setting with its default and meaning. Registered
    in Hydra's ConfigStore as `schema_serve` when this module is imported."""
    export: str = "???"               # required: an export directory (python -m ushash.export); relative paths
                                      # hang off the repository
    host: str = "127.0.0.1"           # anything but loopback needs a bearer token
    port: int = 8470
    token: Optional[str] = None       # bearer token; the environment variable USHASH_SERVE_TOKEN takes precedence
    max_body_bytes: int = 8 << 20     # larger request bodies get 413
    device: str = "cpu"               # where the head (and the encoder for raw inputs) runs
    log_level: str = "warning"        # uvicorn's
    paths: Any = None
    cache: CacheConfig = field(default_factory=CacheConfig)   # configs/cache/*.yaml


def register_schemas() -> None:
    """Put the serve schema in Hydra's ConfigStore (idempotent): configs/serve.yaml names it in its defaults."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="schema_serve", node=ServeConfig)


register_schemas()


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_binding(host: str, token: Optional[str]) -> None:
    """Refuse to serve beyond loopback without a bearer token."""
    if not is_loopback(host) and not token:
        raise SystemExit(f"refusing to bind {host!r} without a bearer token: set token=... or {TOKEN_ENV} "
                         f"(or bind 127.0.0.1)")
    if token is not None and len(token) < 16:
        raise SystemExit("the bearer token must be at least 16 characters")


class _BodyLimit:
    """ASGI middleware: 413 for bodies over `limit` bytes. A declared Content-Length is checked first;
    otherwise (chunked) the body is read here, counting, and handed on only if it fits."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, int(limit)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = None
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    return await _send_json(send, 400, {"error": "bad Content-Length header"})
        if declared is not None:
            if declared > self.limit:
                return await _send_json(send, 413, {"error": f"request body over {self.limit} bytes"})
            return await self.app(scope, receive, send)
        chunks, seen = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # client went away
            body = msg.get("body", b"")
            seen += len(body)
            if seen > self.limit:
                return await _send_json(send, 413, {"error": f"request body over {self.limit} bytes"})
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _send_json(send, status: int, obj: dict) -> None:
    import json

    body = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class LookupBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str = Field("default", pattern=TENANT_PATTERN)
    modality: str
    text: Optional[str] = None
    data_b64: Optional[str] = None
    features: Optional[list[float]] = None


class LookupBatchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str = Field("default", pattern=TENANT_PATTERN)
    modality: str
    features: list[list[float]] = Field(..., max_length=4096)


class StoreBody(LookupBody):
    value: Any
    ttl_s: Optional[float] = Field(None, gt=0, le=10 * 365 * 86400)


class AuthError(Exception):
    pass


def create_app(cache, token: Optional[str] = None, max_body_bytes: int = ServeConfig.max_body_bytes) -> FastAPI:
    """The FastAPI app serving `cache`. Tests call this directly."""
    bearer = HTTPBearer(auto_error=False)  # parses "Authorization: Bearer <token>"; None when absent or another scheme

    def auth(creds: Optional[HTTPAuthorizationCredentials] = Depends(bearer)) -> None:
        if token is None:
            return
        if creds is None or not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise AuthError()

    app = FastAPI(title="ushash semantic cache", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(AuthError)
    async def _auth(request, exc):
        return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        parts = []
        for e in exc.errors()[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
        return JSONResponse({"error": "invalid request: " + "; ".join(parts)}, status_code=422)

    @app.exception_handler(RequestError)
    async def _bad(request, exc):
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.exception_handler(UnknownTenant)
    async def _tenant(request, exc):
        return JSONResponse({"error": str(exc)}, status_code=404)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    def _query(body: LookupBody):
        given = [k for k in ("text", "data_b64", "features") if getattr(body, k) is not None]
        if len(given) != 1:
            raise RequestError(f"give exactly one of text, data_b64, features; got {given or 'none'}")
        if body.features is not None:
            import numpy as np
            return cache.query(body.modality, features=np.asarray(body.features, np.float32))
        if body.text is not None:
            if body.modality != "text":
                raise RequestError(f"'text' is for modality text; send {body.modality} as data_b64")
            return cache.query("text", body.text)
        if body.modality == "text":
            raise RequestError("send text as 'text', not data_b64")
        try:
            data = base64.b64decode(body.data_b64, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError("data_b64 is not valid base64") from None
        return cache.query(body.modality, data)

    @app.get("/healthz")
    def healthz():
        return {"status": "ok"}

    @app.get("/metrics", dependencies=[Depends(auth)])
    def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(cache.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/lookup", dependencies=[Depends(auth)])
    def lookup(body: LookupBody):
        tenant = cache.check_tenant(body.tenant)
        hit = cache.lookup(_query(body), tenant)
        if hit is None:
            return {"hit": False}
        return {"hit": True, "value": hit.value, "distance": hit.distance, "cosine": hit.cosine, "tier": hit.tier,
                "revision": hit.revision, "entry_modality": hit.modality}

    @app.post("/v1/lookup_batch", dependencies=[Depends(auth)])
    def lookup_batch(body: LookupBatchBody):
        import numpy as np

        tenant = cache.check_tenant(body.tenant)
        try:
            feats = np.asarray(body.features, np.float32)
        except ValueError:
            raise RequestError("features must be rows of equal length") from None
        if not len(feats):
            return {"results": []}
        hits = cache.lookup_many(cache.encoder.from_feature_rows(body.modality, feats), tenant)
        return {"results": [{"hit": True, "value": h.value, "distance": h.distance, "cosine": h.cosine, "tier": h.tier,
                             "revision": h.revision, "entry_modality": h.modality} if h is not None else {"hit": False}
                            for h in hits]}

    @app.post("/v1/store", dependencies=[Depends(auth)])
    def store(body: StoreBody):
        tenant = cache.check_tenant(body.tenant)
        try:
            stored = cache.store(_query(body), body.value, tenant, ttl_s=body.ttl_s)
        except TypeError as e:
            raise RequestError(str(e)) from None
        return {"stored": bool(stored), "revision": cache.revision}

    @app.get("/v1/stats", dependencies=[Depends(auth)])
    def stats():
        return cache.stats()

    app.add_middleware(_BodyLimit, limit=max_body_bytes)
    return app


def build(cfg: DictConfig):
    """(app, host, port, token) from a serve config (app.state.cache is the cache); checks the binding
    before loading anything."""
    from pathlib import Path

    from ushash.serving.cache import SemanticCache

    token = os.environ.get(TOKEN_ENV) or (str(cfg.token) if cfg.get("token") else None)
    host = str(cfg.host)
    check_binding(host, token)
    export = Path(str(cfg.export))
    if not export.is_absolute():
        export = Path(cfg.paths.root) / export
    cache = SemanticCache.from_export(export, to_dict(cfg.cache), device=str(cfg.device))
    app = create_app(cache, token=token, max_body_bytes=int(cfg.max_body_bytes))
    app.state.cache = cache
    return app, host, int(cfg.port), token


def run_serve(cfg: DictConfig) -> None:
    import uvicorn

    app, host, port, token = build(cfg)
    cache = app.state.cache
    log.info("serving http://%s:%d revision %s, %d bits, modalities %s, token %s", host, port, cache.revision,
             cache.bits, cache.encoder.modalities, "required" if token else "off (loopback)")
    uvicorn.run(app, host=host, port=port, log_level=str(cfg.log_level), access_log=False)
