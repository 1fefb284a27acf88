"""Configuration: the typed schema of every setting with its default and meaning, and the Hydra plumbing.

The dataclasses below are the one source of the defaults. They are registered in Hydra's ConfigStore as
`<group>/schema` (and `schema_root` for the root keys), and the YAML files under configs/ extend them
(`defaults: [schema, _self_]`), so `python -m ushash.train model.lr=abc` fails at load time naming the key,
and the code builds its objects from the same classes (`ModelConfig()` is what `USHashModule` defaults to).
Settings of the serving side have their own schemas next to their code (`ushash.serving.cache.config`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parent.parent          # the repository (editable install)
CONFIG_DIR = ROOT / "configs"

if not OmegaConf.has_resolver("ushash_root"):
    # Paths never depend on the working directory: they hang off the repository root.
    OmegaConf.register_new_resolver("ushash_root", lambda: str(ROOT))


# ---------------------------------------------------------------------------------------------- schemas

@dataclass
class SpaceConfig:
    """The shared input space (ushash/hashing/methods/space.py): every no-training method is fitted in it,
    and US-HASH's closed-form start (model.init=gcca) is its linear map plus the ITQ rotation of it.
    max_rank / reg "auto": every pair of rank_grid x reg_grid is fitted on train and the one whose float
    space scores best on val is kept (retrieval.SELECTION_DOC); a number is used as given."""
    align: str = "auto"               # auto: raw space for joint encoders (CLIP/CLAP), else gcca; none | gcca
    common_dim: int = 128             # dims of the GCCA common space (raised to bits when bits is larger)
    max_rank: Union[int, str] = "auto"   # principal axes kept per modality before GCCA
    reg: Union[float, str] = "auto"      # ridge on each modality's covariance, relative to its mean eigenvalue
    power: float = 1.0                # common axis i is weighted by (eigenvalue_i - 1) ** power
    rank_grid: list[int] = field(default_factory=lambda: [128, 256, 512, 1024, 2048])
    reg_grid: list[float] = field(default_factory=lambda: [0.1, 0.3, 1.0, 3.0])


Weight = float  # (a field of LossConfig is named "float": its annotations use this alias)


@dataclass
class LossConfig:
    """US-HASH's loss weights (ushash/hashing/methods/ushash.py)."""
    contrastive: Weight = 1.0          # cross-modal InfoNCE on relaxed codes (cosine)
    float: Weight = 0.18               # the same on the continuous embeddings z
    distill: Weight = 15.0             # code similarities pulled to the closed-form space's cosines (init=gcca)
    quant: Weight = 0.1                # (|h| - 1)^2
    balance: Weight = 0.1              # each bit half on
    decor: Weight = 0.01               # bits decorrelated
    proto: Weight = 0.01               # prototypes near-orthogonal
    margin: Weight = 0.0               # different items' codes model.margin_fraction of the bits apart (off; for cache keys)


@dataclass
class ModelConfig:
    """US-HASH heads and their training (ushash/hashing/module.py has the recipe). Defaults chosen on the
    validation splits of Tux Paint, emoji and the synthetic set together (docs/baselines.md); lr,
    temperature and the float and distill weights are the budgeted search's choice on emoji's val, rounded,
    kept because val rose with them on both real sets at 16 to 128 bits."""
    init: str = "gcca"                # gcca: linear heads start as the shared space's maps, prototypes from a closed-form code; random
    prototypes_from: str = "itq"      # init=gcca's prototypes: itq (ITQ rotation of the space), lsh (its random hyperplanes), val (the better on val)
    dim: int = 128                    # shared space dimension with init=random (gcca: the shared space's own)
    hidden: int = 512                 # hidden width of each projection head (init=random with layers > 1)
    layers: int = 1                   # linear layers per head (init=gcca needs 1)
    dropout: float = 0.1
    lr: float = 9e-3                  # prototypes, heads and the learned temperatures
    head_lr: Optional[float] = None   # heads; None: lr
    weight_decay: float = 1e-4
    batch_size: int = 128             # groups per batch
    temperature: float = 0.84         # contrastive temperature (codes and z), the start of the learned one
    learn_temperature: bool = True    # learn it (a CLIP-style logit scale); false: keep it fixed
    temperature_lr: Optional[float] = None  # the learned temperatures' learning rate; None: lr
    ema_epochs: Optional[float] = 4.0  # validate and keep an exponential moving average of the weights over about this many epochs; None: the raw weights
    relax: str = "tanh"               # tanh(beta * sqrt(dim) * l) with beta rising, or ste (straight-through sign)
    beta_start: float = 1.0
    beta_end: float = 16.0
    distill_kernel: str = "cosine"    # code similarity asked for a teacher cosine t: cosine (t) or angular (1 - 2 arccos(t) / pi)
    margin_fraction: float = 0.125    # the Hamming margin of model.loss.margin, as a fraction of the bits (8 of 64)
    distill_pairs: str = "cross"      # pairs distilled: cross (image-text, ...) or all (within a modality too)
    loss: LossConfig = field(default_factory=LossConfig)


