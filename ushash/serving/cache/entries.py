"""The one cache entry record, what a lookup hands back, and the L1's columnar storage of entries.

    Entry        an entry as every tier stores it: code, payload, modality, value (+ its kind), revision,
                 created, expires, compute seconds, and its shared id (the L2's; None for L1-only entries)
    Candidates   a tier's search result: the candidates within the radius, nearest first, as parallel
                 lists (what the hit check reads), plus the nearest distance seen
    Found        what a tier's `find` returns: the entry to serve (or none) and what the lookup learnt
    Hit          the served view of an Entry: value, distance, cosine, tier, refresh, entry id
    EntryTable   L1 entries as columns indexed by slot (numpy arrays for fixed-size fields, lists for bytes)

The Redis hash of an L2 entry (ushash.serving.cache.redis_store) and the L1 columns are both derived from
`Entry`'s fields. Tenant names (`TENANT_PATTERN`) and stored values (`encode_value` / `decode_value`) are
defined here once for the cache, the L2 and the HTTP service.

A slot is an entry's id inside one cache; freed slots are reused. Columnar storage keeps the per-entry
overhead of a million entries small (see benchmarks/cache_lookup.py for the measured bytes per entry).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from orjson import JSONDecodeError
from orjson import loads as _orjson_loads

from ushash.serving.cache import heap

#: Tenant names: 1-64 characters of [A-Za-z0-9_.-] (a Redis hash tag and a metric label, never a path).
TENANT_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"
TENANT_RE = re.compile(TENANT_PATTERN)
#: orjson reads an integer outside [-2**63, 2**64) as a float (json.loads as an int): a float at least this large
_LARGE = float(2 ** 63)
#: The values `_reads_large_float` looks at before it leaves the question to a scan of the bytes
_WALK = 256
#: Each byte as its class for `_long_integer_literal`: a digit as b"0", what continues a number as a float (. e E)
#: as b".", anything else as b" "
_NUMBER_CLASSES = bytes(0x30 if 0x30 <= b <= 0x39 else 0x2E if b in b".eE" else 0x20 for b in range(256))
_RUN_START = b" " + b"0" * 19
_ZEROS = re.compile(rb"0*")


def valid_tenant(tenant) -> bool:
    return isinstance(tenant, str) and TENANT_RE.fullmatch(tenant) is not None  # fullmatch: "$" allows a final "\n"


# ---------------------------------------------------------------------------------------------- values
def check_json(value, what: str = "the value") -> None:
    """Refuse (ValueError naming the place and the fix) what JSON would not give back as it was: a key that is
    not a string, a tuple, a float that is not finite or any other type would come back changed ({7: "a"} as
    {"7": "a"}, a tuple as a list), or not at all. JSON is str, int, float, bool, None, list and dict."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{what} key {k!r} is not a string: it is stored as JSON, whose keys are strings; "
                                 f"use {str(k)!r}")
            check_json(v, f"{what}[{k!r}]")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_json(v, f"{what}[{i}]")
    elif isinstance(value, tuple):
        raise ValueError(f"{what} is a tuple: it is stored as JSON, which has no tuples; pass a list")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what} is {value}: JSON has no NaN or infinity; store it as a string or None")
    elif not isinstance(value, (str, int, float, bool, type(None))):
        raise ValueError(f"{what} is a {type(value).__name__}, not a JSON value (str, int, float, bool, None, "
                         f"list or dict); convert it to one")


