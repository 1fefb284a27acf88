"""The check / store interface RedisVL's SemanticCache users know, on a `SemanticCache` (a mixin of it).

    key = cache.store("A frog.", "a tree frog", metadata={"user": "ann"})       # -> entry id, or None
    hits = cache.check("a frog", num_results=3, filters={"user": "ann"})         # -> list of dicts, best first
    hits = cache.check("cat.png", modality="image")                              # images and sounds: a path too
    cache.store_batch(["a cat", "a dog"], ["cat", "dog"]); cache.check_batch(["a cat", "a dog"])
    await cache.acheck("a frog"); await cache.astore(...); acheck_batch / astore_batch
    cache.drop(hits[0])                                                          # -> 1: that entry removed

A stored response is kept in an envelope, `{"response", "metadata", "prompt", "entry_id", "inserted_at"}`
(JSON, like every value), so `check` can filter on metadata and hand back what RedisVL hands back:
`entry_id`, `prompt` (the caption; None for media), `response`, `metadata`, `vector_distance` (1 - the
payload cosine, RedisVL's cosine distance), `hamming_distance`, `cosine`, `entry_modality`, `tier`,
`inserted_at`, `key` (the tier's reference to the entry: `Hit.entry`). `drop` (RedisVL's) takes such a
result, or a `Hit`, and removes that entry (`SemanticCache.drop`). Metadata is JSON (`check_json`: anything
else is refused, not changed). `filters`: {field: value} (or {field: [values]}) matched exactly against the
metadata as JSON (`json_equal`), or a callable(metadata) -> bool. With filters, every servable candidate
within the radius (at most `max_candidates`) is read and filtered before the best `num_results` are kept.
`get` on an entry stored here returns the envelope. The same request stored again replaces its entry only
under the same metadata (`metadata_scope`): under other metadata it is another entry, so `filters` find each.

The async twins run the call in a worker thread (`asyncio.to_thread`): encoding is CPU work that must not
block an event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from ushash.serving.cache.entries import Hit, check_json, encode_value
from ushash.serving.cache.request import Query, RequestError

#: Files larger than this are not read as a request's image or sound.
MAX_MEDIA_FILE_BYTES = 64 << 20

#: The envelope's fields in the order it is stored in (`served_entry` reads its stored bytes back in it)
ENVELOPE_ORDER = ("response", "metadata", "prompt", "entry_id", "inserted_at")
ENVELOPE_KEYS = frozenset(ENVELOPE_ORDER)


def read_media_file(modality: str, path) -> bytes:
    """The bytes of an image or sound given as a file path; RequestError when it cannot be read."""
    p = Path(os.fspath(path))
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise RequestError(f"{modality} path {str(p)!r} is not a file")
        if size > MAX_MEDIA_FILE_BYTES:
            raise RequestError(f"{modality} file {str(p)!r} is {size} bytes, over {MAX_MEDIA_FILE_BYTES}")
        return p.read_bytes()
    except OSError as e:
        raise RequestError(f"cannot read {modality} file {str(p)!r}: {e.strerror or e}") from None


def is_envelope(value) -> bool:
    return isinstance(value, dict) and set(value) == ENVELOPE_KEYS


def metadata_scope(metadata: Mapping) -> bytes:
    """The entry scope (`Entry.scope`) of a response stored with `metadata`: 16 bytes of sha256 over its
    canonical JSON (b"" for none). Storing the same request again replaces its entry only in the same
    scope, so answers stored under other metadata (another model, user or setting) stay side by side for
    `filters` to choose from."""
    if not metadata:
        return b""
    text = json.dumps(_one_number(metadata), sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=repr)
    return hashlib.sha256(text.encode()).digest()[:16]


def _one_number(value):
    """`value` with each integral float an int (1.0, 1e2, -0.0 as 1, 100, 0): metadata equal as JSON
    (`json_equal`, what `filters` compare by) is one scope, so storing {"v": 1} replaces what {"v": 1.0} stored."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_one_number(v) for v in value]
    if isinstance(value, dict):
        return {k: _one_number(v) for k, v in value.items()}
    return value


