"""The simulator's settings are one typed schema (ushash/sim/config.py) that configs/cachesim.yaml extends."""

import dataclasses

import pytest

import ushash.sim  # noqa: F401  (registers the schema)
from ushash.config import compose, to_dict
from ushash.sim.config import CacheSimConfig, METHODS, StreamConfig, SweepConfig, VariantsConfig


def test_the_yaml_takes_its_defaults_from_the_schema():
    cfg = compose("cachesim")
    assert to_dict(cfg.stream) == dataclasses.asdict(StreamConfig())
    assert to_dict(cfg.variants) == dataclasses.asdict(VariantsConfig())
    assert to_dict(cfg.sweep) == dataclasses.asdict(SweepConfig())
    d = CacheSimConfig()
    for k in ("export", "ckpt", "dataset", "features_dir", "split", "raw_media", "cosine_threshold", "out", "progress"):
        assert cfg[k] == getattr(d, k), k
    assert list(cfg.methods) == list(METHODS) and cfg.progress is True
    # the cache block: configs/cache/default.yaml with the simulator's own TTL
    assert cfg.cache.ttl_s == 7200 and cfg.cache.radius == 3 and cfg.cache.l2 is None


@pytest.mark.parametrize("override", ["stream.nrequests=5", "stream.n_requests=many", "variants.snr_db=loud",
                                      "progres=false"])
def test_misspelt_or_mistyped_settings_fail_at_load_time(override):
    with pytest.raises(Exception):
        compose("cachesim", [override])


def test_dataset_recipe_settings_can_be_added():
    assert compose("cachesim", ["+data.path=/somewhere"]).data.path == "/somewhere"


def test_documented_knobs_are_overridable_as_written():
    """docs/cache.md and the config comments write data=<recipe> data.<key>=...: no "+" needed."""
    cfg = compose("cachesim", ["data=manifest", "data.path=/somewhere/manifest.jsonl", "data.seed=3"])
    assert cfg.data.name == "manifest" and cfg.data.path == "/somewhere/manifest.jsonl" and cfg.data.seed == 3
    assert compose("cachesim", ["data=tuxpaint", "data.val_frac=0.2"]).data.val_frac == 0.2
    assert to_dict(compose("cachesim").data) == {}
