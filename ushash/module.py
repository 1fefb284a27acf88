"""The LightningModule that trains US-HASH heads on cached features. Arguments are primitives only, so
checkpoints rebuild with no config tree and load with `torch.load(weights_only=True)`."""

from __future__ import annotations

import math

import numpy as np
import pytorch_lightning as pl
import torch

from ushash import losses
from ushash.heads import USHash


class USHashModule(pl.LightningModule):
    def __init__(self, in_dims: dict, bits: int = 64, dim: int = 128, hidden: int = 512, layers: int = 2,
                 dropout: float = 0.1, lr: float = 1e-3, weight_decay: float = 1e-4, temperature: float = 0.05,
                 relax: str = "tanh", beta_start: float = 1.0, beta_end: float = 16.0,
                 w_contrastive: float = 1.0, w_float: float = 0.5, w_quant: float = 0.1, w_balance: float = 0.1,
                 w_decor: float = 0.01, w_proto: float = 0.01, max_epochs: int = 30, provenance: dict | None = None,
                 method: str = "ushash", method_args: dict | None = None, n_train_groups: int = 0):
        """provenance: plain dict describing what the head was trained on (dataset, encoder name, config and
        fingerprint, feature store paths); stored in the checkpoint so it describes itself.

        method: the registered trained method (ushash/methods/) whose objective trains the network: "ushash"
        (the w_* weights above) or a baseline ("pairwise", "csq", "orthohash"), whose own hyper-parameters are
        the plain dict method_args. Every method trains the same network (per-modality heads + a linear hash
        layer, ushash.heads.USHash), so every checkpoint loads and encodes the same way.
        n_train_groups: number of training groups (centre/proxy tables of the CSQ- and OrthoHash-style methods)."""
        super().__init__()
        from ushash import methods
        spec = methods.get(method)
        if spec.kind != "trained":
            raise ValueError(f"method {method!r} is a no-training baseline; it is fitted, not trained "
                             f"(python -m ushash.sweep method={spec.name})")
        method, method_args = spec.name, dict(method_args or {})  # canonical name; plain dict in the checkpoint
        self.save_hyperparameters()
        self._objective = spec.objective
        self.model = USHash(in_dims, bits=bits, dim=dim, hidden=hidden, layers=layers, dropout=dropout)

    # ------------------------------------------------------------------ relaxation schedule
    def beta(self) -> float:
        """tanh(beta * l): beta rises geometrically from beta_start to beta_end over training."""
        hp = self.hparams
        total = max(1, hp.max_epochs * max(1, self._steps_per_epoch()))
        t = min(1.0, self.global_step / total)
        return float(hp.beta_start * math.exp(t * math.log(hp.beta_end / hp.beta_start)))

    def _steps_per_epoch(self) -> int:
        try:
            return int(self.trainer.num_training_batches)
        except Exception:
            return 1

    # ------------------------------------------------------------------ training
    def training_step(self, batch: dict, batch_idx: int):
        hp, beta = self.hparams, self.beta()
        h, z, g, present = {}, {}, {}, {}
        for m, (x, gid, pres) in batch.items():
            z[m], lg = self.model(m, x)
            h[m] = losses.relax(lg, beta, hp.relax)
            g[m], present[m] = gid, pres
        parts, weights = self._objective(self, h, z, g, present, hp.method_args)
        loss = sum(weights[k] * v for k, v in parts.items())
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite training loss at step {self.global_step}: "
                                     f"{ {k: float(v) for k, v in parts.items()} }")
        bsz = len(next(iter(batch.values()))[0])
        self.log_dict({f"train/{k}": v for k, v in parts.items()}, batch_size=bsz)
        self.log("train/loss", loss, prog_bar=True, batch_size=bsz)
        self.log("train/beta", beta, batch_size=bsz)
        return loss

    # ------------------------------------------------------------------ validation on whole tables
    def validation_step(self, batch, batch_idx):
        return None

    def on_validation_epoch_end(self):
        from ushash import retrieval
        split = self.trainer.datamodule.val_split
        rows = retrieval.evaluate(split, {"codes": self.code_method()}, protocols=("paired",))
        score = retrieval.mean_map(rows, "paired")
        self.log("val/map@10", score, prog_bar=True)
        for r in rows:
            self.log(f"val/map@10/{r['direction']}", r["map@10"])

    def code_method(self):
        def method(modality: str, x: np.ndarray):
            if modality not in self.model.heads:
                raise KeyError(modality)
            packed, _ = self.model.encode(modality, x)
            return "codes", packed
        return method

    def float_method(self):
        def method(modality: str, x: np.ndarray):
            if modality not in self.model.heads:
                raise KeyError(modality)
            _, z = self.model.encode(modality, x)
            return "float", z
        return method

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, hp.max_epochs))
        return {"optimizer": opt, "lr_scheduler": sched}


def load_checkpoint(path, map_location="cpu") -> USHashModule:
    """Rebuild a trained module from its checkpoint alone (weights_only: no pickle of code objects)."""
    from pathlib import Path
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist; runs write checkpoints/<run>/last.ckpt")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} is not a readable ushash checkpoint ({type(e).__name__}: {e})") from e
    hp = ckpt.get("hyper_parameters")
    if not hp or "in_dims" not in hp or "state_dict" not in ckpt:
        raise ValueError(f"{path} is not a US-HASH checkpoint (no in_dims hyper-parameters or state_dict)")
    mod = USHashModule(**hp)
    missing, unexpected = mod.load_state_dict(ckpt["state_dict"], strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not match this ushash version's model "
                         f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    mod.eval()
    return mod
