"""`CacheSimConfig`: every setting of the cache simulator with its default and meaning.

Registered in Hydra's ConfigStore as `schema_cachesim` when `ushash.sim` is imported; configs/cachesim.yaml
extends it (`defaults: [schema_cachesim, ...]`), so a misspelt or mistyped key fails at load time. The
`cache` block is the SemanticCache's own settings (configs/cache/default.yaml), which the simulator
passes to every code cache it builds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

METHODS = ("exact", "cosine", "lsh", "lsh_codes_only", "ushash", "ushash_codes_only")


@dataclass
class StreamConfig:
    """The request stream (ushash/sim/stream.py) and its clock."""
    n_requests: int = 20000
    zipf_s: float = 1.0               # popularity skew over classes (0: uniform)
    seconds_per_request: float = 1.0  # the simulated clock advances this much per request (TTLs act)
    revision_change_at: float = 0.5   # a new head revision is deployed at this fraction of the stream (0: never)
    seed: int = 0                     # the stream, the variants and the LSH hyperplanes


@dataclass
class VariantsConfig:
    """The members of each equivalence class besides the item's own rows (ushash/sim/pool.py, augment.py)."""
    perturb: int = 2                  # variants per row (feature-space perturbations, or media transformations)
    noise: float = 0.1                # feature space: ||noise|| = noise * ||x||
    jpeg_quality: int = 40            # raw media: images re-encoded at this JPEG quality ...
    crop_frac: float = 0.8            # ... and cropped to this fraction of each side
    snr_db: float = 20.0              # raw media: sounds with white noise at this SNR
    captions: list[str] = field(default_factory=lambda: ["recased"])  # raw media: caption variant kinds (sim/augment.py
                                      # CAPTION_VARIANTS): recased, reordered, synonym, typo,
                                      # template (docs/cache.md: how far each moves MiniLM's embedding)


@dataclass
class SweepConfig:
    """The settings swept besides the main table's (plotted as hit rate against false-hit rate)."""
    radii: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4, 5, 6, 8, 10, 12])   # Hamming radius of the code caches
    thresholds: list[float] = field(default_factory=lambda: [0.98, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6])  # the float cache's cosine
    payload_thresholds: list[float] = field(default_factory=lambda: [0.8, 0.9, 0.95, 0.98, 0.99])  # US-HASH at cache.radius (empty: skip)


@dataclass
class DefencesConfig:
    """The defences of the failure scenarios (ushash/sim/failures.py) as the cache's defaults set them;
    scenario runs switch them off all together, then on one at a time, then all (docs/cache.md)."""
    single_flight: bool = True        # one computation per key; the others wait for it
    bloom: bool = True                # a Bloom filter of the keys that can exist: others refused uncomputed
    bloom_fp_rate: float = 0.01
    ttl_jitter: float = 0.1           # expiry = now + ttl * (1 - jitter * U[0, 1)) (CacheConfig.ttl_jitter)
    xfetch_beta: float = 1.0          # early refresh (CacheConfig.xfetch_beta); 0: off
    swr_s: float = 300.0              # stale-while-revalidate: serve up to this long past expiry, refresh behind
    swr_max_inflight: int = 8         # ... started only while fewer computations than this are in flight
    stale_if_error_s: float = 600.0   # serve-stale-on-error: up to this long past expiry
    breaker: bool = True              # a circuit breaker on the compute path (pybreaker), fallback: stale or fast error
    breaker_fail_max: int = 5         # consecutive failed computations that open it
    breaker_reset_s: float = 2.0      # open this long, then one trial call


