"""Prometheus metrics of one `SemanticCache`, in a registry of its own (two caches never share series).

Names follow docs/cache.md and the "Semantic cache evaluation" notes:

    cache_gets_total{result="hit|miss"}          lookups, L1 and L2 together
    cache_hits_total{tier="l1|l2"}               where the hits came from
    cache_puts_total                              entries stored (after admission)
    cache_rejections_total{reason}                candidates within the radius not served: payload, revision,
                                                  expired; puts refused: admission, too_large, stale_revision
    cache_evictions_total{reason}                 capacity, expired, revision
    cache_size_bytes / cache_capacity_bytes       codes + payloads + values held in L1
    cache_entries                                 entries held in L1
    cache_lookup_duration_seconds{tier}           wall time of a lookup (tier="l1" L1 only, "l2" with the L2 trip)
    cache_put_duration_seconds
    cache_nearest_hamming_distance{result}       nearest candidate's Hamming distance, on hits and on misses
                                                  (+Inf bucket: nothing within the observed radius)
    cache_l2_errors_total{op}                     Redis failures absorbed (the caller never sees them)
    cache_bloom_skips_total                       lookups answered "miss" by the Bloom filter alone
    cache_singleflight_waits_total                callers that waited for another caller's computation
    cache_early_refresh_total                     XFetch early recomputations
    cache_compute_failures_total{during}          early refreshes (refresh) and shadow checks (shadow) that failed:
                                                  the cached answer, still fresh, was served
    cache_hit_ratio, cache_stale_ratio, cache_disruption_index, cache_p99_jitter_rate,
    cache_hidden_memory_growth_rate               the design's SLO series (SLOWindow, below)
    cache_hot_key_requests{rank}, cache_hot_keys_share   when hot keys are tracked (hotkeys.py)

OpenTelemetry tracing (off by default): `configure_tracing` and `SemanticCache.trace`.
"""

from __future__ import annotations

import bisect
import collections
import math
import random
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# Lookups take microseconds (L1) to milliseconds (L2 over the network).
LATENCY_BUCKETS = (5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)


