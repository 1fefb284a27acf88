"""python -m ushash.train data=tuxpaint encoder=offline bits=64 trainer.max_epochs=40 [method=pairwise]

Trains US-HASH heads on cached features (extracting them first if needed). With model.init=gcca (the
default) the heads start from the closed-form shared space chosen on the validation split and the ITQ
rotation of it (ushash/hashing/methods/ushash.py: closed_form_start). Checkpoints go to checkpoints/<run>/:
`best.ckpt` holds the weights with the best validation score seen (retrieval.SELECTION_DOC), the initial
weights included, and `last.ckpt` is what a rerun resumes from (a run of other settings is refused; one of
other features, code or packages set aside to checkpoints/stale/ and trained afresh); training stops early
after `early_stop.patience` epochs without a better validation score.
"""

from __future__ import annotations

from pathlib import Path

import logging

import pytorch_lightning as pl
from omegaconf import DictConfig, open_dict
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

from ushash.config import to_dict
from ushash.core.codes import check_bits
from ushash.core.io import replace_synced, set_aside
from ushash.hashing.datamodule import FeatureDataModule
from ushash.data.extract import relative_to_root, run_extract
from ushash.hashing.module import USHashModule

log = logging.getLogger(__name__)


def method_config(cfg: DictConfig) -> dict:
    """The `method` config group as a plain dict {"name", "args"}; US-HASH when the config has none."""
    meth = to_dict(cfg.get("method")) or {"name": "ushash"}
    return {"name": str(meth["name"]), "args": dict(meth.get("args") or {})}


def space_settings(cfg: DictConfig) -> dict:
    """The shared space's settings (configs/space/default.yaml), as keyword arguments of the fitted methods."""
    return to_dict(cfg.get("space")) or {}


# trainer keys that change how a run reports, not what it learns
TRAINER_REPORTING = ("max_epochs", "enable_progress_bar", "enable_model_summary", "log_every_n_steps",
                     "enable_checkpointing", "default_root_dir", "logger")


def training_settings(cfg: DictConfig) -> dict:
    """The settings of a trained run that are not the module's hyper-parameters but change what it learns:
    the seed, the batch size, the shared space's settings, early stopping and the trainer's (but for
    max_epochs and reporting, `TRAINER_REPORTING`). A resumed run must have the same (`_check_resumable`)
    and a sweep's run digest holds them (`ushash.evaluation.sweep.run_settings`)."""
    return {"seed": int(cfg.seed), "batch_size": int(cfg.model.batch_size), "space": space_settings(cfg),
            "early_stop": to_dict(cfg.get("early_stop")) or {},
            "trainer": {k: v for k, v in (to_dict(cfg.trainer) or {}).items() if k not in TRAINER_REPORTING}}


def module_kwargs(cfg: DictConfig, in_dims: dict, provenance: dict, n_train_groups: int = 0,
                  dim: int | None = None) -> dict:
    m = to_dict(cfg.model)
    w = m.pop("loss")
    m.pop("batch_size")
    if dim is not None:
        m["dim"] = int(dim)
    meth = method_config(cfg)
    return dict(in_dims=in_dims, bits=int(cfg.bits), max_epochs=int(cfg.trainer.max_epochs), provenance=provenance,
                method=meth["name"], method_args=meth["args"], n_train_groups=int(n_train_groups),
                **m, **{f"w_{k}": float(v) for k, v in w.items()})


def check_settings(cfg: DictConfig) -> None:
    """Refuse, in one line naming the setting, what would fail deep inside torch after the extraction and the
    closed-form fit (a negative learning rate, a batch of 0 groups), or train nonsense without a word (a
    negative head learning rate or loss weight, a 0-d head, patience 0 read as "never stop")."""
    from ushash.hashing.module import _CHECKED, check_settings as check_module
    check_bits(cfg.bits)
    seed = cfg.seed
    if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2 ** 32):
        raise ValueError(f"seed={seed!r}: expected a whole number in [0, 2^32)")
    bs = cfg.model.batch_size
    if not (isinstance(bs, int) and not isinstance(bs, bool) and bs >= 1):
        raise ValueError(f"model.batch_size={bs!r}: expected a number of groups per batch >= 1")
    check_patience((cfg.get("early_stop") or {}).get("patience"))
    check_trainer(to_dict(cfg.trainer) or {})
    kw = module_kwargs(cfg, {}, {})
    check_module(**{k: v for k, v in kw.items() if k in _CHECKED})


