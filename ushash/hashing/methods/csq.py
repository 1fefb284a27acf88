"""Hash centres, CSQ-style (central similarity quantization): every class gets a fixed centre in {-1, +1}^bits
(rows of a Hadamard matrix and of its negation, then seeded Bernoulli codes when there are more than 2*bits
classes, as in CSQ), and each modality's relaxed code is pulled to its class's centre with per-bit binary
cross-entropy, plus a quantization term.

ushash methods train on pairs, not class labels, so the classes here are made from the training pairs only:
- ``classes: kmeans`` (default): pseudo-classes. The training groups are clustered (spherical k-means,
  ``n_classes`` clusters, default 2*bits: one Hadamard centre each) in the GCCA space fitted on the training
  pairs (ushash/hashing/methods/space.py), each group represented by the mean of its modalities' embeddings there;
  all modalities of a group share its centre, which is what aligns them.
- ``classes: groups``: one centre per training group (instance-level centres). Measured on the synthetic
  data it generalises poorly (near-identical items are pushed to unrelated centres); kept for comparison.
Centres exist only in training; the checkpoint holds the same network as every trained method."""

from __future__ import annotations

from typing import Callable

import faiss
import numpy as np
import torch

from ushash.hashing import losses
from ushash.hashing.methods import MethodSpec, register
from ushash.hashing.methods.ushash import rows, stacked


def _pseudo_classes(module, args, n_classes: int) -> np.ndarray:
    from ushash.hashing.methods.space import SharedSpace, resolve_align
    dm = getattr(module.trainer, "datamodule", None)
    if dm is None or getattr(dm, "train_set", None) is None:
        raise ValueError(f"method {module.hparams.method} with classes=kmeans needs the FeatureDataModule "
                         "(its training split) to make pseudo-classes; or use classes=groups")
    split, ts = dm.train_split, dm.train_set
    align = str(args.get("align", "auto"))
    space = module.shared_space  # the closed-form start's space (init=gcca), chosen on val
    if space is None or (align != "auto" and resolve_align(align, split.meta["encoder"]["name"]) != space.resolved):
        space = SharedSpace(align=align).fit(split)   # another space than the start's, when args.align names one
    emb = np.zeros((len(ts.groups), space.dim))
    for m in ts.modalities:  # the batcher's rows per group: ts.members indexes its one vocabulary
        y = space.transform(m, split.tables[m].x)
        for g, idx in enumerate(ts.members[m]):
            if idx:
                emb[g] += y[idx].sum(axis=0)
    emb /= np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    km = faiss.Kmeans(emb.shape[1], n_classes, niter=25, seed=int(args.get("centre_seed", 0)) + 1,
                      spherical=True, verbose=False)
    emb32 = np.ascontiguousarray(emb, dtype=np.float32)
    km.train(emb32)
    _, lab = km.index.search(emb32, 1)
    return lab[:, 0].astype(np.int64)


def class_centres(module, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(class of each training group [n_train_groups], centre table [n_classes, bits]); built once per module
    and not saved (seeded functions of the training split)."""
    n = int(module.hparams.n_train_groups)
    if n < 1:
        raise ValueError(f"method {module.hparams.method} needs n_train_groups (the number of training groups); "
                         "ushash.train sets it from the training split")
    bits, seed, mode = int(module.hparams.bits), int(args.get("centre_seed", 0)), str(args.get("classes", "kmeans"))
    key = (n, bits, seed, mode, args.get("n_classes"), args.get("align", "auto"))
    cache = getattr(module, "_class_centres", None)
    if cache is None or cache[0] != key:
        if mode == "groups":
            cls = np.arange(n)
        elif mode == "kmeans":
            cls = _pseudo_classes(module, args, min(n, int(args.get("n_classes") or 2 * bits)))
        else:
            raise ValueError(f"classes={mode!r}: expected 'kmeans' or 'groups'")
        table = losses.hadamard_centres(int(cls.max()) + 1, bits, seed)
        module._class_centres = (key, torch.as_tensor(cls), table)
    _, cls, table = module._class_centres
    return cls.to(module.device), table.to(module.device)


def class_losses(module, h, g, present, args, loss: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """(`loss(codes, table, classes)` averaged over the modalities present in the batch, the quantization
    term of all present codes), with the class of each group and the table from `class_centres`."""
    cls, table = class_centres(module, args)
    ref = next(iter(h.values()))
    total, n = ref.new_zeros(()), 0
    for m in h:
        if present[m].any():
            keep = rows(present[m])
            total = total + loss(h[m][keep], table, cls[g[m][keep]])
            n += 1
    hs = stacked(h, present)
    return total / max(n, 1), losses.quantization(hs)


def objective(module, h, z, g, present, args, teacher=None):
    l_c, l_q = class_losses(module, h, g, present, args, lambda hm, c, k: losses.centre_bce(hm, c[k]))
    return {"centre": l_c, "quant": l_q}, {"centre": 1.0, "quant": float(args.get("w_quant", 0.01))}


register(MethodSpec(name="csq", title="hash centres (CSQ-style, Hadamard)", kind="trained", objective=objective,
                    aliases=("hash_centres", "central_similarity"),
                    reference="Yuan et al., CSQ, CVPR 2020. Classes are k-means pseudo-classes of the training "
                              "pairs (or the groups themselves), not labels."))
