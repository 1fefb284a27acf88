"""python -m ushash.extract data=tuxpaint encoder=offline  — fill the feature store for every split."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from ushash.data import shards
from ushash.config import CONFIG_DIR, to_dict
from ushash.data.datasets import load_rows
from ushash.encoders import build_encoder
from ushash.data.store import FeatureSplit, decode_workers, extract


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def run_extract(cfg: DictConfig, splits: list[str] | None = None, encoder=None) -> dict[str, FeatureSplit]:
    """Extract (or reuse) features of each split; returns the opened stores."""
    enc_cfg = to_dict(cfg.encoder)
    if encoder is None:
        encoder = build_encoder(enc_cfg).to(resolve_device(cfg.extract.device))
    data = to_dict(cfg.data)
    name = data.pop("name")
    out = {}
    for split in splits or list(cfg.extract.splits):
        rows = load_rows(name, split, **data)
        if shards.wanted(cfg.extract, rows):  # extract.shards / strategy / devices, or rows read as a stream
            out[split] = shards.extract_sharded(rows, encoder, cfg.paths.features_dir, dataset=name, split=split,
                                                encoder_cfg=enc_cfg, **shards.options(cfg.extract))
        else:
            out[split] = extract(rows, encoder, cfg.paths.features_dir, dataset=name, split=split,
                                 encoder_cfg=enc_cfg, batch_size=cfg.extract.batch_size,
                                 num_workers=decode_workers(cfg.extract.num_workers), progress=cfg.extract.progress,
                                 max_bad_frac=cfg.extract.max_bad_frac)
        rep = out[split].report
        counts = ", ".join(f"{m} {v.get('ok', 0)}/{v['rows']}" for m, v in rep["modalities"].items())
        print(f"[extract] {name}/{split}: {counts} ok; {len(rep['failed'])} failed -> {out[split].path}")
    return out