def json_equal(a, b) -> bool:
    """Whether two JSON values are equal as JSON: a bool is not a number; numbers compare by value (1 equals
    1.0: JSON has one number type); strings, null, lists (in order) and objects (by key) exactly. Never
    raises, whatever the values."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(v, b[k]) for k, v in a.items())
    return (a is None and b is None) or (isinstance(a, str) and isinstance(b, str) and a == b)


def _matcher(filters) -> Callable[[dict], bool] | None:
    """A predicate on an entry's metadata: every field of `filters` present and equal (`json_equal`) to its
    value, or to one of its values when that is a list (a tuple or set too). To match a list-valued field,
    give it as the one value of a list: {"tags": [["a", "b"]]}."""
    if filters is None:
        return None
    if callable(filters):
        return filters
    if not isinstance(filters, Mapping):
        raise TypeError(f"filters must be a mapping {{field: value or [values]}} or a callable; got {type(filters).__name__}")
    want = {k: list(v) if isinstance(v, (list, tuple, set, frozenset)) else [v] for k, v in filters.items()}
    for k, vs in want.items():
        check_json({k: vs}, "filters")

    def match(meta: dict) -> bool:
        return all(k in meta and any(json_equal(meta[k], v) for v in vs) for k, vs in want.items())

    return match


class CheckStore:
    """check / store (RedisVL-style), their batch variants and async twins, for `SemanticCache`."""

    # ------------------------------------------------------------------ store
    def store_response(self, q: Query, response, *, prompt: str | None = None, metadata: dict | None = None,
                       tenant: str = "default", ttl: float | None = None) -> str | None:
        """Store `response` (bytes, str or JSON) with `metadata` for an encoded request; returns the entry
        id, or None when the cache did not keep it."""
        if metadata is not None and not isinstance(metadata, Mapping):
            raise TypeError(f"metadata must be a mapping; got {type(metadata).__name__}")
        check_json(dict(metadata or {}), "metadata")
        if isinstance(response, (bytes, bytearray, memoryview)):
            raise TypeError("check/store responses are JSON values (str, numbers, lists, dicts); put() stores bytes")
        key = uuid.uuid4().hex
        env = dict(zip(ENVELOPE_ORDER, (response, dict(metadata or {}), prompt, key, float(self.clock()))))
        return key if self.store_query(q, env, tenant, ttl_s=ttl, scope=metadata_scope(env["metadata"])) else None

    def _store_one(self, input, response, modality, features, metadata, tenant, ttl):
        tenant = self.check_tenant(tenant)
        q = self.query(modality, input, features)
        return self.store_response(q, response, prompt=input if modality == "text" and isinstance(input, str) else None,
                                   metadata=metadata, tenant=tenant, ttl=ttl)

    def store_api(self, input=None, response=None, modality: str = "text", *, features=None,
                  metadata: dict | None = None, tenant: str = "default", ttl: float | None = None) -> str | None:
        return self._store_one(input, response, modality, features, metadata, tenant, ttl)

    # ------------------------------------------------------------------ check
    def check(self, input=None, modality: str = "text", *, features=None, num_results: int = 1, filters=None,
              tenant: str = "default") -> list[dict]:
        """The best `num_results` cached responses for this request (an empty list on a miss)."""
        tenant = self.check_tenant(tenant)
        return self.check_query(self.query(modality, input, features), num_results=num_results, filters=filters,
                                tenant=tenant)

    def check_query(self, q: Query, *, num_results: int = 1, filters=None, tenant: str = "default") -> list[dict]:
        n = int(num_results)
        if n < 1:
            raise ValueError(f"num_results must be >= 1; got {num_results}")
        match = _matcher(filters)
        k = max(n, int(self.config.max_candidates)) if match is not None else n
        accept = None if match is None else (lambda v: match(v["metadata"] if is_envelope(v) else {}))
        out = []
        for h in self.lookup_top(q, tenant, k, accept=accept):   # the tiers asked until one has a match
            env = h.value if is_envelope(h.value) else {"response": h.value, "metadata": {}, "prompt": None,
                                                         "entry_id": h.entry, "inserted_at": h.created}
            out.append({**env, "vector_distance": None if h.cosine is None else 1.0 - h.cosine,
                        "hamming_distance": h.distance, "cosine": h.cosine, "entry_modality": h.modality,
                        "tier": h.tier, "key": h.entry})
            if len(out) == n:
                break
        return out

    # ------------------------------------------------------------------ batches
    def _queries(self, inputs, modality: str, features) -> list[Query]:
        if features is not None:
            f = np.asarray(features)
            if f.ndim != 2:
                raise RequestError(f"batch features must be a matrix [N, in_dim]; got shape {f.shape}")
            return [self.query(modality, features=row) for row in f]
        return [self.query(modality, x) for x in inputs]

    def check_batch(self, inputs: Sequence | None = None, modality: str = "text", *, features=None,
                    num_results: int = 1, filters=None, tenant: str = "default") -> list[list[dict]]:
        tenant = self.check_tenant(tenant)
        return [self.check_query(q, num_results=num_results, filters=filters, tenant=tenant)
                for q in self._queries(inputs, modality, features)]

    def store_batch(self, inputs: Sequence | None, responses: Sequence, modality: str = "text", *, features=None,
                    metadata: Sequence[dict] | dict | None = None, tenant: str = "default",
                    ttl: float | None = None) -> list[str | None]:
        tenant = self.check_tenant(tenant)
        qs = self._queries(inputs, modality, features)
        if len(responses) != len(qs):
            raise ValueError(f"{len(qs)} inputs but {len(responses)} responses")
        metas = metadata if isinstance(metadata, (list, tuple)) else [metadata] * len(qs)
        if len(metas) != len(qs):
            raise ValueError(f"{len(qs)} inputs but {len(metas)} metadata records")
        prompts = list(inputs) if inputs is not None and modality == "text" else [None] * len(qs)
        return [self.store_response(q, r, prompt=p if isinstance(p, str) else None, metadata=m, tenant=tenant, ttl=ttl)
                for q, r, p, m in zip(qs, responses, prompts, metas)]

    # ------------------------------------------------------------------ async twins
    async def acheck(self, *args, **kwargs) -> list[dict]:
        return await asyncio.to_thread(self.check, *args, **kwargs)

    async def astore(self, *args, **kwargs) -> str | None:
        return await asyncio.to_thread(self.store_api, *args, **kwargs)

    async def acheck_batch(self, *args, **kwargs) -> list[list[dict]]:
        return await asyncio.to_thread(self.check_batch, *args, **kwargs)

    async def astore_batch(self, *args, **kwargs) -> list[str | None]:
        return await asyncio.to_thread(self.store_batch, *args, **kwargs)

    async def adrop(self, *args, **kwargs) -> int:
        return await asyncio.to_thread(self.drop, *args, **kwargs)


def served_entry(hit) -> tuple[str, str, bytes, float | None, str | None]:
    """What identifies the entry a lookup served, for `drop`: (the tier's reference, the value's kind and stored
    bytes, when it was created and its revision, each None where not known), from a `Hit` or a `check` result
    (its `key`; its envelope, whose entry_id is the entry's own; a value stored without one, by `put`, is
    handed back in one made up with `entry_id` = `key` and `inserted_at` = when it was created)."""
    if isinstance(hit, Hit):
        return (hit.entry, *encode_value(hit.value), hit.created, hit.revision)
    if isinstance(hit, Mapping) and isinstance(hit.get("key"), str):
        if hit.get("entry_id") == hit["key"]:
            return (hit["key"], *encode_value(hit["response"]), hit["inserted_at"], None)
        return (hit["key"], *encode_value({k: hit[k] for k in ENVELOPE_ORDER}), None, None)
    raise TypeError(f"drop() takes what a lookup served: a Hit, or a result of check(); got {type(hit).__name__}")


__all__ = ["CheckStore", "MAX_MEDIA_FILE_BYTES", "is_envelope", "read_media_file", "served_entry"]