#: trainer.precision values training runs (Lightning's names; "bf16-true", "16-true" and "64-true" cast the
#: heads while the val scoring and the closed-form start feed them float32)
PRECISIONS = (32, "32", "32-true", "16-mixed", "bf16-mixed", "16", "bf16")


def check_trainer(trainer: dict) -> None:
    """The trainer settings the training's schedules and bookkeeping assume, refused in one line before the
    extraction: a finite number of epochs (the beta and learning-rate schedules span max_epochs; -1, Lightning's
    "no limit", made them constant or cycle each epoch), one batch per optimizer step (the schedules and the
    weight average count batches), validation once per epoch (the best epoch, patience and resume count
    epochs; a run resumed after a mid-epoch validation drew another order), a precision the heads run in."""
    me = trainer.get("max_epochs")
    if not (isinstance(me, int) and not isinstance(me, bool) and me >= 1):
        raise ValueError(f"trainer.max_epochs={me!r}: expected a number of epochs >= 1 (the schedules span it; "
                         "early_stop.patience stops a run earlier)")
    acc = trainer.get("accumulate_grad_batches", 1)
    if acc != 1:
        raise ValueError(f"trainer.accumulate_grad_batches={acc!r}: not supported (the beta and weight-average "
                         "schedules count batches); raise model.batch_size instead")
    vci = trainer.get("val_check_interval")
    if vci is not None and not (isinstance(vci, float) and vci == 1.0):   # an int is a number of batches
        raise ValueError(f"trainer.val_check_interval={vci!r}: not supported (the checkpoint is chosen, and a run "
                         "resumed, once per epoch); use trainer.check_val_every_n_epoch")
    prec = trainer.get("precision", "32-true")
    if prec not in PRECISIONS:
        raise ValueError(f"trainer.precision={prec!r}: expected one of {', '.join(map(str, PRECISIONS))}")


def check_patience(patience) -> None:
    """early_stop.patience: a whole number of epochs >= 1, or None never to stop early (0 was read as "never")."""
    if patience is not None and not (isinstance(patience, int) and not isinstance(patience, bool) and patience >= 1):
        raise ValueError(f"early_stop.patience={patience!r}: expected a number of epochs >= 1, or null never to "
                         "stop early")


class BestOnVal(Callback):
    """Writes `path` whenever the validation score beats the best so far, the initial weights (before the
    first step) included, and stops training after `patience` epochs without a better score. Its state
    (best score and epoch, every epoch's score) travels in last.ckpt, so a resumed run keeps counting, and a
    run that had stopped trains no further when it is run again."""

    def __init__(self, path: Path, patience: int | None = None):
        check_patience(patience)
        self.path, self.patience = Path(path), patience
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.best_map: float | None = None
        self.scores: list[float] = []   # every epoch's val score, the initial weights' first

    def state_dict(self) -> dict:
        return {"best": self.best, "best_epoch": self.best_epoch, "best_map": self.best_map, "scores": self.scores}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_epoch, self.best_map = state.get("best"), state.get("best_epoch"), state.get("best_map")
        self.scores = list(state.get("scores") or [])

    def on_fit_start(self, trainer, module) -> None:
        if self.best is None:  # a fresh run; a resumed one restored its best from last.ckpt
            from ushash.evaluation import retrieval
            score, rows = module.val_scores()
            self.scores.append(score)
            self._keep(trainer, score, retrieval.mean_map(rows, "paired"), epoch=0)

    def on_train_start(self, trainer, module) -> None:
        # a resumed run that had stopped (its epochs done, counted as on_validation_end counts them, already
        # `patience` past its best) is finished: another epoch could beat the best and train on for another
        # patience, a different model
        if self.patience and self.best_epoch is not None and trainer.current_epoch - self.best_epoch >= self.patience:
            log.info("the run had stopped at epoch %d (best %d, patience %d): nothing to train", trainer.current_epoch,
                     self.best_epoch, self.patience)
            trainer.should_stop = True

    def on_validation_end(self, trainer, module) -> None:
        last, module.last_val = module.last_val, None
        if trainer.sanity_checking or last is None:
            return
        score, paired = last
        epoch = trainer.current_epoch + 1
        self.scores.append(score)
        if self.best is None or score > self.best:
            self._keep(trainer, score, paired, epoch)
        elif self.patience and epoch - self.best_epoch >= self.patience:
            trainer.should_stop = True

    def _keep(self, trainer, score: float, paired: float, epoch: int) -> None:
        self.best, self.best_map, self.best_epoch = score, paired, epoch
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        trainer.save_checkpoint(tmp, weights_only=False)
        if trainer.is_global_zero:
            replace_synced(tmp, self.path)


