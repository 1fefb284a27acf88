"""The shared input space the no-training baselines are fitted in.

Cross-modal codes must share one space, so LSH / PCA-sign / ITQ / PCA + rotation (and the float upper
bound) are fitted jointly on all modalities' embeddings *in one space*. Which space:

- ``align="none"``: the raw encoder features. Only meaningful for joint-space encoders (CLIP image/text,
  CLAP audio/text), whose towers were trained into one space; all modalities must have the same dim.
  Unaligned unimodal encoders with equal dims would run, and score at chance (tests/test_methods.py).
- ``align="gcca"``: a fitted linear map per modality into a common ``common_dim``-d space: generalised
  CCA (MAXVAR; for two modalities it is plain CCA), fitted on the *training pairs* only. With
  ``encoder=offline`` (MiniLM 384-d, EfficientNet 1280-d, aiSFX 512-d) the raw spaces are unrelated, so
  this cheap fitted alignment is what lets a no-training code compare an image with a caption at all.
  It is a linear, closed-form fit of the same pairing signal the trained methods use; tables name it.
- ``align="auto"``: "none" for the joint-space encoders (``JOINT_SPACE_ENCODERS``), "gcca" otherwise.

GCCA (MAXVAR) with missing views, regularised, as fitted here:
1. per modality m, average its training rows per group (several captions -> one row) -> X_m;
2. ridge-whiten: U_m = (X_m - mean_m) V_m diag(lambda + eps)^-1/2 over the top ``max_rank`` principal axes,
   eps = ``reg`` * mean(lambda) (audio has ~100 training rows in 512 dims; ``reg`` was chosen on the Tux
   Paint validation split: 1.0);
3. stack the whitened views side by side over all training groups (a row of zeros where a group lacks a
   modality): U~ [groups, sum r_m]; M = U~^T U~ with its diagonal blocks set to the identity (regularised
   CCA), so that its top eigenvectors B are the axes most shared across modalities;
4. keep the top ``common_dim`` axes by eigenvalue mu. An axis with mu > 1 is shared by at least two
   modalities (for two modalities mu = 1 + regularised canonical correlation); mu < 1 are directions where
   the modalities disagree;
5. modality m maps into the common space by x -> (x - mean_m) V_m diag(.)^-1/2 B_m diag(w), where B_m is m's
   block of B and w = max(mu - 1, 0)^power: each axis is weighted by its shared correlation, and axes that
   are not shared get a floor weight of 1e-3 * max(w), so that code lengths above the number of shared axes
   still exist (their bits are noise, as PCA bits beyond the signal are). `shared_axes` says how many there
   were.
For every space, each modality's training mean is then subtracted (the "modality gap" between towers)
and rows are L2-normalised: the baselines see unit vectors centred per modality.

Choosing the space on val (`choose_space`)
``max_rank`` and ``reg`` decide how much of each encoder's space GCCA may use and how hard it is
regularised; the right values depend on the data (feature widths, number of training pairs). With
``max_rank="auto"`` / ``reg="auto"`` (the shipped defaults, configs/space/default.yaml) every pair of
``rank_grid`` x ``reg_grid`` is fitted on the training split and the one whose float space scores best on
the validation split (`retrieval.selection_score`: mean mAP@10 over directions and protocols) is kept.
Every method fitted in the space, and US-HASH's closed-form initialisation, then use that one space:
the same care for every method, and selection on val, never on test.
"""

from __future__ import annotations

import numpy as np

from ushash.config import SpaceConfig
from ushash.core.checks import unit_rows
from ushash.core.groups import vocabulary
from ushash.data.store import FeatureSplit

JOINT_SPACE_ENCODERS = ("openclip", "hf_clip", "clap")  # towers trained into one space already
ALIGNS = ("auto", "none", "gcca")


def resolve_align(align: str, encoder_name: str) -> str:
    if align not in ALIGNS:
        raise ValueError(f"align={align!r}: expected one of {ALIGNS}")
    if align == "auto":
        return "none" if encoder_name in JOINT_SPACE_ENCODERS else "gcca"
    return align


