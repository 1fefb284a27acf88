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


@dataclass
class SweepConfig:
    """The settings swept besides the main table's (plotted as hit rate against false-hit rate)."""
    radii: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4, 5, 6, 8, 10, 12])   # Hamming radius of the code caches
    thresholds: list[float] = field(default_factory=lambda: [0.98, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6])  # the float cache's cosine
    payload_thresholds: list[float] = field(default_factory=lambda: [0.8, 0.9, 0.95, 0.98, 0.99])  # US-HASH at cache.radius (empty: skip)


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
    out: Optional[str] = None         # default: experiments/cachesim/<dataset>-<revision>
    progress: bool = True             # a progress bar over the requests of each replay
    # the config groups (their own YAML)
    paths: Any = None
    cache: Any = None                 # SemanticCache settings (configs/cache/default.yaml); l2 is always off here


def register_schema() -> None:
    """Put the schema in Hydra's ConfigStore (idempotent): configs/cachesim.yaml names it in its defaults.
    Importing the serving cache registers `cache/schema`, which configs/cache/*.yaml extend."""
    from hydra.core.config_store import ConfigStore

    import ushash.serving.cache  # noqa: F401
    ConfigStore.instance().store(name="schema_cachesim", node=CacheSimConfig)
