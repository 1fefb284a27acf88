"""Orthogonal codebook + cosine classifier, OrthoHash-style: each class's proxy is a fixed near-orthogonal code
(the same Hadamard / Bernoulli table as the CSQ-style method); the loss is cross-entropy over
scale * (cos(h, proxy) - margin on the own class), plus a quantization term.

Departures from OrthoHash: classes are made from the training pairs as for the CSQ-style method
(``classes: kmeans`` pseudo-classes by default, or ``groups``), not labels; the quantization term is
(|h| - 1)^2 instead of OrthoHash's batch-norm based one."""

from __future__ import annotations

from ushash.hashing import losses
from ushash.hashing.methods import MethodSpec, register
from ushash.hashing.methods.csq import class_losses


def objective(module, h, z, g, present, args, teacher=None):
    scale, margin = float(args.get("scale", 8.0)), float(args.get("margin", 0.2))
    l_ce, l_q = class_losses(module, h, g, present, args,
                             lambda hm, book, k: losses.cosine_margin_ce(hm, book, k, scale=scale, margin=margin))
    return {"proxy_ce": l_ce, "quant": l_q}, {"proxy_ce": 1.0, "quant": float(args.get("w_quant", 0.01))}


register(MethodSpec(name="orthohash", title="orthogonal codebook + cosine CE (OrthoHash-style)", kind="trained",
                    objective=objective, aliases=("orthogonal_codebook",),
                    reference="Hoe et al., OrthoHash, NeurIPS 2021. Classes are k-means pseudo-classes of the "
                              "training pairs (or the groups themselves), not labels."))
