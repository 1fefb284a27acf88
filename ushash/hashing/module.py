"""The LightningModule that trains US-HASH heads on cached features. Arguments are primitives only, so
checkpoints rebuild with no config tree and load with `torch.load(weights_only=True)`.

The recipe (docs/baselines.md has the measurements behind each choice):
- init="gcca": the linear head of each modality starts as the closed-form map into the shared space
  (ushash/hashing/methods/space.py, its settings chosen on val) and the prototypes as the ITQ rotation of that space
  (`initialise`), so training starts from the codes ITQ makes and fine-tunes them; the selection on val keeps
  the initial weights when no epoch beats them. init="random": a randomly initialised MLP (layers >= 1).
- the bit logits l = z . P^T (unit rows, |l| <= 1) are relaxed as tanh(beta * sqrt(dim) * l): a unit z spread
  over `dim` axes has |l| ~ 1/sqrt(dim), so the gain makes the relaxation mean the same at every width;
- contrastive terms compare relaxed codes by cosine (1 - 2 d_H / bits for exact codes) with a learned logit
  scale (CLIP's), temperature="learned", or a fixed temperature;
- distillation: the relaxed codes' similarities are pulled towards the cosines of the closed-form space
  (w_distill), which keeps the fine-tuned codes from over-fitting the training pairs.
"""

from __future__ import annotations

import inspect
import math
import numbers

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import WeightAveraging
from torch import nn
from torch.nn import functional as F

from ushash.config import LossConfig, ModelConfig
from ushash.hashing import losses
from ushash.hashing.heads import USHash

_M, _L = ModelConfig(), LossConfig()

INITS = ("gcca", "random")
DISTILL_PAIRS = ("cross", "all")
RELAXATIONS = ("tanh", "ste")
MAX_LOGIT_SCALE = 100.0  # CLIP's clamp on exp(logit_scale)


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def check_settings(method: str = "ushash", init: str = _M.init, layers: int = _M.layers, dim: int = _M.dim,
                   hidden: int = _M.hidden, dropout: float = _M.dropout, lr: float = _M.lr,
                   head_lr: float | None = _M.head_lr, weight_decay: float = _M.weight_decay,
                   temperature: float = _M.temperature, temperature_lr: float | None = _M.temperature_lr,
                   relax: str = _M.relax, beta_start: float = _M.beta_start, beta_end: float = _M.beta_end,
                   prototypes_from: str = _M.prototypes_from, distill_kernel: str = _M.distill_kernel,
                   distill_pairs: str = _M.distill_pairs, margin_fraction: float = _M.margin_fraction,
                   ema_epochs: float | None = _M.ema_epochs, **weights) -> None:
    """Refuse a setting that would train nonsense or fail deep inside torch, in one line that names it and says
    what it takes. `USHashModule` runs it on its arguments, and `run_train` on the config before any extraction.
    weights: the loss weights w_* (each a number >= 0)."""
    from ushash.hashing import methods
    from ushash.hashing.methods.ushash import PROTOTYPE_STARTS
    spec = methods.get(method)
    if spec.kind != "trained":
        raise ValueError(f"method {method!r} is a no-training baseline; it is fitted, not trained "
                         f"(python -m ushash.sweep method={spec.name})")
    if init not in INITS:
        raise ValueError(f"model.init={init!r}: expected one of {INITS}")
    for key, v in (("layers", layers), ("dim", dim), ("hidden", hidden)):
        if not (isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1):
            raise ValueError(f"model.{key}={v!r}: expected a whole number >= 1")
    if init == "gcca" and int(layers) != 1:
        raise ValueError(f"model.init=gcca starts a linear head from the closed-form space; model.layers={layers} "
                         "asks for an MLP: set model.layers=1, or model.init=random for an MLP head")
    if not (_is_number(dropout) and 0 <= dropout < 1):
        raise ValueError(f"model.dropout={dropout!r}: expected a probability in [0, 1)")
    for key, v in (("lr", lr), ("weight_decay", weight_decay)):
        if not (_is_number(v) and v >= 0):
            raise ValueError(f"model.{key}={v!r}: expected a number >= 0")
    if head_lr is not None and not (_is_number(head_lr) and head_lr >= 0):
        raise ValueError(f"model.head_lr={head_lr!r}: expected a number >= 0, or null for model.lr")
    if prototypes_from not in (*PROTOTYPE_STARTS, "val"):
        raise ValueError(f"model.prototypes_from={prototypes_from!r}: expected one of {(*PROTOTYPE_STARTS, 'val')}")
    if relax not in RELAXATIONS:
        raise ValueError(f"model.relax={relax!r}: expected one of {RELAXATIONS}")
    for key, v in (("beta_start", beta_start), ("beta_end", beta_end)):
        if not (_is_number(v) and v > 0):
            raise ValueError(f"model.{key}={v!r}: expected a number > 0 (the relaxation's gain)")
    if distill_kernel not in losses.DISTILL_KERNELS:
        raise ValueError(f"model.distill_kernel={distill_kernel!r}: expected one of {losses.DISTILL_KERNELS}")
    if distill_pairs not in DISTILL_PAIRS:
        raise ValueError(f"model.distill_pairs={distill_pairs!r}: expected one of {DISTILL_PAIRS}")
    if not (_is_number(margin_fraction) and 0 < margin_fraction <= 0.5):
        raise ValueError(f"model.margin_fraction={margin_fraction!r}: expected a share of the bits in (0, 0.5]")
    if not (_is_number(temperature) and temperature > 0):
        raise ValueError(f"model.temperature={temperature!r}: expected a positive number")
    if ema_epochs is not None and not (_is_number(ema_epochs) and ema_epochs > 0):
        raise ValueError(f"model.ema_epochs={ema_epochs!r}: expected a number of epochs > 0, or null for no averaging")
    if temperature_lr is not None and not (_is_number(temperature_lr) and temperature_lr >= 0):
        raise ValueError(f"model.temperature_lr={temperature_lr!r}: expected a number >= 0, or null for model.lr")
    for key, v in weights.items():
        if not (_is_number(v) and v >= 0):
            raise ValueError(f"model.loss.{key.removeprefix('w_')}={v!r}: expected a weight >= 0 (0 turns the term off)")


