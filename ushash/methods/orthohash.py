"""Orthogonal codebook + cosine classifier, OrthoHash-style: each class's proxy is a fixed near-orthogonal code
(the same Hadamard / Bernoulli table as the CSQ-style method); the loss is cross-entropy over
scale * (cos(h, proxy) - margin on the own class), plus a quantization term.

Departures from OrthoHash: classes are made from the training pairs as for the CSQ-style method
(``classes: kmeans`` pseudo-classes by default, or ``groups``), not labels; the quantization term is
(|h| - 1)^2 instead of OrthoHash's batch-norm based one."""

from __future__ import annotations

import torch

from ushash import losses
from ushash.methods import MethodSpec, register
from ushash.methods.csq import class_centres


def objective(module, h, z, g, present, args):
    cls, book = class_centres(module, args)
    ref = next(iter(h.values()))
    l_ce, n = ref.new_zeros(()), 0
    for m in h:
        if present[m].any():
            l_ce = l_ce + losses.cosine_margin_ce(h[m][present[m]], book, cls[g[m][present[m]]],
                                                  scale=float(args.get("scale", 8.0)),
                                                  margin=float(args.get("margin", 0.2)))
            n += 1
    hs = torch.cat([h[m][present[m]] for m in h])
    parts = {"proxy_ce": l_ce / max(n, 1), "quant": losses.quantization(hs)}
    return parts, {"proxy_ce": 1.0, "quant": float(args.get("w_quant", 0.01))}


register(MethodSpec(name="orthohash", title="orthogonal codebook + cosine CE (OrthoHash-style)", kind="trained",
                    objective=objective, aliases=("orthogonal_codebook",),
                    reference="Hoe et al., OrthoHash, NeurIPS 2021. Classes are k-means pseudo-classes of the "
                              "training pairs (or the groups themselves), not labels."))
