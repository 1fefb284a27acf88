"""L2: entries shared by several cache replicas in Redis (>= 7.0), with the L1's semantics.

Layout (prefix "ushash"; {t} is the tenant, a Redis Cluster hash tag, so all of a tenant's keys live in
one hash slot and multi-key commands and scripts work on a cluster too; a tenant is the sharding unit):

    ushash:revisions                        ZSET  revision -> first time any replica announced it (ms);
                                                  the highest score is the watermark
    ushash:{t}:e:<id>                       HASH  c code, p payload, m modality, v value, k value kind,
                                                  r revision, t created, x expires, d compute seconds;
                                                  PEXPIREAT = expires (Redis drops it by itself)
    ushash:{t}:b:<rev>:<j>:<chunk hex>      SET   "<code hex>:<id>" of the entries of revision <rev>
                                                  (12 hex of its sha1) whose j-th code chunk has this
                                                  value; expires with its longest-lived member

Lookup within Hamming radius r, codes split into m chunks: an entry within r has a chunk within
floor(r / m) bits of the request's (pigeonhole), so one SUNION over the probe buckets (m keys while
r < m) gives a superset of the answer with the candidates' codes; the client keeps those within r
and fetches them (one pipelined HMGET round trip, only when there are any). Members whose entry has
expired are removed lazily. Puts are one Lua script (the entry hash and its bucket memberships,
atomically, all keys declared, one slot). Revisions are part of the bucket key, so codes of different
heads never meet; entries also carry their revision and the cache checks it.

Failures: every call has a socket timeout; errors are counted (cache_l2_errors_total{op}) and the
cache carries on with L1 alone. After `breaker_failures` consecutive failures the store stops trying for
`breaker_backoff_s` (doubling up to `breaker_max_backoff_s`), so a dead or slow Redis costs nothing per
request.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from dataclasses import dataclass
from typing import Callable

from ushash.serving.cache.protection import chunk_bounds

TENANT_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

_PUT_LUA = """
local exp = tonumber(ARGV[1])
local member = ARGV[2]
local fields = {}
for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
if exp > 0 then redis.call('PEXPIREAT', KEYS[1], exp) end
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
return 1
"""


@dataclass
class L2Record:
    id: str
    code: bytes
    payload: bytes
    modality: str
    value: bytes
    kind: str          # value encoding tag (see ushash.serving.cache.cache.encode_value)
    revision: str
    created: float
    expires: float     # math.inf: no TTL
    compute_s: float
    distance: int = -1


class L2Unavailable(Exception):
    """Internal: the L2 call failed or was skipped (the cache treats it as a miss)."""


def revision_tag(revision: str) -> str:
    return hashlib.sha1(str(revision).encode()).hexdigest()[:12]


class RedisStore:
    def __init__(self, url: str = "redis://127.0.0.1:6379/0", bits: int = 64, prefix: str = "ushash",
                 chunks: int | None = None, cluster: bool = False, timeout_s: float = 0.05,
                 connect_timeout_s: float = 0.1, breaker_failures: int = 3, breaker_backoff_s: float = 1.0,
                 breaker_max_backoff_s: float = 30.0, max_candidates: int = 32, metrics=None,
                 clock: Callable[[], float] = time.time, client=None):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._redis = redis
        self.url, self.prefix, self.bits = url, str(prefix), int(bits)
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,32}", self.prefix):
            raise ValueError(f"redis prefix must be 1-32 of [A-Za-z0-9_.-]; got {prefix!r}")
        self.chunks = int(chunks) if chunks else max(1, self.bits // 16)
        self.bounds = chunk_bounds(self.bits, self.chunks)
        self.max_candidates = int(max_candidates)
        self.metrics, self.clock = metrics, clock
        self.breaker_failures = int(breaker_failures)
        self.breaker_backoff_s, self.breaker_max_backoff_s = float(breaker_backoff_s), float(breaker_max_backoff_s)
        self._failures, self._open_until, self._backoff = 0, -math.inf, self.breaker_backoff_s
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

    # ------------------------------------------------------------------ keys
    @staticmethod
    def check_tenant(tenant: str) -> str:
        if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
            raise ValueError(f"tenant must be 1-64 characters of [A-Za-z0-9_.-]; got {tenant!r}")
        return tenant

    def rev_key(self) -> str:
        return f"{self.prefix}:revisions"

    def entry_key(self, tenant: str, eid: str) -> str:
        return f"{self.prefix}:{{{tenant}}}:e:{eid}"

    def bucket_key(self, tenant: str, rtag: str, j: int, chunk: int) -> str:
        return f"{self.prefix}:{{{tenant}}}:b:{rtag}:{j}:{chunk:x}"

    def _chunks(self, code_int: int) -> list[int]:
        return [(code_int >> s) & ((1 << w) - 1) for s, w in self.bounds]

    def probe_keys(self, tenant: str, revision: str, code: bytes, radius: int) -> list[str]:
        from itertools import combinations

        c = int.from_bytes(code, "little")
        rtag = revision_tag(revision)
        flips = int(radius) // self.chunks
        keys = []
        for j, (s, w) in enumerate(self.bounds):
            v = (c >> s) & ((1 << w) - 1)
            keys.append(self.bucket_key(tenant, rtag, j, v))
            for f in range(1, flips + 1):
                for idx in combinations(range(w), f):
                    keys.append(self.bucket_key(tenant, rtag, j, v ^ sum(1 << i for i in idx)))
        return keys

    # ------------------------------------------------------------------ failure handling
    @property
    def available(self) -> bool:
        return self.clock() >= self._open_until

    def _call(self, op: str, fn):
        if self.clock() < self._open_until:
            if self.metrics is not None:
                self.metrics.l2_errors.labels(op="circuit_open").inc()
            raise L2Unavailable(op)
        try:
            out = fn()
        except (self._redis.RedisError, OSError) as e:
            self._failures += 1
            if self.metrics is not None:
                self.metrics.l2_errors.labels(op=op).inc()
            if self._failures >= self.breaker_failures:
                self._open_until = self.clock() + self._backoff
                self._backoff = min(self._backoff * 2, self.breaker_max_backoff_s)
            raise L2Unavailable(op) from e
        self._failures, self._backoff = 0, self.breaker_backoff_s
        return out

    # ------------------------------------------------------------------ revisions
    def announce(self, revision: str) -> None:
        try:
            self._call("announce", lambda: self.r.zadd(self.rev_key(), {revision: int(self.clock() * 1000)}, nx=True))
        except L2Unavailable:
            pass

    def newest_revision(self) -> str | None:
        try:
            top = self._call("watermark", lambda: self.r.zrevrange(self.rev_key(), 0, 0))
        except L2Unavailable:
            return None
        return top[0].decode() if top else None

    def retire(self, revision: str) -> None:
        """Forget a revision (a deliberate rollback: the previous one becomes the newest again)."""
        self._call("retire", lambda: self.r.zrem(self.rev_key(), revision))

    # ------------------------------------------------------------------ entries
    def put(self, tenant: str, rec: L2Record) -> bool:
        """Store one entry; False if the L2 is unavailable (counted, never raised)."""
        rtag = revision_tag(rec.revision)
        c = int.from_bytes(rec.code, "little")
        member = f"{rec.code.hex()}:{rec.id}"
        keys = [self.entry_key(tenant, rec.id)] + [self.bucket_key(tenant, rtag, j, v)
                                                   for j, v in enumerate(self._chunks(c))]
        exp_ms = int(rec.expires * 1000) if math.isfinite(rec.expires) else 0
        args = [exp_ms, member, "c", rec.code, "p", rec.payload, "m", rec.modality, "v", rec.value, "k", rec.kind,
                "r", rec.revision, "t", repr(rec.created), "x", repr(rec.expires), "d", repr(rec.compute_s)]
        try:
            self._call("put", lambda: self._put_script(keys=keys, args=args))
        except L2Unavailable:
            return False
        return True

    def lookup(self, tenant: str, revision: str, code: bytes, radius: int) -> list[L2Record]:
        """Entries of `revision` within `radius`, by (distance, id), at most max_candidates; raises
        L2Unavailable on failure. Expired entries are not returned."""
        keys = self.probe_keys(tenant, revision, code, radius)
        members = self._call("lookup", lambda: self.r.sunion(keys))
        if not members:
            return []
        q = int.from_bytes(code, "little")
        cands = []
        for mem in members:
            hexcode, _, eid = mem.decode().partition(":")
            d = (int.from_bytes(bytes.fromhex(hexcode), "little") ^ q).bit_count()
            if d <= radius:
                cands.append((d, eid, hexcode))
        if not cands:
            return []
        cands.sort()
        cands = cands[: self.max_candidates]
        fields = ("c", "p", "m", "v", "k", "r", "t", "x", "d")

        def fetch():
            pipe = self.r.pipeline(transaction=False)
            for _, eid, _ in cands:
                pipe.hmget(self.entry_key(tenant, eid), fields)
            return pipe.execute()

        rows = self._call("fetch", fetch)
        out, gone = [], []
        now = self.clock()
        for (d, eid, hexcode), row in zip(cands, rows):
            if row[0] is None:
                gone.append((eid, hexcode))
                continue
            rec = L2Record(id=eid, code=row[0], payload=row[1] or b"", modality=row[2].decode(), value=row[3] or b"",
                           kind=row[4].decode(), revision=row[5].decode(), created=float(row[6]),
                           expires=float(row[7]), compute_s=float(row[8]), distance=d)
            if rec.expires <= now:
                continue
            out.append(rec)
        if gone:
            self._forget(tenant, revision, gone)
        return out

    def _forget(self, tenant: str, revision: str, gone: list[tuple[str, str]]) -> None:
        """Drop bucket members whose entry hash no longer exists (expired or evicted by Redis)."""
        rtag = revision_tag(revision)

        def run():
            pipe = self.r.pipeline(transaction=False)
            for eid, hexcode in gone:
                c = int.from_bytes(bytes.fromhex(hexcode), "little")
                for j, v in enumerate(self._chunks(c)):
                    pipe.srem(self.bucket_key(tenant, rtag, j, v), f"{hexcode}:{eid}")
            pipe.execute()

        try:
            self._call("cleanup", run)
        except L2Unavailable:
            pass

    def delete(self, tenant: str, eid: str) -> None:
        try:
            self._call("delete", lambda: self.r.delete(self.entry_key(tenant, eid)))
        except L2Unavailable:
            pass
