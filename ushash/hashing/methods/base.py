"""The no-training baselines' common part: fit a `SharedSpace` on the training split (its settings chosen on
the validation split when they are "auto", `choose_space`), fit a projection to `bits` dimensions on all
modalities' training embeddings stacked together, and encode by sign."""

from __future__ import annotations

import numpy as np

from ushash.core import codes as codes_lib
from ushash.data.store import FeatureSplit
from ushash.config import SpaceConfig
from ushash.hashing.methods.space import SharedSpace, choose_space, is_auto

_S = SpaceConfig()


class NotApplicable(ValueError):
    """This method cannot make codes of this length from this data (e.g. more PCA bits than input dims)."""


class FittedMethod:
    """Subclasses implement `_fit(y)` (y: float32 [N, d] stacked training embeddings of every modality) and
    `_project(y) -> float [N, bits]`; the code is `_project(y) > 0`. The object is a retrieval method:
    `method(modality, x) -> ("codes", packed)`. `fit` reads the training split and nothing else."""

    output = "codes"

    def __init__(self, bits: int, seed: int = 0, align: str = _S.align, common_dim: int = _S.common_dim,
                 max_rank=_S.max_rank, reg=_S.reg, power: float = _S.power, rank_grid=None, reg_grid=None):
        """Defaults: ushash.config.SpaceConfig (max_rank / reg "auto": `fit` needs the val split)."""
        self.bits = codes_lib.check_bits(bits) if self.output == "codes" else int(bits)
        self.seed = int(seed)
        self.space_settings = {"align": align, "common_dim": max(int(common_dim), self.bits if self.output == "codes" else 0),
                               "max_rank": max_rank if is_auto(max_rank) else int(max_rank),
                               "reg": reg if is_auto(reg) else float(reg), "power": float(power)}
        self.space_settings.update({k: tuple(v) for k, v in (("rank_grid", rank_grid), ("reg_grid", reg_grid)) if v})
        self.space: SharedSpace | None = None

    def fit(self, train: FeatureSplit, val: FeatureSplit | None = None) -> "FittedMethod":
        """Fit on `train`; `val` is read only to choose the space's "auto" settings (never the test split)."""
        split = train.meta.get("split")
        if split not in (None, "train"):
            raise ValueError(f"baselines are fitted on the training split only; got the {split!r} split")
        self.space = choose_space(train, val, **self.space_settings)
        y = self.space.train_embeddings(train)
        if self.output == "codes" and self.needs_pca and self.bits > y.shape[1]:
            raise NotApplicable(f"{type(self).__name__}: bits={self.bits} > shared space dim {y.shape[1]}; "
                             f"raise common_dim (and max_rank) or use fewer bits")
        self._fit(y)
        return self

    needs_pca = True

    def _fit(self, y: np.ndarray) -> None:
        raise NotImplementedError

    def _project(self, y: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def encode(self, modality: str, x) -> tuple[str, np.ndarray]:
        if self.space is None:
            raise RuntimeError(f"{type(self).__name__}.encode before fit: call fit(train_split, val_split) first")
        y = self.space.transform(modality, x)
        if self.output == "float":
            return "float", y
        return "codes", codes_lib.pack(self._project(y) > 0)

    __call__ = encode

    def describe(self) -> str:
        return self.space.describe()


def pca(y: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(mean [d], top-k principal axes [d, k]) of y, deterministic signs (largest |loading| positive)."""
    mean = y.mean(axis=0)
    _, _, vt = np.linalg.svd(np.asarray(y, np.float64) - mean, full_matrices=False)
    v = vt[:k].T
    flip = np.sign(v[np.abs(v).argmax(axis=0), np.arange(v.shape[1])])
    return mean, v * np.where(flip == 0, 1, flip)


def random_rotation(k: int, seed: int) -> np.ndarray:
    """A seeded Haar-random orthogonal k x k matrix (QR of a Gaussian with the sign fix)."""
    q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(k, k)))
    return q * np.sign(np.diag(r))