@dataclass
class ExtractConfig:
    """Feature extraction (ushash/data/extract.py)."""
    splits: list[str] = field(default_factory=lambda: ["train", "val", "test"])
    batch_size: int = 64
    num_workers: Any = "auto"         # DataLoader workers that decode media; auto: one per core beyond the first, at most 8
    device: str = "auto"              # auto: cuda when available
    max_bad_frac: float = 0.5         # stop when more than this share of a modality's rows fail to decode
    progress: bool = True
    shards: int = 0                   # > 0: hash rows into this many resumable shards (ushash/data/shards.py)
    strategy: Optional[str] = None    # ddp: Lightning DDP prediction, each rank writes its own shards, rank 0 merges
    devices: int = 1
    num_nodes: int = 1


@dataclass
class EvalConfig:
    """Evaluation (ushash/evaluation/evaluate.py): the demo's `eval` block and python -m ushash.eval."""
    split: str = "test"
    database: Optional[str] = None    # split ranked against; None: the query split itself (hashing protocol: database)
    k: int = 10
    denominator: str = "min"          # mAP@k denominator: min (Z=min(k,#rel)), found, all
    protocols: list[str] = field(default_factory=lambda: ["paired", "label"])


@dataclass
class EvalRunConfig(EvalConfig):
    """python -m ushash.eval (configs/eval.yaml): the evaluation settings plus which checkpoint and where."""
    ckpt: str = "???"                 # required: a checkpoint (it describes itself; no other config is needed)
    features_dir: Optional[str] = None  # default: the feature store the checkpoint was trained from
    out: Optional[str] = None         # default: experiments/eval/<run>/<ckpt>-<split>-<digest of what made it>;
                                      # a folder holding the tables of other settings is refused, not overwritten
    paths: Any = None


@dataclass
class EarlyStopConfig:
    patience: Optional[int] = 10      # stop after this many epochs without a better val score (the initial weights count); None: never


