"""`CacheConfig`: every knob of a `SemanticCache`, with its default and meaning: the one source of the
cache's defaults. Registered in Hydra's ConfigStore as `cache/schema` (`register_schemas`, run when this
module is imported); configs/cache/default.yaml extends it and configs/cache/redis.yaml adds an L2.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ushash.serving.cache.policies import POLICIES
from ushash.serving.cache.search import BACKENDS


@dataclass
class L2Config:
    """The Redis L2 (ushash.serving.cache.redis_store); configs/cache/redis.yaml turns it on."""
    url: str = "redis://127.0.0.1:6379/0"   # redis:// or rediss://; a cluster seed node with cluster: true
    cluster: bool = False                    # redis.cluster.RedisCluster (keys are hash-tagged per tenant)
    prefix: str = "ushash"                   # key prefix (several caches can share one Redis)
    chunks: Optional[int] = None             # code chunks for the bucket keys; None: bits // 16
    timeout_s: float = 0.05                  # socket timeout per call: a slow Redis is a failed call
    connect_timeout_s: float = 0.1
    breaker_failures: int = 3                # consecutive failures that open the circuit
    breaker_backoff_s: float = 1.0           # first pause before retrying the L2 (doubles, capped)
    breaker_max_backoff_s: float = 30.0
    watermark_check_s: float = 1.0           # how often the newest announced revision is re-read; 0: every lookup
    write: bool = True                       # store puts in the L2 too


@dataclass
class CacheConfig:
    """python -m ushash.serve / ushash.cachesim `cache.*` (configs/cache/*.yaml extend this schema)."""
    capacity_bytes: int = 256 << 20          # L1 budget: codes + payloads + values (not entries)
    radius: int = 3                          # Hamming radius of a hit (inclusive)
    observe_radius: Optional[int] = None     # search radius, >= radius: nearest-distance histogram of misses
                                             # sees this far (costs search time); None: radius
    payload_check: bool = True               # verify cosine(query z, decoded payload) before serving
    payload_threshold: float = 0.98          # ... and require at least this cosine (docs/cache.md: 0.8 lets
                                             # through 20% false hits on Tux Paint at radius 3, 0.98 0.8%)
    cross_modal: bool = True                 # a text request may hit an image entry (one shared space)
    max_candidates: int = 32                 # candidates within the radius checked per lookup, nearest first
    policy: str = "wtinylfu"                 # lru | lfu | wtinylfu | lruk
    policy_options: Dict[str, Any] = field(default_factory=dict)  # wtinylfu: window, protected; lruk: k, half_life_s
    backend: str = "auto"                    # auto | flat | mih (faiss, CPU) | torch (tensors on `device`)
    device: str = "cpu"                      # torch backend: cuda, cuda:1, cpu
    mih_nhash: Optional[int] = None          # multi-index hash tables; None: bits // 16
    mih_min_entries: int = 20000             # auto: switch from flat to multi-index hashing at this size
    ttl_s: Optional[float] = 3600.0          # time to live; 0 / None: no expiry
    ttl_jitter: float = 0.1                  # expiry = now + ttl * (1 - jitter * U[0, 1))
    xfetch_beta: float = 1.0                 # early refresh eagerness; 0: off
    bloom: bool = True                       # Bloom filter of stored code chunks: skip searches that must miss
    bloom_fp_rate: float = 0.01
    bloom_chunks: Optional[int] = None       # None: radius + 1, at least 16 bits a chunk
    bloom_guard_l2: bool = False             # also skip the L2 on a Bloom miss (single writer per tenant only)
    tenants: Optional[List[str]] = None      # allowed tenants; None: any valid name
    singleflight_timeout_s: float = 30.0     # followers wait at most this long for the leader
    l2: Optional[L2Config] = None            # Redis; None: L1 only

    def __post_init__(self):
        if isinstance(self.l2, dict):
            self.l2 = _build(L2Config, self.l2, "cache.l2")
        if int(self.capacity_bytes) <= 0:
            raise ValueError(f"capacity_bytes must be positive; got {self.capacity_bytes}")
        if int(self.radius) < 0:
            raise ValueError(f"radius must be >= 0; got {self.radius}")
        if self.observe_radius is not None and int(self.observe_radius) < int(self.radius):
            raise ValueError(f"observe_radius ({self.observe_radius}) must be >= radius ({self.radius})")
        if str(self.policy).lower() not in POLICIES:
            raise ValueError(f"unknown eviction policy {self.policy!r}; choose one of {sorted(POLICIES)}")
        if str(self.backend).lower() not in BACKENDS:
            raise ValueError(f"unknown search backend {self.backend!r}; choose one of {BACKENDS}")
        if not -1.0 <= float(self.payload_threshold) <= 1.0:
            raise ValueError(f"payload_threshold is a cosine in [-1, 1]; got {self.payload_threshold}")
        if self.tenants is not None:
            self.tenants = [str(t) for t in self.tenants]

    @classmethod
    def from_dict(cls, d: dict | None) -> "CacheConfig":
        return _build(cls, dict(d or {}), "cache")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _build(cls, d: dict, where: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {unknown}; known: {sorted(names)}")
    return cls(**d)


def register_schemas() -> None:
    """Put the cache schemas in Hydra's ConfigStore (idempotent): configs/cache/*.yaml name `schema` in
    their defaults. Called on import, so any verb that imports the cache can compose `cache`."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="cache", name="schema", node=CacheConfig)


register_schemas()
