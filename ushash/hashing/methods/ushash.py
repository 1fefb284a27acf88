"""US-HASH itself: cross-modal InfoNCE on relaxed codes and on the continuous embeddings, similarity
distillation from the closed-form shared space it starts from, with quantization, bit balance, decorrelation
and a near-orthogonal-prototypes regulariser (ushash/hashing/heads.py, ushash/hashing/losses.py, ushash/hashing/module.py).
Its loss weights are `model.loss.*` (configs/model/ushash.yaml), hyper-parameters `w_*` of the module.

`closed_form_start` makes the initialisation: the shared space chosen on val (`choose_space`, the one the
no-training baselines use) and the ITQ rotation of it (the registry's ITQ, so US-HASH starts from the codes
the ITQ baseline makes, up to ITQ's centring, which sign(z . P^T) has no bias for)."""

from __future__ import annotations

import itertools

import torch

from ushash.hashing import losses
from ushash.hashing.methods import MethodSpec, register


EVERY_ROW = slice(None)   # a mask whose rows are all present: indexing by it is a view, not a gather (and its backward a scatter)


def rows(mask: torch.Tensor, kept: int | None = None):
    """`mask`, or EVERY_ROW when it keeps every row (the usual batch): the same rows, the same values, no copy.
    kept: how many rows it keeps, where the caller has counted them already."""
    full = bool(mask.all()) if kept is None else kept == len(mask)
    return EVERY_ROW if full else mask


def cross_modal_pairs(h: dict, present: dict):
    """(a, b, both) for every pair of modalities with at least two rows present in both; `both` indexes them."""
    for a, b in itertools.combinations(h, 2):
        both = present[a] & present[b]
        kept = int(both.sum())
        if kept >= 2:
            yield a, b, rows(both, kept)


def stacked(h: dict, present: dict) -> torch.Tensor:
    return torch.cat([h[m][rows(present[m])] for m in h])


def label_positives(module, ga: torch.Tensor, gb: torch.Tensor) -> torch.Tensor:
    """[len(ga), len(gb)] bool: the same group, or groups sharing a class label of the training split."""
    dm = getattr(module.trainer, "datamodule", None) if module._trainer is not None else None
    if dm is None or getattr(dm, "train_set", None) is None:
        raise ValueError(f"method {module.hparams.method} needs the FeatureDataModule (the training split's labels)")
    lab = dm.train_set.label_matrix(dm.train_split).to(ga.device)
    return (ga[:, None] == gb[None, :]) | ((lab[ga] @ lab[gb].T) > 0)


def objective(module, h, z, g, present, args, teacher=None, positives=None):
    """positives: None (the pairs: the same group) or a function (module, ga, gb) -> bool matrix."""
    hp = module.hparams
    ref = next(iter(h.values()))
    l_con = l_float = l_distill = ref.new_zeros(())
    n_pairs = 0
    t_code, t_float = module.code_temperature(), module.float_temperature()
    for a, b, both in cross_modal_pairs(h, present):
        ga, gb = g[a][both], g[b][both]
        pos = positives(module, ga, gb) if positives else None
        l_con = l_con + losses.contrastive(h[a][both], h[b][both], ga, gb, t_code, similarity="cosine", positives=pos)
        # the same objective on the continuous embeddings keeps z well-shaped (and is the float baseline)
        l_float = l_float + losses.contrastive(z[a][both], z[b][both], ga, gb, t_float, similarity="cosine",
                                               positives=pos)
        if (hp.distill_pairs == "cross" and teacher is not None and teacher.get(a) is not None
                and teacher.get(b) is not None):
            l_distill = l_distill + losses.similarity_distillation(h[a][both], h[b][both], teacher[a][both],
                                                                   teacher[b][both], hp.distill_kernel)
        n_pairs += 1
    n_pairs = max(n_pairs, 1)
    hs = stacked(h, present)
    if hp.distill_pairs == "all" and teacher is not None and all(teacher.get(m) is not None for m in h):
        # every pair of rows of the batch, within a modality too: a cache compares a request with entries of
        # its own modality first, so their distances are trained, not left to follow from the cross-modal ones
        ts = stacked(teacher, present)
        l_distill = losses.similarity_distillation(hs, hs, ts, ts, hp.distill_kernel)
    else:
        l_distill = l_distill / n_pairs
    parts = {
        "contrastive": l_con / n_pairs, "float": l_float / n_pairs, "distill": l_distill,
        "quant": losses.quantization(hs), "balance": losses.balance(hs), "decor": losses.decorrelation(hs),
        "proto": losses.prototype(module.model.prototypes),
    }
    if hp.w_margin:  # off by default: no term, the objective as it was
        parts["margin"] = losses.hamming_margin(hs, stacked(g, present), hp.margin_fraction)
    weights = {"contrastive": hp.w_contrastive, "float": hp.w_float, "distill": hp.w_distill, "quant": hp.w_quant,
               "balance": hp.w_balance, "decor": hp.w_decor, "proto": hp.w_proto, "margin": hp.w_margin}
    return parts, weights


