"""Export of hash heads for the serving cache: bit-identical codes, manifest, refusals, no pickle, no Hydra."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ushash.serving import artifact
from ushash.evaluation import retrieval
from ushash.data import synthetic
from ushash.serving.artifact import (CorruptExport, IncompatibleExport, TamperedExport, TruncatedExport, load_export,
                             manifest_digest, revision_id)
from ushash.config import ROOT, compose

DIMS = {"image": 16, "text": 12, "audio": 8}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny head trained (2 epochs) on synthetic features, its checkpoint, and an export of it."""
    from ushash.hashing.module import load_checkpoint
    from ushash.hashing.training import run_train

    root = tmp_path_factory.mktemp("export")
    splits = synthetic.write_synthetic(root / "data" / "features", sizes={"train": 300, "val": 100, "test": 150},
                                       n_classes=5, dims=DIMS)
    # an MLP head (init=random, 2 layers): the export carries every op the serving forward knows
    cfg = compose("config", [f"paths.root={root}", "trainer.accelerator=cpu", "trainer.max_epochs=2", "bits=32",
                             "model.batch_size=128", "trainer.enable_progress_bar=false", "model.init=random",
                             "model.layers=2"])
    out = run_train(cfg, splits=splits)
    from ushash.serving.export import run_export
    exp = run_export(_export_cfg(root, out["last"], "exports/tiny"))
    return {"root": root, "ckpt": out["last"], "splits": splits, "export": exp, "module": load_checkpoint(out["last"])}


def _export_cfg(root, ckpt, out, *extra):
    return compose("export", [f"paths.root={root}", f"ckpt={ckpt}", f"out={out}", *extra])


@pytest.fixture()
def copy(trained, tmp_path):
    """A fresh copy of the export to damage."""
    dst = tmp_path / "e"
    shutil.copytree(trained["export"]["out"], dst)
    return dst


def _rewrite_manifest(path, change, resign=True):
    mf = json.loads((path / "manifest.json").read_text())
    change(mf)
    if resign:
        mf["revision"] = revision_id(mf["files"]["weights.safetensors"]["sha256"], mf)
        mf["manifest_sha256"] = manifest_digest(mf)
    (path / "manifest.json").write_text(json.dumps(mf))


# ------------------------------------------------------------------------------------------ equivalence

def test_export_codes_are_bit_identical_to_eval(trained):
    from ushash.evaluation.evaluate import methods_for

    head = load_export(trained["export"]["out"], expect_bits=32, expect_encoder=synthetic.ENCODER)
    module = trained["module"]
    methods = methods_for(module, synthetic.ENCODER["name"])
    code_m, float_m = methods["US-HASH 32-bit codes"], methods["float z (US-HASH head, 128-d)"]
    test = trained["splits"]["test"]
    for m, t in test.tables.items():
        x = np.asarray(t.x)
        kind, ref = code_m(m, x)
        assert kind == "codes"
        got = head.codes(m, x)
        assert got.dtype == np.uint8 and got.shape == (len(x), 4)
        np.testing.assert_array_equal(got, ref)
        np.testing.assert_array_equal(head.embed(m, x), float_m(m, x)[1])
    # and so the evaluation tables are the same when the export stands in for the checkpoint
    ours = {"codes": lambda m, x: ("codes", head.codes(m, x))}
    theirs = {"codes": code_m}
    assert retrieval.evaluate(test, ours) == retrieval.evaluate(test, theirs)


def test_manifest_describes_the_head(trained):
    head = load_export(trained["export"]["out"])
    mf = head.manifest
    assert mf["format"] == "ushash-export" and mf["format_version"] == 1
    assert head.bits == 32 and head.dim == 128 and mf["ushash_version"]
    assert head.modalities == tuple(DIMS) and head.in_dims == DIMS
    assert head.encoder == (synthetic.ENCODER["name"], synthetic.ENCODER["fingerprint"])
    assert mf["prototypes"]["shape"] == [32, 128]
    assert [op["op"] for op in mf["head"]["layers"]["image"]] == ["linear", "layer_norm", "gelu", "linear"]
    assert mf["payload"]["modalities"]["image"]["kind"] == "int4"
    assert mf["payload"]["modalities"]["text"]["kind"] == "fp16"
    assert head.payload["image"].nbytes == 72 and head.payload["text"].nbytes == 256
    assert set(mf["files"]) == {"weights.safetensors"} and len(mf["files"]["weights.safetensors"]["sha256"]) == 64
    assert len(head.revision) == 16
    # no machine paths travel with an export
    text = (trained["export"]["out"] + "/manifest.json")
    assert str(trained["root"]) not in open(text).read()


