"""L2: entries shared by several cache replicas in Redis (>= 7.0), with the L1's semantics.

Layout (prefix "ushash"; {t} is the tenant, a Redis Cluster hash tag, so all of a tenant's keys live in
one hash slot and multi-key commands and scripts work on a cluster too; a tenant is the sharding unit):

    ushash:layout                           STR   "chunks=<m>": how codes are split into bucket chunks;
                                                  a replica of another layout is refused at start
    ushash:revisions                        ZSET  revision -> when its export was made (ms); the highest
                                                  score is the watermark (replicas announce what they
                                                  know again when it is lost: freshness.py)
    ushash:{t}:e:<id>                       HASH  c code, p payload, m modality, v value, k value kind,
                                                  r revision, t created, x expires, d compute seconds
                                                  (REDIS_FIELDS);
                                                  PEXPIREAT = expires (Redis drops it by itself)
    ushash:{t}:b:<rev>:<j>:<chunk hex>      SET   "<code hex>:<id>" of the entries of revision <rev>
                                                  (12 hex of its sha1) whose j-th code chunk has this
                                                  value; expires with its longest-lived member
    ushash:changed                          pub/sub channel: "<replica> <tenant> <id>" on every put and on a
                                                  drop that removed an entry ("*" for every entry of a
                                                  tenant deleted): the other replicas drop their L1
                                                  copies of it (`listen`)

Lookup within Hamming radius r, codes split into m chunks: an entry within r has a chunk within
floor(r / m) bits of the request's (pigeonhole), so the union of the probe buckets (m keys while r < m;
one script, which leaves out the largest buckets beyond `max_bucket_read` members) gives a superset of
the answer with the candidates' codes; the client keeps those within r
and fetches them (one pipelined HMGET round trip, only when there are any): every field but the value, which
is read with the nearest candidate only, and for another only once the hit check chooses it (one more round
trip), so a lookup among many candidates does not move every one's answer. Members whose entry has
expired are removed lazily, and the candidates next in line fetched in their place. Puts are one Lua script (the entry hash and its bucket memberships,
atomically, all keys declared, one slot), which announces the entry on the channel in the same call.

L1 copies: a replica copies an entry it served from the L2 into its L1, where it is served until it expires.
A replica that stores the same request again (a refresh: `Cache-Control: no-cache` at the proxy) or drops it
replaces the shared entry; the others hear it on `ushash:changed` (one subscriber thread per store) and drop
their copies. Pub/sub delivers at most once: while a replica's subscription is down (the L2 unreachable, or a
connection that went silent: it pings, and a subscription that hears nothing for `SILENT_S` is taken as down)
it hears nothing, so when it is back the replica drops every L1 copy of an L2 entry it holds. Revisions are part of the bucket key, so codes of different
heads never meet; entries also carry their revision and the cache checks it.

The entry hash holds the fields of `ushash.serving.cache.entries.Entry` under the one-letter names of
`REDIS_FIELDS`; the put script takes them as name/value pairs, and lookups HMGET the same list.

Failures: every call has a socket timeout; errors are counted (cache_l2_errors_total{op}) and the
cache carries on with L1 alone. A circuit breaker (pybreaker's state machine) opens after
`breaker_failures` consecutive failures to reach Redis (an error Redis answers with, as OOM when it is full,
fails that call only): the store then stops trying for `breaker_backoff_s` (doubling,
as redis-py's ExponentialBackoff, up to `breaker_max_backoff_s`, after each failed trial call), so a dead
or slow Redis costs nothing per request. One trial call at a time: while it is out, other calls are refused
as if the circuit were open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import re
import secrets
import threading
import time
import weakref
from datetime import datetime, timedelta, timezone
from typing import Callable

import pybreaker

from ushash.serving.cache.entries import (ENTRY_FIELDS, MISS, VALUE_KINDS, Candidates, Entry, Found,
                                          decode_value)
from ushash.serving.cache.protection import chunk_bounds, chunk_values, probe_masks

# One entry stored (`RedisStore.put`): KEYS[1] its hash, KEYS[2:] its buckets; ARGV: expiry (ms, 0: none), bucket
# member, the change channel and this replica's message (published on every put: an entry Redis evicted early or
# lost is stored again without replacing one, and other replicas may still hold copies of it), the hash's fields
log = logging.getLogger("ushash.cache")

_PUT_LUA = """
local exp = tonumber(ARGV[1])
local member = ARGV[2]
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
if exp > 0 then redis.call('PEXPIREAT', KEYS[1], exp) else redis.call('PERSIST', KEYS[1]) end
for i = 2, #KEYS do
  local existed = redis.call('EXISTS', KEYS[i])
  redis.call('SADD', KEYS[i], member)
  if exp > 0 then
    local cur = redis.call('PEXPIRETIME', KEYS[i])
    if existed == 0 or (cur > 0 and cur < exp) then redis.call('PEXPIREAT', KEYS[i], exp) end
  else
    redis.call('PERSIST', KEYS[i])
  end