class LastCheckpoint(ModelCheckpoint):
    """last.ckpt after every validation, not only when fit ends (Lightning's ModelCheckpoint with no top-k saves
    `last` at the end of training only, so a run cut mid-training had nothing to resume from and started
    over), and when training ends, as Lightning's does. Every write is atomic and durable (a temporary file
    beside it, fsynced, then a rename, `replace_synced`): a run killed while saving, or a power cut, leaves the
    previous last.ckpt whole."""

    def on_validation_end(self, trainer, pl_module) -> None:
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_end(self, trainer, pl_module) -> None:
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))  # as Lightning's: the finished run

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        path = Path(filepath)
        tmp = path.with_name(f".{path.name}.tmp")
        super()._save_checkpoint(trainer, str(tmp))
        if trainer.is_global_zero:
            replace_synced(tmp, path)
        self._last_checkpoint_saved = str(path)


class RandomState(Callback):
    """The random state training draws from, in every checkpoint, and put back when a run resumes: torch's
    (the loader's shuffle draws from it each epoch) and the batcher's (which of a group's rows a batch takes).
    Without it a resumed run re-drew the first epoch's order from the seed, and trained a different model
    than the run it continued would have. Restored at the first training epoch after the load, after
    the sanity check's draws, where the run it continues drew next."""

    def __init__(self):
        self._loaded: dict | None = None

    def state_dict(self) -> dict:
        import torch
        trainer = getattr(self, "_trainer", None)
        dm = getattr(trainer, "datamodule", None) if trainer is not None else None
        batcher = getattr(dm, "train_set", None)
        return {"torch": torch.get_rng_state(),
                "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else [],
                "batcher": batcher.rng.bit_generator.state if batcher is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self._loaded = dict(state)

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer = trainer

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        state, self._loaded = self._loaded, None
        if not state:
            return
        import torch
        torch.set_rng_state(state["torch"])
        cuda = state.get("cuda") or []
        if cuda and torch.cuda.is_initialized() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        batcher = getattr(trainer.datamodule, "train_set", None)
        if state.get("batcher") is not None and batcher is not None:
            batcher.rng.bit_generator.state = state["batcher"]


def _saved_hparams(last: Path) -> dict | None:
    """The hyper-parameters a checkpoint was saved with; None when there is none. One that cannot be read
    is refused in one line (Lightning's own report was a traceback from inside torch.load)."""
    if not last.exists():
        return None
    import torch
    try:
        ckpt = torch.load(last, map_location="cpu", weights_only=True)
    except Exception as e:
        why = " ".join(str(e).split())[:200]
        raise ValueError(f"{last} cannot be read as a checkpoint ({type(e).__name__}: {why}); set resume=false to "
                         f"train this run afresh, or run_name=... for a new run") from e
    if not isinstance(ckpt, dict):
        raise ValueError(f"{last} is not a Lightning checkpoint; set resume=false to train this run afresh, or "
                         f"run_name=... for a new run")
    return ckpt.get("hyper_parameters") or {}


def _as_trained(hp: dict) -> dict:
    """A checkpoint's hyper-parameters as the settings it was trained with. One saved before the weight
    average (no `ema_epochs`) trained without one, and its `head_lr: None` meant lr / 10 with init="gcca"
    (None means lr now): resuming it takes those values, passed explicitly."""
    if "ema_epochs" in hp:
        return hp
    lr = hp.get("lr")
    head_lr = hp.get("head_lr")
    if head_lr is None and lr is not None:
        head_lr = lr / 10 if hp.get("init", "gcca") == "gcca" else lr
    return {**hp, "ema_epochs": None, "head_lr": head_lr}


def _check_resumable(last: Path, hp: dict, hparams: dict) -> None:
    """Refuse to resume the run at `last` (saved with hyper-parameters `hp`) trained with other settings
    (another method, bits, loss weights, seed, batch size, space, trainer...): only max_epochs may change
    between a run and its resumption."""
    from ushash.hashing import methods
    theirs = methods.get(hp.get("method", "ushash")).name
    if theirs != methods.get(hparams.get("method", "ushash")).name:
        raise ValueError(f"{last} was trained with method {theirs!r}, not {hparams.get('method')!r}; set "
                         f"run_name=... (or resume=false) so the runs do not share a folder")
    # the training settings outside the hyper-parameters (`training_settings`); a checkpoint from before they
    # were recorded has none to compare
    ours = (hparams.get("provenance") or {}).get("training") or {}
    differ = [k for k, v in ((hp.get("provenance") or {}).get("training") or {}).items() if _plain(v) != _plain(ours.get(k))]
    hp = _as_trained(hp)
    # a setting the checkpoint does not record predates it: the run used what is now that setting's default
    import inspect
    from ushash.hashing.module import USHashModule
    default = {k: p.default for k, p in inspect.signature(USHashModule.__init__).parameters.items()
               if p.default is not inspect.Parameter.empty}
    # provenance is where the features came from (the folder, run name, data settings): the features
    # themselves are `_trained_on_other_features`'s to judge; its training settings are compared above
    differ = sorted(differ + [k for k in set(hp) | set(hparams)
                              if k not in ("max_epochs", "provenance") and _plain(hp.get(k, default.get(k))) != _plain(hparams.get(k, default.get(k)))])
    if differ:
        raise ValueError(f"{last} was trained with other settings ({', '.join(differ)}); resuming it would mix "
                         f"them. Set run_name=... for a new run, or resume=false to start this one over")


def _trained_on_other_features(hp: dict, provenance: dict) -> bool:
    """Whether a run saved with hyper-parameters `hp` learned from other features than `provenance`
    describes: the train and val stores' content digests (`FeatureSplit.content`), or their rows' fingerprints
    in a checkpoint from before those were recorded. A setting that differs is `_check_resumable`'s refusal;
    other features are not a setting."""
    theirs = hp.get("provenance") or {}
    key = "content" if "content" in theirs else "stores"
    return theirs.get(key) != provenance.get(key)


def trained_by() -> dict:
    """The code and package versions that train a run (`provenance.made_by` but the CPU): a checkpoint is
    resumed, or a finished run kept, only under the same (it was reused as it was after a code change)."""
    from ushash.core.provenance import code_digest, package_versions

    return {"code": code_digest(), "versions": package_versions()}


def _plain(v):
    """Compare hyper-parameters as plain data (tuples and lists alike)."""
    import json
    return json.dumps(v, sort_keys=True, default=str)


def run_train(cfg: DictConfig, splits: dict | None = None) -> dict:
    """Train; returns {"run_dir", "best", "last", "val_score", "val_map@10", "best_epoch", "val_scores", "space"}:
    val_score is the selection score of best.ckpt, val_map@10 its mean paired mAP@10 on val, best_epoch 0
    when the initial weights were never beaten; val_scores every epoch's selection score, the initial
    weights' first (val_score is their maximum, so it is biased upwards by the epochs' noise: comparing
    recipes, read the later epochs' too)."""
    check_settings(cfg)  # before extraction: a wrong setting must not cost an extraction first
    splits = splits or run_extract(cfg, splits=["train", "val"])
    if cfg.model.init == "gcca" and cfg.model.prototypes_from == "val":
        return _train_from_each_start(cfg, splits)
    train, val = splits["train"], splits["val"]
    mods = [m for m in train.modalities if m in val.modalities]
    in_dims = {m: int(train.meta["modalities"][m]["dim"]) for m in mods}
    space = prototypes = None
    if cfg.model.init == "gcca":
        from ushash.hashing.methods.ushash import closed_form_start
        space, prototypes = closed_form_start(train, val, int(cfg.bits), int(cfg.seed), space_settings(cfg),
                                              str(cfg.model.prototypes_from))
    # what the head was trained on: the store folder relative to the project (a copied checkpoint resolves it in
    # the clone it is used in), the rows' fingerprints, and the data settings that made them (when they did)
    data_cfg = to_dict(cfg.data)
    made_here = data_cfg.get("name") == train.meta["dataset"]
    provenance = {"dataset": train.meta["dataset"], "encoder": train.meta["encoder"],
                  "tokenizers": train.tokenizers,
                  "features_dir": relative_to_root(Path(train.path).parents[2], cfg.paths.root),
                  "stores": {sp: s.meta.get("rows_fingerprint") for sp, s in (("train", train), ("val", val))},
                  "content": {sp: s.content for sp, s in (("train", train), ("val", val))},
                  "run_name": str(cfg.run_name), "seed": int(cfg.seed), "data": data_cfg if made_here else None,
                  "method": method_config(cfg), "space": _space_record(space), "training": training_settings(cfg),
                  "made_by": trained_by()}
    dm = FeatureDataModule(str(train.path), str(val.path), mods, batch_size=int(cfg.model.batch_size), seed=int(cfg.seed))
    dm.setup("fit")
    n_groups = len(dm.train_set.groups)  # the batcher's vocabulary (ushash.core.groups): the one count
    # Seeded here, after the data is open: extraction (or not) and the closed-form fit consume no random
    # numbers of torch's, so ushash.train and ushash.sweep train the same model for the same seed.
    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    module = USHashModule(**module_kwargs(cfg, in_dims, provenance, n_train_groups=n_groups,
                                          dim=space.dim if space is not None else None))
    if space is not None:
        module.initialise(space, prototypes)
    run_dir = Path(cfg.paths.checkpoints_dir) / str(cfg.run_name)
    last = run_dir / "last.ckpt"
    saved = _saved_hparams(last) if cfg.resume else None
    if saved is not None and _trained_on_other_features(saved, provenance):
        aside = set_aside(run_dir, run_dir.parent / "stale")
        log.warning("%s was trained on other features than the stores now hold (a store made again); training "
                    "afresh, the old run kept in %s", run_dir, aside)
        saved = None
    elif saved is not None and (saved.get("provenance") or {}).get("made_by") != provenance["made_by"]:
        aside = set_aside(run_dir, run_dir.parent / "stale")
        log.warning("%s was trained by other code or packages (%s, here %s); training afresh, the old run kept "
                    "in %s", run_dir, (saved.get("provenance") or {}).get("made_by") or "not recorded",
                    provenance["made_by"], aside)
        saved = None
    run_dir.mkdir(parents=True, exist_ok=True)
    best = BestOnVal(run_dir / "best.ckpt", patience=(cfg.get("early_stop") or {}).get("patience"))
    last_ckpt = LastCheckpoint(dirpath=run_dir, save_top_k=0, save_last=True, enable_version_counter=False)
    kind = cfg.logger.kind
    # logs/version_<n>/: a resumed run logs beside the first part instead of deleting its metrics
    logger = (TensorBoardLogger if kind == "tensorboard" else CSVLogger)(save_dir=str(run_dir), name="logs")
    trainer = pl.Trainer(**to_dict(cfg.trainer), callbacks=[best, RandomState(), last_ckpt], logger=logger,
                         default_root_dir=str(run_dir))
    resume = str(last) if cfg.resume and last.exists() else None
    if resume and saved is not None:
        _check_resumable(last, saved, dict(module.hparams))
        log.info("resuming from %s", resume)
    trainer.fit(module, datamodule=dm, ckpt_path=resume, weights_only=True)
    return {"run_dir": str(run_dir), "best": str(best.path if best.path.exists() else last), "last": str(last),
            "val_score": best.best, "val_map@10": best.best_map, "best_epoch": best.best_epoch,
            "val_scores": list(best.scores), "space": provenance["space"]}


def _train_from_each_start(cfg: DictConfig, splits: dict) -> dict:
    """model.prototypes_from=val: one training from each closed-form start (checkpoints/<run>/<start>/, each
    resumable), and the one with the higher val score kept (a tie keeps the first, ITQ). The result is the
    kept run's, plus "start" (which) and "starts" (every start's val score)."""
    from ushash.hashing.methods.ushash import PROTOTYPE_STARTS
    outs = {}
    for start in PROTOTYPE_STARTS:
        sub = cfg.copy()
        with open_dict(sub):
            sub.model.prototypes_from = start
            sub.run_name = f"{cfg.run_name}/{start}"
        outs[start] = run_train(sub, splits)
    kept = max(PROTOTYPE_STARTS, key=lambda s: outs[s]["val_score"])
    log.info("prototypes_from=val: kept the %s start (val score %s)", kept,
             ", ".join(f"{s} {o['val_score']:.4f}" for s, o in outs.items()))
    return {**outs[kept], "start": kept, "starts": {s: o["val_score"] for s, o in outs.items()}}


def _space_record(space) -> dict | None:
    if space is None:
        return None
    return {"align": space.resolved, "dim": int(space.dim), **{k: v for k, v in space.choice.items() if k != "candidates"}}