def _group_means(x: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the vocabulary ids present, ascending; mean row per present group)."""
    uniq, inv = np.unique(ids, return_inverse=True)
    sums = np.zeros((len(uniq), x.shape[1]), np.float64)
    np.add.at(sums, inv, x)
    return uniq, sums / np.bincount(inv, minlength=len(uniq))[:, None]


_VIEWS: dict = {}


def _views(tables) -> tuple[np.ndarray, dict]:
    """(group vocabulary, per modality (groups, group means, mean, singular values, right vectors)): the
    part of the GCCA fit that does not depend on max_rank / reg, computed once per training split."""
    key = tuple((m, id(t.x), len(t)) for m, t in tables.items())
    hit = _VIEWS.get(key)
    if hit is not None and all(h is t for h, t in zip(hit[0], tables.values())):
        return hit[1]
    vocab, index = vocabulary({m: t.groups for m, t in tables.items()})
    views = {}
    for m, t in tables.items():
        uniq, xg = _group_means(np.asarray(t.x, np.float64), index[m])
        mean = xg.mean(axis=0)
        _, s, vt = np.linalg.svd(xg - mean, full_matrices=False)
        views[m] = (uniq, xg, mean, s, vt)
    _VIEWS.clear()  # one split's views at a time: they hold the features' size
    _VIEWS[key] = (tuple(tables.values()), (vocab, views))
    return vocab, views


_l2 = unit_rows


_S = SpaceConfig()
RANK_GRID, REG_GRID = tuple(_S.rank_grid), tuple(_S.reg_grid)


class SharedSpace:
    """Fit with `fit(train_split)`; then `transform(modality, x)` -> float32 [N, dim], unit rows.
    max_rank / reg must be numbers here; "auto" is resolved on val by `choose_space`."""

    def __init__(self, align: str = _S.align, common_dim: int = _S.common_dim, max_rank: int = 256, reg: float = 1.0,
                 power: float = _S.power):
        if is_auto(max_rank) or is_auto(reg):
            raise ValueError("max_rank/reg='auto' are chosen on the validation split: use "
                             "ushash.hashing.methods.space.choose_space(train, val, ...) (or pass numbers)")
        self.align, self.common_dim, self.max_rank, self.reg, self.power = align, int(common_dim), int(max_rank), float(reg), float(power)
        if self.common_dim < 1 or self.max_rank < 1 or not (np.isfinite(self.reg) and self.reg >= 0):
            raise ValueError(f"shared space: common_dim and max_rank must be >= 1 and reg a finite number >= 0; got "
                             f"common_dim={common_dim!r}, max_rank={max_rank!r}, reg={reg!r}")
        self.maps: dict[str, tuple[np.ndarray, np.ndarray]] = {}   # modality -> (input mean, projection)
        self.post_mean: dict[str, np.ndarray] = {}
        self.resolved = None
        self.dim = None
        self.fitted_on: dict | None = None

    # ------------------------------------------------------------------ fitting
    def fit(self, train: FeatureSplit) -> "SharedSpace":
        self.resolved = resolve_align(self.align, train.meta["encoder"]["name"])
        tables = {m: train.tables[m] for m in train.modalities}
        for m, t in tables.items():  # an empty or non-finite table would give NaN maps, hence silently constant codes
            if len(t) == 0:
                raise ValueError(f"the training split has no {m} rows, so the shared space cannot map {m}; extract {m} "
                                 f"features for the training split, or leave {m} out of the store")
            bad = int((~np.isfinite(np.asarray(t.x))).any(axis=1).sum())
            if bad:
                raise ValueError(f"the training split's {m} features have {bad} rows with NaN or inf; extract them again "
                                 f"(or drop those rows) before fitting the shared space")
        if self.resolved == "none":
            dims = {m: t.x.shape[1] for m, t in tables.items()}
            if len(set(dims.values())) != 1:
                raise ValueError(
                    f"align=none needs one shared input space, but the modalities have different dims {dims} "
                    f"(encoder {train.meta['encoder']['name']!r} is not a joint-space encoder). Use align=gcca "
                    f"(a fitted linear alignment on the training pairs) or align=auto.")
            d = next(iter(dims.values()))
            self.maps = {m: (np.zeros(d), np.eye(d)) for m in tables}
        else:
            self._fit_gcca(tables)
        self.post_mean = {}
        for m, t in tables.items():
            y = self._map(m, np.asarray(t.x, np.float64))
            self.post_mean[m] = y.mean(axis=0)
        self.dim = next(iter(self.maps.values()))[1].shape[1]
        self.fitted_on = {"split": train.meta.get("split"), "dataset": train.meta.get("dataset"),
                          "rows": {m: len(t) for m, t in tables.items()}}
        return self

    def _fit_gcca(self, tables) -> None:
        if len(tables) < 2:
            raise ValueError(f"align=gcca needs at least two modalities in the training split, got {list(tables)}")
        vocab, views = _views(tables)
        blocks, whiten = {}, {}
        for m in tables:
            uniq, xg, mean, s, vt = views[m]
            lam = s ** 2
            r = int(min(self.max_rank, (lam > lam[0] * 1e-10).sum()))
            if r == 0:  # one training group, or identical rows: no direction to whiten, every m row would get one code
                raise ValueError(f"align=gcca: the training split's {m} features span no direction ({len(uniq)} group(s), "
                                 f"all rows equal after averaging per group); {m} needs rows of at least two distinct "
                                 f"groups to be mapped, or leave {m} out of the store")
            lam, v = lam[:r], vt[:r].T
            w = v / np.sqrt(lam + self.reg * lam.mean())
            rows = uniq  # ids in the one vocabulary
            u = np.zeros((len(vocab), r))
            u[rows] = (xg - mean) @ w
            blocks[m], whiten[m] = u, (mean, w)
        order = list(tables)
        U = np.concatenate([blocks[m] for m in order], axis=1)
        M = U.T @ U
        # Regularised CCA: the cross-blocks use the ridge-whitened views, the diagonal blocks are the identity,
        # so an axis shared by two modalities has eigenvalue 1 + (regularised) canonical correlation.
        start = 0
        for m in order:
            r = blocks[m].shape[1]
            M[start:start + r, start:start + r] = np.eye(r)
            start += r
        evals, evecs = np.linalg.eigh(M)
        # An axis with eigenvalue > 1 is shared by at least two modalities; <= 1 is one modality's own variance
        # (or, below 1, directions where the modalities disagree): those are dropped.
        shared = int((evals > 1.0 + 1e-6).sum())
        if shared == 0:
            raise ValueError("GCCA found no axis shared by two modalities in the training split")
        d = min(self.common_dim, len(evals))
        top = np.argsort(evals)[::-1][:d]
        evals, evecs = evals[top], evecs[:, top]
        weight = np.clip(evals - 1.0, 0.0, None) ** self.power
        scale = np.maximum(weight, 1e-3 * weight.max())
        self.shared_axes = shared
        self.eigenvalues = evals
        start = 0
        for m in order:
            mean, w = whiten[m]
            r = w.shape[1]
            self.maps[m] = (mean, (w @ evecs[start:start + r]) * scale)
            start += r

    # ------------------------------------------------------------------ mapping
    def _map(self, modality: str, x: np.ndarray) -> np.ndarray:
        if modality not in self.maps:
            raise KeyError(modality)  # retrieval.evaluate skips modalities a method cannot encode
        mean, proj = self.maps[modality]
        if x.ndim != 2 or x.shape[1] != proj.shape[0]:
            raise ValueError(f"{modality} features: expected [N, {proj.shape[0]}], got {list(x.shape)}")
        return (x - mean) @ proj

    def transform(self, modality: str, x) -> np.ndarray:
        """float32 [N, dim]: mapped, centred by the modality's training mean, L2-normalised."""
        if self.resolved is None:
            raise RuntimeError("SharedSpace.transform before fit()")
        x = np.asarray(x, np.float64)
        if x.size and not np.isfinite(x).all():  # NaN would map to a NaN row: a code of all zeros, silently
            raise ValueError(f"{modality} features contain NaN or inf in {int((~np.isfinite(x)).reshape(len(x), -1).any(axis=1).sum())} "
                             f"row(s); expected finite values (re-extract those items or drop them)")
        y = self._map(modality, x)
        return _l2(y - self.post_mean[modality])

    def train_embeddings(self, train: FeatureSplit) -> np.ndarray:
        """All modalities' training rows in the shared space, stacked (what the baselines are fitted on)."""
        return np.concatenate([self.transform(m, train.tables[m].x) for m in train.modalities if m in self.maps])

    def describe(self) -> str:
        if self.resolved == "none":
            return "raw joint encoder space"
        return (f"GCCA-aligned {self.dim}-d space fitted on training pairs (max_rank {self.max_rank}, "
                f"reg {self.reg:g})")