end
redis.call('PUBLISH', ARGV[3], ARGV[4])
return 1
"""

# The members of a lookup's probe buckets, at most ARGV[1] of them: the largest buckets are left out (largest
# first, ties by position) until the rest hold no more; a key holding another type than a set (corrupt or
# hostile data) is left out too, not an error that fails the lookup; returns {buckets left out for their size,
# members of the others, keys of another type}
_UNION_LUA = """
local cap = tonumber(ARGV[1])
local sizes, order, total, bad = {}, {}, 0, {}
local nbad = 0
for i = 1, #KEYS do
  local n = redis.pcall('SCARD', KEYS[i])
  if type(n) ~= 'number' then
    n, bad[i], nbad = 0, true, nbad + 1
  end
  sizes[i] = n
  order[i] = i
  total = total + n
end
table.sort(order, function(a, b) if sizes[a] ~= sizes[b] then return sizes[a] > sizes[b] end return a < b end)
local skip, over = {}, 0
for _, i in ipairs(order) do
  if total <= cap then break end
  if sizes[i] == 0 then break end
  skip[i], total, over = true, total - sizes[i], over + 1
end
local keep = {}
for i = 1, #KEYS do if not skip[i] and not bad[i] then keep[#keep + 1] = KEYS[i] end end
if #keep == 0 then return {over, {}, nbad} end
return {over, redis.call('SUNION', unpack(keep)), nbad}
"""

# A gone entry's bucket members (ARGV[1]) dropped from its buckets (KEYS[2..]), only while its hash (KEYS[1]) is
# still gone: a replica may have stored the same request again (same id and code, its members added back) since
# the lookup found it gone
_FORGET_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 2, #KEYS do redis.pcall('SREM', KEYS[i], ARGV[1]) end
return 1
"""

# The entry KEYS[1] removed (`RedisStore.drop`), only while it is still the one a lookup served: the same value
# kind (ARGV[1]), value (ARGV[2]: its sha1) and, unless ARGV[3] is "", creation time (its stored text); not one
# stored again under its id since. Its bucket members are left to `_FORGET_LUA`, as an expired entry's. A removal
# is published on the change channel (ARGV[4]) as ARGV[5].
_DROP_LUA = """
local f = redis.pcall('HMGET', KEYS[1], 'k', 'v', 't')
if type(f) ~= 'table' or f[1] ~= ARGV[1] or not f[2] or redis.sha1hex(f[2]) ~= ARGV[2] then return 0 end
if ARGV[3] ~= '' and f[3] ~= ARGV[3] then return 0 end
redis.call('UNLINK', KEYS[1])
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
"""

#: Entry field -> (hash field, to bytes, from bytes); the entry's id is its key, not a field.
REDIS_FIELDS = {
    "code": ("c", bytes, bytes),
    "payload": ("p", bytes, lambda b: b or b""),
    "modality": ("m", str, bytes.decode),
    "value": ("v", bytes, lambda b: b or b""),
    "kind": ("k", str, bytes.decode),
    "revision": ("r", str, bytes.decode),
    "created": ("t", repr, float),
    "expires": ("x", repr, float),
    "compute_s": ("d", repr, float),
    "scope": ("s", bytes, lambda b: b or b""),   # absent in entries written before it existed: none
}
assert set(REDIS_FIELDS) == set(ENTRY_FIELDS) - {"id"}
_HASH_FIELDS = tuple(name for name, _, _ in REDIS_FIELDS.values())
#: what a lookup reads of a candidate it may not serve: every field but the value (a model's answer, maybe
#: large), which is read for the candidates the hit check chooses (`RedisStore._served`)
_META_FIELDS = tuple(name for f, (name, _, _) in REDIS_FIELDS.items() if f != "value")
_VALUE_AT = list(REDIS_FIELDS).index("value")


def to_hash(e: Entry) -> list:
    """The entry as HSET name/value pairs."""
    out = []
    for f, (name, enc, _) in REDIS_FIELDS.items():
        out += [name, enc(getattr(e, f))]
    return out


def from_hash(eid: str, row: list) -> Entry:
    """An Entry from the HMGET row of `_HASH_FIELDS`."""
    return Entry(id=eid, **{f: dec(v) for (f, (_, _, dec)), v in zip(REDIS_FIELDS.items(), row)})


