"""python -m ushash.export ckpt=checkpoints/<run>/best.ckpt out=exports/<name>

Writes a self-contained, pickle-free export of a trained US-HASH head for the serving cache (format in
docs/export.md): `weights.safetensors` (the projection heads, the prototypes and any payload channel
scales) and `manifest.json` (format version, ushash version, bits, dims, modalities, the encoder's name
and weights fingerprint, the layer list, payload settings, a revision id and sha256 checksums).
`ushash.serving.artifact.load_export` reads it with no Hydra, Lightning or training code.

Payload formats come from `payload` (configs/payload/*.yaml; e.g. `payload=int4_sparse`, or
`payload.image.kind=fp16`). Formats with channel scales are calibrated on the checkpoint's training split
(`calibration.split`), so those need the feature store; the defaults do not.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from omegaconf import DictConfig
from torch import nn

import ushash
from ushash.config import to_dict
from ushash.core.io import atomic_write, replace_folder, write_json
from ushash.hashing import forward as fwd
from ushash.hashing.heads import USHash
from ushash.serving import artifact
from ushash.serving.payload import PayloadCodec, PayloadConfig

log = logging.getLogger(__name__)


@dataclass
class CalibrationConfig:
    """Only for payload formats with scale: channel."""
    split: str = "train"              # z of this split sets the per-dimension INT4 scales
    max_rows: int = 20000
    percentile: float = 100.0         # 100: absmax per dimension; lower clips outliers


@dataclass
class ExportConfig:
    """python -m ushash.export (configs/export.yaml): every setting with its default and meaning. Registered
    in Hydra's ConfigStore as `schema_export` (and the payload formats as payload/schema) on import."""
    ckpt: str = "???"                 # required: the checkpoint to export
    out: Optional[str] = None         # default: exports/<run name>; a relative path is taken from the repository root
    overwrite: bool = False           # replace an existing export at `out`
    features_dir: Optional[str] = None  # default: the feature store the checkpoint was trained from (calibration only)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    paths: Any = None
    payload: PayloadConfig = field(default_factory=PayloadConfig)   # configs/payload/*.yaml


def register_schemas() -> None:
    """Put the export and payload schemas in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="schema_export", node=ExportConfig)
    cs.store(group="payload", name="schema", node=PayloadConfig)


register_schemas()


def layer_list(model: USHash) -> tuple[dict, dict[str, torch.Tensor]]:
    """The inference-time layers of every head as manifest entries (ushash.hashing.forward.to_ops), and
    the tensors they name, as contiguous float32 CPU copies."""
    layers, tensors = {}, {}
    for m, seq in model.heads.items():
        layers[m], named = fwd.to_ops(seq, f"heads.{m}")
        tensors.update(named)
    tensors["prototypes"] = model.prototypes
    return layers, {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in tensors.items()}


def created_now() -> str:
    """The manifest's `created`: UTC to the millisecond (ISO 8601), since the revision watermark ranks exports by
    it (ushash.serving.cache.freshness.revision_rank): to the second, two exports made in one second tied, and
    whichever revision id sorted higher won, the older export as likely as the newer."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


def build_manifest(model: USHash, encoder: dict, payload: PayloadCodec, tensors: dict[str, torch.Tensor],
                   layers: dict, source: dict | None = None) -> dict:
    """The manifest without `files`, `revision` and `manifest_sha256` (write_export adds them)."""
    if not encoder or not encoder.get("name") or not encoder.get("fingerprint"):
        raise ValueError("the export needs the encoder's name and weights fingerprint; the checkpoint's "
                         "provenance has none (train with ushash.train, or pass encoder={name, fingerprint})")
    if payload.dim != model.dim:
        raise ValueError(f"payload formats are {payload.dim}-d but the head's shared space is {model.dim}-d")
    missing = [m for m in model.modalities if m not in payload.modalities]
    if missing:
        raise ValueError(f"no payload format for modalities {missing}")
    first = next(iter(model.heads.values()))
    hidden = next((op.out_features for op in first if isinstance(op, nn.Linear)), None)
    return {
        "format": artifact.FORMAT,
        "format_version": artifact.FORMAT_VERSION,
        "ushash_version": ushash.__version__,
        "created": created_now(),
        "bits": int(model.bits),
        "dim": int(model.dim),
        "modalities": {m: {"in_dim": int(d)} for m, d in model.in_dims.items()},
        "encoder": {"name": str(encoder["name"]), "fingerprint": str(encoder["fingerprint"]),
                    "config": encoder.get("config") or {},
                    # the digests of the tokenizer files its features were made with (the store's), which
                    # the fingerprint does not cover: a raw text is encoded only with the same (request.py)
                    **({"tokenizers": dict(encoder["tokenizers"])} if encoder.get("tokenizers") else {})},
        "head": {"hidden": hidden, "n_linear": sum(isinstance(op, nn.Linear) for op in first),
                 "output": "l2_normalize", "layers": layers},
        "prototypes": {"tensor": "prototypes", "shape": [int(model.bits), int(model.dim)],
                       "logits": "z @ l2_normalize(prototypes).T", "code": "bit i = logit_i > 0",
                       "bit_order": "bit i is bit i % 8 (LSB first) of byte i // 8"},
        "payload": {**payload.settings(), "embedding": "z (shared space, L2-normalised)",
                    "int4": "symmetric, q = clip(round(x / s), -7, 7) stored as q + 8, two nibbles a byte, "
                            "even position low"},
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
                    for k, v in sorted(tensors.items())},
        "source": dict(source or {}),
    }