def encode_value(value) -> tuple[str, bytes]:
    """Values are stored as bytes: bytes as they are, str as UTF-8, anything else as JSON (no pickle:
    an L2 shared with other processes must never be able to run code in this one), and only what JSON gives
    back as it was (`check_json`): a hit never hands back a changed value."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "b", bytes(value)
    try:
        if isinstance(value, str):
            return "s", value.encode("utf-8")
        check_json(value)
        return "j", json.dumps(value, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: no UTF-8 for it, and no reader could use it
        raise TypeError(f"cache values must be valid Unicode text; this one holds a lone surrogate at {e.start}") from e
    except (TypeError, ValueError, RecursionError) as e:
        raise TypeError(f"cache values must be bytes, str or JSON-serialisable; got {type(value).__name__} ({e})") from e


def decode_value(kind: str, data: bytes):
    if kind == "b":
        return bytes(data)
    if kind == "s":
        return bytes(data).decode("utf-8")
    if kind == "j":
        return loads_json(data)
    raise ValueError(f"unknown stored value kind {kind!r}")


def loads_json(raw) -> Any:
    """JSON bytes (or a buffer of them) as json.loads reads them, at orjson's speed where it reads them the
    same. What orjson refuses (NaN, lone surrogates) goes to json.loads, whose error (ValueError, or
    RecursionError when nested past the interpreter's limit) a body neither reads raises; so does a body in
    which orjson may have read an integer as a float (2**64 and beyond): one whose reading holds a float of
    2**63 or more, or, past `_WALK` values, whose bytes hold what may be an integer literal of 19 digits. A
    chat body's base64 image is one value to look at, not megabytes to scan."""
    data = raw if isinstance(raw, (bytes, bytearray)) else bytes(raw)
    try:
        out = _orjson_loads(data)
    except JSONDecodeError:
        return json.loads(data)
    large = _reads_large_float(out)
    if large is None:
        large = _long_integer_literal(data)
    return json.loads(data) if large else out


def _long_integer_literal(data: bytes) -> bool:
    """Whether `data` holds what may be an integer literal of 19 digits or more: a run of that many digits
    after neither a digit nor a point (not a fraction's digits, as in 0.0000123...) and before neither a point
    nor an exponent (not a float's integer part). Digits in a string may match too (json.loads then reads the
    body, the same either way). Found by a substring search over the bytes' classes, at C speed however
    many values the body holds."""
    t = b" " + data.translate(_NUMBER_CLASSES)
    i = t.find(_RUN_START)
    while i >= 0:
        end = _ZEROS.match(t, i + 1).end()
        if end == len(t) or t[end] != 0x2E:
            return True
        i = t.find(_RUN_START, end)
    return False


def _reads_large_float(obj) -> bool | None:
    """Whether `obj` (orjson's reading) holds a float of magnitude 2**63 or more, or one that is not finite
    (from an integer literal orjson made a float, or a float literal that large, which json.loads reads
    alike); None when it holds more than `_WALK` values (a vector of features: the bytes are scanned instead)."""
    if type(obj) is float:
        return not -_LARGE < obj < _LARGE
    if type(obj) is not dict and type(obj) is not list:
        return False
    stack, seen = [obj], 0
    while stack:
        x = stack.pop()
        for y in (x.values() if type(x) is dict else x):
            seen += 1
            if seen > _WALK:
                return None
            t = type(y)
            if t is float:
                if not -_LARGE < y < _LARGE:
                    return True
            elif t is dict or t is list:
                stack.append(y)
    return False


# ---------------------------------------------------------------------------------------------- records
@dataclass
class Entry:
    """One cache entry, the same in every tier."""
    code: bytes             # packed code, bits / 8 bytes
    payload: bytes          # the payload record of the request's z (b"": none)
    modality: str
    value: bytes            # the value as stored (encode_value)
    kind: str               # its encoding tag: "b" bytes, "s" str, "j" JSON
    revision: str           # the head revision that made code and payload
    created: float
    expires: float          # math.inf: no TTL
    compute_s: float        # how long the value took to compute (XFetch)
    id: str | None = None   # the shared (L2) id; None for an entry that lives in L1 only
    scope: bytes = b""      # what else its answer depends on (check/store: a digest of its metadata): the
                            # same request stored in another scope is another entry, not a replacement

    @property
    def nbytes(self) -> int:
        """What the entry costs against a byte capacity: code + payload + value (+ scope)."""
        return len(self.code) + len(self.payload) + len(self.value) + len(self.scope)


ENTRY_FIELDS = tuple(f.name for f in dataclasses.fields(Entry))


def shared_id(e: "Entry") -> str:
    """An entry's L2 id: a digest of what the L1 replaces an entry by (modality, code, payload, scope) and of
    its revision, so the same request stored again overwrites its shared entry as it replaces the L1's."""
    h = hashlib.blake2b(digest_size=8)
    for part in (e.revision.encode(), e.modality.encode(), e.code, e.payload, e.scope):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


@dataclass
class Candidates:
    """A tier's entries within the radius of a request, nearest first (at most max_candidates), as
    parallel lists; `nearest` is the nearest distance the tier saw, within its observe radius."""
    ids: list = field(default_factory=list)          # the tier's handle of each candidate (L1 slot, L2 id)
    dists: list = field(default_factory=list)
    modalities: list = field(default_factory=list)
    payloads: list = field(default_factory=list)
    revisions: list = field(default_factory=list)
    expires: list = field(default_factory=list)
    nearest: int | None = None

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class Found:
    """What a tier's `find` returns: the entry served (None: a miss in this tier), its distance, the
    payload cosine, the tier's own reference to it, the nearest distance seen, and whether the next tier
    can be skipped (the Bloom guard with bloom_guard_l2)."""
    entry: Entry | None = None
    distance: int = -1
    cosine: float | None = None
    ref: str = ""
    nearest: int | None = None
    skip_next: bool = False
    more: tuple = ()        # find(..., k > 1): the next servable entries, best first, as (Entry, distance, cosine, ref)


MISS = Found()
_FOUND_FIELDS = ("entry", "distance", "cosine", "ref", "nearest", "skip_next", "more")
assert tuple(f.name for f in dataclasses.fields(Found)) == _FOUND_FIELDS


def found(entry: Entry | None, distance: int, cosine: float | None, ref: str, nearest: int | None) -> Found:
    """Found(entry, distance, cosine, ref, nearest), made without the frozen dataclass's object.__setattr__
    per field (~4x cheaper: one per hit of a lookup); equal to the constructor's in every field."""
    f = object.__new__(Found)
    f.__dict__.update(entry=entry, distance=distance, cosine=cosine, ref=ref, nearest=nearest, skip_next=False,
                      more=())
    return f


class Tier(Protocol):
    """A cache tier: L1 (ushash.serving.cache.l1.L1Tier) or Redis (ushash.serving.cache.redis_store.RedisStore)."""
    name: str           # "l1" | "l2": the Hit's tier and the metrics label

    def find(self, q, tenant: str, revision: str, check, now: float, k: int = 1) -> Found:
        """The entry to serve for Query q: the tier's candidates within its radius, by `check` (HitCheck);
        with k > 1 also the next k - 1 servable ones (`Found.more`)."""

    def put(self, tenant: str, e: Entry) -> bool:
        """Store e; False when not stored (refused, or the tier is unavailable). Never raises for that."""


@dataclass
class Hit:
    value: Any
    distance: int           # Hamming distance between the request's code and the entry's
    cosine: float | None    # request z vs the entry's decoded payload (None: check off)
    tier: str               # "l1" or "l2"
    modality: str           # the entry's modality (a text request can hit an image entry)
    revision: str
    created: float
    expires: float
    refresh: bool = False   # XFetch: the caller should recompute early (get_or_compute does)
    entry: str = ""         # entry id ("l1:<slot>" or the L2 id)

    @classmethod
    def of(cls, e: Entry, distance: int, cosine: float | None, tier: str, refresh: bool, ref: str) -> "Hit":
        return _hit(decode_value(e.kind, e.value), int(distance), cosine, tier, e.modality, e.revision, e.created,
                    e.expires, refresh, ref)


_HIT_FIELDS = ("value", "distance", "cosine", "tier", "modality", "revision", "created", "expires", "refresh", "entry")
assert tuple(f.name for f in dataclasses.fields(Hit)) == _HIT_FIELDS


def _hit(value, distance, cosine, tier, modality, revision, created, expires, refresh, entry) -> Hit:
    """Hit(...) without the dataclass __init__'s call overhead (one per hit of every lookup); equal to the
    constructor's in every field."""
    h = object.__new__(Hit)
    h.__dict__ = {"value": value, "distance": distance, "cosine": cosine, "tier": tier, "modality": modality,
                  "revision": revision, "created": created, "expires": expires, "refresh": refresh, "entry": entry}
    return h


# ---------------------------------------------------------------------------------------------- L1 columns
VALUE_KINDS = ("b", "s", "j")   # encode_value's tags, stored as their index
COMPUTE_S_MAX = float(np.finfo(np.float16).max)   # the compute seconds column's largest value


class EntryTable:
    """L1 entries as columns indexed by slot: `code` uint8 [capacity, code_bytes], `payload` uint8
    [capacity, payload_bytes] (fixed-width rows; `plen` says how many bytes a row holds, 0: none), one
    numpy column per fixed-size field of `Entry` (modality and kind as small interned ids) and per
    bookkeeping field, the values in one byte arena (`voff`, `vlen`), and the L2 ids in a dict (only
    entries shared with an L2 have one). Every entry of a table is of one revision (an L1 serves one
    head: a new revision is a new tier), so the revision has no column. Columns are as narrow as their
    values allow: `plen` as its rows' width needs; tenant and modality ids and value lengths start at one
    or two bytes and the column is widened (`WIDEN`) before a value it cannot hold is written. The compute
    seconds, which only weigh XFetch's early refresh, are held as float16 (three significant digits; a
    compute beyond float16's range, ~18 hours, is held as 65,504 s).

    The arena is append-only; a removed value's bytes are garbage until the arena is compacted, which
    happens when garbage outweighs the live bytes (amortised O(1) per removal)."""

    # a value is < 4 GiB (checked in write); voff is uint32 until the arena holds VOFF_LIMIT bytes, then
    # int64 (`_arena_put` widens it)
    NUMERIC = {"tenant": np.uint8, "modality": np.int8, "kind": np.int8,
               "created": np.float64, "expires": np.float64, "compute_s": np.float16,
               "alive": np.bool_, "plen": np.uint8, "voff": np.uint32, "vlen": np.uint8}
    #: the dtypes a column is widened through, narrowest first (its NUMERIC dtype is the first)
    WIDEN = {"tenant": (np.uint8, np.uint16, np.uint32, np.int64), "modality": (np.int8, np.int16, np.int32),
             "vlen": (np.uint8, np.uint16, np.uint32)}
    VOFF_LIMIT = 1 << 32
    # every Entry field has a column of the same name (id: l2id, and scope: scope, dicts holding only the
    # entries that have one; value: the arena; revision: one per table)
    assert set(ENTRY_FIELDS) - {"id", "revision", "scope"} <= {"code", "payload", "value", *NUMERIC}

    def __init__(self, code_bytes: int, payload_bytes: int = 0, capacity: int = 16):
        self.code_bytes, self.payload_bytes = int(code_bytes), int(payload_bytes)
        self._cap = max(16, int(capacity))
        self.code = np.zeros((self._cap, self.code_bytes), np.uint8)
        self.payload = np.zeros((self._cap, self.payload_bytes), np.uint8)
        for name, dt in self.NUMERIC.items():
            setattr(self, name, np.zeros(self._cap, dt))
        # a row's payload length: as wide as the rows need
        self.plen = np.zeros(self._cap, next(dt for dt in (np.uint8, np.uint16, np.uint32)
                                             if self.payload_bytes <= np.iinfo(dt).max))
        self._max = {name: int(np.iinfo(self.NUMERIC[name]).max) for name in self.WIDEN}
        self._words = self._words_of = None       # code_words' view, and the column it is of
        self.l2id: dict[int, str] = {}
        self.slots_of_l2id: dict[str, set[int]] = {}   # the reverse of l2id: an L2 entry's copies (one per tenant)
        self.scope: dict[int, bytes] = {}
        self.arena = np.zeros(256, np.uint8)
        self._top = 0            # arena bytes used (live + garbage)
        self._live_bytes = 0     # arena bytes of live values
        self._free: list[int] = []
        self._hwm = 0
        self.live = 0

    def _grow(self) -> None:
        cap = self._cap * 2
        freed = 0
        for name in ("code", "payload", *self.NUMERIC):
            old = getattr(self, name)
            a = heap.zeros((cap,) + old.shape[1:], old.dtype)   # the rows beyond the held ones cost nothing
            a[: self._cap] = old
            setattr(self, name, a)
            freed += old.nbytes
        self._cap = cap
        heap.replaced(freed)

    def code_words(self) -> np.ndarray:
        """The code column as uint64 [capacity, code_bytes / 8] (a view; code_bytes a multiple of 8, read
        as little-endian words): the own index's codes by slot (mindex.MultiIndex's `codes`)."""
        if self._words_of is not self.code:   # made again after the column grows
            self._words, self._words_of = self.code.view("<u8"), self.code
        return self._words

    def _widen(self, name: str, value: int) -> None:
        """Widen column `name` to the narrowest of its WIDEN dtypes that holds `value` (ids and lengths
        are >= 0: a negative one is refused)."""
        if value < 0:
            raise ValueError(f"{name} must be >= 0; got {value}")
        for dt in self.WIDEN[name]:
            if value <= np.iinfo(dt).max:
                break
        else:
            raise ValueError(f"{name} {value} is beyond the widest {name} column ({np.dtype(dt).name})")
        setattr(self, name, getattr(self, name).astype(dt))
        self._max[name] = int(np.iinfo(dt).max)

    def alloc(self) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            if self._hwm == self._cap:
                self._grow()
            slot = self._hwm
            self._hwm += 1
        self.alive[slot] = True
        self.live += 1
        return slot

    def _arena_put(self, slot: int, data: bytes) -> None:
        n = len(data)
        if n >= 1 << 32:
            raise ValueError(f"a cached value must be under 4 GiB; got {n} bytes")
        if self._top + n > len(self.arena):
            if self._top - self._live_bytes > self._live_bytes:
                self._compact()
            if self._top + n > len(self.arena):
                a = heap.zeros(max(2 * len(self.arena), self._top + n), np.uint8)
                a[: self._top] = self.arena[: self._top]
                freed, self.arena = len(self.arena), a
                heap.replaced(freed)
        if self._top + n > self.VOFF_LIMIT and self.voff.dtype != np.int64:
            self.voff = self.voff.astype(np.int64)   # offsets beyond uint32
        if n > self._max["vlen"]:
            self._widen("vlen", n)
        self.arena[self._top : self._top + n] = np.frombuffer(data, np.uint8)
        self.voff[slot], self.vlen[slot] = self._top, n
        self._top += n
        self._live_bytes += n

    def _compact(self) -> None:
        """Move the live values to the front of the arena, in slot order."""
        live = self.live_slots()
        lens = self.vlen[live]
        new_off = np.zeros(len(live), np.int64)
        if len(live):
            np.cumsum(lens[:-1], out=new_off[1:])
        total = int(lens.sum())
        src = np.repeat(self.voff[live] - new_off, lens) + np.arange(total)
        self.arena[:total] = self.arena[src]
        self.voff[live] = new_off
        self._top = self._live_bytes = total

    def write(self, slot: int, e: Entry, tenant: int, modality: int) -> None:
        """Store entry `e` in `slot` (tenant and modality as the L1's interned ids; the table's one revision
        is the L1's, so an entry's is not stored)."""
        np_ = len(e.payload)
        if np_ > self.payload_bytes:
            raise ValueError(f"payload record of {np_} bytes; this table's rows hold {self.payload_bytes}")
        if tenant > self._max["tenant"] or tenant < 0:
            self._widen("tenant", tenant)
        if modality > self._max["modality"] or modality < 0:
            self._widen("modality", modality)
        self.code[slot] = np.frombuffer(e.code, np.uint8)
        if np_:
            self.payload[slot, :np_] = np.frombuffer(e.payload, np.uint8)
        self.plen[slot] = np_
        self.tenant[slot], self.modality[slot] = tenant, modality
        self.kind[slot] = VALUE_KINDS.index(e.kind)
        self.created[slot], self.expires[slot] = e.created, e.expires
        self.compute_s[slot] = min(e.compute_s, COMPUTE_S_MAX)
        self._unlink_l2id(slot)
        if e.id is not None:
            self.l2id[slot] = e.id
            self.slots_of_l2id.setdefault(e.id, set()).add(slot)
        if e.scope:
            self.scope[slot] = e.scope
        self._arena_put(slot, e.value)

    def payload_of(self, slot: int) -> bytes:
        return self.payload[slot, : self.plen[slot]].tobytes()

    def value_of(self, slot: int) -> bytes:
        o = int(self.voff[slot])
        return self.arena[o : o + int(self.vlen[slot])].tobytes()

    def decoded_value(self, slot: int):
        """The value in `slot` as it was stored (decode_value)."""
        return decode_value(VALUE_KINDS[self.kind[slot]], self.value_of(slot))

    def read(self, slot: int, modalities: list[str], revision: str) -> Entry:
        """The entry in `slot` (modalities: the L1's interned names; revision: the L1's, every entry's)."""
        return Entry(code=self.code[slot].tobytes(), payload=self.payload_of(slot), modality=modalities[self.modality[slot]],
                     value=self.value_of(slot), kind=VALUE_KINDS[self.kind[slot]], revision=revision,
                     created=float(self.created[slot]), expires=float(self.expires[slot]),
                     compute_s=float(self.compute_s[slot]), id=self.l2id.get(slot), scope=self.scope.get(slot, b""))

    def read_many(self, slots: list[int], modalities: list[str], revision: str) -> list[Entry]:
        """`read` of each slot, the columns gathered once for all (the same Entries, field for field)."""
        if len(slots) == 1:
            return [self.read(slots[0], modalities, revision)]
        ix = np.asarray(slots, np.int64)
        cb, pw = self.code_bytes, self.payload_bytes
        codes, pays = self.code[ix].tobytes(), self.payload[ix].tobytes()
        plen, voff, vlen = self.plen[ix].tolist(), self.voff[ix].tolist(), self.vlen[ix].tolist()
        mod, kind = self.modality[ix].tolist(), self.kind[ix].tolist()
        created, expires, cs = self.created[ix].tolist(), self.expires[ix].tolist(), self.compute_s[ix].tolist()
        arena, l2id, scope = self.arena, self.l2id, self.scope
        return [Entry(code=codes[i * cb:(i + 1) * cb], payload=pays[i * pw:i * pw + plen[i]],
                      modality=modalities[mod[i]], value=arena[voff[i]:voff[i] + vlen[i]].tobytes(),
                      kind=VALUE_KINDS[kind[i]], revision=revision, created=created[i], expires=expires[i],
                      compute_s=cs[i], id=l2id.get(s), scope=scope.get(s, b"")) for i, s in enumerate(slots)]

    def hits(self, slots: list[int], dists: list[int], cosines: list[float], tier: str, modalities: list[str],
             revision: str) -> tuple[list[Hit], list[float]]:
        """The served view (`Hit`, refresh False, entry "<tier>:<slot>") of the entry in each slot, with its
        distance and cosine (NaN: not checked), and the entries' compute seconds (for the caller's XFetch):
        `Hit.of(read(slot), ...)` field for field, without the Entry, the columns gathered once for all."""
        arena = self.arena
        if len(slots) == 1:
            s, c = slots[0], cosines[0]
            o = int(self.voff[s])
            return [_hit(decode_value(VALUE_KINDS[self.kind[s]], arena[o:o + int(self.vlen[s])].tobytes()), dists[0],
                         None if c != c else c, tier, modalities[self.modality[s]], revision,
                         float(self.created[s]), float(self.expires[s]), False, f"{tier}:{s}")], \
                [float(self.compute_s[s])]
        ix = np.array(slots, np.int64)
        voff, vlen, kind = self.voff[ix].tolist(), self.vlen[ix].tolist(), self.kind[ix].tolist()
        mod = self.modality[ix].tolist()
        created, expires = self.created[ix].tolist(), self.expires[ix].tolist()
        return [_hit(decode_value(VALUE_KINDS[k], arena[o:o + n].tobytes()), d, None if c != c else c, tier,
                     modalities[m], revision, cr, ex, False, f"{tier}:{s}")
                for s, d, c, k, o, n, m, cr, ex in zip(slots, dists, cosines, kind, voff, vlen, mod, created, expires)], \
            self.compute_s[ix].tolist()

    def release(self, slot: int) -> None:
        if not self.alive[slot]:
            return
        self.alive[slot] = False
        self._unlink_l2id(slot)
        self.scope.pop(slot, None)
        self._live_bytes -= int(self.vlen[slot])
        self.vlen[slot] = 0
        self._free.append(slot)
        self.live -= 1

    def _unlink_l2id(self, slot: int) -> None:
        eid = self.l2id.pop(slot, None)
        if eid is not None:
            held = self.slots_of_l2id[eid]
            held.discard(slot)
            if not held:
                del self.slots_of_l2id[eid]

    def live_slots(self) -> np.ndarray:
        return np.flatnonzero(self.alive[: self._hwm])

    @property
    def nbytes_held(self) -> int:
        """Bytes of every column and the arena (what the table costs, beside the index and the policy)."""
        return int(sum(getattr(self, n).nbytes for n in ("code", "payload", *self.NUMERIC)) + self.arena.nbytes
                   + sys.getsizeof(self.l2id) + sys.getsizeof(self.slots_of_l2id) + sys.getsizeof(self.scope))
