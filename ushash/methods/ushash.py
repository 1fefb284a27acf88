"""US-HASH itself: cross-modal InfoNCE on relaxed codes and on the continuous embeddings, with quantization,
bit balance, decorrelation and a near-orthogonal-prototypes regulariser (ushash/heads.py, ushash/losses.py).
Its loss weights are `model.loss.*` (configs/model/ushash.yaml), hyper-parameters `w_*` of the module."""

from __future__ import annotations

import itertools

import torch

from ushash import losses
from ushash.methods import MethodSpec, register


def cross_modal_pairs(h: dict, present: dict):
    """(a, b, both) for every pair of modalities with at least two rows present in both."""
    for a, b in itertools.combinations(h, 2):
        both = present[a] & present[b]
        if both.sum() >= 2:
            yield a, b, both


def stacked(h: dict, present: dict) -> torch.Tensor:
    return torch.cat([h[m][present[m]] for m in h])


def objective(module, h, z, g, present, args):
    hp = module.hparams
    ref = next(iter(h.values()))
    l_con = l_float = ref.new_zeros(())
    n_pairs = 0
    for a, b, both in cross_modal_pairs(h, present):
        l_con = l_con + losses.contrastive(h[a][both], h[b][both], g[a][both], g[b][both], hp.temperature)
        # the same objective on the continuous embeddings keeps z well-shaped (and is the float baseline)
        l_float = l_float + losses.contrastive(z[a][both], z[b][both], g[a][both], g[b][both],
                                               hp.temperature * hp.dim / hp.bits)
        n_pairs += 1
    n_pairs = max(n_pairs, 1)
    hs = stacked(h, present)
    parts = {
        "contrastive": l_con / n_pairs, "float": l_float / n_pairs, "quant": losses.quantization(hs),
        "balance": losses.balance(hs), "decor": losses.decorrelation(hs),
        "proto": losses.prototype(module.model.prototypes),
    }
    weights = {"contrastive": hp.w_contrastive, "float": hp.w_float, "quant": hp.w_quant,
               "balance": hp.w_balance, "decor": hp.w_decor, "proto": hp.w_proto}
    return parts, weights


register(MethodSpec(name="ushash", title="US-HASH", kind="trained", objective=objective, aliases=("us-hash", "us_hash"),
                    reference="this project (docs/design.md)"))
