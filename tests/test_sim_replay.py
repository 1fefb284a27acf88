"""The replay driver, the sweeps and the run (ushash/sim/replay.py): one reset per sweep point, the clock
put back, the progress bar without effect on the numbers, the primary metric the verb returns, and the
temporary export of a checkpoint removed when the run ends, whether it succeeds or fails."""

import tempfile

import numpy as np
import pytest

from ushash.config import compose
from ushash.data import synthetic
from ushash.sim.adapters import ExactKeyCache
from ushash.sim.pool import Pool, pool_from_split
from ushash.sim.replay import open_head, replay, run_cachesim, sweep
from ushash.sim.stream import SimClock, make_stream

DIMS = {"image": 24, "text": 24}
TIMING = ("lookup_p50_us", "lookup_p99_us")


def _untimed(res: dict) -> dict:
    return {k: v for k, v in res.items() if k not in TIMING}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    splits = synthetic.write_synthetic(root / "features", sizes={"train": 10, "val": 10, "test": 30}, n_classes=5,
                                       dims=DIMS, aligned=True)
    return root, splits


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, store):
    """A real (untrained) US-HASH checkpoint that names its dataset, encoder and feature store."""
    import torch

    from ushash.hashing.module import USHashModule

    root, _ = store
    torch.manual_seed(0)
    m = USHashModule(DIMS, bits=64, dim=32, hidden=32, init="random",
                     provenance={"dataset": "synthetic", "encoder": dict(synthetic.ENCODER),
                                 "features_dir": str(root / "features")})
    path = tmp_path_factory.mktemp("ckpt") / "last.ckpt"
    torch.save({"hyper_parameters": dict(m.hparams), "state_dict": m.state_dict()}, path)
    return path