def _read(eid: str, row: list, hexcode: str) -> Entry | None:
    """`from_hash`, or None for a row no put writes (a field missing or unreadable, a NaN expiry, a code
    other than its bucket member's, a value its kind does not decode): such an entry is never served
    nor promoted into L1. A row of `_META_FIELDS` gives the entry with value None (not read yet)."""
    full = len(row) == len(_HASH_FIELDS)
    try:
        e = from_hash(eid, row if full else [*row[:_VALUE_AT], b"", *row[_VALUE_AT:]])
        if e.kind not in VALUE_KINDS or math.isnan(e.expires) or e.code.hex() != hexcode:
            return None
        if not full:
            e.value = None
        elif e.kind != "b":
            decode_value(e.kind, e.value)
    except (TypeError, ValueError, RecursionError):   # a missing field (None), a bad number, not UTF-8 / JSON
        return None
    return e


#: Round trips a lookup may spend fetching entries, the first included: later ones fetch the candidates next in
#: line for the places of those found gone, expired or unreadable.
FETCH_ROUNDS = 3


class _Listener:
    """The subscriber of one store: a daemon thread reading the change channel (redis-py's pub/sub), on its own
    connection, with a read timeout of a second so that it notices `stop`. A failed read (Redis unreachable)
    is retried after `breaker_backoff_s`; the first message after one (redis-py subscribes again on the new
    connection) is preceded by `lost()`. The callbacks are held weakly (a cache's bound methods): the thread
    ends once the cache that listens is gone."""

    def __init__(self, store: "RedisStore", changed, lost):
        self.store = store
        self.hear(changed, lost)
        self._stop = threading.Event()
        # subscribed before the cache serves: a change published from here on is heard (one before the thread
        # reads it waits on the connection); unreachable now, the thread subscribes once it is back
        try:
            pubsub, down = self._subscribe(), False
        except Exception:   # noqa: BLE001 (Redis unreachable: the cache starts on its L1)
            pubsub, down = None, True
        self._thread = threading.Thread(target=self._run, args=(pubsub, down), daemon=True,
                                        name=f"ushash-l2-changes-{store.replica}")
        self._thread.start()

    def _subscribe(self):
        pubsub = self.store.r.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(self.store.changes_channel())
        except Exception:
            with contextlib.suppress(Exception):
                pubsub.close()
            raise
        return pubsub

    def hear(self, changed, lost) -> None:
        weak = lambda f: weakref.WeakMethod(f) if hasattr(f, "__self__") else (lambda: f)   # noqa: E731
        self._changed, self._lost = weak(changed), weak(lost)

    def stop(self) -> None:
        """Ask the thread to end (within a second): no callback is made from here on. Not joined: `close` may
        be called under the L1's lock (a reload), which a callback in flight waits for."""
        self._stop.set()

    #: a subscription pings every PING_S and is taken as down when it heard nothing (a PONG included) for SILENT_S:
    #: a connection a NAT or a load balancer dropped silently returns no message and no error
    PING_S, SILENT_S = 5.0, 15.0

    def _run(self, pubsub, down: bool) -> None:
        me = self.store.replica
        heard = pinged = time.monotonic()
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    pubsub = self._subscribe()
                    heard = pinged = time.monotonic()
                    if down:
                        # called, never held across the wait below (a held callback keeps the cache alive)
                        if self._lost() is None or self._stop.is_set():
                            break
                        self._lost()()
                        down = False
                msg = pubsub.get_message(timeout=1.0)
                now = time.monotonic()
                if msg is not None:
                    heard = now
                elif now - heard > self.SILENT_S:
                    raise ConnectionError(f"no message and no answer to a ping for {now - heard:.0f} s")
                if now - pinged > self.PING_S:
                    pubsub.ping()
                    pinged = now
            except Exception as e:   # noqa: BLE001 (a connection error, a timeout: the thread must go on)
                if self._changed() is None:
                    break
                if not down:
                    log.warning("the L2's change channel is unreachable (%s: %s): L1 copies are dropped once it is "
                                "back", type(e).__name__, e)
                down = True
                with contextlib.suppress(Exception):
                    if pubsub is not None:
                        pubsub.close()
                pubsub = None
                self._stop.wait(self.store.breaker_backoff_s)
                continue
            if self._changed() is None:
                break   # the cache is gone
            if not msg or msg.get("type") != "message":
                continue
            try:
                replica, tenant, eid = msg["data"].decode().split(" ")
            except (AttributeError, UnicodeDecodeError, ValueError):
                continue   # not a message of ours
            if replica != me and not self._stop.is_set():
                try:
                    # through the weak reference each time: a local would keep the cache alive while the thread waits
                    (self._changed() or (lambda *_: None))(tenant, eid)
                except Exception:   # noqa: BLE001 (one bad callback must not end the subscription)
                    log.exception("dropping the L1 copy of a changed L2 entry failed")
        with contextlib.suppress(Exception):
            if pubsub is not None:
                pubsub.close()


def _served_entries(f: Found) -> list[Entry]:
    """The entries a tier's choice serves: the one, then the next best (k > 1)."""
    return [] if f.entry is None else [f.entry, *(m[0] for m in f.more)]


