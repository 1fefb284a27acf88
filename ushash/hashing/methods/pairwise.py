"""Pairwise likelihood, DCMH/DPSH-style: the negative log-likelihood of cross-modal pair similarities under
p(s_ij = 1) = sigmoid(scale * h_a[i] . h_b[j]), plus quantization and bit-balance terms.

Departures from the papers, so that it is a fair baseline here: s_ij comes from the pairing signal every
ushash method trains on (same group = similar), not from class labels, so similar pairs are rare and are
up-weighted to half the total weight (HashNet's weighted likelihood; unweighted, the loss collapses, see
ushash.hashing.losses.pairwise_likelihood); bit balance is per modality; the network is the shared one
(per-modality MLP heads + a linear hash layer) and the relaxation is tanh(beta * l) with beta rising, as for
US-HASH; DCMH's alternating discrete B-step is replaced by the quantization penalty (as in DPSH).
Registered also as "deephash" (what earlier notes called it)."""

from __future__ import annotations

import torch

from ushash.hashing import losses
from ushash.hashing.methods import MethodSpec, register
from ushash.hashing.methods.ushash import cross_modal_pairs, rows, stacked


def objective(module, h, z, g, present, args, teacher=None):
    ref = next(iter(h.values()))
    l_pair, n = ref.new_zeros(()), 0
    for a, b, both in cross_modal_pairs(h, present):
        l_pair = l_pair + losses.pairwise_likelihood(h[a][both], h[b][both], g[a][both], g[b][both],
                                                     scale=float(args.get("scale", 0.5)),
                                                     pos_weight=args.get("pos_weight", "balanced"))
        n += 1
    hs = stacked(h, present)
    # bit balance per modality (DCMH's F1 / G1 terms): on the stacked codes, one modality's codes being the
    # negation of the other's would look balanced
    bal = torch.stack([losses.balance(h[m][rows(present[m])]) for m in h if present[m].any()]).mean()
    parts = {"pairwise": l_pair / max(n, 1), "quant": losses.quantization(hs), "balance": bal}
    weights = {"pairwise": 1.0, "quant": float(args.get("w_quant", 0.1)), "balance": float(args.get("w_balance", 0.1))}
    return parts, weights


register(MethodSpec(name="pairwise", title="pairwise likelihood (DCMH/DPSH-style)", kind="trained",
                    objective=objective, aliases=("deephash", "dpsh", "dcmh"),
                    reference="Li et al., DPSH, IJCAI 2016; Jiang & Li, DCMH, CVPR 2017. Pair-supervised here."))