_CHECKED = tuple(inspect.signature(check_settings).parameters)[:-1] + tuple(
    f"w_{k}" for k in ("contrastive", "float", "quant", "balance", "decor", "proto", "distill", "margin"))


class USHashModule(pl.LightningModule):
    def __init__(self, in_dims: dict, bits: int = 64, dim: int = _M.dim, hidden: int = _M.hidden,
                 layers: int = _M.layers, dropout: float = _M.dropout, lr: float = _M.lr,
                 weight_decay: float = _M.weight_decay, temperature: float = _M.temperature,
                 learn_temperature: bool = _M.learn_temperature, temperature_lr: float | None = _M.temperature_lr,
                 relax: str = _M.relax,
                 beta_start: float = _M.beta_start, beta_end: float = _M.beta_end, init: str = _M.init,
                 head_lr: float | None = _M.head_lr, w_contrastive: float = _L.contrastive, w_float: float = _L.float,
                 w_quant: float = _L.quant, w_balance: float = _L.balance, w_decor: float = _L.decor,
                 w_proto: float = _L.proto, w_distill: float = _L.distill, distill_kernel: str = _M.distill_kernel,
                 w_margin: float = _L.margin, margin_fraction: float = _M.margin_fraction,
                 distill_pairs: str = _M.distill_pairs, prototypes_from: str = _M.prototypes_from,
                 ema_epochs: float | None = _M.ema_epochs, max_epochs: int = 40,
                 provenance: dict | None = None, method: str = "ushash", method_args: dict | None = None,
                 n_train_groups: int = 0):
        """Defaults: ushash.config.ModelConfig / LossConfig (the same as configs/model/ushash.yaml).

        provenance: plain dict describing what the head was trained on (dataset, encoder name, config and
        fingerprint, feature store paths, the shared space); stored in the checkpoint so it describes itself.

        init: "gcca" (closed-form start, needs layers=1 and `initialise` before training) or "random".
        prototypes_from: where init="gcca" takes the prototypes (ushash.hashing.methods.ushash.closed_form_start:
        "itq" or "lsh"; "val" is resolved by run_train into one of them); recorded so the checkpoint says how it started.
        head_lr: the heads' learning rate; None: lr. temperature: the contrastive temperature, learned from that value when
        learn_temperature (a CLIP-style logit scale) or fixed; temperature_lr: its learning rate (None: lr).

        method: the registered trained method (ushash/hashing/methods/) whose objective trains the network: "ushash"
        (the w_* weights above) or a baseline ("pairwise", "csq", "orthohash"), whose own hyper-parameters are
        the plain dict method_args. Every method trains the same network (per-modality heads + a linear hash
        layer, ushash.hashing.heads.USHash) from the same initialisation, so every checkpoint loads and encodes the
        same way.
        n_train_groups: number of training groups (centre/proxy tables of the CSQ- and OrthoHash-style methods)."""
        super().__init__()
        from ushash.hashing import methods
        spec = methods.get(method)
        check_settings(**{k: v for k, v in locals().items() if k in _CHECKED})
        method, method_args = spec.name, dict(method_args or {})  # canonical name; plain dict in the checkpoint
        self.save_hyperparameters()
        self._objective = spec.objective
        self.model = USHash(in_dims, bits=bits, dim=dim, hidden=hidden, layers=layers, dropout=dropout)
        # contrastive scales exp(logit_scale) = 1 / temperature, learned as CLIP's when learn_temperature; they are
        # training state only, not part of the export
        self.last_val: tuple[float, float] | None = None   # the last validation's (score, paired mAP@10)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / temperature)), requires_grad=bool(learn_temperature))
        self.float_logit_scale = nn.Parameter(torch.tensor(math.log(1 / temperature)),
                                              requires_grad=bool(learn_temperature))
        # the closed-form space, frozen: the distillation teacher (filled by `initialise`)
        self.teacher = nn.ModuleDict({m: nn.Linear(d, dim) for m, d in self.model.in_dims.items()} if init == "gcca" else {})
        self.teacher.requires_grad_(False)
        self.shared_space = None  # the fitted SharedSpace when initialised in this process (CSQ pseudo-classes use it)

    # ------------------------------------------------------------------ closed-form start
    @torch.no_grad()
    def initialise(self, space, prototypes: np.ndarray) -> None:
        """Heads := the shared space's linear maps (x -> (x - mean) proj - post_mean, then L2-normalised, exactly
        `space.transform`), prototypes := `prototypes` [bits, dim] (an ITQ rotation of that space).

        Each map is scaled so that its weights have the RMS of a default nn.Linear of that width: z is
        normalised, so the scale changes nothing in z, but Adam's steps are in absolute units and a whitening
        map of wide, large-valued features (EfficientNet's) has tiny weights that one step would overturn."""
        if self.hparams.init != "gcca":
            raise ValueError("initialise() is the init=gcca start; this module was built with init=random")
        if space.dim != self.hparams.dim:
            raise ValueError(f"the shared space is {space.dim}-d but the head's dim is {self.hparams.dim}")
        for m in self.model.heads:
            mean, proj = space.maps[m]
            w = np.asarray(proj, np.float64).T
            b = -(np.asarray(mean, np.float64) @ proj) - space.post_mean[m]
            c = 1.0 / (np.sqrt((w ** 2).mean()) * np.sqrt(w.shape[1]))
            w, b = torch.as_tensor(w * c, dtype=torch.float32), torch.as_tensor(b * c, dtype=torch.float32)
            for lin in (self.model.heads[m][0], self.teacher[m]):
                lin.weight.copy_(w)
                lin.bias.copy_(b)
        p = torch.as_tensor(np.asarray(prototypes), dtype=torch.float32)
        if tuple(p.shape) != tuple(self.model.prototypes.shape):
            raise ValueError(f"prototypes {tuple(p.shape)}, expected {tuple(self.model.prototypes.shape)}")
        self.model.prototypes.copy_(p)
        self.shared_space = space

    def teacher_embed(self, modality: str, x: torch.Tensor) -> torch.Tensor | None:
        if modality not in self.teacher:
            return None
        return F.normalize(self.teacher[modality](x), dim=-1)

    # ------------------------------------------------------------------ relaxation schedule
    def beta(self) -> float:
        """tanh(beta * l): beta rises geometrically from beta_start to beta_end over training."""
        hp = self.hparams
        total = max(1, hp.max_epochs * max(1, self._steps_per_epoch()))
        t = min(1.0, self.global_step / total)
        return float(hp.beta_start * math.exp(t * math.log(hp.beta_end / hp.beta_start)))

    def relaxed(self, logits: torch.Tensor, beta: float) -> torch.Tensor:
        return losses.relax(logits * math.sqrt(self.hparams.dim), beta, self.hparams.relax)

    def code_temperature(self) -> torch.Tensor:
        """Temperature of the contrastive term on relaxed codes (cosine similarity)."""
        return 1.0 / self.logit_scale.exp().clamp(max=MAX_LOGIT_SCALE)

    def float_temperature(self) -> torch.Tensor:
        return 1.0 / self.float_logit_scale.exp().clamp(max=MAX_LOGIT_SCALE)

    def _steps_per_epoch(self) -> int:
        try:
            return int(self.trainer.num_training_batches)
        except Exception:
            return 1

    # ------------------------------------------------------------------ training
    def training_step(self, batch: dict, batch_idx: int):
        hp, beta = self.hparams, self.beta()
        h, z, g, present, teacher = {}, {}, {}, {}, {}
        for m, (x, gid, pres) in batch.items():
            z[m], lg = self.model(m, x)
            h[m] = self.relaxed(lg, beta)
            g[m], present[m] = gid, pres
            teacher[m] = self.teacher_embed(m, x)
        parts, weights = self._objective(self, h, z, g, present, hp.method_args,
                                         teacher=teacher if self.teacher else None)
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

    def val_scores(self) -> tuple[float, list[dict]]:
        """(the selection score on the val split, retrieval.SELECTION_DOC; the per-direction rows)."""
        from ushash.evaluation import retrieval
        split = self.trainer.datamodule.val_split
        rows = retrieval.evaluate(split, {"codes": self.code_method()}, protocols=("paired", "label"))
        return retrieval.selection(rows), rows

    def on_validation_epoch_start(self):
        # scored here, not at the epoch's end: the weight-averaging callback swaps the averaged weights in
        # before this hook and back out before the module's on_validation_epoch_end
        from ushash.evaluation import retrieval
        score, rows = self.val_scores()
        paired = retrieval.mean_map(rows, "paired")
        # the scores as computed (float64), for the checkpoint selection: the logged metrics are float32
        # tensors, and a rounded score compared with an exact one can beat it on a tie
        self.last_val = (score, paired)
        self.log("val/score", score, prog_bar=True)
        self.log("val/map@10", paired, prog_bar=True)
        for r in rows:
            self.log(f"val/map@10/{r['protocol']}/{r['direction']}", r["map@10"])

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

    def configure_callbacks(self):
        """ema_epochs: Lightning's weight averaging, an exponential moving average of every weight with a
        per-step decay that spans about ema_epochs epochs whatever the data set's size (`ema_decay`);
        validation and the checkpoints' state_dict are the average's, the raw weights travel beside it."""
        if self.hparams.ema_epochs is None:
            return []
        def step(averages, currents, n):  # torch's own EMA update (swa_utils.get_ema_multi_avg_fn), at our decay
            torch._foreach_lerp_(averages, currents, 1.0 - self.ema_decay())
        return [_KeepRawWeights(multi_avg_fn=step)]

    def ema_decay(self) -> float:
        return math.exp(-1.0 / (float(self.hparams.ema_epochs) * max(1, self._steps_per_epoch())))

    def configure_optimizers(self):
        hp = self.hparams
        head_lr = hp.head_lr if hp.head_lr is not None else hp.lr
        groups = [{"params": list(self.model.heads.parameters()), "lr": float(head_lr)},
                  {"params": [self.model.prototypes]},
                  {"params": [self.logit_scale, self.float_logit_scale], "weight_decay": 0.0,
                   "lr": float(hp.temperature_lr if hp.temperature_lr is not None else hp.lr)}]
        opt = torch.optim.AdamW(groups, lr=hp.lr, weight_decay=hp.weight_decay)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, hp.max_epochs))
        return {"optimizer": opt, "lr_scheduler": sched}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """A run resumed with another max_epochs (cut short, or extended after it finished) goes on along the
        cosine schedule of its new max_epochs, from the epoch it resumes at: the saved scheduler's T_max and
        the saved learning rates (which Lightning restores after this hook) are set to that schedule's. Left
        as saved, the old T_max made the learning rate of a finished run that was extended climb back up from
        zero, a warm restart no setting asked for."""
        T = max(1, int(self.hparams.max_epochs))
        for sd, opt in zip(checkpoint.get("lr_schedulers") or [], checkpoint.get("optimizer_states") or []):
            if "T_max" not in sd or sd["T_max"] == T:
                continue
            e, low = min(int(sd["last_epoch"]), T), float(sd["eta_min"])
            lrs = [low + (float(b) - low) * (1 + math.cos(math.pi * e / T)) / 2 for b in sd["base_lrs"]]
            sd["T_max"], sd["_last_lr"] = T, lrs
            for group, lr in zip(opt["param_groups"], lrs):
                group["lr"] = lr


class _KeepRawWeights(WeightAveraging):
    """Lightning's WeightAveraging, less its copy of the average into the module when training ends: the
    checkpoints already hold the average as their weights, and the last one keeps the raw weights beside it,
    so a finished run extended to more epochs goes on from where its raw weights were."""

    def on_train_end(self, trainer, pl_module) -> None:
        return None


def load_checkpoint(path, map_location="cpu", data: bytes | None = None) -> USHashModule:
    """Rebuild a trained module from its checkpoint alone (weights_only: no pickle of code objects). `data`:
    the file's bytes, already read (what a caller keys a result by is then exactly what was loaded)."""
    import io
    from pathlib import Path
    path = Path(path)
    if data is None and not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist; runs write checkpoints/<run>/last.ckpt")
    try:
        ckpt = torch.load(path if data is None else io.BytesIO(data), map_location=map_location, weights_only=True)
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
