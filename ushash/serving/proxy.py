"""A caching reverse proxy in front of an inference service (`python -m ushash.proxy`).

    python -m ushash.proxy upstream=http://127.0.0.1:8480 export=exports/<name> [port=8471]

Every POST is read as JSON. The request's text and media come from OpenAI-style chat `messages` (text
parts, `image_url` parts with base64 data URLs), or, for other APIs, from `text_path` / `image_path`
(dotted paths into the body, e.g. `input.prompt`, with base64 for the image). A request with an image is
looked up by the image, its text an exact metadata filter; otherwise by its text ("role: text" lines), the
texts of every message but the last (a system prompt, the conversation so far) an exact filter. A request holding what
it cannot key by (an image that is not a base64 data URL, a part of another type, a text that is not a
string, over 256 messages or parts) is passed through (`X-Cache: bypass`): keyed by the rest, it could be
served another's answer. So is one the cache cannot encode (an image over its pixel limit or undecodable,
a text over its length limit or its encoder's token window) or store (a lone surrogate escape in its text or
`model`): the upstream
answers or refuses it as it would without the proxy, and nothing is stored.
The body's `model`, the URL path and query string (as they came, forwarded so too), `stream`, the
gateway's `X-Model-Revision` header (every line of it), the request headers of `key_headers` (the API
version and beta headers of Anthropic's and OpenAI's APIs) and everything else in the body (`request_params`:
temperature, max_tokens, tools, the messages' roles and names, the form of their content: the parts'
order, an image's media type and detail, ...) are exact filters too: an answer of another model,
endpoint, revision or setting is never served. A hit is answered from the cache (a streamed answer
replayed as it was streamed); a miss is forwarded, streamed through as it arrives, and a 200 answer of at
most `max_answer_bytes` is stored (a longer one is relayed as it arrives, never held whole; a store that
fails is logged, and the answer still sent), unless its own headers forbid a shared cache to keep it
(`Cache-Control: no-store`, `private` or `no-cache`, or a `Vary` on request headers other than
Accept-Encoding: `answer_storable`), or it is already stale, or it reports an error inside its 200 (a JSON
`error`, an event stream's error event: `reports_error`, `stream_reports_error`), or it ends cut off (an event
stream not at an event's end, a JSON body that does not parse: `answer_whole`); one that states its
freshness (`s-maxage`, `max-age`, `Expires`, less its age as it came: `answer_lifetime`) is kept no longer than that.
A request's `Cache-Control: no-cache` or `max-age=0` (or `Pragma: no-cache` without a Cache-Control) skips
the lookup (the fresh answer is stored), `max-age=N` is not served an answer older than N s (its age, RFC 9111
4.2.3: its age when it came, its `Age` or the time since its `Date` if more, plus its time in the cache; a hit's
`Age` says it; the refused entry is
dropped once the fresh answer is stored, RFC 9111 4's most recent), `no-store` skips storing (the directives of
every Cache-Control line).
`X-Cache: hit | miss | bypass` says which, and `Server-Timing` how long the lookup took (`lookup;dur=` in ms:
encoding the request, the search and the check) and, on a forwarded request, the upstream
(`upstream;dur=`: until its answer's headers).

GET /metrics is the cache's Prometheus series and the proxy's own: `proxy_requests_total{outcome}` (each POST
the proxy answered: hit, miss, bypass, refused (its own 4xx), upstream_error (502)), the upstream's time to
its answer's headers (`proxy_upstream_duration_seconds`) and answers relayed but not stored
(`proxy_store_failures_total`). With a token set, /metrics needs one too (any): aggregate counts only.

Tenants: `tokens` maps a bearer token to a tenant; with a map, a request without a known token is 401.
Without one, `token` (or USHASH_PROXY_TOKEN) is the one accepted token, required when the proxy binds
beyond loopback, and every request is tenant `default`. A tenant the cache does not serve (`cache.tenants`)
is refused at start. Errors as `ushash.serve`: 400 for a body that is
not JSON, 401, 404 for an unknown tenant, 413 over `max_body_bytes`, 502 when the upstream fails. A body of
more JSON values than `max_json_values` (counted on its bytes) is not parsed: it is forwarded as it came.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers

from ushash.serving import connection
from ushash.serving.cache import CacheConfig, RequestError, UnknownTenant
from ushash.serving.cache.entries import loads_json
from ushash.serving.cache.freshness import MIN_TTL_S, check_ttl
from ushash.serving.messages import (content_form, decode_base64, decode_data_url, images_digest, json_digest,
                                     read_content)
from ushash.serving.service import MAX_JSON_VALUES, check_limits, is_json_type
from ushash.serving.workers import Workers

log = logging.getLogger(__name__)

TOKEN_ENV = "USHASH_PROXY_TOKEN"
#: A chat body of more messages than this is not keyed (passed through).
MAX_MESSAGES = 256
#: Headers not copied between the hops (RFC 9110 7.6.1's connection-specific ones, HTTP/1.0's Proxy-Connection,
#: and what httpx recomputes); with them, each header the Connection header names (`connection_options`).
HOP = frozenset({"connection", "proxy-connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                 "trailer", "transfer-encoding", "upgrade", "content-length", "content-encoding", "host"})
#: The greatest delta-seconds (an age, a max-age) read: RFC 9111 1.2.2's 2^31, for a larger (or overflowing) value.
MAX_DELTA_SECONDS = 2 ** 31
#: Request headers the proxy does not forward (as bytes, as ASGI gives them): the hop ones, the client's token, and
#: its Accept-Encoding (httpx sends its own: the codings it decodes, as the proxy relays the body decoded; a
#: coding it cannot decode, as brotli without its package, reached the client as raw bytes without its name).
NOT_FORWARDED = frozenset(h.encode() for h in HOP | {"authorization", "accept-encoding"})


@dataclass
class ProxyConfig:
    """python -m ushash.proxy (configs/proxy.yaml): every setting with its default and meaning."""
    export: str = "???"               # required: the export whose codes key the cache
    upstream: str = "???"             # required: the inference service, e.g. http://127.0.0.1:8480
    host: str = "127.0.0.1"           # anything but loopback needs a token (or a tokens map)
    port: int = 8471
    token: Optional[str] = None       # the one accepted bearer token (USHASH_PROXY_TOKEN takes precedence)
    tokens: Any = None                # bearer token -> tenant ({token: tenant}); set: unknown tokens get 401
    text_path: Optional[str] = None   # dotted path of the text in a non-chat body (e.g. input.prompt)
    image_path: Optional[str] = None  # dotted path of a base64 image in a non-chat body
    max_body_bytes: int = 8 << 20     # larger request bodies get 413
    max_json_values: int = MAX_JSON_VALUES  # a body of more JSON values (counted on its bytes) is forwarded unparsed
    max_answer_bytes: int = 1 << 20   # larger upstream answers are passed through, not stored
    upstream_timeout_s: float = 60.0
    # request headers that change an answer, so key a request exactly too (every line, as forwarded; besides
    # X-Model-Revision, always): the API versions and beta features of Anthropic's and OpenAI's APIs
    key_headers: tuple = ("anthropic-version", "anthropic-beta", "openai-beta")
    ttl_s: Optional[float] = None     # stored answers' TTL; None: the cache's
    device: str = "cpu"
    threads: Optional[int] = 1        # torch's intra-op threads (ushash.serve's `threads`)
    log_level: str = "warning"
    paths: Any = None
    cache: CacheConfig = field(default_factory=CacheConfig)


def register_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="schema_proxy", node=ProxyConfig)


register_schemas()


@dataclass
class Extracted:
    text: str                          # the texts joined ("role: text" lines for chat), what a text is keyed by
    image: Optional[bytes]             # the image the request is looked up by (the first)
    more_images: str = ""              # a digest of the images after it (an exact filter), "" for none
    texts: tuple = ()                  # the texts one by one (chat): the exact filter of an image request's text,
                                       # which the joined text is not ("a\nuser: b", "c" joins as "a", "b\nuser: c")
    before: int = 0                    # how many of `texts` come before the last message's (chat)

    @property
    def text_digest(self) -> str:
        return json_digest(list(self.texts)) if self.texts else _digest(self.text)

    @property
    def context(self) -> str:
        """A digest of the texts of every message but the last: the exact filter of a text request's earlier
        turns, "" for a single message."""
        return json_digest(list(self.texts[:self.before])) if self.before else ""


#: What `_at` gives for a path that leads nowhere (a JSON null there is None).
_MISSING = object()


def _at(body, path: str):
    cur = body
    for part in path.split("."):
        if isinstance(cur, list) and _is_digits(part) and int(part) < len(cur):
            cur = cur[int(part)]
        elif isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            return _MISSING
    return cur


def _is_unicode(text: str) -> bool:
    """Whether `text` is valid Unicode: one holding a lone surrogate escape has no UTF-8 to digest or store
    it by."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def extract_request(body: dict, text_path: str | None = None, image_path: str | None = None) -> Optional[Extracted]:
    """The text and first image of a request body (None: nothing to key it by, which includes text that
    is not valid Unicode: a lone surrogate escape has no UTF-8 to encode or digest, and a body holding
    more than it reads, such as a text that is not a string: keyed by the rest, requests that differ only
    there would share an answer)."""
    req = _extract(body, text_path, image_path)
    return req if req is not None and _is_unicode(req.text) else None


