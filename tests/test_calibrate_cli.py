"""python -m ushash.calibrate: on a tiny export of synthetic data it writes <export>/calibration.json, the same
calibration `ushash.sim.calibrate.calibrate` makes of the export's own val rows, and a cache serves by it;
the test split, a missing export and a missing feature store are one-line mistakes."""

import json
import logging

import pytest

from ushash.config import compose
from ushash.data import synthetic
from ushash.serving.artifact import load_export
from ushash.serving.calibration import Calibration, CalibrationSettings
from ushash.serving.export import write_export
from ushash.sim.calibrate import calibrate, run_calibrate
from ushash.sim.pool import pool_from_split
from ushash.sim.stream import make_stream

DIMS = {"image": 24, "text": 24}
SMALL = ["requests=800", "target_false_hit_rate=0.05", "calibration.max_radius=8",
         "calibration.threshold_step=0.02", "calibration.path_points=4", "calibration.tight_thresholds=[0.95]"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    import torch

    from ushash.hashing.heads import USHash

    root = tmp_path_factory.mktemp("calibrate")
    splits = synthetic.write_synthetic(root / "features", sizes={"train": 20, "val": 40, "test": 30},
                                       n_classes=8, dims=DIMS, aligned=True)
    torch.manual_seed(0)
    model = USHash(DIMS, bits=64, dim=32, hidden=32).eval()
    encoder = {"name": "synthetic", "fingerprint": synthetic.ENCODER["fingerprint"]}
    write_export(model, root / "exports" / "tiny", encoder, source={"dataset": "synthetic"})
    return root, splits


def _cfg(root, *overrides):
    return compose("calibrate", [f"paths.root={root}", "export=exports/tiny", f"features_dir={root / 'features'}",
                                 *SMALL, *overrides])


def test_the_verb_writes_the_calibration_calibrate_makes(project, capsys):
    from ushash.calibrate import main
    from ushash.serving.cache import SemanticCache

    root, splits = project
    out = main.__wrapped__(_cfg(root))                  # the verb's body, without Hydra's own run folder
    path = root / "exports" / "tiny" / "calibration.json"
    assert out == str(path) and path.exists()
    printed = capsys.readouterr().out
    assert printed.startswith("| pair | status |")
    loaded = Calibration.load(path)
    # the naive reference: the val rows' pool and a Zipf stream, seeded as the verb seeds them
    head = load_export(root / "exports" / "tiny")
    pool = pool_from_split(splits["val"], seed=0)
    stream = make_stream(pool, 800, 1.0, 0)
    settings = CalibrationSettings(split="val", n_requests=800, max_radius=8, threshold_step=0.02, path_points=4,
                                   tight_thresholds=(0.95,))
    ref = calibrate(head, pool, stream, 0.05, settings,
                    info={"dataset": "synthetic", "split": "val", "zipf_s": 1.0, "seed": 0})
    assert loaded.to_dict() == json.loads(json.dumps(ref.to_dict()))
    assert set(loaded.pairs) == {"image>image", "image>text", "text>image", "text>text"}
    assert loaded.table() in printed
    cache = SemanticCache(head, {"calibration": str(path)})      # what the file is for
    assert cache.budget.calibrated and cache.budget.points == loaded.pairs
    # out= elsewhere, and a calibration block setting reaches the settings
    other = run_calibrate(_cfg(root, f"out={root / 'other.json'}", "calibration.path=hits"))
    assert other["out"] == str(root / "other.json")
    assert Calibration.load(root / "other.json").info["settings"]["path"] == "hits"


@pytest.mark.parametrize("override,err,match", [
    ("split=test", ValueError, "split=test: .*use split=val"),
    ("calibration.split=test", ValueError, "split=test"),
    ("export=exports/missing", FileNotFoundError, r"no export at .*missing: make one with python -m ushash.export"),
    ("features_dir=/nonexistent/features", Exception, r"feature store.*python -m ushash.extract"),
])
def test_mistakes_are_refused_before_anything_is_written(project, override, err, match):
    root, _ = project
    with pytest.raises(err, match=match):
        run_calibrate(_cfg(root, override, f"out={root / 'refused.json'}"))
    assert not (root / "refused.json").exists()


def test_the_test_split_is_one_line_and_status_2(project, caplog, monkeypatch):
    from ushash.calibrate import main

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    root, _ = project
    with caplog.at_level(logging.ERROR, logger="ushash"), pytest.raises(SystemExit) as e:
        main.__wrapped__(_cfg(root, "split=test"))
    assert e.value.code == 2
    (rec,) = caplog.records
    assert rec.getMessage().startswith("split=test") and "\n" not in rec.getMessage()


def test_the_calibration_block_is_the_settings_and_mistakes_fail_at_load_time():
    from ushash.config import to_dict

    cfg = compose("calibrate", ["export=x"])
    assert CalibrationSettings(**to_dict(cfg.calibration)) == CalibrationSettings(n_requests=40000)
    assert (cfg.split, cfg.requests, cfg.target_false_hit_rate) == ("val", 40000, 0.01)
    block = to_dict(compose("calibrate", ["split=x", "requests=7"]).calibration)
    assert (block["split"], block["n_requests"]) == ("x", 7)
    for bad in ("calibration.pth=hits", "calibration.max_radius=far", "request=5"):
        with pytest.raises(Exception):
            compose("calibrate", [bad])