@dataclass
class FailuresConfig:
    """The failure scenarios (`scenario=penetration|breakdown|avalanche|all`): the traffic, the service
    behind the cache (ushash/sim/downstream.py) and the trigger of each scenario. Simulated time."""
    duration_s: float = 90.0          # simulated seconds of traffic
    rate: float = 600.0               # client requests per second (mean)
    arrivals: str = "poisson"         # poisson | gpd (generalised-Pareto inter-arrival times)
    gpd_shape: float = 0.83           # the design's fit of inter-arrival times
    n_keys: int = 8000                # the cacheable keys, Zipf-popular
    zipf_s: float = 1.0
    novel_frac: float = 0.05          # requests for valid keys never asked before (always a miss)
    ttl_s: float = 300.0
    workers: int = 16                 # the service's concurrency limit (calls in service at once)
    queue_limit: int = 200            # calls waiting behind them; more are refused
    service_median_s: float = 0.08    # lognormal service time: median ...
    service_sigma: float = 0.5        # ... and log-space sigma
    timeout_s: float = 1.0            # a caller waits this long for a computation
    retries: int = 2                  # client retries after an error, ...
    backoff_s: float = 0.1            # ... after backoff * 2^attempt * U[0.5, 1.5)
    hit_s: float = 0.001              # the latency of an answer from the cache
    trigger_s: float = 30.0           # when the failure starts
    flood_rate: float = 300.0         # penetration: requests per second for keys that do not exist ...
    flood_s: float = 30.0             # ... for this long
    hot_share: float = 0.3            # breakdown: one key gets this share of the traffic ...
    hot_median_s: float = 1.0         # ... costs this much to compute ...
    hot_ttl_s: float = 30.0           # ... and is written at t = 0 with this TTL (expires at ~30, 60, 90 s)
    seed: int = 0


@dataclass
class CacheSimConfig:
    """python -m ushash.cachesim (configs/cachesim.yaml)."""
    export: Optional[str] = None      # an export directory (python -m ushash.export) ...
    ckpt: Optional[str] = None        # ... or a checkpoint (exported to a temporary folder, removed at the end)
    dataset: Optional[str] = None     # default: the dataset the export was trained on
    features_dir: Optional[str] = None  # default: the export's feature store, else paths.features_dir
    split: str = "test"               # the stream is built from this split (never the training split)
    raw_media: bool = False           # true: load the dataset's media and re-encode/crop/noise them for real
    data: dict[str, Any] = field(default_factory=dict)  # dataset recipe settings for raw_media (configs/data/<name>.yaml keys)
    stream: StreamConfig = field(default_factory=StreamConfig)
    variants: VariantsConfig = field(default_factory=VariantsConfig)
    methods: list[str] = field(default_factory=lambda: list(METHODS))  # ushash_codes_only runs only with ushash
    cosine_threshold: float = 0.8     # the float cache's threshold in the main table (GPTCache's default)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    scenario: Optional[str] = None    # penetration | breakdown | avalanche | all: the failure scenarios instead
                                      # of the workload replay (no export needed; ushash/sim/failures.py)
    failures: FailuresConfig = field(default_factory=FailuresConfig)
    defences: DefencesConfig = field(default_factory=DefencesConfig)
    out: Optional[str] = None         # default: experiments/cachesim/<dataset>-<revision>
    progress: bool = True             # a progress bar over the requests of each replay
    # the config groups (their own YAML)
    paths: Any = None
    cache: Any = None                 # SemanticCache settings (configs/cache/default.yaml); l2 is always off here


