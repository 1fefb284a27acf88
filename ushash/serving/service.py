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
refuses to start without a bearer token, and every route but /healthz then needs
`Authorization: Bearer <token>`. `token=` (or USHASH_SERVE_TOKEN) may use every tenant; `tokens=` maps
more tokens each to the tenants it may use (see docs/cache.md, threat model). Bad input gets a 4xx with
{"error": "..."}: 400 bad media or modality or features, 401 no/wrong token, 403 a tenant the token may
not use, 404 unknown tenant, 413 body too large (over `max_body_bytes`, or more JSON values than
`max_json_values`, counted before parsing), 415 a body sent without Content-Type: application/json, 422
malformed JSON. A fault of the server is a 500 with
{"error": "internal error"} (the traceback goes to the log), and the connection stays usable.

`workers=N` (N > 1) runs uvicorn's own multi-worker mode: N processes accept on the one port, each with
the export loaded and its own L1, over the L2 they share (`cache=redis`, required: without it an entry
stored through one worker would not be found through another). GET /metrics and /v1/stats then answer
for the worker that took the request (its L1, its counters; /v1/stats names it by `pid`): to scrape every
worker, run N services of `workers=1` on their own ports behind the balancer instead.
"""

# No `from __future__ import annotations` here: FastAPI reads the route annotations at runtime.
import base64
import functools
import hmac
import inspect
import ipaddress
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.security.utils import get_authorization_scheme_param
from omegaconf import DictConfig
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ushash.config import to_dict
from ushash.serving import connection
from ushash.serving.cache import TENANT_PATTERN, RequestError, UnknownTenant
from ushash.serving.cache.config import CacheConfig
from ushash.serving.cache.entries import loads_json
from ushash.serving.cache.freshness import MIN_TTL_S
from ushash.serving.messages import decode_base64
from ushash.serving.workers import Workers

log = logging.getLogger(__name__)

TOKEN_ENV = "USHASH_SERVE_TOKEN"
#: What one request body may parse to: at most this many JSON values. Parsed, 8 MB of `0,0,...` became
#: 216 MB of Python objects and 8 MB of `[0],[0],...` 240 MB and 1.3 s; 2^20 values is at most ~75 MB, and more
#: than an 8 MB body of float32 features holds (~10 bytes each).
MAX_JSON_VALUES = 1 << 20
LOOPBACK_NAMES = ("localhost",)


@dataclass
class ServeConfig:
    """python -m ushash.serve (configs/serve.yaml): every setting with its default and meaning. Registered
    in Hydra's ConfigStore as `schema_serve` when this module is imported."""
    export: str = "???"               # required: an export directory (python -m ushash.export); relative paths
                                      # hang off the repository
    host: str = "127.0.0.1"           # anything but loopback needs a bearer token
    port: int = 8470
    token: Optional[str] = None       # bearer token for every tenant; the environment variable USHASH_SERVE_TOKEN
                                      # takes precedence
    tokens: Any = None                # more bearer tokens, each -> the tenants it may use ({token: [tenant, ...]}; checked at start)
    max_body_bytes: int = 8 << 20     # larger request bodies get 413
    max_json_values: int = MAX_JSON_VALUES  # a body of more JSON values (counted on its bytes) gets 413, unparsed
    device: str = "cpu"               # where the head (and the encoder for raw inputs) runs
    threads: Optional[int] = 1        # torch's intra-op threads per process (worker): 1 serves concurrent
                                      # requests side by side; torch's default (null) spins a thread per core on
                                      # every one-row forward pass (a features lookup: ~7 ms of CPU, not ~0.5)
    log_level: str = "warning"        # uvicorn's
    workers: int = 1                  # uvicorn worker processes on the one port (uvicorn's own multi-worker mode);
                                      # each loads the export and keeps its own L1, so > 1 needs a shared L2
                                      # (cache=redis) for a store on one worker to be found by the others
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


