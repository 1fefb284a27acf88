"""`CacheConfig`: every knob of a `SemanticCache`, with its default and meaning: the one source of the
cache's defaults. Registered in Hydra's ConfigStore as `cache/schema` (`register_schemas`, run when this
module is imported); configs/cache/default.yaml extends it and configs/cache/redis.yaml adds an L2.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ushash.data.media import MediaLimits
from ushash.serving.cache.entries import valid_tenant
from ushash.serving.calibration import ShadowConfig
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
    invalidate: bool = True                  # drop this replica's L1 copy of an L2 entry another replica replaced
                                             # or dropped (Redis pub/sub, channel <prefix>:changed)
    max_bucket_read: int = 20000             # bucket members one lookup reads at most: the largest probe buckets
                                             # beyond it are left out (counted, cache_l2_errors_total{op="oversized"})


@dataclass
class CacheConfig:
    """python -m ushash.serve / ushash.cachesim `cache.*` (configs/cache/*.yaml extend this schema)."""
    capacity_bytes: int = 256 << 20          # L1 budget: codes + payloads + values (not entries)
    radius: int = 3                          # Hamming radius of a hit (inclusive)
    observe_radius: Optional[int] = None     # search radius, >= radius: nearest-distance histogram of misses
                                             # sees this far (costs search time); None: radius
    payload_check: bool = True               # verify cosine(query z, decoded payload) before serving
    payload_threshold: float = 0.98          # ... and require at least this cosine (a false-hit budget
                                             # chooses it per modality pair instead: docs/cache.md)
    cross_modal: bool = True                 # a text request may hit an image entry (one shared space)
    max_candidates: int = 32                 # candidates within the radius checked per lookup, nearest first
    policy: str = "wtinylfu"                 # lru | lfu | wtinylfu | lruk
    policy_options: Dict[str, Any] = field(default_factory=dict)  # wtinylfu: window, protected; lruk: k, half_life_s
    backend: str = "auto"                    # auto = mindex (own multi-index, numba) | flat | mih | faiss (faiss:
                                             # flat, MIH, flat then MIH) | torch (tensors on `device`)
    device: str = "cpu"                      # torch backend: cuda, cuda:1, cpu
    mih_nhash: Optional[int] = None          # multi-index hash tables; None: bits // 16 (each at most 64 bits)
    mih_min_entries: int = 20000             # faiss: flat below this size, then MIH; mindex: tables from
                                             # min(this, 4096) codes (a scan below)
    ttl_s: Optional[float] = 3600.0          # time to live; 0 / None: no expiry
    ttl_jitter: float = 0.1                  # expiry = now + ttl * (1 - jitter * U[0, 1))
    adaptive_ttl: bool = False               # ttl = ttl_s x mem_factor x lat_factor (serving/cache/adaptive.py):
                                             # memory in use (`device`'s, or the process's) and the p99 of
                                             # get_or_compute's computations over the last minute
    xfetch_beta: float = 1.0                 # early refresh eagerness; 0: off
    bloom: bool = True                       # with an L2: a Bloom filter of the L1's code chunks; an empty
                                             # search it says "no entry" for is counted (cache_bloom_skips_total)
                                             # and, with bloom_guard_l2, not asked of the L2; no L2: no filter
    bloom_fp_rate: float = 0.01
    bloom_chunks: Optional[int] = None       # None: radius + 1, at least 16 bits a chunk
    bloom_guard_l2: bool = False             # also skip the L2 on a Bloom miss (single writer per tenant only)
    tenants: Optional[List[str]] = None      # allowed tenants; None: any valid name
    singleflight_timeout_s: float = 30.0     # followers wait at most this long for the leader
    media: MediaLimits = field(default_factory=MediaLimits)  # what decoding one raw request may cost
                                             # (pixels, aspect, SVG size and render time, audio, caption)
    l2: Optional[L2Config] = None            # Redis; None: L1 only
    calibration: Optional[str] = None        # calibration.json (python -m ushash.calibrate): per modality pair
                                             # radius + payload threshold for a false-hit budget, with its
                                             # bound; replaces radius / payload_threshold / cross_modal;
                                             # serve and proxy read a relative path from paths.root
    shadow: ShadowConfig = field(default_factory=ShadowConfig)   # online checks of a share of hits

    def __post_init__(self):
        if isinstance(self.l2, dict):
            self.l2 = _build(L2Config, self.l2, "cache.l2")
        if isinstance(self.shadow, dict):
            self.shadow = _build(ShadowConfig, self.shadow, "cache.shadow")
        if isinstance(self.media, dict):
            self.media = _build(MediaLimits, self.media, "cache.media")
        check_types(self, "cache")
        _positive(self, "cache", "capacity_bytes", "max_candidates", "mih_min_entries", "singleflight_timeout_s",
                  "bloom_fp_rate")
        if self.mih_nhash is not None:
            _positive(self, "cache", "mih_nhash")
        sh = self.shadow
        check_types(sh, "cache.shadow")
        if sh.target_false_hit_rate is not None and not 0.0 < sh.target_false_hit_rate < 1.0:
            raise ValueError(f"cache.shadow.target_false_hit_rate is a rate in (0, 1), or null (the calibration's); "
                             f"got {sh.target_false_hit_rate}")
        if sh.min_checks < 0:
            raise ValueError(f"cache.shadow.min_checks must be >= 0 checks; got {sh.min_checks}")
        if not sh.step > 0:
            raise ValueError(f"cache.shadow.step must be > 0 (how much a breach raises the threshold); got {sh.step}")
        if self.radius < 0:
            raise ValueError(f"cache.radius must be an integer >= 0 (bits of Hamming distance); got {self.radius}")
        if self.observe_radius is not None and self.observe_radius < self.radius:
            raise ValueError(f"cache.observe_radius ({self.observe_radius}) must be >= cache.radius ({self.radius}), "
                             f"or null")
        if self.bloom_chunks is not None:
            _positive(self, "cache", "bloom_chunks")
        if str(self.policy).lower() not in POLICIES:
            raise ValueError(f"cache.policy: unknown eviction policy {self.policy!r}; choose one of {sorted(POLICIES)}")
        if str(self.backend).lower() not in BACKENDS:
            raise ValueError(f"cache.backend: unknown search backend {self.backend!r}; choose one of {BACKENDS}")
        if not -1.0 <= self.payload_threshold <= 1.0:
            raise ValueError(f"cache.payload_threshold is a cosine in [-1, 1]; got {self.payload_threshold}")
        if self.ttl_s is not None and self.ttl_s < 0:
            raise ValueError(f"cache.ttl_s must be >= 0 seconds (0 or null: no expiry); got {self.ttl_s}")
        if not 0.0 <= self.ttl_jitter < 1.0:
            raise ValueError(f"cache.ttl_jitter is a fraction in [0, 1); got {self.ttl_jitter}")
        if self.xfetch_beta < 0:
            raise ValueError(f"cache.xfetch_beta must be >= 0 (0: off); got {self.xfetch_beta}")
        if not 0.0 < self.bloom_fp_rate < 1.0:
            raise ValueError(f"cache.bloom_fp_rate is a probability in (0, 1); got {self.bloom_fp_rate}")
        if self.tenants is not None:
            bad = [t for t in self.tenants if not valid_tenant(t)]
            if bad or not self.tenants:
                raise ValueError(f"cache.tenants must be a non-empty list of names of 1-64 characters of "
                                 f"[A-Za-z0-9_.-] (or null: any name); bad: {bad or self.tenants}")
        if self.l2 is not None:
            l2 = self.l2
            check_types(l2, "cache.l2")
            _positive(l2, "cache.l2", "timeout_s", "connect_timeout_s", "breaker_failures", "breaker_backoff_s",
                      "breaker_max_backoff_s", "max_bucket_read")
            if l2.chunks is not None:
                _positive(l2, "cache.l2", "chunks")
            if l2.watermark_check_s < 0:
                raise ValueError(f"cache.l2.watermark_check_s must be >= 0 (0: every lookup); got {l2.watermark_check_s}")
            if not str(l2.url).startswith(("redis://", "rediss://", "unix://")):
                raise ValueError(f"cache.l2.url must start with redis://, rediss:// or unix://; got {l2.url!r}")
            if not l2.prefix or not all(ch.isalnum() or ch in "_.-" for ch in l2.prefix):
                raise ValueError(f"cache.l2.prefix must be letters, digits or _.- ; got {l2.prefix!r}")

    def check_head(self, bits: int) -> None:
        """The settings that depend on the head, checked when one is loaded (before serving anything):
        the multi-index hash tables must divide the code, radii fit in it, and the torch device exist."""
        if str(self.backend).lower() in ("auto", "mih", "faiss"):
            from ushash.serving.cache.search import mih_tables

            try:
                mih_tables(bits, self.mih_nhash)
            except ValueError as e:
                raise ValueError(f"cache.{e} (the head's code)") from None
        if self.radius > bits or (self.observe_radius or 0) > bits:
            raise ValueError(f"cache.radius / observe_radius must be <= the head's {bits} bits")
        device = str(self.device)
        if str(self.backend).lower() != "torch":
            if device != "cpu":
                raise ValueError(f"cache.device={device!r} needs cache.backend=torch (the other backends run on the CPU)")
        elif device.startswith("cuda"):
            import torch

            index = int(device.split(":", 1)[1]) if ":" in device else 0
            if not torch.cuda.is_available() or index >= torch.cuda.device_count():
                raise ValueError(f"cache.device={device!r}: no such CUDA device here; use cache.device=cpu")

    @classmethod
    def from_dict(cls, d: dict | None) -> "CacheConfig":
        return _build(cls, dict(d or {}), "cache")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _build(cls, d: dict, where: str) -> Any:
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a mapping of settings; got {type(d).__name__} {d!r:.60}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {unknown}; known: {sorted(names)}")
    return cls(**d)


def _type_ok(value, tp) -> tuple[bool, Any]:
    """(does `value` fit the annotation `tp`, the value normalised: int for float fields, list copies)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return True, None
        for a in args:
            if a is not type(None):
                ok, v = _type_ok(value, a)
                if ok:
                    return True, v
        return False, value
    if tp is Any:
        return True, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False, value
        return True, float(value)
    if tp is str:
        return isinstance(value, str), value
    if origin in (list, List):
        (item,) = typing.get_args(tp) or (Any,)
        if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
            return False, value
        out = []
        for x in value:
            ok, v = _type_ok(x, item)
            if not ok:
                return False, value
            out.append(v)
        return True, out
    if origin in (dict, Dict):
        return (hasattr(value, "keys"), dict(value)) if hasattr(value, "keys") else (False, value)
    if dataclasses.is_dataclass(tp):
        return isinstance(value, tp), value
    return True, value


def _describe(tp) -> str:
    return str(tp).replace("typing.", "").replace("<class '", "").replace("'>", "")


def check_types(obj, where: str) -> None:
    """Every field of the dataclass `obj` has its annotated type (ints are not floats rounded, a string is
    not a list, NaN and inf are no float setting), else ValueError naming `where.key`."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        ok, norm = _type_ok(value, hints[f.name])
        if not ok:
            raise ValueError(f"{where}.{f.name} must be {_describe(hints[f.name])}; got {value!r:.80} "
                             f"({type(value).__name__})")
        setattr(obj, f.name, norm)


def _positive(obj, where: str, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if not v > 0:
            raise ValueError(f"{where}.{name} must be > 0; got {v!r}")


def register_schemas() -> None:
    """Put the cache schemas in Hydra's ConfigStore (idempotent): configs/cache/*.yaml name `schema` in
    their defaults. Called on import, so any verb that imports the cache can compose `cache`."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="cache", name="schema", node=CacheConfig)


register_schemas()