def _filled(f: Found, read: dict) -> Found:
    """`f` with its entries that were read without their value replaced by the ones `read` (id -> Entry), and
    those `read` found gone, expired or unreadable (None) left out (a top-k choice keeps the rest of its k); a
    miss when none is left."""
    if f.entry is None or not read:
        return f
    kept = [(read.get(e.id) or e, d, c, ref) for e, d, c, ref in ((f.entry, f.distance, f.cosine, f.ref), *f.more)
            if read.get(e.id, e) is not None]
    if not kept:
        return Found(nearest=f.nearest)
    (e, d, c, ref), *more = kept
    return dataclasses.replace(f, entry=e, distance=d, cosine=c, ref=ref, more=tuple(more))


class L2Unavailable(Exception):
    """Internal: the L2 call failed or was skipped (the cache treats it as a miss)."""


def revision_tag(revision: str) -> str:
    return hashlib.sha1(str(revision).encode()).hexdigest()[:12]


class _Backoff(pybreaker.CircuitBreakerListener):
    """Open time: `base` at the first opening, doubled after each failed trial call up to `cap` (redis-py's
    ExponentialBackoff), `base` again once a call succeeds."""

    def __init__(self, base: float, cap: float):
        from redis.backoff import ExponentialBackoff

        self.base, self.schedule, self.trials = float(base), ExponentialBackoff(cap=float(cap), base=float(base)), 0

    def state_change(self, cb, old_state, new_state) -> None:
        if new_state.name == pybreaker.STATE_OPEN:
            if old_state is not None and old_state.name == pybreaker.STATE_HALF_OPEN:
                self.trials += 1
            cb.reset_timeout = self.schedule.compute(self.trials)
        elif new_state.name == pybreaker.STATE_CLOSED:
            self.trials, cb.reset_timeout = 0, self.base


