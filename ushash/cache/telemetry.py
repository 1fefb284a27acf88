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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Lookups take microseconds (L1) to milliseconds (L2 over the network).
LATENCY_BUCKETS = (5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)


class CacheMetrics:
    """All series of one cache. `text()` renders them in the Prometheus exposition format."""

    def __init__(self, bits: int, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.gets = Counter("cache_gets", "Cache lookups by result", ["result"], registry=r)
        self.hits = Counter("cache_hits", "Cache hits by tier", ["tier"], registry=r)
        self.puts = Counter("cache_puts", "Entries stored", registry=r)
        self.rejections = Counter("cache_rejections", "Candidates or puts refused, by reason", ["reason"], registry=r)
        self.evictions = Counter("cache_evictions", "Entries removed, by reason", ["reason"], registry=r)
        self.size_bytes = Gauge("cache_size_bytes", "Codes + payloads + values held in L1", registry=r)
        self.capacity_bytes = Gauge("cache_capacity_bytes", "L1 capacity in bytes", registry=r)
        self.entries = Gauge("cache_entries", "Entries held in L1", registry=r)
        self.lookup_seconds = Histogram("cache_lookup_duration_seconds", "Lookup wall time", ["tier"],
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.put_seconds = Histogram("cache_put_duration_seconds", "Put wall time", buckets=LATENCY_BUCKETS,
                                     registry=r)
        # One bucket per distance up to 32, then coarser; +Inf means nothing within the observed radius.
        dist_buckets = tuple(float(d) for d in list(range(0, 33)) + [40, 48, 64, 96, 128, 256, 512, 1024] if d <= bits)
        self.nearest = Histogram("cache_nearest_hamming_distance", "Nearest candidate's Hamming distance",
                                 ["result"], buckets=dist_buckets, registry=r)
        self.l2_errors = Counter("cache_l2_errors", "Redis (L2) failures absorbed, by operation", ["op"], registry=r)
        self.bloom_skips = Counter("cache_bloom_skips", "Lookups answered miss by the Bloom filter", registry=r)
        self.singleflight_waits = Counter("cache_singleflight_waits", "Callers that waited on another's compute",
                                          registry=r)
        self.early_refresh = Counter("cache_early_refresh", "XFetch early recomputations", registry=r)
        # children bound once: `labels()` costs microseconds on every lookup otherwise
        self.get_hit, self.get_miss = self.gets.labels(result="hit"), self.gets.labels(result="miss")
        self.nearest_hit, self.nearest_miss = self.nearest.labels(result="hit"), self.nearest.labels(result="miss")
        self.hit_tier = {t: self.hits.labels(tier=t) for t in ("l1", "l2")}
        self.lookup_tier = {t: self.lookup_seconds.labels(tier=t) for t in ("l1", "l2")}

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, **labels) -> float:
        """A sample's current value (tests, the simulator); 0.0 when the series does not exist yet."""
        v = self.registry.get_sample_value(name, labels or None)
        return 0.0 if v is None else float(v)
