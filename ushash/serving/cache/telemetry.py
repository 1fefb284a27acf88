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
"""

from __future__ import annotations

import bisect
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

    def record_lookup(self, hit: bool, tier: str, nearest: float, seconds: float) -> None:
        self._hot.record(hit, tier, nearest, seconds)

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
        self.dist_bounds = [float(d) for d in list(range(0, 33)) + [40, 48, 64, 96, 128, 256, 512, 1024] if d <= bits]
        self.gets = {"hit": 0, "miss": 0}
        self.hits = {"l1": 0, "l2": 0}
        self.lat = {t: [0] * (len(self.lat_bounds) + 1) for t in ("l1", "l2")}
        self.lat_sum = {"l1": 0.0, "l2": 0.0}
        self.dist = {r: [0] * (len(self.dist_bounds) + 1) for r in ("hit", "miss")}
        self.dist_sum = {"hit": 0.0, "miss": 0.0}
        self._lock = threading.Lock()

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