class CacheMetrics:
    """All series of one cache. `text()` renders them in the Prometheus exposition format."""

    def __init__(self, bits: int, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # The per-lookup series (gets, hits, lookup latency, nearest distance) are kept in plain counters
        # and rendered by a collector at scrape time: prometheus_client objects cost ~10 us per lookup.
        self._hot = _LookupStats(bits)
        r.register(self._hot)
        self.puts = Counter("cache_puts", "Entries stored", registry=r)
        self.rejections = Counter("cache_rejections", "Candidates or puts refused, by reason", ["reason"], registry=r)
        self.evictions = Counter("cache_evictions", "Entries removed, by reason", ["reason"], registry=r)
        self.size_bytes = Gauge("cache_size_bytes", "Codes + payloads + values held in L1", registry=r)
        self.capacity_bytes = Gauge("cache_capacity_bytes", "L1 capacity in bytes", registry=r)
        self.entries = Gauge("cache_entries", "Entries held in L1", registry=r)
        self.put_seconds = Histogram("cache_put_duration_seconds", "Put wall time", buckets=LATENCY_BUCKETS,
                                     registry=r)
        self.l2_errors = Counter("cache_l2_errors", "Redis (L2) failures absorbed, by operation", ["op"], registry=r)
        self.bloom_skips = Counter("cache_bloom_skips", "Lookups answered miss by the Bloom filter", registry=r)
        self.singleflight_waits = Counter("cache_singleflight_waits", "Callers that waited on another's compute",
                                          registry=r)
        self.early_refresh = Counter("cache_early_refresh", "XFetch early recomputations", registry=r)
        self.compute_failures = Counter("cache_compute_failures", "Early refreshes and shadow checks that failed "
                                        "while their cached answer was served", ["during"], registry=r)
        # the design's SLO series (hit / stale ratio, CDI, P99 jitter, hidden memory growth), per-second buckets
        self.slo = SLOWindow()
        self._hot.slo = self.slo
        self._evictions_seen = 0.0
        r.register(SLOCollector(self.slo, self._sample_slo))

    def _sample_slo(self) -> None:
        """At scrape time: evictions since the last scrape, and RSS against the bytes accounted."""
        import psutil

        ev = sum(s.value for m in self.evictions.collect() for s in m.samples if s.name.endswith("_total"))
        if ev > self._evictions_seen:
            self.slo.record_evictions(ev - self._evictions_seen)
            self._evictions_seen = ev
        self.slo.record_memory(psutil.Process().memory_info().rss, self.size_bytes._value.get())

    def record_lookup(self, hit: bool, tier: str, nearest: float, seconds: float) -> None:
        self._hot.record(hit, tier, nearest, seconds)

    def record_lookups(self, hits: list, tiers, nearest: list, seconds: float) -> None:
        """`record_lookup(hit is not None, tier, d, seconds)` of each lookup of a batch (hits: a Hit or None
        each; tiers: one tier name for all, or one per lookup; nearest: the distance of each), under one lock."""
        self._hot.record_many(hits, tiers, nearest, seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, **labels) -> float:
        """A sample's current value (tests, the simulator); 0.0 when the series does not exist yet."""
        v = self.registry.get_sample_value(name, labels or None)
        return 0.0 if v is None else float(v)


class _LookupStats:
    """A collector for the hot-path series; `record` is a few list increments under a lock."""

    def __init__(self, bits: int):
        self.lat_bounds = list(LATENCY_BUCKETS)
        # the code's width is a bound too: a distance beyond the last listed one and <= bits is no "+Inf"
        # (nothing within the observed radius, recorded as bits + 1)
        self.dist_bounds = [float(d) for d in sorted({*range(0, 33), 40, 48, 64, 96, 128, 256, 512, 1024, bits})
                            if d <= bits]
        self.gets = {"hit": 0, "miss": 0}
        self.hits = {"l1": 0, "l2": 0}
        self.lat = {t: [0] * (len(self.lat_bounds) + 1) for t in ("l1", "l2")}
        self.lat_sum = {"l1": 0.0, "l2": 0.0}
        self.dist = {r: [0] * (len(self.dist_bounds) + 1) for r in ("hit", "miss")}
        self.dist_sum = {"hit": 0.0, "miss": 0.0}
        self._lock = threading.Lock()
        self.slo = None

    def record(self, hit: bool, tier: str, nearest: float, seconds: float) -> None:
        res = "hit" if hit else "miss"
        with self._lock:
            self.gets[res] += 1
            if hit:
                self.hits[tier] += 1
            self.lat[tier][bisect.bisect_left(self.lat_bounds, seconds)] += 1
            self.lat_sum[tier] += seconds
            self.dist[res][bisect.bisect_left(self.dist_bounds, nearest)] += 1
            self.dist_sum[res] += nearest
            if self.slo is not None:
                self.slo.record_request(hit, seconds, read=not hit)

    def record_many(self, hits: list, tiers, nearest: list, seconds: float) -> None:
        """`record` of each lookup of a batch (see CacheMetrics.record_lookups): the same counts and sums,
        added per distinct (result, tier) and (result, distance) rather than per lookup."""
        n = len(hits)
        one_tier = isinstance(tiers, str)
        if n == 1:
            return self.record(hits[0] is not None, tiers if one_tier else tiers[0], nearest[0], seconds)
        li = bisect.bisect_left(self.lat_bounds, seconds)
        flags = [h is not None for h in hits]
        nh = sum(flags)
        per_tier = {(tiers, True): nh, (tiers, False): n - nh} if one_tier else collections.Counter(zip(tiers, flags))
        per_dist = collections.Counter(zip(flags, nearest))
        dist_bounds = self.dist_bounds
        with self._lock:
            for (tier, hit), c in per_tier.items():
                if not c:
                    continue
                self.gets["hit" if hit else "miss"] += c
                if hit:
                    self.hits[tier] += c
                self.lat[tier][li] += c
                s = self.lat_sum[tier]
                for _ in range(c):   # one addition per lookup, as `record` makes them (the same float sum)
                    s += seconds
                self.lat_sum[tier] = s
            for (hit, d), c in per_dist.items():
                res = "hit" if hit else "miss"
                self.dist[res][bisect.bisect_left(dist_bounds, d)] += c
                self.dist_sum[res] += d * c   # integer distances: exact, as c additions are
            if self.slo is not None:   # serialised by this lock, as record_request is
                self.slo.record_requests(flags, seconds)

    @staticmethod
    def _cumulative(bounds, counts):
        out, acc = [], 0
        for b, c in zip(bounds + [float("inf")], counts):
            acc += c
            out.append((floatToGoString(b), acc))
        return out

    def collect(self):
        with self._lock:
            gets, hits = dict(self.gets), dict(self.hits)
            lat = {k: list(v) for k, v in self.lat.items()}
            lat_sum, dist_sum = dict(self.lat_sum), dict(self.dist_sum)
            dist = {k: list(v) for k, v in self.dist.items()}
        g = CounterMetricFamily("cache_gets", "Cache lookups by result", labels=["result"])
        for k, v in gets.items():
            g.add_metric([k], v)
        yield g
        h = CounterMetricFamily("cache_hits", "Cache hits by tier", labels=["tier"])
        for k, v in hits.items():
            h.add_metric([k], v)
        yield h
        lh = HistogramMetricFamily("cache_lookup_duration_seconds", "Lookup wall time", labels=["tier"])
        for k in lat:
            lh.add_metric([k], self._cumulative(self.lat_bounds, lat[k]), lat_sum[k])
        yield lh
        dh = HistogramMetricFamily("cache_nearest_hamming_distance", "Nearest candidate's Hamming distance",
                                   labels=["result"])
        for k in dist:
            dh.add_metric([k], self._cumulative(self.dist_bounds, dist[k]), dist_sum[k])
        yield dh


# ---------------------------------------------------------------------------------------------- SLO metrics
# The design's service-level series, over per-second buckets (docs/cache.md, "SLO metrics"):
#   cache_hit_ratio                   hits / requests over the last `window_s` (60 s)
#   cache_stale_ratio                 stale answers / answers over the same window
#   cache_disruption_index (CDI)      evicted keys in the window x the increase of the average read QPS
#                                     reaching the service (this window against the one before) / 60 s
#   cache_p99_jitter_rate             std / mean of the per-second p99 latency over the last 300 s
#   cache_hidden_memory_growth_rate   (dRSS - d accounted bytes) / d accounted bytes between the oldest and
#                                     the newest memory sample of the last 300 s


class SLOWindow:
    """Per-second buckets of requests, hits, stale answers, service reads, evictions and latencies, and
    the design's metrics computed from them. Every method takes `now` (seconds) or reads `clock`."""

    SAMPLE = 512

    def __init__(self, window_s: float = 60.0, jitter_s: float = 300.0, clock=None):
        import time

        self.window_s, self.jitter_s = float(window_s), float(jitter_s)
        self.clock = clock or time.monotonic
        self._sec: dict[int, list] = {}   # second -> [requests, hits, stale, reads, evictions, [latencies]]
        self._mem: list[tuple[float, float, float]] = []   # (t, rss, accounted)
        self._lock = threading.Lock()
        self._cur_s, self._cur_b = None, None

    def _bucket(self, now):
        s = int(math.floor(self.clock() if now is None else now))
        b = self._sec.get(s)
        if b is None:
            b = self._sec[s] = [0, 0, 0, 0, 0, []]
            keep = s - int(max(self.jitter_s, 2 * self.window_s)) - 1
            for old in [k for k in self._sec if k < keep]:
                del self._sec[old]
        return b

    def _current(self, now):
        """The bucket of the second `now` falls in (the current one kept at hand)."""
        t = self.clock() if now is None else now
        sec = int(t) if t >= 0 else int(math.floor(t))
        if sec != self._cur_s:
            with self._lock:
                self._cur_b, self._cur_s = self._bucket(sec), sec
        return self._cur_b

    def record_request(self, hit: bool, latency_s: float, stale: bool = False, read: bool = False,
                       now: float | None = None) -> None:
        """One answer; `read`: it went to the service (a miss). Each second keeps a uniform sample of at
        most `SAMPLE` latencies for its p99. The caller serialises calls (CacheMetrics does, under its
        lookup lock); the current second's bucket is kept at hand, so this is a few increments."""
        b = self._current(now)
        b[0] += 1
        if hit:
            b[1] += 1
        if stale:
            b[2] += 1
        if read:
            b[3] += 1
        lat = b[5]
        if len(lat) < self.SAMPLE:
            lat.append(latency_s)
        else:  # reservoir sampling
            j = int(random.random() * b[0])
            if j < self.SAMPLE:
                lat[j] = latency_s

    def record_requests(self, hits: list, latency_s: float, now: float | None = None) -> None:
        """`record_request(hit, latency_s, read=not hit)` of each of a batch's answers (one latency for
        all): the same counts and the same reservoir sampling, the bucket looked up once."""
        b = self._current(now)
        n, h = len(hits), sum(1 for x in hits if x)
        lat = b[5]
        room = min(n, max(0, self.SAMPLE - len(lat)))
        lat.extend([latency_s] * room)
        seen = b[0] + room
        for _ in range(n - room):  # reservoir sampling, as record_request does one at a time
            seen += 1
            j = int(random.random() * seen)
            if j < self.SAMPLE:
                lat[j] = latency_s
        b[0] += n
        b[1] += h
        b[3] += n - h

    def record_read(self, n: int = 1, now: float | None = None) -> None:
        """`n` reads reached the service (misses, refreshes)."""
        with self._lock:
            self._bucket(now)[3] += int(n)

    def record_evictions(self, n: int = 1, now: float | None = None) -> None:
        with self._lock:
            self._bucket(now)[4] += int(n)

    def record_memory(self, rss_bytes: float, accounted_bytes: float, now: float | None = None) -> None:
        t = self.clock() if now is None else now
        with self._lock:
            self._mem.append((float(t), float(rss_bytes), float(accounted_bytes)))
            self._mem = [m for m in self._mem if m[0] >= t - self.jitter_s]

    def _span(self, now, a: float, b: float):
        """Buckets of the seconds (now - a, now - b], whole seconds, the current one included for b = 0."""
        s = int(math.floor(self.clock() if now is None else now))
        return [self._sec[k] for k in range(s - int(a) + 1, s - int(b) + 1) if k in self._sec]

    def hit_ratio(self, now: float | None = None) -> float:
        with self._lock:
            bs = self._span(now, self.window_s, 0)
        n = sum(b[0] for b in bs)
        return sum(b[1] for b in bs) / n if n else 0.0

    def stale_ratio(self, now: float | None = None) -> float:
        with self._lock:
            bs = self._span(now, self.window_s, 0)
        n = sum(b[0] for b in bs)
        return sum(b[2] for b in bs) / n if n else 0.0

    def cdi(self, now: float | None = None) -> float:
        """Evicted keys in the last window x max(0, mean read QPS of that window - of the one before) / 60."""
        w = self.window_s
        with self._lock:
            cur, prev = self._span(now, w, 0), self._span(now, 2 * w, w)
        evicted = sum(b[4] for b in cur)
        increase = sum(b[3] for b in cur) / w - sum(b[3] for b in prev) / w
        return evicted * max(0.0, increase) / 60.0

    def p99_jitter_rate(self, now: float | None = None) -> float:
        """std / mean (population std) of the per-second p99 latencies of the last jitter_s seconds."""
        import numpy as np

        with self._lock:
            bs = self._span(now, self.jitter_s, 0)
            p99 = [float(np.percentile(b[5], 99)) for b in bs if b[5]]
        if len(p99) < 2 or np.mean(p99) == 0:
            return 0.0
        return float(np.std(p99) / np.mean(p99))

    def hidden_memory_growth_rate(self) -> float:
        """(dRSS - d accounted) / d accounted between the oldest and newest sample; 0 when accounted bytes
        did not change."""
        with self._lock:
            if len(self._mem) < 2:
                return 0.0
            (_, r0, a0), (_, r1, a1) = self._mem[0], self._mem[-1]
        da = a1 - a0
        return ((r1 - r0) - da) / da if da else 0.0

    def values(self, now: float | None = None) -> dict:
        return {"cache_hit_ratio": self.hit_ratio(now), "cache_stale_ratio": self.stale_ratio(now),
                "cache_disruption_index": self.cdi(now), "cache_p99_jitter_rate": self.p99_jitter_rate(now),
                "cache_hidden_memory_growth_rate": self.hidden_memory_growth_rate()}


SLO_HELP = {"cache_hit_ratio": "Hits / requests over the last window (60 s)",
            "cache_stale_ratio": "Stale answers / answers over the last window",
            "cache_disruption_index": "Cache disruption index: evicted keys x read-QPS increase / 60 s",
            "cache_p99_jitter_rate": "std / mean of the per-second p99 latency over 5 minutes",
            "cache_hidden_memory_growth_rate": "(dRSS - d accounted bytes) / d accounted bytes over 5 minutes"}


class SLOCollector:
    """Renders an SLOWindow's metrics as gauges at scrape time; `before_collect` (optional) is called first,
    e.g. to sample memory and the eviction counter."""

    def __init__(self, window: SLOWindow, before_collect=None):
        self.window, self.before_collect = window, before_collect

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        if self.before_collect is not None:
            self.before_collect()
        for name, v in self.window.values().items():
            g = GaugeMetricFamily(name, SLO_HELP[name])
            g.add_metric([], v)
            yield g


# ---------------------------------------------------------------------------------------------- tracing
# OpenTelemetry spans for encode, search, verify, L2 and compute, with cache.* attributes. Off by default:
# `configure_tracing()` returns None unless asked (an exporter given, or otlp_endpoint / the standard
# OTEL_EXPORTER_OTLP_ENDPOINT set), and a cache without a tracer opens no span at all.

SPAN_NAMES = ("ushash.encode", "ushash.search", "ushash.verify", "ushash.l2", "ushash.compute")


def configure_tracing(exporter=None, otlp_endpoint: str | None = None, service_name: str = "ushash"):
    """A tracer of its own TracerProvider (the global one is left alone), exporting to `exporter` (e.g.
    the SDK's InMemorySpanExporter, synchronously) or over OTLP/HTTP to `otlp_endpoint`; None when neither
    is given nor OTEL_EXPORTER_OTLP_ENDPOINT is set (tracing off)."""
    import os

    otlp_endpoint = otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if exporter is None and not otlp_endpoint:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    return provider.get_tracer("ushash.serving.cache")


def key_hash(code: bytes) -> str:
    """`cache.key.hash`: a short digest of the request's code (the code itself is not exported)."""
    import hashlib

    return hashlib.sha1(code).hexdigest()[:16]


class TracedCheck:
    """A HitCheck whose `choose` runs in a `ushash.verify` span (cache.candidates, cache.hit)."""

    def __init__(self, inner, tracer):
        self.inner, self.tracer = inner, tracer

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def uncounted(self) -> "TracedCheck":
        """`HitCheck.uncounted`, still traced: a choice made again is a span of its own."""
        return TracedCheck(self.inner.uncounted(), self.tracer)

    def choose(self, q, c, revision, now, trusted):
        with self.tracer.start_as_current_span("ushash.verify", attributes={"cache.candidates": len(c)}) as span:
            out = self.inner.choose(q, c, revision, now, trusted)
            span.set_attribute("cache.hit", out is not None)
            return out

    def select(self, qz, has_z, qmod, modalities, c, now, trusted):
        """The batch hit check (L1): a span when there are candidates to check."""
        if len(c.dists) == 0:
            return self.inner.select(qz, has_z, qmod, modalities, c, now, trusted)
        with self.tracer.start_as_current_span("ushash.verify", attributes={"cache.candidates": len(c.dists)}) as span:
            chosen, cos = self.inner.select(qz, has_z, qmod, modalities, c, now, trusted)
            span.set_attribute("cache.hits", int((chosen >= 0).sum()))
            return chosen, cos

    def rank(self, q, c, revision, now, trusted, k=1):
        """The top-k hit check (L2, check / store): `choose`'s span for one, a span around the ranking for more."""
        if k <= 1:
            best = self.choose(q, c, revision, now, trusted)
            return [best] if best is not None else []
        with self.tracer.start_as_current_span("ushash.verify", attributes={"cache.candidates": len(c)}) as span:
            out = self.inner.rank(q, c, revision, now, trusted, k)
            span.set_attribute("cache.hits", len(out))
            return out

    def select_top(self, qz, has_z, qmod, modalities, c, now, trusted, k):
        """The top-k batch hit check of one query (L1, check / store): a span when there are candidates."""
        if len(c.dists) == 0:
            return self.inner.select_top(qz, has_z, qmod, modalities, c, now, trusted, k)
        with self.tracer.start_as_current_span("ushash.verify", attributes={"cache.candidates": len(c.dists)}) as span:
            out = self.inner.select_top(qz, has_z, qmod, modalities, c, now, trusted, k)
            span.set_attribute("cache.hits", len(out))
            return out