def _extract(body: dict, text_path: str | None, image_path: str | None) -> Optional[Extracted]:
    msgs = body.get("messages")
    if isinstance(msgs, list) and not (text_path or image_path):
        if len(msgs) > MAX_MESSAGES:
            return None
        texts, images, before = [], [], 0
        for m in msgs:
            if not isinstance(m, dict):
                continue
            t, i, complete = read_content(m.get("content"))
            if not complete:   # an image it cannot decode (a remote URL), a part of another type
                return None
            role = str(m.get("role", ""))
            before = len(texts)   # the texts before the last message's
            texts += [f"{role}: {x}" for x in t]
            images += i
        if not texts and not images:
            return None
        return Extracted("\n".join(texts), images[0] if images else None, images_digest(images[1:]), tuple(texts),
                         before)
    text = _at(body, text_path) if text_path else _MISSING
    img = _at(body, image_path) if image_path else _MISSING
    if text is not _MISSING and not isinstance(text, str):   # a text there, but not one it can read
        return None
    image = None
    if isinstance(img, str):
        image = decode_data_url(img) if img.startswith("data:") else decode_base64(img)
    if img is not _MISSING and img is not None and image is None:   # an image there, but not one it can decode
        return None
    if text is _MISSING and image is None:
        return None
    return Extracted("" if text is _MISSING else text, image)