def check_replay_settings(cfg) -> None:
    """Refuse, with one line naming the field and the fix, the workload-replay settings the schema's types
    accept but that would silently measure nothing or something else than they say."""
    methods = [str(m) for m in cfg.methods]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"methods: unknown method(s) {unknown}; choose from {list(METHODS)}")
    if not methods:
        raise ValueError(f"methods is empty: nothing to replay; name at least one of {list(METHODS)}")
    if "ushash_codes_only" in methods and "ushash" not in methods:
        raise ValueError("methods: ushash_codes_only runs only with ushash; add ushash to methods")
    if str(cfg.split) not in ("val", "test"):
        why = "the heads were trained on it: its hit rates flatter them" if str(cfg.split) == "train" else "unknown split"
        raise ValueError(f"split={cfg.split}: {why}; replay split=test (or split=val)")
    st = cfg.stream
    if int(st.n_requests) <= 0:
        raise ValueError(f"stream.n_requests must be > 0; got {st.n_requests}")
    if float(st.zipf_s) < 0:
        raise ValueError(f"stream.zipf_s must be >= 0 (0: uniform); got {st.zipf_s}")
    if float(st.seconds_per_request) <= 0:
        raise ValueError(f"stream.seconds_per_request must be > 0 (the clock TTLs run on); got {st.seconds_per_request}")
    if not 0.0 <= float(st.revision_change_at) < 1.0:
        raise ValueError(f"stream.revision_change_at is a fraction of the stream in [0, 1) (0: never); "
                         f"got {st.revision_change_at}")
    if float(st.revision_change_at) and int(float(st.revision_change_at) * int(st.n_requests)) == 0:
        raise ValueError(f"stream.revision_change_at={st.revision_change_at} puts the change before the first of "
                         f"{st.n_requests} requests (no change at all); raise it or use 0 for none")
    if int(cfg.variants.perturb) < 0:
        raise ValueError(f"variants.perturb is a number of copies, >= 0; got {cfg.variants.perturb}")
    if not -1.0 <= float(cfg.cosine_threshold) <= 1.0:
        raise ValueError(f"cosine_threshold is a cosine in [-1, 1]; got {cfg.cosine_threshold}")
    for name in ("thresholds", "payload_thresholds"):
        bad = [float(x) for x in cfg.sweep.get(name) or [] if not -1.0 <= float(x) <= 1.0]
        if bad:
            raise ValueError(f"sweep.{name} are cosines in [-1, 1]; got {bad}")
    if any(int(r) < 0 for r in cfg.sweep.radii):
        raise ValueError(f"sweep.radii are Hamming radii >= 0; got {list(cfg.sweep.radii)}")
    if cfg.get("cache") is not None and cfg.cache.get("calibration"):
        # a calibration sets every pair's radius and threshold: the sweeps over both would replay one point
        # under many labels (and the LSH cache is not the head it was made for)
        raise ValueError("cache.calibration: the replay sweeps the radius and the payload threshold, which a "
                         "calibration fixes; measure a calibration with benchmarks/false_hit_budget.py (or "
                         "ushash.sim.calibrate.measure)")


def check_failures_settings(f: FailuresConfig, scenario: str) -> None:
    """Refuse, with one line naming the field and the fix, the failure-scenario settings that would crash the
    simulation or run something else than they say (`scenario`: the one about to run)."""
    for name in ("duration_s", "rate"):
        if not float(getattr(f, name)) > 0:
            raise ValueError(f"failures.{name} must be > 0; got {getattr(f, name)}")
    for name, low in (("n_keys", 1), ("workers", 1), ("queue_limit", 0), ("retries", 0)):
        if int(getattr(f, name)) < low:
            raise ValueError(f"failures.{name} must be >= {low}; got {getattr(f, name)}")
    if float(f.zipf_s) < 0:
        raise ValueError(f"failures.zipf_s must be >= 0 (0: uniform); got {f.zipf_s}")
    for name in ("hot_share", "novel_frac"):
        if not 0.0 <= float(getattr(f, name)) <= 1.0:
            raise ValueError(f"failures.{name} is a share of the traffic in [0, 1]; got {getattr(f, name)}")
    if scenario == "penetration" and float(f.trigger_s) + float(f.flood_s) > float(f.duration_s):
        raise ValueError(f"failures.trigger_s + failures.flood_s ({f.trigger_s:g} + {f.flood_s:g} s) runs past "
                         f"failures.duration_s ({f.duration_s:g} s); shorten the flood or lengthen the run")


def register_schema() -> None:
    """Put the schema in Hydra's ConfigStore (idempotent): configs/cachesim.yaml names it in its defaults.
    Importing the serving cache registers `cache/schema`, which configs/cache/*.yaml extend."""
    from hydra.core.config_store import ConfigStore

    import ushash.serving.cache  # noqa: F401
    ConfigStore.instance().store(name="schema_cachesim", node=CacheSimConfig)