PROTOTYPE_STARTS = ("itq", "lsh")   # closed-form starts; model.prototypes_from=val trains from each (training.run_train)


def closed_form_start(train, val, bits: int, seed: int, space_settings: dict, prototypes_from: str = "itq"):
    """(the shared space chosen on val, prototypes [bits, space.dim]) for `USHashModule.initialise`.

    prototypes_from: "itq", the ITQ rotation of the space (the codes the ITQ baseline makes: the space's top
    `bits` principal directions, rotated); "lsh", the registry LSH's seeded random hyperplanes of it (the LSH
    baseline's codes, which read every dimension of a space wider than `bits`). Which start trains the better
    head depends on the data set (docs/baselines.md), so model.prototypes_from=val trains from both and keeps
    the better on val (`ushash.hashing.training.run_train`). A space narrower than `bits` (tiny features) gets
    ITQ's rotation for its width and seeded random unit prototypes (LSH bits) for the rest."""
    import numpy as np

    from ushash.hashing import methods
    from ushash.hashing.methods.base import NotApplicable
    if prototypes_from not in PROTOTYPE_STARTS:
        raise ValueError(f"closed_form_start(prototypes_from={prototypes_from!r}): expected one of {PROTOTYPE_STARTS} "
                         "(model.prototypes_from=val is run_train's: one training per start)")
    try:
        m = methods.build(prototypes_from, bits=bits, seed=seed, **space_settings).fit(train, val)
        if prototypes_from == "itq":
            return m.space, m.rotation()
        p = np.asarray(m.planes.T, np.float32)
        return m.space, p / np.linalg.norm(p, axis=1, keepdims=True)
    except NotApplicable:
        pass
    same = {**space_settings, "common_dim": max(int(space_settings.get("common_dim", 128)), bits)}  # ITQ's space
    space = methods.build("float", bits=bits, seed=seed, **same).fit(train, val).space
    width = space.dim - space.dim % 8
    protos = (methods.build("itq", bits=width, seed=seed, **same).fit(train, val).rotation() if width
              else np.zeros((0, space.dim), np.float32))
    extra = np.random.default_rng(seed).normal(size=(bits - len(protos), space.dim)).astype(np.float32)
    return space, np.concatenate([protos, extra / np.linalg.norm(extra, axis=1, keepdims=True)])


def supervised_objective(module, h, z, g, present, args, teacher=None):
    return objective(module, h, z, g, present, args, teacher=teacher, positives=label_positives)


register(MethodSpec(name="ushash", title="US-HASH", kind="trained", objective=objective, aliases=("us-hash", "us_hash"),
                    reference="this project (docs/design.md)"))
register(MethodSpec(name="ushash_labels", title="US-HASH, label-supervised (positives share a class label)",
                    kind="trained", objective=supervised_objective, aliases=("ushash-labels",),
                    reference="this project; positives as in SupCon (Khosla et al., NeurIPS 2020). Uses the "
                              "training split's class labels: not comparable with the pair-trained methods"))