def _directive_values(lines: list[str]) -> dict[str, str]:
    """The directives of Cache-Control header lines: every line, each a comma-separated list of `name` or
    `name=value` (RFC 9111), so `no-store` in a second line counts and `x-no-store-hint` is not `no-store`:
    name (lowercase) -> its value ("" for a bare name; the first of a name counts)."""
    out: dict[str, str] = {}
    for line in lines:
        for d in line.split(","):
            name, _, value = d.partition("=")
            out.setdefault(name.strip().lower(), value.strip().strip('"'))
    return out


def cache_directives(lines: list[str]) -> set[str]:
    """The directive names (lowercase) of Cache-Control (or Pragma) header lines (`_directive_values`)."""
    return set(_directive_values(lines))


def _delta_seconds(value) -> float:
    """RFC 9111 delta-seconds, at most MAX_DELTA_SECONDS (1.2.2: a larger one is taken as 2^31, so that no
    arithmetic on it overflows: a max-age and an Age of 400 digits each were infinity less infinity, a lifetime
    that was not a number); anything else is 0 (an invalid freshness value means stale)."""
    value = str(value or "").strip()
    return min(float(value), MAX_DELTA_SECONDS) if _is_digits(value) else 0.0


def _is_digits(value: str) -> bool:
    """ASCII digits only: `str.isdigit` takes "²" and "٣" too, which float() and int() refuse (a 500)."""
    return value.isascii() and value.isdigit()


def _latin1(value: str) -> str:
    """A header value Starlette can send (it encodes latin-1): as it is, or its UTF-8 bytes read as latin-1 where
    it holds a character past latin-1 (a Content-Type stored by a proxy that kept httpx's str of it)."""
    try:
        value.encode("latin-1")
        return value
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogatepass").decode("latin-1")


def stored_age(response) -> float:
    """How old a stored answer was when it came (`initial_age`, whole seconds), as `keep` recorded it;
    0 for an entry without one (stored before the proxy kept it, possibly by another proxy through a shared L2)
    or with an invalid one (`_delta_seconds`)."""
    return _delta_seconds(response.get("age")) if isinstance(response, dict) else 0.0