def test_export_is_deterministic_and_refuses_to_overwrite(trained):
    from ushash.serving.export import run_export

    root = trained["root"]
    with pytest.raises(FileExistsError, match="overwrite"):
        run_export(_export_cfg(root, trained["ckpt"], "exports/tiny"), module=trained["module"])
    again = run_export(_export_cfg(root, trained["ckpt"], "exports/tiny", "overwrite=true"), module=trained["module"])
    assert again["revision"] == trained["export"]["revision"]
    other = run_export(_export_cfg(root, trained["ckpt"], "exports/fp32", "payload=fp32"), module=trained["module"])
    assert other["revision"] != trained["export"]["revision"]   # payload settings are part of the revision
    assert other["manifest"]["files"] == trained["export"]["manifest"]["files"]   # same weights file


def test_no_pickle_in_an_export(trained):
    out = trained["export"]["out"]
    from pathlib import Path
    files = sorted(p.name for p in Path(out).iterdir())
    assert files == ["manifest.json", "weights.safetensors"]
    for name in files:
        data = (Path(out) / name).read_bytes()
        assert not (data[:1] == b"\x80" and data[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")), name  # pickle magic
        assert b"PK\x03\x04" not in data[:4]                                                   # torch zip
    from safetensors.numpy import load_file
    tensors = load_file(str(Path(out) / "weights.safetensors"))
    assert set(tensors) == set(trained["export"]["manifest"]["tensors"])


def test_serving_loader_imports_no_training_code():
    code = ("import sys, ushash.serving.artifact, ushash.serving.payload\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('hydra', 'omegaconf', 'pytorch_lightning', 'lightning', 'lightning_fabric', 'faiss') "
            "or m in ('ushash.hashing.module', 'ushash.train', 'ushash.hashing.training', 'ushash.hashing.heads', 'ushash.data.store', 'ushash.export', 'ushash.serving.export', "
            "'ushash.config', 'ushash.hashing.losses', 'ushash.hashing.datamodule'))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_channel_scales_are_calibrated_and_exported(trained):
    from ushash.serving.export import run_export

    root = trained["root"]
    cfg = _export_cfg(root, trained["ckpt"], "exports/chan", "payload=int4", "payload.image.scale=channel",
                      "payload.image.topk=48")
    exp = run_export(cfg, module=trained["module"])
    head = load_export(exp["out"])
    assert "payload.image.channel_scales" in head.manifest["tensors"]
    f = head.payload["image"]
    assert f.scale == "channel" and f.topk == 48 and f.channel_scales.shape == (128,)
    z = head.embed("image", np.asarray(trained["splits"]["test"].tables["image"].x))
    cos = head.payload.cosine(z, "image", head.payload.encode("image", z))
    # naive reference: the same rows kept to their 48 largest magnitudes in fp32, which the sparse codec
    # cannot beat; the 4-bit values with the calibrated channel scales lose little beyond that truncation
    kept = np.where(np.abs(z) >= -np.sort(-np.abs(z), axis=1)[:, 47:48], z, 0.0)
    ref = (z * kept).sum(1) / (np.linalg.norm(z, axis=1) * np.linalg.norm(kept, axis=1))
    print(f"INT4 channel-scaled cosine {cos.mean():.4f}, fp32 top-48 truncation {ref.mean():.4f}")
    assert np.all(cos <= ref + 1e-4) and cos.mean() > ref.mean() - 0.03, (cos.mean(), ref.mean())


def test_cli(trained, tmp_path):
    out = tmp_path / "cli"
    res = subprocess.run([sys.executable, "-m", "ushash.export", f"paths.root={trained['root']}",
                          f"ckpt={trained['ckpt']}", f"out={out}", "payload=fp16"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    head = load_export(out)
    assert head.payload["image"].kind == "fp16" and "revision" in res.stdout


# ------------------------------------------------------------------------------------------ refusals

def test_truncated_weights(copy):
    w = copy / "weights.safetensors"
    w.write_bytes(w.read_bytes()[:-100])
    with pytest.raises(TruncatedExport, match="truncated export: weights.safetensors has"):
        load_export(copy)


def test_tampered_weights_checksum(copy):
    w = copy / "weights.safetensors"
    data = bytearray(w.read_bytes())
    data[-5] ^= 0x01  # one bit of one weight
    w.write_bytes(bytes(data))
    with pytest.raises(TamperedExport, match="sha256 of weights.safetensors does not match"):
        load_export(copy)


def test_tampered_manifest(copy):
    _rewrite_manifest(copy, lambda mf: mf.update(bits=64), resign=False)
    with pytest.raises(TamperedExport, match="manifest_sha256"):
        load_export(copy)


def test_resigned_but_inconsistent_manifest_is_corrupt(copy):
    _rewrite_manifest(copy, lambda mf: mf.update(bits=64))   # hashes recomputed: shapes still disagree
    with pytest.raises(CorruptExport, match="prototypes"):
        load_export(copy)


def test_corrupt_manifest_and_missing_files(copy, tmp_path):
    (copy / "manifest.json").write_text('{"format": "ushash-export", "format_')
    with pytest.raises(CorruptExport, match="not valid JSON"):
        load_export(copy)
    with pytest.raises(CorruptExport, match="no manifest.json"):
        load_export(tmp_path)
    with pytest.raises(CorruptExport, match="not a directory"):
        load_export(tmp_path / "nowhere")


def test_missing_weights(trained, copy):
    (copy / "weights.safetensors").unlink()
    with pytest.raises(CorruptExport, match="weights.safetensors is missing"):
        load_export(copy)


def test_pickle_file_listed_in_manifest_is_refused(copy):
    (copy / "extra.pt").write_bytes(b"\x80\x04junk")
    _rewrite_manifest(copy, lambda mf: mf["files"].update({"extra.pt": {"sha256": "0" * 64, "bytes": 6}}))
    with pytest.raises(CorruptExport, match="no pickle"):
        load_export(copy)


def test_incompatible_format_version(copy):
    _rewrite_manifest(copy, lambda mf: mf.update(format_version=99))
    with pytest.raises(IncompatibleExport, match="format version 99"):
        load_export(copy)


def test_incompatible_bits_and_encoder(trained):
    out = trained["export"]["out"]
    with pytest.raises(IncompatibleExport, match="32-bit codes, expected 64 bits"):
        load_export(out, expect_bits=64)
    with pytest.raises(IncompatibleExport, match="encoder 'synthetic', expected 'offline'"):
        load_export(out, expect_encoder="offline")
    with pytest.raises(IncompatibleExport, match="fingerprint"):
        load_export(out, expect_encoder=("synthetic", "123456789abc"))
    head = load_export(out, expect_bits=32, expect_encoder={"name": "synthetic", "fingerprint": "0" * 12})
    with pytest.raises(ValueError, match=r"expected \[B, 16\]"):
        head.codes("image", np.zeros((3, 12), np.float32))
    with pytest.raises(ValueError, match="no head for modality"):
        head.codes("video", np.zeros((3, 12), np.float32))


def test_the_tokenizer_digests_of_the_training_features_reach_the_manifest(trained, tmp_path):
    """The checkpoint's provenance names the tokenizer digests its training store records (none for synthetic
    features: no key); the export writes them beside the encoder's fingerprint, where request.py checks them."""
    from ushash.serving.export import run_export

    prov = trained["module"].hparams.provenance
    assert prov["tokenizers"] == {}
    assert "tokenizers" not in load_export(trained["export"]["out"]).manifest["encoder"]
    prov["tokenizers"] = {"text tokenizer": "0123456789abcdef"}
    try:
        exp = run_export(_export_cfg(trained["root"], trained["ckpt"], str(tmp_path / "t")), module=trained["module"])
    finally:
        prov["tokenizers"] = {}
    assert load_export(exp["out"]).manifest["encoder"]["tokenizers"] == {"text tokenizer": "0123456789abcdef"}


def test_checkpoint_without_encoder_provenance_is_refused(trained, tmp_path):
    from ushash.serving.export import write_export

    with pytest.raises(ValueError, match="fingerprint"):
        write_export(trained["module"].model, tmp_path / "x", encoder={"name": "synthetic"})
    assert not (tmp_path / "x").exists()
    assert artifact.ALLOWED_SUFFIXES == (".json", ".safetensors")


def test_an_export_written_over_another_is_whole_whenever_a_folder_is_deleted(tmp_path, monkeypatch):
    """overwrite=true deleted the old export before renaming the new one into place: a loader then found a
    folder without its manifest (thousands of failures while 30 exports were written over one), and a kill
    after the delete left none. Now the old one is renamed aside first: after every deletion the path holds
    a whole export, the new one once the write returns, and nothing is left beside it."""
    import torch

    from ushash.hashing.heads import USHash
    from ushash.serving.export import write_export

    enc = {"name": "x", "fingerprint": "f"}
    out = tmp_path / "e"
    torch.manual_seed(0)
    first = write_export(USHash({"text": 12}, bits=32, dim=24), out, enc)
    old_revision = load_export(first).revision
    whole, rmtree = [], shutil.rmtree

    def watched(path, *a, **k):
        rmtree(path, *a, **k)
        whole.append(load_export(out).revision)   # raises where the path holds no whole export

    monkeypatch.setattr(shutil, "rmtree", watched)
    torch.manual_seed(1)
    write_export(USHash({"text": 12}, bits=32, dim=24), out, enc, overwrite=True)
    new_revision = load_export(out).revision
    assert new_revision != old_revision and whole and set(whole) == {new_revision}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]


# ------------------------------------------------------------------------------------------ one forward

def test_one_forward_for_training_and_serving(tmp_path):
    """USHash and ExportedHead run ushash.hashing.forward on the same modules: the layer list round trip
    rebuilds them exactly, draws nothing from torch's RNG, and every head is a HashHead."""
    import torch
    from torch import nn

    from ushash.hashing import forward
    from ushash.hashing.heads import USHash
    from ushash.serving.cache.lsh import LSHHead
    from ushash.serving.export import write_export

    torch.manual_seed(0)
    model = USHash({"image": 16, "text": 12}, bits=32, dim=24, hidden=20, layers=3).eval()
    ops, tensors = forward.to_ops(model.heads["image"], "heads.image")
    assert [op["op"] for op in ops] == ["linear", "layer_norm", "gelu"] * 2 + ["linear"]   # no dropout
    rng = torch.random.get_rng_state()
    rebuilt = forward.from_ops(ops, {k: v.detach() for k, v in tensors.items()})
    assert torch.equal(rng, torch.random.get_rng_state())
    x = torch.randn(7, 16)
    with torch.inference_mode():
        assert torch.equal(forward.embed(rebuilt, x), model.embed("image", x))
    with pytest.raises(TypeError, match="Linear, LayerNorm, GELU"):
        forward.to_ops(nn.Sequential(nn.ReLU()), "heads.x")

    head = load_export(write_export(model, tmp_path / "e", {"name": "x", "fingerprint": "f"}))
    feats = np.random.default_rng(0).normal(size=(forward.BATCH + 5, 12)).astype(np.float32)  # two batches
    ref, got = model.encode("text", feats), head.encode("text", feats)
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1], ref[1])
    lsh = LSHHead({"image": 16}, bits=32, dim=8)
    for h in (model, head, lsh):
        assert isinstance(h, forward.HashHead)
    for h in (head, lsh):
        assert isinstance(h, artifact.ServedHead)
    assert head.encode("text", feats[:0])[0].shape == (0, 4)


def test_export_and_payload_configs_take_their_defaults_from_the_schemas():
    import dataclasses

    from ushash.config import to_dict
    from ushash.serving.export import CalibrationConfig
    from ushash.serving.payload import DEFAULTS, PayloadConfig

    cfg = to_dict(compose("export", ["ckpt=x"]))
    assert cfg["payload"] == dataclasses.asdict(PayloadConfig()) == DEFAULTS
    assert cfg["calibration"] == dataclasses.asdict(CalibrationConfig()) and cfg["out"] is None
    sparse = to_dict(compose("export", ["ckpt=x", "payload=int4_sparse"]))["payload"]
    assert all(f == {"kind": "int4", "scale": "group", "group_size": 32, "topk": 64} for f in sparse.values())
    assert to_dict(compose("export", ["ckpt=x", "payload=fp16"]))["payload"]["image"]["kind"] == "fp16"
    with pytest.raises(Exception, match="group_size"):
        compose("export", ["ckpt=x", "payload.image.group_size=big"])
