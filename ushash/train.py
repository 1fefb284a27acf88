"""python -m ushash.train data=tuxpaint encoder=offline bits=64 trainer.max_epochs=30 [method=pairwise]

Trains US-HASH heads on cached features (extracting them first if needed). Checkpoints go to
checkpoints/<run>/ (`best.ckpt` chosen on the validation split, `last.ckpt` to resume from).
"""

from __future__ import annotations

from pathlib import Path

import hydra
import pytorch_lightning as pl
from omegaconf import DictConfig
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

from ushash.config import CONFIG_DIR, to_dict
from ushash.datamodule import FeatureDataModule
from ushash.extract import run_extract
from ushash.module import USHashModule


def method_config(cfg: DictConfig) -> dict:
    """The `method` config group as a plain dict {"name", "args"}; US-HASH when the config has none."""
    meth = to_dict(cfg.get("method")) or {"name": "ushash"}
    return {"name": str(meth["name"]), "args": dict(meth.get("args") or {})}


def module_kwargs(cfg: DictConfig, in_dims: dict, provenance: dict, n_train_groups: int = 0) -> dict:
    m = to_dict(cfg.model)
    w = m.pop("loss")
    m.pop("batch_size")
    meth = method_config(cfg)
    return dict(in_dims=in_dims, bits=int(cfg.bits), max_epochs=int(cfg.trainer.max_epochs), provenance=provenance,
                method=meth["name"], method_args=meth["args"], n_train_groups=int(n_train_groups),
                **m, **{f"w_{k}": float(v) for k, v in w.items()})


def _check_resumable(last: Path, hparams: dict) -> None:
    """Refuse to resume a run trained with other settings (another method, bits, loss weights, data...):
    only max_epochs may change between a run and its resumption."""
    import torch
    try:
        hp = torch.load(last, map_location="cpu", weights_only=True).get("hyper_parameters") or {}
    except Exception:
        return  # Lightning reports an unreadable checkpoint itself
    from ushash import methods
    theirs = methods.get(hp.get("method", "ushash")).name
    if theirs != methods.get(hparams.get("method", "ushash")).name:
        raise ValueError(f"{last} was trained with method {theirs!r}, not {hparams.get('method')!r}; set "
                         f"run_name=... (or resume=false) so the runs do not share a folder")
    differ = sorted(k for k in set(hp) | set(hparams)
                    if k != "max_epochs" and _plain(hp.get(k)) != _plain(hparams.get(k)))
    if differ:
        raise ValueError(f"{last} was trained with other settings ({', '.join(differ)}); resuming it would mix "
                         f"them. Set run_name=... for a new run, or resume=false to start this one over")


def _plain(v):
    """Compare hyper-parameters as plain data (tuples and lists alike)."""
    import json
    return json.dumps(v, sort_keys=True, default=str)


def run_train(cfg: DictConfig, splits: dict | None = None) -> dict:
    """Train; returns {"run_dir", "best", "last", "val_map@10"}."""
    pl.seed_everything(int(cfg.seed), workers=True)
    splits = splits or run_extract(cfg, splits=["train", "val"])
    train, val = splits["train"], splits["val"]
    mods = [m for m in train.modalities if m in val.modalities]
    in_dims = {m: int(train.meta["modalities"][m]["dim"]) for m in mods}
    provenance = {"dataset": train.meta["dataset"], "encoder": train.meta["encoder"],
                  "features_dir": str(Path(train.path).parent.parent.parent), "run_name": str(cfg.run_name),
                  "seed": int(cfg.seed), "data": to_dict(cfg.data), "method": method_config(cfg)}
    n_groups = len(set().union(*(set(train.tables[m].groups) for m in mods)))  # = GroupBatches' group count
    module = USHashModule(**module_kwargs(cfg, in_dims, provenance, n_train_groups=n_groups))
    dm = FeatureDataModule(str(train.path), str(val.path), mods, batch_size=int(cfg.model.batch_size), seed=int(cfg.seed))
    run_dir = Path(cfg.paths.checkpoints_dir) / str(cfg.run_name)
    ckpt = ModelCheckpoint(dirpath=run_dir, filename="best", monitor="val/map@10", mode="max", save_last=True,
                           enable_version_counter=False)
    kind = cfg.logger.kind
    logger = (TensorBoardLogger if kind == "tensorboard" else CSVLogger)(save_dir=str(run_dir), name="logs", version="")
    trainer = pl.Trainer(**to_dict(cfg.trainer), callbacks=[ckpt], logger=logger, default_root_dir=str(run_dir))
    last = run_dir / "last.ckpt"
    resume = str(last) if cfg.resume and last.exists() else None
    if resume:
        _check_resumable(last, dict(module.hparams))
        print(f"[train] resuming from {resume}")
    trainer.fit(module, datamodule=dm, ckpt_path=resume)
    score = ckpt.best_model_score
    return {"run_dir": str(run_dir), "best": ckpt.best_model_path or str(last), "last": str(last),
            "val_map@10": float(score) if score is not None else None}


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    out = run_train(cfg)
    print(f"[train] best val mAP@10 {out['val_map@10']}: {out['best']}")


if __name__ == "__main__":
    main()