# ---------------------------------------------------------------------------------------------- choice on val

def is_auto(v) -> bool:
    return isinstance(v, str) and v.lower() == "auto"


_CHOSEN: dict = {}


def choose_space(train: FeatureSplit, val: FeatureSplit | None, align: str = _S.align, common_dim: int = _S.common_dim,
                 max_rank=_S.max_rank, reg=_S.reg, power: float = _S.power, rank_grid=RANK_GRID, reg_grid=REG_GRID,
                 progress: bool = False) -> SharedSpace:
    """The shared space fitted on `train`, with max_rank / reg set to "auto" chosen on `val` (module doc).

    Numbers are used as given. The result carries `choice`: the settings kept, the val score of every
    candidate and the criterion. Choices are remembered per (train, val, settings) within the process,
    so a sweep over methods, code lengths and seeds fits the grid once."""
    auto_rank, auto_reg = is_auto(max_rank), is_auto(reg)
    resolved = resolve_align(align, train.meta["encoder"]["name"])
    if resolved == "none" or not (auto_rank or auto_reg):
        space = SharedSpace(align, common_dim, 256 if auto_rank else max_rank, 1.0 if auto_reg else reg, power)
        space.fit(train)
        space.choice = {"max_rank": space.max_rank, "reg": space.reg, "chosen_on": None}
        return space
    if val is None:
        raise ValueError("max_rank/reg='auto' are chosen on the validation split, and none was given; pass the "
                         "val split (ushash.train and ushash.sweep do) or set space.max_rank / space.reg to numbers")
    if val.meta.get("split") not in (None, "val"):
        raise ValueError(f"the shared space is chosen on the validation split only; got the {val.meta.get('split')!r} split")
    ranks = [int(r) for r in rank_grid] if auto_rank else [int(max_rank)]
    regs = [float(r) for r in reg_grid] if auto_reg else [float(reg)]
    # what the stores hold (`FeatureSplit.content`, computed once per opened split; training and sweeps read it too):
    # a store made again in place within one second has the same folder and `created`, and other features
    key = (train.content, val.content, align, int(common_dim), tuple(ranks), tuple(regs), float(power))
    if key in _CHOSEN:
        return _CHOSEN[key]
    from ushash.evaluation import retrieval
    from tqdm.auto import tqdm
    dims = {m: train.tables[m].x.shape[1] for m in train.modalities}
    groups = len(set().union(*(set(t.groups) for t in train.tables.values())))
    cap = min(max(dims.values()), groups)  # a rank above every view's own rank fits the same space
    ranks = sorted({min(r, cap) for r in ranks})
    scores, best = [], None
    grid = [(r, g) for r in ranks for g in regs]
    for r, g in tqdm(grid, desc="shared space on val", disable=not progress, leave=False):
        space = SharedSpace(align, common_dim, r, g, power).fit(train)
        score = retrieval.selection_score(val, lambda m, x, s=space: ("float", s.transform(m, x)))
        scores.append({"max_rank": r, "reg": g, "val": round(score, 5)})
        if best is None or score > best[0]:
            best = (score, space)
    space = best[1]
    space.choice = {"max_rank": space.max_rank, "reg": space.reg, "chosen_on": "val", "val_score": round(best[0], 5),
                    "criterion": retrieval.SELECTION_DOC, "candidates": scores}
    if len(_CHOSEN) >= 8:  # a few recent choices: each holds a fitted space
        _CHOSEN.pop(next(iter(_CHOSEN)))
    _CHOSEN[key] = space
    return space
