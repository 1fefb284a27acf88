"""Seeded synthetic multimodal features with a known cluster structure (tests, benchmarks, baselines).

Each class has a latent centre in a shared space; each modality sees it through its own random linear
map plus noise, so cross-modal structure exists but no modality's raw space is aligned with another's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ushash.data.store import FeatureSplit, identity_path, store_identity, write_split

ENCODER = {"name": "synthetic", "fingerprint": "0" * 12, "config": {}}


def clustered(n_groups: int, n_classes: int, dims: dict[str, int], latent: int = 32, noise: float = 0.6,
              seed: int = 0, maps_seed: int = 1234, centres_seed: int = 4321, aligned: bool = False) -> dict[str, dict]:
    """Tables modality -> {x, ids, groups, labels}; one row per modality per group. Splits made with different
    `seed` share the class centres and modality maps (fixed by maps_seed / centres_seed). aligned=True gives
    every modality the same map (all dims must match), like a CLIP-style joint space."""
    centres = np.random.default_rng(centres_seed).normal(size=(n_classes, latent))
    if aligned and len(set(dims.values())) != 1:
        raise ValueError(f"aligned=True needs equal dims, got {dims}")
    maps = {m: np.random.default_rng(maps_seed + (0 if aligned else i)).normal(size=(latent, d)) / np.sqrt(latent)
            for i, (m, d) in enumerate(sorted(dims.items()))}
    rng = np.random.default_rng(seed)
    cls = rng.integers(n_classes, size=n_groups)
    inst = centres[cls] + 0.5 * rng.normal(size=(n_groups, latent))     # the item itself, shared by its modalities
    tables = {}
    for m, d in dims.items():
        x = (inst + noise * rng.normal(size=inst.shape)) @ maps[m]
        tables[m] = {"x": x.astype(np.float32), "ids": [f"{m}{seed}-{g}" for g in range(n_groups)],
                     "groups": [f"s{seed}-g{g}" for g in range(n_groups)], "labels": [(f"c{c}",) for c in cls]}
    return tables


def write_synthetic(root: str | Path, dataset: str = "synthetic", sizes=None, **kw) -> dict[str, FeatureSplit]:
    """Write train/val/test synthetic stores under `root` (the features dir) and return them opened."""
    sizes = sizes or {"train": 2000, "val": 300, "test": 500}
    out = {}
    for i, (split, n) in enumerate(sizes.items()):
        path = identity_path(root, store_identity(dataset, split, ENCODER))
        out[split] = write_split(path, dataset, split, clustered(n, seed=i, **kw), ENCODER)
    return out