@dataclass
class RootConfig:
    """The root keys of configs/config.yaml (extract / train / sweep / demo); the groups are their own schemas."""
    bits: int = 64                    # code length: 16, 32, 64 or 128 (any multiple of 8 up to 1024)
    seed: int = 0
    run_name: str = "${data.name}-${encoder.name}-${bits}b-s${seed}"
    resume: bool = True               # continue from checkpoints/<run>/last.ckpt when it exists
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sweep: Any = None                 # the sweep's settings (ushash/evaluation/sweep.py), set by experiment files
    search: Any = None                # the search's settings (ushash/evaluation/search.py), set by configs/search.yaml
    # the config groups (each with its own YAML; model and space with their schemas)
    paths: Any = None
    data: Any = None
    encoder: Any = None
    space: SpaceConfig = field(default_factory=SpaceConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    method: Any = None
    trainer: Any = None
    logger: Any = None
    experiment: Any = None


def register_schemas() -> None:
    """Put the schemas in Hydra's ConfigStore (idempotent): configs/*.yaml name them in their defaults."""
    from hydra.core.config_store import ConfigStore
    cs = ConfigStore.instance()
    cs.store(name="schema_root", node=RootConfig)
    cs.store(group="model", name="schema", node=ModelConfig)
    cs.store(group="space", name="schema", node=SpaceConfig)
    cs.store(name="schema_eval", node=EvalRunConfig)


register_schemas()


# ---------------------------------------------------------------------------------------------- plumbing

def quiet_third_party() -> None:
    """What the entry points call first: no progress bars or notices from libraries that users cannot act on
    (transformers' weight-loading bar, a torch deprecation raised inside Lightning). Library use is untouched."""
    import warnings
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def user_errors(main):
    """Decorator of a verb's `main`: a mistake in what was asked (a bad setting, a missing or existing file,
    data that cannot be read) prints one line that names it and the fix, and exits with status 2; a bug
    still shows its traceback. `hydra.verbose=true` or HYDRA_FULL_ERROR=1 shows the traceback of both."""
    import functools
    import sys

    @functools.wraps(main)
    def wrapped(cfg):
        from omegaconf.errors import MissingMandatoryValue

        from ushash.data.datasets.emoji import FetchError as EmojiFetchError
        from ushash.data.datasets.tuxpaint import FetchError as TuxFetchError
        from ushash.data.store import FeatureStoreError
        mistakes = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
                    PermissionError, FeatureStoreError, TuxFetchError, EmojiFetchError, MissingMandatoryValue)
        try:
            return main(cfg)
        except Exception as e:
            if not (isinstance(e, mistakes) or _refused_by_lightning(e)):
                raise
            if os.environ.get("HYDRA_FULL_ERROR") == "1" or _hydra_verbose():
                raise
            logging.getLogger("ushash").error("%s (hydra.verbose=true for the traceback)", _one_line(e))
            sys.exit(2)
    return wrapped


def _refused_by_lightning(e: Exception) -> bool:
    """Lightning's MisconfigurationException: the Trainer refused a trainer.* setting (trainer.devices=0, an
    accelerator that is not there). Told by its name, so that verbs that never import Lightning do not."""
    return type(e).__name__ == "MisconfigurationException" and type(e).__module__.split(".")[0] in (
        "lightning_fabric", "pytorch_lightning", "lightning")


def _one_line(e: Exception) -> str:
    """The line a mistake prints: its message, or for a required setting left out (a `???` in the verb's
    config, which omegaconf reports over three lines) the key and how to give it."""
    from omegaconf.errors import MissingMandatoryValue
    if isinstance(e, MissingMandatoryValue):
        key = getattr(e, "full_key", None) or "a required setting"
        return f"{key} is required: add {key}=... to the command (--help shows the verb's usage)"
    if _refused_by_lightning(e):
        return f"the trainer settings (trainer.*) were refused: {' '.join(str(e).split())}"
    return str(e) or type(e).__name__


def _hydra_verbose() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        return bool(HydraConfig.get().verbose)
    except ValueError:
        return False


class ConsoleFormatter(logging.Formatter):
    """`[train] message` for ushash's INFO lines (the last part of the logger's name), `[name] WARNING: message`
    for warnings and errors of anyone (configs/hydra/job_logging/ushash.yaml)."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        short = record.name.rsplit(".", 1)[-1]
        if record.levelno >= logging.WARNING:
            return f"[{short}] {record.levelname}: {msg}"
        return f"[{short}] {msg}"


class RankZeroFilter(logging.Filter):
    """Under DDP only rank 0 writes INFO lines to the console (warnings come from every rank)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)
        return rank == 0 or record.levelno >= logging.WARNING


class OwnInfoFilter(logging.Filter):
    """The console shows INFO lines of ushash only; other libraries reach it from WARNING up. A filter and not
    a level, because Lightning sets its loggers to INFO when it is first imported, which can be after Hydra
    configured logging (the file log keeps every INFO line; hydra.verbose=true shows all)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno >= logging.WARNING or record.name == "ushash" or record.name.startswith("ushash.")
                or logging.getLogger().level <= logging.DEBUG)  # hydra.verbose=true: everything


def to_dict(cfg: DictConfig | None) -> dict:
    """Plain, resolved containers before anything reaches a constructor or a checkpoint."""
    if cfg is None:
        return {}
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.structured(cfg)
    return OmegaConf.to_container(cfg, resolve=True)


def compose(config_name: str = "config", overrides: list[str] | None = None) -> DictConfig:
    """The config an entry point would see for these overrides (used by tests and the demo)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))