def write_export(model: USHash, out: str | Path, encoder: dict, payload: PayloadCodec | None = None,
                 source: dict | None = None, overwrite: bool = False) -> Path:
    """Write model + payload settings to the export directory `out` (a sibling temp folder, its files written
    atomically, renamed into place by `replace_folder`). Returns the path. Refuses to replace an existing
    export unless overwrite."""
    from safetensors.torch import save as st_save

    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=true to replace it")
    payload = payload or PayloadCodec.default(model.dim, model.modalities)
    layers, tensors = layer_list(model)
    for k, v in payload.tensors().items():
        tensors[k] = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))
    for k, v in tensors.items():  # NaN weights would export a head that gives one code for every input
        artifact.check_tensor(k, v, ValueError)
    manifest = build_manifest(model, encoder, payload, tensors, layers, source)
    # one metadata key: safetensors writes its metadata map in hash order, and the bytes must not vary
    blob = st_save(dict(sorted(tensors.items())), metadata={"format": f"{artifact.FORMAT}/{artifact.FORMAT_VERSION}"})
    wsha = artifact.sha256_bytes(blob)
    manifest["files"] = {artifact.WEIGHTS: {"sha256": wsha, "bytes": len(blob)}}
    manifest["revision"] = artifact.revision_id(wsha, manifest)
    manifest["manifest_sha256"] = artifact.manifest_digest(manifest)

    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.with_name(f".{out.name}.partial{os.getpid()}")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    atomic_write(work / artifact.WEIGHTS, blob)
    write_json(work / artifact.MANIFEST, manifest)
    replace_folder(work, out)   # an older export renamed aside, not deleted before the new one is in place
    return out


def _calibration_samples(module, cfg: DictConfig, codec: PayloadCodec) -> dict:
    """z of the checkpoint's training split, for formats with channel scales (only when needed)."""
    need = [m for m, f in codec.formats.items() if f.uses_channel_scales]
    if not need:
        return {}
    from ushash.data.extract import resolve_features_dir, stored_split
    prov = module.hparams.provenance or {}
    if not prov.get("dataset") or not prov.get("encoder"):
        raise ValueError(f"payload formats of {need} use channel scales, calibrated on the training split, but "
                         f"the checkpoint does not say what it was trained on; set features_dir=...")
    split = stored_split(prov, cfg.calibration.split, resolve_features_dir(prov, cfg))
    out = {}
    for m in need:
        x = np.asarray(split.tables[m].x[: int(cfg.calibration.max_rows)])
        out[m] = module.model.encode(m, x)[1]
    return out


def _stores(prov: dict) -> dict | None:
    """The rows fingerprint of every split the export's data settings list here (the checkpoint records train
    and val): where the export is used without its data (the manifest's path is not exported), they name
    the stores of exactly those rows (`extract.stored_split`)."""
    from ushash.data.extract import listed_fingerprint
    stores = dict(prov.get("stores") or {})
    if not prov.get("dataset"):
        return stores or None
    for sp in ("train", "val", "test"):
        stores[sp] = stores.get(sp) or listed_fingerprint(prov, sp)
    return stores


def run_export(cfg: DictConfig, module=None) -> dict:
    """Export the checkpoint `cfg.ckpt`; returns {"out", "revision", "manifest"}."""
    from ushash.hashing.module import load_checkpoint

    module = module or load_checkpoint(cfg.ckpt)
    model = module.model.eval()
    prov = dict(module.hparams.provenance or {})
    codec = PayloadCodec.from_config(model.dim, model.modalities, to_dict(cfg.payload) if cfg.get("payload") else None)
    samples = _calibration_samples(module, cfg, codec)
    for m, z in samples.items():
        codec[m].fit(z, percentile=float(cfg.calibration.percentile))
    run = prov.get("run_name") or Path(str(cfg.ckpt)).parent.name
    out = Path(cfg.out) if cfg.out else Path(cfg.paths.root) / "exports" / run
    if not out.is_absolute():
        out = Path(cfg.paths.root) / out  # relative paths hang off the repository, like the rest of ushash
    # provenance without machine paths: the export travels to other machines
    data = {k: v for k, v in (prov.get("data") or {}).items()
            if not (isinstance(v, str) and os.path.isabs(v))} if prov.get("data") else None  # no machine paths
    source = {"dataset": prov.get("dataset"), "data": data, "encoder": prov.get("encoder"),
              "features_dir": prov.get("features_dir") if not os.path.isabs(str(prov.get("features_dir") or "")) else None,
              "stores": _stores(prov), "run_name": run, "checkpoint": Path(str(cfg.ckpt)).name,
              "seed": prov.get("seed"), "calibration_split": cfg.calibration.split if samples else None}
    encoder = {**(prov.get("encoder") or {}), "tokenizers": prov.get("tokenizers")}
    write_export(model, out, encoder, codec, source=source, overwrite=bool(cfg.overwrite))
    head = artifact.load_export(out)  # read back through the serving loader before declaring success
    log.info("export %s: revision %s, %d bits, modalities %s, encoder %s-%s, payload %r", out, head.revision,
             head.bits, head.modalities, head.encoder.name, head.encoder.fingerprint, head.payload)
    return {"out": str(out), "revision": head.revision, "manifest": head.manifest}