def tokens_of(cfg: DictConfig):
    """The verb's `tokens` as plain Python (None when unset); `check_binding` judges its shape."""
    from omegaconf import OmegaConf

    raw = cfg.get("tokens")
    return OmegaConf.to_container(raw) if OmegaConf.is_config(raw) else (raw or None)


def check_binding(host: str, token: Optional[str], tokens: Optional[dict] = None) -> None:
    """Refuse to serve beyond loopback without a bearer token (`token`, or `tokens`' keys); a token is at
    least 16 characters. The service and the proxy both start through here."""
    if tokens is not None and not hasattr(tokens, "keys"):
        raise SystemExit(f"tokens must map each bearer token to its tenants, e.g. tokens={{<token>:[acme]}}; "
                         f"got {type(tokens).__name__} {tokens!r:.40}")
    if not is_loopback(host) and not token and not tokens:
        raise SystemExit(f"refusing to bind {host!r} without a bearer token: set token=..., tokens={{...}} or "
                         f"{TOKEN_ENV} (or bind 127.0.0.1)")
    for t in ([token] if token is not None else []) + list((tokens or {}).keys()):
        if len(t) < 16:
            raise SystemExit("bearer tokens must be at least 16 characters")


def cache_from_cfg(cfg: DictConfig):
    """The verb's `SemanticCache`: torch's threads set (`threads`), `export=` and `cache.calibration=`
    relative to the repository root (`paths.root`), like every path of ushash, then `SemanticCache.from_export`."""
    from ushash.serving.cache import SemanticCache

    def under_root(p) -> Path:
        p = Path(str(p))
        return p if p.is_absolute() else Path(cfg.paths.root) / p

    threads = cfg.get("threads")
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer or null (torch's default); got {threads!r}")
        import torch
        torch.set_num_threads(threads)
    cache_cfg = to_dict(cfg.cache)
    if cache_cfg.get("calibration"):
        cache_cfg["calibration"] = str(under_root(cache_cfg["calibration"]))
    return SemanticCache.from_export(under_root(cfg.export), cache_cfg, device=str(cfg.device))


def bearer_credentials(header: Optional[str]) -> bytes:
    """The credentials of an `Authorization: Bearer <token>` header as bytes (b"" for none or another
    scheme), read as fastapi.security.HTTPBearer(auto_error=False) reads them: the scheme case-insensitive,
    the credentials stripped. The service and the proxy both read their tokens through here."""
    scheme, credentials = get_authorization_scheme_param(header)
    bearer = bool(header and scheme and credentials) and scheme.lower() == "bearer"
    return credentials.encode("utf-8", "surrogateescape") if bearer else b""


def check_tokens(tokens, tenants: Optional[list] = None) -> dict[str, frozenset]:
    """`tokens` (token -> tenants it may use) checked: tokens of >= 16 printable ASCII characters, each
    with a non-empty list of valid tenant names, all of them served (`cache.tenants`) when that is set."""
    from ushash.serving.cache.entries import valid_tenant

    if tokens is None:
        return {}
    if not hasattr(tokens, "items"):
        raise ValueError(f"tokens must map each bearer token to a list of tenants; got {type(tokens).__name__}")
    out = {}
    for i, (tok, ts) in enumerate(tokens.items()):
        if not isinstance(tok, str) or len(tok) < 16 or not tok.isascii() or not tok.isprintable() or " " in tok:
            raise ValueError(f"tokens: token #{i + 1} must be at least 16 printable ASCII characters, no spaces")
        if isinstance(ts, str) or not hasattr(ts, "__iter__"):
            raise ValueError(f"tokens: token #{i + 1} must map to a list of tenant names; got {ts!r:.60}")
        ts = list(ts)
        bad = [t for t in ts if not valid_tenant(t) or (tenants is not None and t not in tenants)]
        if bad or not ts:
            raise ValueError(f"tokens: token #{i + 1} names tenants that are not served or not valid names: "
                             f"{bad or 'none'} (served: {tenants if tenants is not None else 'any valid name'})")
        out[tok] = frozenset(ts)
    return out


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
                if not v.isdigit():   # RFC 9110: 1*DIGIT (int() would take "-1", "+2", "2_0" and spaces)
                    return await _send_json(send, 400, {"error": "bad Content-Length header"})
                # past 19 digits (leading zeros aside) it is over any limit: int() refuses past 4,300 digits (a
                # 500 out of this, the outermost layer), and HTTP parsers let a 5,000-digit one with zeros through
                digits = v.lstrip(b"0")
                declared = int(digits or b"0") if len(digits) <= 19 else self.limit + 1
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
        await self.app(scope, _replaying(b"".join(chunks), receive), send)


def _replaying(body: bytes, receive):
    """An ASGI receive that hands on `body`, already read, as the request's one message, then `receive`'s."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_json(send, status: int, obj: dict) -> None:
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
    ttl_s: Optional[float] = Field(None, ge=MIN_TTL_S, le=10 * 365 * 86400)


_MISS = b'{"hit":false}'


class AuthError(Exception):
    pass


class Forbidden(Exception):
    pass


class SafeJSONResponse(JSONResponse):
    """JSON as ASCII: a value or a message holding a lone surrogate still encodes (as \\udXXX)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class _ServerFaults:
    """ASGI middleware: an exception no handler turned into a response becomes a 500 with a JSON body
    (traceback to the log). Starlette's own last resort re-raises after answering, and uvicorn then
    closes the connection, failing the client's next request on it; this one does not re-raise."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, receive, tracking)
        except Exception:
            log.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # nothing else can be said on this connection
            await _send_json(send, 500, {"error": "internal error (logged by the server)"})


class _FeaturesLookup:
    """ASGI middleware: POST /v1/lookup with a JSON body of precomputed features, answered without FastAPI's
    routing, dependency solving and request and response machinery (most of the server's time per
    features lookup; docs/benchmarks.md). The body is parsed by orjson and validated by the route's own
    model (`LookupBody`), the token checked and the lookup answered by the route's own functions
    (`answer`: a Response, or None for a request that is not a features lookup). Anything else, and every
    refusal (malformed JSON, an invalid body, a wrong token, a tenant not allowed or unknown, bad
    features), goes on to the app with the body replayed, so every error is the app's own answer; a
    refusal comes before the cache is asked, so nothing is counted twice."""

    PATH = "/v1/lookup"

    def __init__(self, app, answer, max_json_values: int):
        self.app, self.answer, self.max_json_values = app, answer, max_json_values

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.PATH:
            return await self.app(scope, receive, send)
        header = content_type = None
        for k, v in scope["headers"]:   # the first of each, as Starlette's headers.get reads them
            if k == b"content-type" and content_type is None:
                content_type = v
            elif k == b"authorization" and header is None:
                header = v.decode("latin-1")
        json_body = content_type is not None and content_type.split(b";", 1)[0].strip().lower() == b"application/json"
        if not json_body:   # FastAPI reads other content types differently: its answer
            return await self.app(scope, receive, send)
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # client went away
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        out = None
        try:
            if not too_many_values(body, self.max_json_values, scope):
                out = self.answer(LookupBody.model_validate(loads_json(body)), header)
        except (ValueError, RecursionError, ValidationError, AuthError, Forbidden, RequestError, UnknownTenant):
            out = None
        if out is None:
            return await self.app(scope, _replaying(body, receive), send)
        if not isinstance(out, Response):   # a value orjson does not take: the route's generic path
            out = SafeJSONResponse(jsonable_encoder(out))
        await out(scope, receive, send)


class _FastJSONRequest(Request):
    """A request whose JSON body is parsed by orjson (a 1,000-row lookup_batch body: ~0.8 ms against
    json.loads' ~3.7 ms). What orjson refuses and json.loads takes (NaN, integers beyond 64 bits, lone
    surrogates) goes to json.loads, so every body means what it meant before; a body neither parses is
    json.loads' error, which FastAPI answers as before (422), and so are a body that is not UTF-8 and one
    nested past the parser's depth (FastAPI's own answer to those was a bare 400)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            raw = await self.body()
            over = too_many_values(raw, self.scope["app"].state.max_json_values, self.scope)
            if over:
                raise StarletteHTTPException(413, over)   # FastAPI re-raises an HTTPException as it is
            try:   # the two errors FastAPI would answer with a bare 400 "There was an error parsing the body"
                self._json = loads_json(raw)
            except UnicodeDecodeError as e:
                raise StarletteHTTPException(422, f"invalid request: the body is not UTF-8 (byte {e.start}): send "
                                                  "the JSON encoded as UTF-8") from None
            except RecursionError:
                raise StarletteHTTPException(422, "invalid request: the body's JSON nests arrays or objects "
                                                  "deeper than the parser goes (about 1,000 levels)") from None
            except ValueError as e:
                if isinstance(e, json.JSONDecodeError):
                    raise   # not JSON: FastAPI's own answer
                raise StarletteHTTPException(422, f"invalid request: the body's JSON holds a number Python does not "
                                                  f"read ({str(e)[:120]})") from None
        return self._json