def _http_date(value) -> Optional[float]:
    """An HTTP date as a POSIX time; None for a missing or invalid one. A date without a zone (asctime's form,
    which RFC 9110 5.6.7 has recipients accept) is GMT, not the machine's local time."""
    from datetime import timezone
    from email.utils import parsedate_to_datetime

    try:
        when = parsedate_to_datetime(value)
        return (when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def initial_age(headers, now: Optional[float] = None, asked: Optional[float] = None) -> float:
    """How old an upstream answer is as it comes (RFC 9111 4.2.3's corrected_initial_age): the larger of its
    apparent age (`now`, the clock's time when not given, less its `Date`; none below 0) and its `Age` plus the
    time the request took (`now` less `asked`, when it was sent). An answer that reached the proxy through a
    cache that sets no `Age` is still as old as its Date says."""
    now = time.time() if now is None else now
    date = _http_date(headers.get("date") or "")
    apparent = max(0.0, now - date) if date is not None else 0.0
    return max(apparent, _delta_seconds(headers.get("age")) + (max(0.0, now - asked) if asked is not None else 0.0))


def answer_lifetime(headers, now: Optional[float] = None, asked: Optional[float] = None) -> Optional[float]:
    """Seconds a shared cache may serve an upstream answer from now on (RFC 9111 4.2): its `s-maxage`, else
    its `max-age`, else `Expires` less `Date` (less `now`, the clock's time when not given, without a Date; an
    invalid Expires: already stale), less its age as it comes (`initial_age`: its `Age`, or the time since its
    `Date` when that is more); None when it states no freshness (the cache's TTL applies)."""
    now = time.time() if now is None else now
    cc = _directive_values(headers.get_list("cache-control"))
    if "s-maxage" in cc or "max-age" in cc:
        life = _delta_seconds(cc.get("s-maxage", cc.get("max-age")))
    elif "expires" in headers:
        expires, date = _http_date(headers.get("expires")), _http_date(headers.get("date") or "")
        life = 0.0 if expires is None else expires - (date if date is not None else now)
    else:
        return None
    return life - initial_age(headers, now, asked)


def connection_options(lines: list[str]) -> set[str]:
    """The header names (lowercase) that Connection header lines list: hop-by-hop too, never forwarded (RFC
    9110 7.6.1)."""
    return {name.strip().lower() for line in lines for name in line.split(",") if name.strip()}


def reports_error(value) -> bool:
    """Whether a JSON value of an answer reports a failure inside its 200: an object whose `error` is not null
    (as vLLM and OpenAI-compatible servers send one, in a stream mid-generation, then end it as usual), whose
    `type` is "error" (an OpenAI Responses or Anthropic error event) or whose `response.error` is not null (a
    Responses `response.failed` event). Such an answer is relayed, never stored."""
    if not isinstance(value, dict):
        return False
    response = value.get("response")
    return (value.get("error") is not None or value.get("type") == "error"
            or (isinstance(response, dict) and response.get("error") is not None))


def _json_reports_error(data: str) -> bool:
    """Whether `data`, read as JSON, `reports_error` (False when it is not a JSON object). Only data that holds
    "error" is read (every event of a long stream would be, on the event loop)."""
    if "error" not in data or not data.lstrip().startswith("{"):
        return False
    try:
        return reports_error(loads_json(data.encode()))
    except (ValueError, RecursionError):
        return False


def sse_events(text: str):
    """The events of a server-sent event stream (WHATWG HTML, 9.2.6), as (type, data): the lines end at CRLF,
    LF or CR; an event ends at a blank line; its `data:` lines are joined with "\n", its last `event:` line
    names it ("message" when none); ":" lines are comments. An event without data, or cut off by the stream's
    end, is one too (a client skips it; here it may only keep an answer from being stored)."""
    name, data = "", []
    for line in [*re.split(r"\r\n|\r|\n", text), ""]:
        if not line:
            if name or data:
                yield name or "message", "\n".join(data)
            name, data = "", []
            continue
        field_name, colon, value = line.partition(":")
        value = value[1:] if colon and value.startswith(" ") else value
        if field_name == "event":
            name = value
        elif field_name == "data":
            data.append(value)


#: a line of the field `error`, which the SSE format does not have (a client ignores it): llama.cpp's server
#: reports a failure inside its 200 so (`error: {"code": 500, ...}`), then ends the stream as a whole one
_ERROR_FIELD = re.compile(r"(?:\A|[\r\n])error:")
#: an event stream's end where its last event ended (a blank line); the whole stream's lines are not split again
_EVENT_END = re.compile(r"(?:\r\n|\n|\r(?!\n))(?:\r\n|\n|\r)\Z")


def stream_reports_error(text: str) -> bool:
    """Whether a server-sent event stream reports a failure inside its 200: an event named `error` or ending in
    `.failed` or `.error` (OpenAI's Responses `response.failed`), one whose data `reports_error`, or a line of
    the field `error` (llama.cpp's). Such an answer is relayed, never stored."""
    return bool(_ERROR_FIELD.search(text)) or any(
        name == "error" or name.endswith((".failed", ".error")) or _json_reports_error(data)
        for name, data in sse_events(text))


def answer_whole(text: str, content_type: str) -> bool:
    """Whether an answer is whole as far as its own form says: an event stream ends where its last event ended
    (a blank line), a JSON body reads as JSON. An upstream that ends its body by closing the connection (no
    Content-Length, not chunked) and fails mid-answer ends it as it ends a whole one, for httpx as for any
    client: such an answer is relayed as it came, never stored."""
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind == "text/event-stream":
        return bool(_EVENT_END.search(text[-4:]))
    if is_json_type(content_type):
        try:
            loads_json(text.encode())
        except (ValueError, RecursionError):
            return False
    return True


def answer_storable(headers, now: Optional[float] = None, asked: Optional[float] = None) -> bool:
    """Whether a shared cache may keep an upstream answer (RFC 9111): not one its Cache-Control marks
    `no-store`, `private` (one user's) or `no-cache` (every reuse revalidated, which the proxy cannot do),
    nor one whose `Vary` names request headers the proxy does not key by (any but Accept-Encoding: the
    proxy keeps the decoded body), as `Vary: Accept-Language` or `*`, nor one already stale
    (`answer_lifetime` at `now` below the cache's shortest TTL, `MIN_TTL_S`: `max-age=0`, an `Expires` in the
    past)."""
    if cache_directives(headers.get_list("cache-control")) & {"no-store", "private", "no-cache"}:
        return False
    life = answer_lifetime(headers, now, asked)
    if life is not None and life < MIN_TTL_S:
        return False
    vary = {v.strip().lower() for line in headers.get_list("vary") for v in line.split(",")}
    return not (vary - {"", "accept-encoding"})


def request_params(body: dict, text_path: str | None = None, image_path: str | None = None) -> Optional[str]:
    """A digest of everything in the body but what the lookup compares by meaning (the messages' texts and
    images, or the values at `text_path` / `image_path`): the model's settings (temperature, max_tokens,
    tools, response_format, ...), the messages' roles, names and tool calls, the form of their content
    (`content_form`: the parts' order, an image's media type and detail, any other key of a part), the
    user. An answer depends on them too, so a hit needs them all equal. None when the body cannot be
    written back as JSON (nested past the interpreter's limit): such a request is not keyed."""
    msgs = body.get("messages")
    if isinstance(msgs, list) and not (text_path or image_path):
        rest = {**body, "messages": [_message_rest(m) for m in msgs]}
    else:
        rest = body
        for path in filter(None, (text_path, image_path)):
            rest = _without(rest, path.split("."))
    try:
        return json_digest(rest)
    except (RecursionError, ValueError):
        return None


def _message_rest(m):
    """A chat message less its texts and images (`content_form`)."""
    if not isinstance(m, dict):
        return m
    return {**m, "content": content_form(m.get("content"))} if "content" in m else m


def _without(obj, path: list[str]):
    """`obj` less the value at `path` (the parts of a dotted path; a list index as its digits), copied only
    along the path; `obj` itself where the path leads nowhere."""
    head, rest = path[0], path[1:]
    if isinstance(obj, dict) and head in obj:
        if not rest:
            return {k: v for k, v in obj.items() if k != head}
        return {**obj, head: _without(obj[head], rest)}
    if isinstance(obj, list) and _is_digits(head) and int(head) < len(obj):
        i = int(head)
        return [*obj[:i], _without(obj[i], rest) if rest else None, *obj[i + 1:]]
    return obj


def _digest(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()[:32]


def check_tenants(cache, tokens: dict) -> None:
    """Refuse (ValueError, one line) a tenant the cache does not serve: one a token maps to, or `default`,
    every request's tenant when there are no tokens. Each request would be a 404, its answer never stored."""
    served = cache.config.tenants
    for t in dict.fromkeys(tokens.values()) if tokens else ["default"]:
        try:
            cache.check_tenant(t)
        except UnknownTenant:
            if tokens:
                raise ValueError(f"tokens map a token to tenant {t!r}, which cache.tenants={served} does not "
                                 f"list: add it to cache.tenants or map the token to a served tenant") from None
            raise ValueError(f"without tokens every request is tenant 'default', which cache.tenants={served} "
                             f"does not list: add default to cache.tenants or set tokens={{<token>:<tenant>}}"
                             ) from None


def request_target(scope) -> bytes:
    """The request's path and query string, bytes for bytes as they came: forwarded and keyed so, neither
    decoded nor encoded again (/a%3Fb stays /a%3Fb, not the path /a with the query b)."""
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string", b"")
    return path + (b"?" + query if query else b"")


class ProxyMetrics:
    """The proxy's own series, in a registry of their own (rendered after the cache's at /metrics)."""

    OUTCOMES = ("hit", "miss", "bypass", "refused", "upstream_error")

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = r = CollectorRegistry()
        requests = Counter("proxy_requests", "POST requests the proxy answered, by outcome", ["outcome"], registry=r)
        self._by_outcome = {o: requests.labels(outcome=o) for o in self.OUTCOMES}  # every series from the start
        self.upstream = Histogram("proxy_upstream_duration_seconds", "Upstream time to its answer's headers",
                                  buckets=(1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                                           30.0, 60.0), registry=r)
        self.store_failures = Counter("proxy_store_failures", "Upstream answers relayed but not stored (the store "
                                      "failed)", registry=r)

    def answered(self, outcome: str) -> None:
        self._by_outcome[outcome].inc()

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def _headers_digest(headers, names: tuple) -> str:
    """A digest of the lines of `headers` ((name, value) bytes) whose names (lowercase) are in `names`, in
    order, "" when there is none: requests that differ there get different answers."""
    lines = [[k.lower().decode("latin-1"), v.decode("latin-1")] for k, v in headers if k.lower() in names]
    return json_digest(lines) if lines else ""


def create_proxy_app(cache, upstream: str, *, token: str | None = None, tokens: dict | None = None,
                     text_path: str | None = None, image_path: str | None = None,
                     max_body_bytes: int = ProxyConfig.max_body_bytes,
                     max_json_values: int = ProxyConfig.max_json_values,
                     max_answer_bytes: int = ProxyConfig.max_answer_bytes, timeout_s: float = 60.0,
                     ttl_s: float | None = None, key_headers=ProxyConfig.key_headers, transport=None):
    import httpx

    from ushash.serving.service import _BodyLimit, _ServerFaults, bearer_credentials, too_many_values

    check_limits({"max_body_bytes": max_body_bytes, "max_json_values": max_json_values,
                  "max_answer_bytes": max_answer_bytes})
    check_ttl(ttl_s)   # at start: one under MIN_TTL_S failed every store, each with a warning
    keyed = tuple(sorted({str(h).strip().lower().encode("latin-1") for h in key_headers or ()}))
    cache.warm_up()   # what the cache loads once (compiled kernels, ~1 s) before the first request, as ushash.serve does
    tokens = dict(tokens or {})
    check_tenants(cache, tokens)
    client = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=timeout_s, transport=transport)
    own = ProxyMetrics()
    workers = Workers()   # the cache's work (encoding, search, store) off the event loop

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with workers.lifespan():   # the upstream client closed, then the threads
            try:
                yield
            finally:
                await client.aclose()

    app = FastAPI(title="ushash caching proxy", lifespan=lifespan, redirect_slashes=False)   # as the service's
    app.state.client, app.state.workers = client, workers

    keys = [(t.encode(), tenant) for t, tenant in tokens.items()] if tokens else \
        [(token.encode(), "default")] if token is not None else []

    def tenant_of(headers) -> str | None:
        """The tenant of the request's bearer token, None for a missing or wrong one ("default" when the
        proxy takes no token). Read as ushash.serve reads it, every token compared in constant time."""
        if not keys:
            return "default"
        given, found = bearer_credentials(headers.get("authorization")), None
        for key, tenant in keys:
            if hmac.compare_digest(given, key):
                found = tenant
        return found

    def err(status: int, msg: str):
        return JSONResponse({"error": msg}, status_code=status)

    @app.get("/healthz")
    def healthz():
        return {"ok": True, "revision": cache.revision}

    @app.get("/metrics")
    def metrics(request: Request):
        if tenant_of(request.headers) is None:
            return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(cache.metrics.text() + own.text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/{path:path}")
    async def every_post(path: str):
        """Never called: every POST is answered by `proxy` below, before FastAPI. The route puts the proxy's one
        route in the OpenAPI schema, and makes FastAPI answer another method on any path with a 405
        (Allow: POST), not a 404."""
        raise RuntimeError("a POST reached FastAPI; the proxy answers every POST itself")

    async def proxy(scope, receive):
        """The answer to a POST (any path): a Response, None when the client went away before its body came."""
        headers = Headers(scope=scope)
        tenant = tenant_of(headers)
        if tenant is None:
            return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return None
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        raw = b"".join(chunks)
        target = request_target(scope)
        # as received, bytes for bytes: a header value outside ASCII (obs-text) is forwarded, not re-encoded; not
        # the hop-by-hop ones, which include those the Connection header names
        named = connection_options(headers.getlist("connection"))
        not_forwarded = NOT_FORWARDED.union(n.encode("latin-1") for n in named)
        fwd_headers = [(k, v) for k, v in scope["headers"] if k.lower() not in not_forwarded]
        if too_many_values(raw, max_json_values):
            # more than the cache would parse (8 MB of `{},` is ~200 MB of Python objects): the upstream's to
            # answer or refuse, as it came, its answer relayed as it arrives (whether it streams is unread)
            return await forward(target, raw, fwd_headers, True, None, "bypass", "")
        try:
            body = loads_json(raw)
        except (ValueError, RecursionError):   # nested past the recursion limit too: 400, not 500
            return err(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return err(400, "the request body must be a JSON object")
        lines = headers.getlist("cache-control")
        cc = _directive_values(lines)
        # max-age=N asks for an answer no older than N s (RFC 9111 5.2.1.1): max-age=0 as no-cache does, a hit
        # older than N is not served; Pragma: no-cache is HTTP/1.0's
        max_age = _delta_seconds(cc["max-age"]) if "max-age" in cc else None
        no_cache = ("no-cache" in cc or max_age == 0
                    or (not lines and "no-cache" in cache_directives(headers.getlist("pragma"))))
        no_store = "no-store" in cc
        try:
            req = extract_request(body, text_path, image_path)
            params = request_params(body, text_path, image_path) if req is not None else None
        except RecursionError:   # a part or role nested past what the parser took and Python's str() can
            return err(400, "the request body is nested too deep")
        stream = body.get("stream") is True   # OpenAI's flag is a JSON boolean: "no" is not a stream

        def passthrough():   # forwarded as it came, never stored
            return forward(target, raw, fwd_headers, stream, None, "bypass", "")

        if req is None or params is None:   # nothing to key: pass through
            return await passthrough()
        meta = {"model": str(body.get("model", "")), "path": target[1:].decode("latin-1"), "stream": stream,
                # every X-Model-Revision line: a request sending two is not keyed as one sending the first; as
                # forwarded (none, when its Connection header names it)
                "revision": ", ".join(v.decode("latin-1") for k, v in fwd_headers if k.lower() == b"x-model-revision"),
                # the `key_headers` it came with, every line as forwarded ("" for none of them)
                "headers": _headers_digest(fwd_headers, keyed),
                "text": req.text_digest if req.image is not None else "",
                # a text request's earlier turns (a system prompt, the conversation so far) are matched exactly:
                # by meaning, "answer in French" and "answer in English" before one question shared an answer
                "context": req.context if req.image is None else "",
                "params": params, "more_images": req.more_images}
        modality, data = ("image", req.image) if req.image is not None else ("text", req.text)
        # a model name with a lone surrogate escape cannot be stored (the cache keeps valid Unicode only)
        if modality not in cache.head.modalities or not _is_unicode(meta["model"]):
            return await passthrough()
        try:
            q, hit, refused, age, spent = await workers.run(lookup, modality, data, None if no_cache else meta,
                                                            tenant, max_age)
        except RequestError as e:
            # what the cache cannot key (media over its limits or undecodable, text over its length or token
            # window) is the model's to answer or refuse, not the proxy's: passed through, never stored
            log.debug("bypass: %s", e)
            return await passthrough()
        except UnknownTenant as e:
            return err(404, str(e))
        if hit is not None:
            ans = hit["response"]
            return Response(ans["body"].encode(), status_code=200,
                            headers={"X-Cache": "hit", "X-Cache-Distance": str(hit["hamming_distance"]),
                                     "Content-Type": _latin1(ans["content_type"]), "Age": str(int(age)),
                                     "Server-Timing": f"lookup;dur={spent * 1e3:.3f}"})
        return await forward(target, raw, fwd_headers, stream, None if no_store else (q, tenant, meta, refused),
                             "bypass" if no_cache else "miss", f"lookup;dur={spent * 1e3:.3f}, ")

    async def post(scope, receive, send):
        answer = await proxy(scope, receive)
        if answer is not None:
            own.answered(answer.headers.get("x-cache")
                         or ("upstream_error" if answer.status_code == 502 else "refused"))
            await answer(scope, receive, send)

    def lookup(modality, data, filters, tenant, max_age):
        """In a worker thread: the request encoded, and its hit unless `filters` is None (no-cache) or there is
        none, with its age (RFC 9111 4.2.3: its age when it came, `stored_age`, plus the seconds since
        it was stored, on the cache's clock): None too when older than `max_age` (the request's Cache-Control
        max-age), and then the hit refused; with the seconds it took (the thread handoffs are not the lookup's).
        The search may ask the L2 (Redis): never on the event loop."""
        t0 = time.perf_counter()
        q = cache.query(modality, data)
        hits = [] if filters is None else cache.check_query(q, filters=filters, tenant=tenant)
        hit, refused, age = None, None, 0.0
        if hits:
            # an answer that came 100 s old is 100 s older than its time here: its Age, and what max-age is
            # compared with (its TTL, `answer_lifetime`, was already shortened by that age: its Age reaches the
            # upstream's lifetime as it expires)
            age = stored_age(hits[0]["response"]) + max(0.0, cache.clock() - hits[0]["inserted_at"])
            hit, refused = (hits[0], None) if max_age is None or age <= max_age else (None, hits[0])
        return q, hit, refused, age, time.perf_counter() - t0

    def store(q, answer, meta, tenant, ttl, refused):
        """In a worker thread (the store and the drop may write to the L2, Redis: never on the event loop): the
        answer stored and, once it is, the entry a max-age refused dropped (RFC 9111 4: the most recent answer is
        served; kept, it went on answering the wording it was stored for). An answer that ended cut off
        (`answer_whole`: its JSON read here, off the event loop) is not stored."""
        if not answer_whole(answer["body"], answer["content_type"]):
            own.store_failures.inc()
            log.warning("the upstream's answer ended cut off (%s, %d characters): relayed, not stored",
                        answer["content_type"], len(answer["body"]))
            return
        if cache.store_response(q, answer, metadata=meta, tenant=tenant, ttl=ttl) is None or refused is None:
            return
        try:
            cache.drop(refused, tenant=tenant)
        except Exception as e:   # noqa: BLE001 (the fresh answer is stored and sent either way)
            log.warning("the answer a max-age refused was not dropped: %s: %s", type(e).__name__, e)

    async def forward(target, raw, headers, stream, key, label, timing):
        t0, asked = time.perf_counter(), time.time()
        target = client.base_url.raw_path.rstrip(b"/") + target
        try:
            # the target extension: the request line carries it as it came (httpx's URL would encode " < > again)
            up_req = client.build_request("POST", client.base_url.copy_with(raw_path=target), content=raw,
                                          headers=headers, extensions={"target": target})
        except (httpx.InvalidURL, ValueError) as e:   # a target httpx cannot send: not the upstream's fault
            return err(400, f"the request cannot be forwarded: {type(e).__name__}: {str(e)[:200]}")
        try:
            up = await client.send(up_req, stream=True)
        except httpx.HTTPError as e:
            return err(502, f"upstream failed: {type(e).__name__}")
        waited = time.perf_counter() - t0
        own.upstream.observe(waited)
        not_copied = HOP | connection_options(up.headers.get_list("connection")) | {"x-cache", "server-timing"}
        # the upstream's header bytes as they came (read as latin-1, which Starlette sends back byte for byte):
        # httpx's str of a UTF-8 value outside latin-1 ("X-Note: €") could not be sent, a 500; repeated ones joined
        out_headers, timings = {}, []
        for k, v in up.headers.raw:
            name, value = k.decode("latin-1").lower(), v.decode("latin-1")
            if name == "server-timing":
                timings.append(value)
            elif name not in not_copied:
                out_headers[name] = f"{out_headers[name]}, {value}" if name in out_headers else value
        out_headers["X-Cache"] = label
        # the upstream's own Server-Timing metrics, if any, after the proxy's
        out_headers["Server-Timing"] = ", ".join([f"{timing}upstream;dur={waited * 1e3:.3f}", *timings])
        ctype = out_headers.get("content-type", "application/json")
        chunks = up.aiter_bytes()   # decoded: content-encoding is not copied

        async def streamed(head: list[bytes], **kw) -> Response:
            """The answer relayed as it arrives after `head`; with nothing read yet, its first chunk is read before
            the status goes out: a body that fails to decode (gzip that is not) failed after the status line, a
            torn connection; now a 502 as when read whole."""
            if not head:
                try:
                    head = [await chunks.__anext__()]
                except StopAsyncIteration:
                    pass
                except httpx.HTTPError as e:
                    await up.aclose()
                    return err(502, f"upstream failed while sending its answer: {type(e).__name__}")
            return StreamingResponse(relay(head), status_code=up.status_code, headers=out_headers, **kw)

        async def keep(body: bytes):
            if key is None or up.status_code != 200 or len(body) > max_answer_bytes:
                return
            now = time.time()   # one clock reading: the lifetime that made it storable is the one it is kept for
            if not answer_storable(up.headers, now, asked):
                return
            try:
                text = body.decode()
            except UnicodeDecodeError:
                return
            if (stream_reports_error(text) if ctype.split(";", 1)[0].strip().lower() == "text/event-stream"
                    else _json_reports_error(text)):
                return
            q, tenant, meta, refused = key
            ttl = cache.freshness.within(answer_lifetime(up.headers, now, asked), ttl_s)
            # its age as it came (`initial_age`, as `answer_lifetime` reads it): a hit adds its time in the cache
            # to it (`lookup`); a whole number of seconds, so that `stored_age` reads it back
            answer = {"body": text, "content_type": ctype, "age": int(initial_age(up.headers, now, asked))}
            try:
                await workers.run(store, q, answer, meta, tenant, ttl, refused)
            except Exception as e:   # noqa: BLE001 (the upstream's answer is the client's, stored or not)
                own.store_failures.inc()
                log.warning("the upstream's answer was relayed but not stored: %s: %s", type(e).__name__, e)

        async def relay(head: list[bytes]):
            """The answer as it arrives, after `head` (what was read of it already), stored at its end if it
            came whole within max_answer_bytes: at most that much of it is held."""
            n = sum(map(len, head))
            buf = list(head) if n <= max_answer_bytes else []
            try:
                for chunk in head:
                    yield chunk
                async for chunk in chunks:
                    n += len(chunk)
                    if n <= max_answer_bytes:
                        buf.append(chunk)
                    yield chunk
            finally:
                await up.aclose()
            if n <= max_answer_bytes:
                await keep(b"".join(buf))

        if stream and up.status_code == 200:
            return await streamed([], media_type=ctype)
        # read whole (to store it, and to answer with its length) up to max_answer_bytes; a longer answer is
        # never stored: relayed as it arrives, so that it is never held whole
        head, n = [], 0
        declared = up.headers.get("content-length", "")
        if not (_is_digits(declared) and int(declared) > max_answer_bytes):
            try:
                async for chunk in chunks:
                    head.append(chunk)
                    n += len(chunk)
                    if n > max_answer_bytes:
                        break
            except httpx.HTTPError as e:   # the upstream failed after its headers: a 502 too, not a 500
                await up.aclose()
                return err(502, f"upstream failed while sending its answer: {type(e).__name__}")
            if n <= max_answer_bytes:   # all of it
                await up.aclose()
                body = b"".join(head)
                await keep(body)
                return Response(body, status_code=up.status_code, headers=out_headers)
        return await streamed(head)   # over max_answer_bytes: by its Content-Length (nothing read yet) or as read

    app.add_middleware(_ServerFaults)   # an unforeseen error: a JSON 500, and the connection kept
    post = _ServerFaults(post)

    async def route(scope, receive, send):
        # every POST, whatever its path, is the proxy's, answered without FastAPI's routing, request and response
        # machinery (with the thread handoffs, most of the proxy's own time on a hit; docs/cache.md); the rest
        # (GET /healthz, the docs, another method's 405, the lifespan) is FastAPI's
        if scope["type"] == "http" and scope["method"] == "POST":
            return await post(scope, receive, send)
        return await app(scope, receive, send)

    wrapped = _BodyLimit(route, max_body_bytes)
    wrapped.state = app.state  # type: ignore[attr-defined]
    return wrapped


def build(cfg):
    from ushash.serving.service import cache_from_cfg, check_binding, tokens_of

    token = os.environ.get(TOKEN_ENV) or (str(cfg.token) if cfg.get("token") else None)
    tokens = tokens_of(cfg)
    host = str(cfg.host)
    check_binding(host, token, tokens)
    tokens = tokens or {}
    if any(not isinstance(v, str) for v in tokens.values()):
        raise SystemExit("tokens must map each bearer token to one tenant name, e.g. tokens={<token>:acme}")
    tokens = {str(k): v for k, v in tokens.items()}
    check_limits({k: cfg.get(k) for k in ("max_body_bytes", "max_json_values", "max_answer_bytes")}, SystemExit)
    cache = cache_from_cfg(cfg)
    app = create_proxy_app(cache, str(cfg.upstream), token=token, tokens=tokens, text_path=cfg.get("text_path"),
                           image_path=cfg.get("image_path"), max_body_bytes=int(cfg.max_body_bytes),
                           max_json_values=int(cfg.max_json_values),
                           max_answer_bytes=int(cfg.max_answer_bytes), timeout_s=float(cfg.upstream_timeout_s),
                           ttl_s=cfg.get("ttl_s"), key_headers=tuple(cfg.get("key_headers") or ()))
    return app, host, int(cfg.port), cache


def run_proxy(cfg) -> None:
    import uvicorn

    app, host, port, cache = build(cfg)
    log.info("proxy http://%s:%d -> %s, revision %s", host, port, cfg.upstream, cache.revision)
    uvicorn.run(app, host=host, port=port, log_level=str(cfg.log_level), access_log=False,
                http=connection.PROTOCOL, **connection.SERVER_OPTIONS)


__all__ = ["Extracted", "ProxyConfig", "answer_storable", "build", "create_proxy_app", "extract_request", "run_proxy"]