@pytest.fixture()
def tmpdir_root(tmp_path, monkeypatch):
    """tempfile's folder, redirected so that what the run leaves there can be listed."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _cfg(tmp_path, *extra):
    return compose("cachesim", [f"paths.root={tmp_path}", "stream.n_requests=400", "sweep.radii=[0,3]",
                                "sweep.thresholds=[0.9]", "sweep.payload_thresholds=[0.9]", f"out={tmp_path / 'out'}",
                                "progress=false", *extra])


def test_the_export_of_a_checkpoint_lives_only_as_long_as_the_run(ckpt, tmp_path, tmpdir_root):
    cfg = _cfg(tmp_path, f"ckpt={ckpt}")
    with open_head(cfg) as head:
        (folder,) = tmpdir_root.iterdir()
        assert (folder / "export" / "manifest.json").exists() and head.bits == 64
        assert head.manifest["source"]["features_dir"].endswith("features")
    assert not any(tmpdir_root.iterdir())
    with pytest.raises(RuntimeError, match="boom"):
        with open_head(cfg):
            raise RuntimeError("boom")
    assert not any(tmpdir_root.iterdir())
    # the whole run: the export is made, used (the checkpoint names its feature store) and removed
    res = run_cachesim(cfg)
    assert res["info"]["dataset"] == "synthetic" and res["info"]["pool"] == 30 * 2 * 3
    assert not any(tmpdir_root.iterdir())


def test_a_failing_run_removes_the_temporary_export_too(ckpt, tmp_path, tmpdir_root):
    with pytest.raises(Exception):  # no feature store there
        run_cachesim(_cfg(tmp_path, f"ckpt={ckpt}", f"features_dir={tmp_path / 'nowhere'}"))
    assert not any(tmpdir_root.iterdir())


def test_open_head_needs_an_export_or_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="export=<export dir>"):
        with open_head(_cfg(tmp_path)):
            pass


def test_the_score_is_ushash_hit_rate_at_the_configured_radius(ckpt, tmp_path):
    from ushash.cachesim import main

    cfg = _cfg(tmp_path, f"ckpt={ckpt}", "cache.radius=3")
    res = run_cachesim(cfg)
    (row,) = [r for r in res["rows"] if r["method"] == "US-HASH 64-bit codes + payload check"]
    assert row["radius"] == 3 and res["score"] == row["hit_rate"]
    assert main(cfg) == res["score"]  # the verb returns it (what a Hydra sweeper optimises)
    assert run_cachesim(_cfg(tmp_path, f"ckpt={ckpt}", "methods=[exact,cosine]"))["score"] is None


def test_sweep_resets_before_every_point_and_labels_it(store):
    _, splits = store
    pool = pool_from_split(splits["test"], perturb=1, noise=0.0, seed=0)  # noise 0: variants share the exact key
    stream = make_stream(pool, 300, seed=1)
    clock = SimClock()
    cache = ExactKeyCache(pool, clock, ttl_s=None)
    pts = sweep(cache, "exact", [("first", {}, {"k": 1}), ("second", {}, {"k": 2})], stream, pool, clock)
    assert [(p["method"], p["param"], p["k"]) for p in pts] == [("exact", "first", 1), ("exact", "second", 2)]
    assert _untimed(pts[0]) | {"param": "second", "k": 2} == _untimed(pts[1])  # the second started empty too
    assert pts[0]["hit_rate"] > 0
    with pytest.raises(ValueError):
        sweep(cache, "exact", [("bad", {"radius": 1}, {})], stream, pool, clock)


def test_replay_puts_the_clock_back_and_the_progress_bar_changes_nothing():
    pool = Pool()
    for c in range(4):
        pool.add("text", np.zeros(2), c, "original", bytes([c]))
    stream = make_stream(pool, 500, seed=0)
    clock = SimClock(100.0)
    cache = ExactKeyCache(pool, clock, ttl_s=50)  # entries expire on the replay's clock (1 s / request)
    quiet = replay(cache, stream, pool, clock, seconds_per_request=1.0, revision_change_at=0.5)
    assert clock.t == 100.0
    cache.reset()
    shown = replay(cache, stream, pool, clock, seconds_per_request=1.0, revision_change_at=0.5, progress=True,
                   desc="test")
    assert _untimed(quiet) == _untimed(shown) and clock.t == 100.0
    assert 0 < quiet["hit_rate"] < quiet["oracle_hit_rate"] + 1e-9  # TTL misses, yet the oracle bounds it


def _distinct_pool(n: int) -> Pool:
    pool = Pool()
    for c in range(n):
        pool.add("text", np.zeros(2), c, "original", c.to_bytes(4, "big"))  # n distinct exact keys
    return pool


def test_peak_bytes_counts_the_live_entries_on_the_replays_clock_not_after_it_is_put_back():
    pool = _distinct_pool(100)
    clock = SimClock()
    # 100 distinct requests 1 s apart, TTL 10 s: never more than 10 live entries (40 bytes each)
    res = replay(ExactKeyCache(pool, clock, ttl_s=10), np.arange(100), pool, clock)
    assert res["peak_bytes"] == 10 * 40  # not every entry ever stored, as at the restored clock


class _DroppedOnRevision:
    """Every store kept (8 bytes) until a new revision drops them all, as the code caches' reload does."""
    name = "drops"

    def reset(self, **settings):
        self.n = 0

    def new_revision(self):
        self.n = 0

    def lookup(self, i):
        from ushash.sim.adapters import Outcome
        return Outcome(False)

    def store(self, i, value):
        self.n += 1

    def nearest_value(self, i):
        return None

    @property
    def nbytes(self):
        return 8 * self.n


def test_peak_bytes_includes_the_entries_just_before_a_revision_change_drops_them():
    pool = _distinct_pool(200)
    cache = _DroppedOnRevision()
    cache.reset()
    res = replay(cache, np.arange(200), pool, SimClock(), revision_change_at=0.75)
    assert res["peak_bytes"] == 150 * 8  # 150 stored before the change, 50 after