class RedisStore:
    name = "l2"

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", bits: int = 64, prefix: str = "ushash",
                 chunks: int | None = None, cluster: bool = False, timeout_s: float = 0.05,
                 connect_timeout_s: float = 0.1, breaker_failures: int = 3, breaker_backoff_s: float = 1.0,
                 breaker_max_backoff_s: float = 30.0, max_candidates: int = 32, radius: int = 3, metrics=None,
                 clock: Callable[[], float] = time.time, client=None, max_bucket_read: int = 20000):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._redis = redis
        self.url, self.prefix, self.bits = url, str(prefix), int(bits)
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,32}", self.prefix):
            raise ValueError(f"redis prefix must be 1-32 of [A-Za-z0-9_.-]; got {prefix!r}")
        self.chunks = int(chunks) if chunks else max(1, self.bits // 16)
        self.bounds = chunk_bounds(self.bits, self.chunks)
        self.max_candidates, self.radius = int(max_candidates), int(radius)
        probe_masks(self.bounds, self.radius // self.chunks)   # refused now when a lookup would probe too many
        self.max_bucket_read = int(max_bucket_read)
        if self.max_bucket_read < 1:
            raise ValueError(f"max_bucket_read must be >= 1; got {max_bucket_read}")
        self.metrics, self.clock = metrics, clock
        self.breaker_backoff_s = float(breaker_backoff_s)
        self.replica = secrets.token_hex(8)   # names this store's own messages on the change channel
        self._listener = None
        # pybreaker counts consecutive failures and opens / half-opens / closes; `_call` makes the Redis call
        # itself outside pybreaker's lock (its `call` holds the lock for the whole call, which would make
        # every thread wait on every other's round trip) and reports the outcome to it
        self._storage = pybreaker.CircuitMemoryStorage(pybreaker.STATE_CLOSED)
        self._trial = threading.Lock()
        self._breaker = pybreaker.CircuitBreaker(
            fail_max=int(breaker_failures), reset_timeout=float(breaker_backoff_s), state_storage=self._storage,
            listeners=[_Backoff(breaker_backoff_s, breaker_max_backoff_s)], throw_new_error_on_trip=False,
            exclude=[lambda e: not isinstance(e, (self._redis.RedisError, OSError))])
        if client is not None:
            self.r = client
        else:
            kw = dict(socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s,
                      retry=Retry(NoBackoff(), 0), retry_on_timeout=False)
            if cluster:
                from redis.cluster import RedisCluster
                self.r = RedisCluster.from_url(url, **kw)
            else:
                self.r = redis.Redis.from_url(url, **kw)
        self.cluster = bool(cluster)
        self._put_script = self.r.register_script(_PUT_LUA)
        self._union_script = self.r.register_script(_UNION_LUA)
        self._forget_script = self.r.register_script(_FORGET_LUA)
        self._drop_script = self.r.register_script(_DROP_LUA)

    def _queue_script(self, pipe, script, keys: list, args: list) -> None:
        """One call of a registered script in a pipeline. A cluster pipeline loads no script before its EVALSHA
        (redis-py's does for a single Redis), so a node that holds none (restarted, added, flushed) answered
        NOSCRIPT: there the script's text is sent (EVAL; Redis keeps it compiled by its digest)."""
        if self.cluster:
            pipe.execute_command("EVAL", script.script, len(keys), *keys, *args)
        else:
            script(keys=keys, args=args, client=pipe)

    # ------------------------------------------------------------------ keys
    def rev_key(self) -> str:
        return f"{self.prefix}:revisions"

    def layout_key(self) -> str:
        return f"{self.prefix}:layout"

    def changes_channel(self) -> str:
        return f"{self.prefix}:changed"

    def _change_message(self, tenant: str, eid: str) -> str:
        return f"{self.replica} {tenant} {eid}"

    def check_layout(self) -> None:
        """Record how this store splits codes into bucket chunks, or refuse to start where the replicas already
        on this Redis and prefix split them otherwise: each would read buckets the other never writes, and
        find none of its entries while Redis holds them all. Not checked while Redis cannot be reached."""
        want = f"chunks={self.chunks}"
        try:
            old = self._call("layout", lambda: self.r.set(self.layout_key(), want, nx=True, get=True))
        except L2Unavailable:
            return
        old = old.decode() if isinstance(old, bytes) else old
        if old is not None and old != want:
            raise ValueError(f"l2.chunks gives {want}, but the entries under prefix {self.prefix!r} on this Redis "
                             f"were stored with {old}: a replica of another layout finds none of them. Set "
                             f"l2.{old}, or use another l2.prefix (or delete {self.layout_key()!r} and the "
                             f"prefix's keys to change it for all)")

    def entry_key(self, tenant: str, eid: str) -> str:
        return f"{self.prefix}:{{{tenant}}}:e:{eid}"

    def bucket_key(self, tenant: str, rtag: str, j: int, chunk: int) -> str:
        return f"{self.prefix}:{{{tenant}}}:b:{rtag}:{j}:{chunk:x}"

    def _bucket_keys(self, tenant: str, rtag: str, code: bytes) -> list[str]:
        """The buckets an entry of this code belongs to: one per chunk."""
        return [self.bucket_key(tenant, rtag, j, v)
                for j, v in enumerate(chunk_values(int.from_bytes(code, "little"), self.bounds))]

    def probe_keys(self, tenant: str, revision: str, code: bytes, radius: int) -> list[str]:
        """The buckets a request within `radius` must look in (pigeonhole: protection.probe_masks)."""
        rtag = revision_tag(revision)
        masks = probe_masks(self.bounds, int(radius) // self.chunks)
        return [self.bucket_key(tenant, rtag, j, v ^ m)
                for j, v in enumerate(chunk_values(int.from_bytes(code, "little"), self.bounds)) for m in masks[j]]

    # ------------------------------------------------------------------ failure handling
    def _closed_for(self) -> float:
        """Seconds the circuit stays open (0: calls may be made)."""
        if self._breaker.current_state != pybreaker.STATE_OPEN or self._storage.opened_at is None:
            return 0.0
        until = self._storage.opened_at + timedelta(seconds=self._breaker.reset_timeout)
        return max(0.0, (until - datetime.now(timezone.utc)).total_seconds())

    @property
    def available(self) -> bool:
        return self._closed_for() == 0.0

    def _report(self, error: BaseException | None) -> None:
        """Tell the breaker how a call went (a call it rejects as still open changes nothing)."""
        def outcome():
            if error is not None:
                raise error

        try:
            self._breaker.call(outcome)
        except (pybreaker.CircuitBreakerError, self._redis.RedisError, OSError):
            pass

    def _call(self, op: str, fn):
        # once the open time is up, one trial call at a time: the others are refused as if it were still
        # open (pybreaker lets every caller through in half-open, a herd of timeouts on a dead Redis)
        trial = self._breaker.current_state != pybreaker.STATE_CLOSED
        if not self.available or (trial and not self._trial.acquire(blocking=False)):
            if self.metrics is not None:
                self.metrics.l2_errors.labels(op="circuit_open").inc()
            raise L2Unavailable(op)
        try:
            out = fn()
        except self._redis.ResponseError as e:
            # Redis answered, with an error (full under maxmemory with noeviction, a key of another type): the
            # call failed but Redis is up, so the breaker hears a success: counted as an outage, a full Redis
            # opened the circuit and cut the lookups it could still answer
            if self.metrics is not None:
                self.metrics.l2_errors.labels(op=op).inc()
            self._report(None)
            raise L2Unavailable(op) from e
        except (self._redis.RedisError, OSError) as e:
            if self.metrics is not None:
                self.metrics.l2_errors.labels(op=op).inc()
            self._report(e)
            raise L2Unavailable(op) from e
        else:
            self._report(None)
        finally:
            if trial:
                self._trial.release()
        return out

    # ------------------------------------------------------------------ revisions
    def announce(self, revision: str, rank: float) -> bool:
        """Register `revision` with its rank (when its export was made, ms); a known one keeps its rank. False
        when the L2 could not be told."""
        try:
            self._call("announce", lambda: self.r.zadd(self.rev_key(), {revision: float(rank)}, nx=True))
        except L2Unavailable:
            return False
        return True

    def newest_revision(self) -> tuple[str, float] | tuple[None, None] | None:
        """(revision, rank) of the newest announced revision; (None, None) when none is (the key was lost);
        None when the L2 cannot be asked."""
        try:
            top = self._call("watermark", lambda: self.r.zrevrange(self.rev_key(), 0, 0, withscores=True))
        except L2Unavailable:
            return None
        return (top[0][0].decode(), float(top[0][1])) if top else (None, None)

    def delete_tenant(self, tenant: str, batch: int = 500) -> int:
        """UNLINK every key of one tenant (entries and buckets of every revision; they share one hash
        slot). Returns how many keys; raises L2Unavailable on failure (the caller should try again)."""
        pattern = f"{self.prefix}:{{{tenant}}}:*"

        def run():
            n, keys = 0, []
            for k in self.r.scan_iter(match=pattern, count=batch):
                keys.append(k)
                if len(keys) >= batch:
                    n += self.r.unlink(*keys)
                    keys = []
            if keys:
                n += self.r.unlink(*keys)
            self.r.publish(self.changes_channel(), self._change_message(tenant, "*"))
            return n

        return self._call("delete", run)

    # ------------------------------------------------------------------ other replicas' changes
    def listen(self, changed: Callable[[str, str], None], lost: Callable[[], None]) -> None:
        """Hear the other replicas' changes in a daemon thread (one per store; a second call changes the
        callbacks): `changed(tenant, entry id or "*")` for an entry they replaced or dropped, `lost()` when the
        subscription was down (messages may have been missed) and is back. Idempotent; `close` stops it."""
        if self._listener is not None:
            self._listener.hear(changed, lost)
            return
        self._listener = _Listener(self, changed, lost)

    def close(self) -> None:
        """Stop hearing changes (the subscriber thread ends within about a second)."""
        if self._listener is not None:
            self._listener.stop()
            self._listener = None

    def drop(self, tenant: str, eid: str, ident: tuple) -> bool:
        """Remove entry `eid` of `tenant` where it is still the one a lookup served (`ident`: as `L1Tier.held`'s),
        in one script (`_DROP_LUA`); its bucket members go lazily, as an expired entry's (`_forget`). Whether it
        was removed; raises L2Unavailable on failure (the caller should try again)."""
        kind, value, created = ident
        args = [kind, hashlib.sha1(value).hexdigest(), "" if created is None else repr(float(created)),
                self.changes_channel(), self._change_message(tenant, eid)]
        return bool(self._call("drop", lambda: self._drop_script(keys=[self.entry_key(tenant, eid)], args=args)))

    # ------------------------------------------------------------------ the tier
    def put(self, tenant: str, e: Entry) -> bool:
        """Store one entry (e.id is its key); False if the L2 is unavailable (counted, never raised)."""
        keys = [self.entry_key(tenant, e.id)] + self._bucket_keys(tenant, revision_tag(e.revision), e.code)
        exp_ms = int(e.expires * 1000) if math.isfinite(e.expires) else 0
        args = [exp_ms, f"{e.code.hex()}:{e.id}", self.changes_channel(), self._change_message(tenant, e.id), *to_hash(e)]
        try:
            self._call("put", lambda: self._put_script(keys=keys, args=args))
        except L2Unavailable:
            return False
        return True

    def find(self, q, tenant: str, revision: str, check, now: float, k: int = 1) -> Found:
        """The entry to serve from the L2 (the hit check on its candidates within `radius`), or a miss; a
        failed or skipped call is a miss (counted)."""
        return self.find_many([q], tenant, revision, check, now, k)[0]

    def find_many(self, queries: list, tenant: str, revision: str, check, now: float, k: int = 1) -> list[Found]:
        """`find` of each query, the batch in two round trips (`lookup_many`, which reads the values of each
        query's nearest `k` candidates only), and a third only where the hit check chooses a candidate whose
        value was not read with it (`_served`); a failed or skipped call is a miss for every query of the
        batch (counted once)."""
        try:
            looked = self.lookup_many(tenant, revision, [q.code for q in queries], self.radius, values=k)
            codec = getattr(check, "codec", None)
            return self._served(queries, [self._fits(entries, dists, codec) for entries, dists in looked],
                                tenant, revision, check, now, k)
        except L2Unavailable:
            return [MISS] * len(queries)

    def _served(self, queries: list, cands: list, tenant: str, revision: str, check, now: float,
                k: int) -> list[Found]:
        """Each query's choice among its candidates (`_choose`), with the values of the entries it serves: those
        not read with their candidate are read now, for the chosen entries alone (one pipelined round trip for
        the batch). A chosen entry found gone, expired or unreadable then is dropped (counted as corrupt when
        unreadable) and its query chooses again among the rest, at most `FETCH_ROUNDS` times (counting no
        rejection again: `HitCheck.uncounted`)."""
        out = [MISS] * len(queries)
        todo = list(range(len(queries)))
        for round_ in range(FETCH_ROUNDS):
            need: dict[str, str] = {}   # entry id -> its code (hex), first-seen order
            choosing = check if round_ == 0 else check.uncounted()
            for i in todo:
                out[i] = self._choose(queries[i], *cands[i], revision, choosing, now, k)
                need.update((e.id, e.code.hex()) for e in _served_entries(out[i]) if e.value is None)
            if not need:
                return out
            rows = self._call("fetch", self._fetch(tenant, dict.fromkeys(need, _HASH_FIELDS)))
            later = self.clock()
            read: dict[str, Entry | None] = {}   # None: gone, expired or unreadable
            bad = 0
            for (eid, hexcode), row in zip(need.items(), rows):
                e = None if isinstance(row, Exception) or row[0] is None else _read(eid, row, hexcode)
                bad += e is None and (isinstance(row, Exception) or row[0] is not None)
                read[eid] = e if e is not None and e.expires > later else None
            self._corrupt(bad)
            again = []
            for i in todo:
                entries, dists = cands[i]
                if any(e.id in read for e in entries):
                    keep = [j for j, e in enumerate(entries) if e.id not in read or read[e.id] is not None]
                    cands[i] = ([read.get(entries[j].id) or entries[j] for j in keep], [dists[j] for j in keep])
                if any(read.get(e.id, e) is None for e in _served_entries(out[i])):
                    again.append(i)
                else:
                    out[i] = _filled(out[i], read)
            todo = again
        for i in todo:   # still choosing entries that vanish as they are read: served what was read of its choice
            out[i] = _filled(out[i], read)
        return out

    def _fits(self, entries: list[Entry], dists: list[int], codec) -> tuple[list[Entry], list[int]]:
        """The candidates whose payload record is one this head's codec reads (none, or its modality's
        size); others are corrupt (counted as op="corrupt") and never checked, served or promoted."""
        keep = [i for i, e in enumerate(entries) if not e.payload or (
            codec is not None and e.modality in codec.modalities and len(e.payload) == codec.nbytes(e.modality))]
        if len(keep) == len(entries):
            return entries, dists
        self._corrupt(len(entries) - len(keep))
        return [entries[i] for i in keep], [dists[i] for i in keep]

    def _corrupt(self, n: int) -> None:
        """Count `n` bucket members or entries that no put writes (corrupt or hostile data in Redis)."""
        if n and self.metrics is not None:
            self.metrics.l2_errors.labels(op="corrupt").inc(n)

    @staticmethod
    def _choose(q, entries: list[Entry], dists: list[int], revision: str, check, now: float, k: int) -> Found:
        """The hit check's choice among one query's candidates."""
        if not entries:
            return MISS
        cands = Candidates(ids=[e.id for e in entries], dists=dists, modalities=[e.modality for e in entries],
                           payloads=[e.payload for e in entries], revisions=[e.revision for e in entries],
                           expires=[e.expires for e in entries], nearest=min(dists))
        ranked = check.rank(q, cands, revision, now, trusted=False, k=k)
        if not ranked:
            return Found(nearest=cands.nearest)
        i, d, cos = ranked[0]
        return Found(entries[i], d, cos, entries[i].id, cands.nearest,
                     more=tuple((entries[j], dj, cj, entries[j].id) for j, dj, cj in ranked[1:]))

    def lookup(self, tenant: str, revision: str, code: bytes, radius: int,
               values: int | None = None) -> tuple[list[Entry], list[int]]:
        """Entries of `revision` within `radius` and their distances, by (distance, id), at most
        max_candidates; raises L2Unavailable on failure. Expired, vanished and unreadable entries are not
        returned, nor counted against max_candidates. `values`: the entries whose value is read, the
        nearest first (None: all); the others are returned with value None."""
        return self.lookup_many(tenant, revision, [code], radius, values)[0]

    def lookup_many(self, tenant: str, revision: str, codes: list[bytes], radius: int,
                    values: int | None = None) -> list[tuple[list[Entry], list[int]]]:
        """`lookup` of each code in two round trips for all: the probe buckets' SUNION of every code (one
        pipeline), then the entries of all their candidates within `radius` (one pipelined HMGET each,
        an entry that is a candidate of several codes fetched once, with its value only where it is one of
        a code's nearest `values`). Where some of a code's nearest
        max_candidates turn out gone (expired or evicted by Redis, not yet dropped from their buckets),
        expired or unreadable, the next ones are fetched in another round trip (at most `FETCH_ROUNDS` in
        all): they used to take the places of live entries further out, which were then never served."""
        probes = [self.probe_keys(tenant, revision, code, radius) for code in codes]

        cap = [self.max_bucket_read]

        def union():
            if len(probes) == 1:
                return [self._union_script(keys=probes[0], args=cap)]
            pipe = self.r.pipeline(transaction=False)
            for keys in probes:
                self._queue_script(pipe, self._union_script, keys, cap)
            return pipe.execute()

        per_code = []   # each code's candidates within the radius, (distance, id, code hex), nearest first
        bad = skipped = 0
        for code, (over, members, wrong) in zip(codes, self._call("lookup", union)):
            skipped += int(over)
            bad += int(wrong)
            q = int.from_bytes(code, "little")
            cands = []
            for mem in members:
                hexcode, _, eid = mem.decode("utf-8", "replace").partition(":")
                try:
                    mcode = bytes.fromhex(hexcode)
                except ValueError:
                    mcode = b""
                if len(mcode) != len(code) or not eid:   # not a member a put writes: skipped
                    bad += 1
                    continue
                d = (int.from_bytes(mcode, "little") ^ q).bit_count()
                if d <= radius:
                    cands.append((d, eid, hexcode))
            cands.sort()
            per_code.append(cands)

        rows: dict[str, list] = {}
        gone: dict[str, str] = {}   # entry id -> its code (hex): members whose entry hash no longer exists
        made: dict[tuple[str, str], Entry | None] = {}   # (id, its member's code): a member's code must be the entry's
        out = [([], []) for _ in codes]
        pos = [0] * len(codes)
        for _ in range(FETCH_ROUNDS):
            takes, need = [], {}   # per code the candidates read this round; the ids to fetch, first-seen order
            fields = {}            # the fields to read of each: the value too for a code's nearest `values`
            for i, ((entries, _), cands) in enumerate(zip(out, per_code)):
                take = cands[pos[i]: pos[i] + max(0, self.max_candidates - len(entries))]
                pos[i] += len(take)
                takes.append(take)
                for t, (_, eid, hexcode) in enumerate(take):
                    if eid not in rows:
                        need.setdefault(eid, hexcode)
                        full = values is None or len(entries) + t < values
                        if full or eid not in fields:
                            fields[eid] = _HASH_FIELDS if full else _META_FIELDS
            if need:
                rows.update(zip(need, self._call("fetch", self._fetch(tenant, {eid: fields[eid] for eid in need}))))
            now = self.clock()
            for (entries, dists), take in zip(out, takes):
                for d, eid, hexcode in take:
                    row = rows[eid]
                    wrong = isinstance(row, Exception)   # a key of another type: corrupt, counted below
                    if not wrong and row[0] is None:
                        gone.setdefault(eid, hexcode)
                        continue
                    if (eid, hexcode) not in made:
                        made[eid, hexcode] = None if wrong else _read(eid, row, hexcode)
                        bad += made[eid, hexcode] is None
                    e = made[eid, hexcode]
                    if e is None or e.expires <= now:
                        continue
                    entries.append(e)
                    dists.append(d)
            if all(len(out[i][0]) >= self.max_candidates or pos[i] >= len(per_code[i]) for i in range(len(codes))):
                break
        self._corrupt(bad)
        if skipped and self.metrics is not None:
            self.metrics.l2_errors.labels(op="oversized").inc(skipped)
        if gone:
            self._forget(tenant, revision, list(gone.items()))
        return out

    def _fetch(self, tenant: str, fields: dict[str, tuple]) -> Callable[[], list]:
        """The call that reads each entry's `fields` (entry id -> HMGET fields) in one pipeline: per entry its
        row, or the error of a key of another type (WRONGTYPE: that entry's, not the fetch's, read as corrupt)."""
        def run():
            pipe = self.r.pipeline(transaction=False)
            for eid, names in fields.items():
                pipe.hmget(self.entry_key(tenant, eid), names)
            return pipe.execute(raise_on_error=False)
        return run

    def _forget(self, tenant: str, revision: str, gone: list[tuple[str, str]]) -> None:
        """Drop bucket members whose entry hash no longer exists (expired or evicted by Redis), where it is still
        gone (`_FORGET_LUA`)."""
        rtag = revision_tag(revision)

        def run():
            pipe = self.r.pipeline(transaction=False)
            for eid, hexcode in gone:
                keys = [self.entry_key(tenant, eid)] + self._bucket_keys(tenant, rtag, bytes.fromhex(hexcode))
                self._queue_script(pipe, self._forget_script, keys, [f"{hexcode}:{eid}"])
            pipe.execute(raise_on_error=False)   # one entry's error: the others are still cleaned

        try:
            self._call("cleanup", run)
        except L2Unavailable:
            pass
