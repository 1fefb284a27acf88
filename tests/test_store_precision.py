"""A feature store is keyed by the precision its features were computed at: an encoder with `amp` on CUDA
computes under fp16 autocast, whose features differ from fp32 ones, yet its fingerprint leaves `amp` and the
device out (a head trained on CPU features must stay servable on a GPU). Both once shared one store folder,
so fp16 features were reused as fp32 ones and the other way round. An fp32 store keeps the folder it had."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from ushash.data import store
from ushash.data.extract import extract, stored_split
from ushash.data.rows import Row
from ushash.data.store import (FeatureStoreError, encoder_meta, identity_path, other_precisions, store_identity,
                               store_path)
from ushash.encoders import FP16_AUTOCAST, FP32, autocast_precision, build_encoder

# `_autocast` encoders say fp16 autocast while they run on the CPU, where torch turns the autocast off and says so
pytestmark = pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")

TINY = {"name": "tiny", "dim": 8, "modalities": ["image", "text"], "device": "cpu"}
FINGERPRINT, ROWS = "918f5cbf500c207e", "fedcba9876543210"


def _identity(precision=None):
    enc = {"name": "tiny", "fingerprint": FINGERPRINT, "config": {"name": "tiny"}}
    if precision is not None:
        enc["precision"] = precision
    return store_identity("toy", "train", enc, ROWS)


def _on_cuda(enc):
    """`enc` as it reports its device on CUDA (no CUDA is needed to test the keys; nothing is encoded)."""
    enc.__class__ = type("OnCuda", (type(enc),), {"device": property(lambda self: torch.device("cuda"))})
    return enc


def _autocast(enc):
    """`enc` saying it computes under fp16 autocast, as with `amp` on CUDA, while it encodes on the CPU here."""
    enc.__class__ = type("Autocast", (type(enc),), {"precision": property(lambda self: FP16_AUTOCAST)})
    return enc


def _rows(tmp_path, n=3):
    rows = []
    for i in range(n):
        path = tmp_path / f"{i}.png"
        Image.fromarray(np.full((8, 8, 3), 50 * i, np.uint8)).save(path)
        rows += [Row("image", f"i{i}", f"g{i}", str(path)), Row("text", f"t{i}", f"g{i}", f"caption {i}")]
    return rows


def _extract(rows, root, enc):
    return extract(rows, enc, root, "toy", "train", batch_size=4, num_workers=0, progress=False)


def test_precision_is_fp16_autocast_only_with_amp_on_cuda():
    assert autocast_precision(True, "cuda") == autocast_precision(True, torch.device("cuda:1")) == FP16_AUTOCAST
    assert autocast_precision(False, "cuda") == autocast_precision(True, "cpu") == FP32
    assert autocast_precision(False, "cpu") == FP32
    assert set(store.PRECISION_SUFFIX) == {FP32, FP16_AUTOCAST} and store.FP32 == FP32  # the store knows each


def test_amp_on_cuda_changes_the_precision_but_not_the_fingerprint():
    cpu = build_encoder(TINY)
    assert cpu.amp and cpu.precision == FP32  # amp is on, but never autocast on CPU
    cuda = _on_cuda(build_encoder(TINY))
    assert cuda.precision == FP16_AUTOCAST
    assert cuda.fingerprint == cpu.fingerprint == build_encoder({**TINY, "amp": False}).fingerprint
    assert _on_cuda(build_encoder({**TINY, "amp": False})).precision == FP32


def test_an_fp32_store_keeps_its_folder_and_record(tmp_path):
    """The folder name below is what the code gave before precision was part of the key."""
    assert identity_path("feat", _identity()) == identity_path("feat", _identity(FP32))
    assert str(identity_path("feat", _identity())) == f"feat/toy/train/tiny-{FINGERPRINT}-r{ROWS}"
    assert str(store_path("feat", "toy", "train", "tiny", FINGERPRINT)) == f"feat/toy/train/tiny-{FINGERPRINT}"
    enc = build_encoder(TINY)  # amp on, CPU: the record is the one made before precision was recorded
    assert encoder_meta(enc, {"name": "tiny"}) == {"name": "tiny", "fingerprint": enc.fingerprint,
                                                   "config": {"name": "tiny"}}


def test_an_fp16_autocast_store_is_another_folder():
    fp16 = identity_path("feat", _identity(FP16_AUTOCAST))
    assert str(fp16) == f"feat/toy/train/tiny-{FINGERPRINT}-fp16-r{ROWS}"
    assert fp16 != identity_path("feat", _identity())
    assert store_path("feat", "toy", "train", "tiny", FINGERPRINT, FP16_AUTOCAST).name == f"tiny-{FINGERPRINT}-fp16"
    enc = _on_cuda(build_encoder(TINY))
    assert encoder_meta(enc)["precision"] == FP16_AUTOCAST
    assert identity_path("feat", store_identity("toy", "train", encoder_meta(enc), ROWS)) == fp16
    with pytest.raises(ValueError, match="unknown encoder precision 'bf16'"):
        store_path("feat", "toy", "train", "tiny", FINGERPRINT, "bf16")


def test_autocast_features_never_reuse_the_fp32_store(tmp_path):
    rows = _rows(tmp_path)
    fp32 = _extract(rows, tmp_path / "feat", build_encoder(TINY))
    fp16 = _extract(rows, tmp_path / "feat", _autocast(build_encoder(TINY)))
    assert fp16.path != fp32.path and fp16.path.name == fp32.path.name.replace("-r", "-fp16-r", 1)
    assert fp16.meta["encoder"]["precision"] == FP16_AUTOCAST and "precision" not in fp32.meta["encoder"]
    assert json.loads((fp16.path / "meta.json").read_text())["encoder"]["precision"] == FP16_AUTOCAST
    assert _extract(rows, tmp_path / "feat", build_encoder(TINY)).path == fp32.path
    assert other_precisions(tmp_path / "feat", fp32.meta) == {FP16_AUTOCAST: [fp16.path]}


def test_a_lookup_uses_only_its_own_precision_and_names_the_other(tmp_path):
    rows = _rows(tmp_path)
    fp16 = _extract(rows, tmp_path / "feat", _autocast(build_encoder(TINY)))
    enc = {k: fp16.meta["encoder"][k] for k in ("name", "fingerprint")}  # an fp32 checkpoint's record
    recorded = {"dataset": "toy", "stores": {"train": fp16.meta["rows_fingerprint"]}}
    assert stored_split({**recorded, "encoder": fp16.meta["encoder"]}, "train", tmp_path / "feat").path == fp16.path
    with pytest.raises(FeatureStoreError, match=r"no feature store of toy/train .*\(fp32 features; fp16-autocast "
                                                r"store\(s\) of those rows at .*-fp16-r.*not used\).*encoder.amp=false"):
        stored_split({**recorded, "encoder": enc}, "train", tmp_path / "feat")
    # no rows record (synthetic data): the one store of that encoder, of its own precision only
    synthetic = {"dataset": "toy", "encoder": fp16.meta["encoder"]}
    assert stored_split(synthetic, "train", tmp_path / "feat").path == fp16.path
    with pytest.raises(FeatureStoreError, match=r"no feature store\(s\) of toy/train with encoder tiny \(.*, fp32\)"
                                                r".*; fp16-autocast store\(s\) of that encoder at .*tiny-.*-fp16-r.*not used"):
        stored_split({"dataset": "toy", "encoder": enc}, "train", tmp_path / "feat")
    fp32 = _extract(rows, tmp_path / "feat", build_encoder(TINY))
    assert stored_split({"dataset": "toy", "encoder": enc}, "train", tmp_path / "feat").path == fp32.path
    assert stored_split({**recorded, "encoder": enc}, "train", tmp_path / "feat").path == fp32.path


def test_a_sharded_extraction_refuses_an_encoder_of_another_precision_than_its_plan(tmp_path):
    """The shards' stores are keyed by the precision the plan was made at; an encoder that computes at another
    (moved to a GPU with `amp` on after the plan) would write them where the merge never looks."""
    from ushash.data.shards import Plan

    rows = _rows(tmp_path)
    plan = Plan(rows, build_encoder(TINY), tmp_path / "feat", "toy", "train", num_workers=0, progress=False)
    with pytest.raises(FeatureStoreError, match="computes at fp16-autocast .* keyed by fp32"):
        plan.run_task(plan.tasks(0, 1)[0], _autocast(build_encoder(TINY)))
    assert not plan.done(plan.units[0])
