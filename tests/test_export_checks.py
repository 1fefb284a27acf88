"""Export loading refuses malformed manifests with CorruptExport (never a KeyError or TypeError), tensors
that are not finite float32, LayerNorm / bias shapes that do not fit, and files that are symlinks; the
writer refuses non-finite weights."""

import json
import os
import shutil

import pytest
import torch
from conftest import write_tiny_export

from ushash.serving.artifact import CorruptExport, ExportError, load_export, manifest_digest, revision_id


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_export(tmp_path_factory.mktemp("export") / "tiny-64b")


@pytest.fixture()
def copy(tiny, tmp_path):
    dst = tmp_path / "e"
    shutil.copytree(tiny, dst)
    return dst


def _resave(path, tensors=None, manifest=None):
    """Rewrite an export with changed tensors and / or manifest, every checksum and the revision redone
    (so only the checks under test can refuse it)."""
    from safetensors.torch import load as st_load, save as st_save

    mf = json.loads((path / "manifest.json").read_text())
    ts = st_load((path / "weights.safetensors").read_bytes())
    if tensors:
        tensors(ts)
        mf["tensors"] = {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
                         for k, v in sorted(ts.items())}
    blob = st_save(dict(sorted(ts.items())))
    (path / "weights.safetensors").write_bytes(blob)
    import hashlib

    mf["files"]["weights.safetensors"] = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    if manifest:
        manifest(mf)
    if isinstance(mf.get("files"), dict) and isinstance(mf["files"].get("weights.safetensors"), dict) \
            and isinstance(mf["files"]["weights.safetensors"].get("sha256"), str):
        try:
            mf["revision"] = revision_id(mf["files"]["weights.safetensors"]["sha256"], mf)
        except Exception:
            pass
    mf["manifest_sha256"] = manifest_digest(mf)
    (path / "manifest.json").write_text(json.dumps(mf))


def _first(ts, suffix):
    return next(k for k in sorted(ts) if k.endswith(suffix))


def _set(mf, path, value):
    *head, last = path
    d = mf
    for k in head:
        d = d[k]
    d[last] = value


MALFORMED = [
    (("bits",), "64"), (("bits",), -8), (("dim",), None), (("modalities",), []), (("modalities",), {}),
    (("modalities", "text"), 16), (("modalities", "text"), {"in_dim": "16"}), (("encoder",), "tiny"),
    (("encoder",), {"name": 1, "fingerprint": "x"}), (("encoder", "tokenizers"), ["x"]),
    (("encoder", "tokenizers"), {"text tokenizer": 7}), (("head",), []), (("head", "layers"), None),
    (("head", "layers", "text"), "linear"), (("head", "layers", "text"), [1, 2]),
    (("prototypes",), "prototypes"), (("prototypes",), {"tensor": 3}), (("payload",), None),
    (("tensors",), []), (("tensors", "prototypes"), {"shape": 3}),
    (("files", "weights.safetensors", "bytes"), "12"),
]


@pytest.mark.parametrize("where,value", MALFORMED, ids=[".".join(w) + "=" + repr(v) for w, v in MALFORMED])
def test_malformed_manifest_fields_are_corrupt_exports(copy, where, value):
    _resave(copy, manifest=lambda mf: _set(mf, where, value))
    with pytest.raises(ExportError) as e:
        load_export(copy)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("op_change,match", [
    (lambda op: op.update(normalized_shape=[7]), "normalized_shape"),
    (lambda op: op.update(eps=-1), "eps"),
    (lambda op: op.update(eps="small"), "eps"),
])
def test_layer_norm_settings_are_checked(copy, op_change, match):
    def change(mf):
        ops = mf["head"]["layers"]["text"]
        ln = [op for op in ops if op["op"] == "layer_norm"]
        if not ln:
            pytest.skip("the tiny head has no layer_norm")
        op_change(ln[0])
    _resave(copy, manifest=change)
    with pytest.raises(CorruptExport, match=match):
        load_export(copy)


def test_a_bias_of_the_wrong_length_is_corrupt(copy):
    def change(ts):
        k = next(k for k in sorted(ts) if k.startswith("heads.text") and k.endswith("bias"))
        ts[k] = torch.zeros(ts[k].shape[0] + 1)
    _resave(copy, tensors=change)
    with pytest.raises(CorruptExport, match="bias"):
        load_export(copy)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(copy, bad):
    def change(ts):
        k = _first(ts, "weight")
        ts[k] = ts[k].clone()
        ts[k].view(-1)[3] = bad
    _resave(copy, tensors=change)
    with pytest.raises(CorruptExport, match="non-finite"):
        load_export(copy)


def test_other_dtypes_are_refused(copy):
    def change(ts):
        ts["prototypes"] = ts["prototypes"].to(torch.float64)
    _resave(copy, tensors=change)
    with pytest.raises(CorruptExport, match="float32"):
        load_export(copy)


@pytest.mark.parametrize("name", ["manifest.json", "weights.safetensors"])
def test_symlinked_files_are_refused(copy, tmp_path, name):
    outside = tmp_path / f"outside-{name}"
    os.replace(copy / name, outside)
    os.symlink(outside, copy / name)
    with pytest.raises(CorruptExport, match="symlink"):
        load_export(copy)


def test_a_fifo_is_not_read(copy):
    os.unlink(copy / "weights.safetensors")
    os.mkfifo(copy / "weights.safetensors")
    with pytest.raises(CorruptExport, match="not a regular file"):
        load_export(copy)


def test_the_writer_refuses_non_finite_weights(tmp_path):
    from conftest import ENC_CFG

    from ushash.encoders import build_encoder
    from ushash.hashing.heads import USHash
    from ushash.serving.export import write_export

    enc = build_encoder({**ENC_CFG, "device": "cpu"})
    model = USHash(dict(enc.dims), bits=64, dim=32, hidden=32).eval()
    with torch.no_grad():
        model.prototypes[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        write_export(model, tmp_path / "x", {"name": "tiny", "fingerprint": enc.fingerprint, "config": ENC_CFG})
    assert not (tmp_path / "x").exists()


def test_the_tiny_export_still_loads(tiny):
    assert load_export(tiny).bits == 64