def json_values_bound(raw: bytes) -> int:
    """An upper bound on the JSON values in `raw`, from its bytes, before anything is parsed: each value is the
    document itself or an element of an array or object, and a container of k elements holds k - 1 commas
    (commas and brackets inside strings count too, which only raises the bound). Three scans at memchr's
    speed (~1 ms for 8 MB)."""
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1


_BOUND_KEY = "ushash.json_values_bound"   # a request's bound, kept in its ASGI scope once counted


def too_many_values(raw: bytes, limit: int, scope: Optional[dict] = None) -> Optional[str]:
    """The 413's message for a body of more than `limit` JSON values (`json_values_bound`), else None. With
    the request's ASGI `scope`, the bound is counted once per request (~7 ms for an 8 MB body): a
    /v1/lookup body the features fast path passes on to the app is not counted again. A body shorter than
    `limit` bytes is not counted at all: its bound is at most its length plus one."""
    if len(raw) < limit:
        return None
    bound = scope.get(_BOUND_KEY) if scope is not None else None
    if bound is None:
        bound = json_values_bound(raw)
        if scope is not None:
            scope[_BOUND_KEY] = bound
    if bound <= limit:
        return None
    return f"request body of more than {limit} JSON values (max_json_values; send fewer rows per request)"


class _FastJSONRoute(APIRoute):
    """The service's routes: their bodies parsed by `_FastJSONRequest`."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route_handler(request: Request):
            return await handler(_FastJSONRequest(request.scope, request.receive))
        return route_handler


def is_json_type(content_type: Optional[str]) -> bool:
    """Whether a Content-Type is one FastAPI reads a body as JSON by: application/json or application/*+json
    (parameters such as charset aside)."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def check_limits(limits: dict, error: type[Exception] = ValueError) -> None:
    """Refuse a bound on what one request may cost that is not a positive integer (`error` naming it; the
    verbs pass SystemExit, to refuse at start before loading the export): the service's and the proxy's
    `max_body_bytes`, `max_json_values`, `max_answer_bytes`."""
    for name, v in limits.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise error(f"{name} must be a positive integer; got {v!r}")


def create_app(cache, token: Optional[str] = None, max_body_bytes: int = ServeConfig.max_body_bytes,
               tokens: Optional[dict] = None, max_json_values: int = MAX_JSON_VALUES) -> FastAPI:
    """The FastAPI app serving `cache`. Tests call this directly. `token` may use every tenant; `tokens`
    maps further tokens to the tenants each may use."""
    check_limits({"max_body_bytes": max_body_bytes, "max_json_values": max_json_values})
    scoped = check_tokens(tokens, cache.config.tenants)
    cache.warm_up()   # the compiled kernels loaded before the first request, not during it
    if token is not None and token in scoped:
        raise ValueError("tokens: the all-tenants token is also listed as a scoped one")
    keys = [(token.encode(), None)] if token is not None else []
    keys += [(t.encode(), ts) for t, ts in scoped.items()]

    def allowed_by(header: Optional[str]) -> Optional[frozenset]:
        """The tenants a caller with this Authorization header may use (None: every tenant); AuthError for a
        missing or wrong token (`bearer_credentials`, without HTTPBearer's own dependency level)."""
        if not keys:
            return None
        given = bearer_credentials(header)
        allowed, ok = None, False
        for key, ts in keys:  # every key compared, in constant time each
            if hmac.compare_digest(given, key):
                allowed, ok = ts, True
        if not ok:
            raise AuthError()
        return allowed

    async def auth(request: Request) -> Optional[frozenset]:
        """`allowed_by` as a route dependency. A coroutine: a few compares are not worth a trip through the
        thread pool (FastAPI runs plain-function dependencies there)."""
        return allowed_by(request.headers.get("Authorization"))

    def guarded(endpoint):
        """`endpoint`, whose `allowed` parameter is `Depends(auth)`, as the route's function: with a token
        configured, unchanged (the token is checked as a dependency, so a wrong one is refused before the
        body is validated); with none, without that parameter, `allowed` None (every tenant): solving a
        dependency costs a features lookup more than the lookup's own parsing and validation."""
        if keys:
            return endpoint
        sig = inspect.signature(endpoint)
        if inspect.iscoroutinefunction(endpoint):
            @functools.wraps(endpoint)
            async def route(**kw):
                return await endpoint(**kw, allowed=None)
        else:
            @functools.wraps(endpoint)
            def route(**kw):
                return endpoint(**kw, allowed=None)
        route.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "allowed"])
        return route

    token_checked = [Depends(auth)] if keys else []

    def tenant_of(body, allowed: Optional[frozenset]) -> str:
        # a scoped token is refused any tenant not its own before the cache is asked: whether that tenant
        # exists (404) is not a scoped token's to learn
        if allowed is not None and body.tenant not in allowed:
            raise Forbidden(f"this token may not use tenant {body.tenant!r}")
        return cache.check_tenant(body.tenant)

    # a lookup's encoding off the event loop (the caching proxy's threads too: a cheaper handoff than a thread
    # pool's, docs/benchmarks.md); the plain-function routes (batches, stores) run in FastAPI's thread pool
    workers = Workers()
    # redirect_slashes off: a path with a trailing slash is a 404, not a redirect that re-reads the query string
    # as UTF-8 (bytes that are not were a 500 from FastAPI's redirect)
    app = FastAPI(title="ushash semantic cache", docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=SafeJSONResponse, lifespan=workers.lifespan, redirect_slashes=False)
    app.router.route_class = _FastJSONRoute
    app.state.max_json_values = max_json_values   # read by _FastJSONRequest
    app.state.workers = workers

    @app.exception_handler(Forbidden)
    async def _forbidden(request, exc):
        return SafeJSONResponse({"error": str(exc)}, status_code=403)

    @app.exception_handler(AuthError)
    async def _auth(request, exc):
        return SafeJSONResponse({"error": "missing or wrong bearer token"}, status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        ctype = request.headers.get("content-type")
        if not is_json_type(ctype):   # the body was never read as JSON: say why, not what it then failed
            got = f"Content-Type {ctype!r}" if ctype else "no Content-Type"
            return SafeJSONResponse({"error": f"the request body was sent with {got}: send it as JSON with "
                                              f"Content-Type: application/json"}, status_code=415)
        parts = []
        for e in exc.errors()[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
        return SafeJSONResponse({"error": "invalid request: " + "; ".join(parts)}, status_code=422)

    @app.exception_handler(RequestError)
    async def _bad(request, exc):
        return SafeJSONResponse({"error": str(exc)}, status_code=400)

    @app.exception_handler(UnknownTenant)
    async def _tenant(request, exc):
        return SafeJSONResponse({"error": str(exc)}, status_code=404)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):
        return SafeJSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    def _query(body: LookupBody):
        given = [k for k in ("text", "data_b64", "features") if getattr(body, k) is not None]
        if len(given) != 1:
            raise RequestError(f"give exactly one of text, data_b64, features; got {given or 'none'}")
        if body.features is not None:
            import numpy as np
            with np.errstate(over="ignore", invalid="ignore"):   # beyond float32: the query's own 400
                f = np.asarray(body.features, np.float32)
            return cache.query(body.modality, features=f)
        if body.text is not None:
            if body.modality != "text":
                raise RequestError(f"'text' is for modality text; send {body.modality} as data_b64")
            return cache.query("text", body.text)
        if body.modality == "text":
            raise RequestError("send text as 'text', not data_b64")
        data = decode_base64(body.data_b64)
        if data is None:
            raise RequestError("data_b64 is not valid base64")
        return cache.query(body.modality, data)

    def _hit_json(hit) -> dict:
        out = {"hit": True, "value": hit.value, "distance": hit.distance, "cosine": hit.cosine, "tier": hit.tier,
               "revision": hit.revision, "entry_modality": hit.modality}
        if isinstance(hit.value, bytes):  # stored as bytes (by a Python caller sharing the L2): base64
            out["value"] = base64.b64encode(hit.value).decode("ascii")
            out["value_encoding"] = "base64"
        return out

    @app.get("/healthz")
    def healthz():
        return {"status": "ok"}

    @app.get("/metrics", dependencies=token_checked)
    def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(cache.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    def _json(out: dict):
        try:  # orjson straight to bytes, skipping FastAPI's generic encoding of the returned dict
            return Response(orjson.dumps(out), media_type="application/json")
        except TypeError:  # a value orjson does not take (an integer beyond 64 bits): the generic path
            return out

    def _lookup(body: LookupBody, allowed: Optional[frozenset]):
        tenant = tenant_of(body, allowed)
        hit = cache.lookup(_query(body), tenant)
        return Response(_MISS, media_type="application/json") if hit is None else _json(_hit_json(hit))

    @app.post("/v1/lookup")
    @guarded
    async def lookup(body: LookupBody, allowed: Optional[frozenset] = Depends(auth)):
        # features: the head's forward pass and the cache, tens of microseconds, run on the event loop
        # (a thread round trip costs more than the work); raw media and text go through an encoder
        # and run in the worker threads, so that they never hold up other requests
        if body.features is not None and body.text is None and body.data_b64 is None:
            return _lookup(body, allowed)
        return await workers.run(_lookup, body, allowed)

    @app.post("/v1/lookup_batch")
    @guarded
    def lookup_batch(body: LookupBatchBody, allowed: Optional[frozenset] = Depends(auth)):
        import numpy as np

        tenant = tenant_of(body, allowed)
        modality = cache.encoder.check_modality(body.modality)   # an empty batch too: its 400, not a 200
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                feats = np.asarray(body.features, np.float32)
        except ValueError:
            raise RequestError("features must be rows of equal length") from None
        if not len(feats):
            return {"results": []}
        hits = cache.lookup_many(cache.encoder.from_feature_rows(modality, feats), tenant)
        return _json({"results": [_hit_json(h) if h is not None else {"hit": False} for h in hits]})

    @app.post("/v1/store")
    @guarded
    def store(body: StoreBody, allowed: Optional[frozenset] = Depends(auth)):
        tenant = tenant_of(body, allowed)
        try:
            stored = cache.store(_query(body), body.value, tenant, ttl_s=body.ttl_s)
        except TypeError as e:
            raise RequestError(str(e)) from None
        return {"stored": bool(stored), "revision": cache.revision}

    @app.get("/v1/stats", dependencies=token_checked)
    def stats():
        # `pid`: which process answered (with workers > 1, each has its own L1, stats and metrics)
        return {**cache.stats(), "pid": os.getpid()}

    def features_lookup(body: LookupBody, header: Optional[str]):
        """The /v1/lookup route's answer to a features request (as the route gives it), for `_FeaturesLookup`."""
        if body.features is None or body.text is not None or body.data_b64 is not None:
            return None
        return _lookup(body, allowed_by(header))

    app.add_middleware(_FeaturesLookup, answer=features_lookup, max_json_values=max_json_values)
    app.add_middleware(_ServerFaults)
    app.add_middleware(_BodyLimit, limit=max_body_bytes)
    return app


WORKER_CONFIG_ENV = "USHASH_SERVE_WORKER_CONFIG"  # the serve config (YAML) uvicorn's worker processes build from
WORKER_START_S = 120  # how long a worker may take to answer uvicorn's health ping (imports, loading the export)


def build(cfg: DictConfig):
    """(app, host, port, token) from a serve config (app.state.cache is the cache); checks the binding
    before loading anything."""
    check_workers(cfg)
    token = os.environ.get(TOKEN_ENV) or (str(cfg.token) if cfg.get("token") else None)
    tokens = tokens_of(cfg)
    host = str(cfg.host)
    check_binding(host, token, tokens)
    check_limits({k: cfg.get(k) for k in ("max_body_bytes", "max_json_values")}, SystemExit)
    port = cfg.get("port")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise SystemExit(f"port must be an integer in 1..65535; got {port!r}")
    check_tokens(tokens, list(cfg.cache.tenants) if cfg.cache.get("tenants") is not None else None)
    cache = cache_from_cfg(cfg)
    app = create_app(cache, token=token, max_body_bytes=int(cfg.max_body_bytes), tokens=tokens,
                     max_json_values=int(cfg.max_json_values))
    app.state.cache = cache
    return app, host, int(cfg.port), token


def check_workers(cfg) -> int:
    """`workers`, checked: a positive integer, and > 1 only with an L2 the workers share."""
    n = cfg.get("workers", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SystemExit(f"workers must be a positive integer (uvicorn worker processes); got {n!r}")
    if n > 1 and not (cfg.get("cache") or {}).get("l2"):
        raise SystemExit(f"workers={n} needs a shared L2 (cache=redis [cache.l2.url=...]): each worker keeps its "
                         f"own L1, so without one an entry stored through one worker is not found by the others")
    return n


def worker_app() -> FastAPI:
    """The app of one of uvicorn's worker processes (workers > 1), built from the serve config the parent
    put in the environment: each worker loads the export and makes its own cache (L1) over the shared L2."""
    from omegaconf import OmegaConf

    text = os.environ.get(WORKER_CONFIG_ENV)
    if not text:
        raise RuntimeError(f"{WORKER_CONFIG_ENV} is not set: worker_app is started by run_serve with workers > 1")
    return build(OmegaConf.create(text))[0]


def run_serve(cfg: DictConfig) -> None:
    import uvicorn

    workers = check_workers(cfg)
    if workers == 1:
        app, host, port, token = build(cfg)
        cache = app.state.cache
        log.info("serving http://%s:%d revision %s, %d bits, modalities %s, token %s", host, port, cache.revision,
                 cache.bits, cache.encoder.modalities, "required" if token else "off (loopback)")
        uvicorn.run(app, host=host, port=port, log_level=str(cfg.log_level), access_log=False,
                    http=connection.PROTOCOL, **connection.SERVER_OPTIONS)
        return
    from omegaconf import OmegaConf

    # uvicorn's multi-worker mode: this process binds the port, starts `workers` processes that each build
    # the app (worker_app) and accept on it, and restarts one that dies. The app is built here once first,
    # so that a bad setting or export fails now rather than in every worker, again and again; the config
    # travels resolved, in the environment (a token stays off the command line).
    app, host, port, _ = build(cfg)
    del app
    os.environ[WORKER_CONFIG_ENV] = OmegaConf.to_yaml(cfg, resolve=True)
    log.info("serving http://%s:%d with %d workers", host, port, workers)
    # a worker answers uvicorn's health pings only once it has imported this module (torch among what
    # that pulls in), which on a busy machine takes longer than uvicorn's default 5 s
    uvicorn.run("ushash.serving.service:worker_app", factory=True, host=host, port=port, workers=workers,
                log_level=str(cfg.log_level), access_log=False, timeout_worker_healthcheck=WORKER_START_S,
                http=connection.PROTOCOL, **connection.SERVER_OPTIONS)
