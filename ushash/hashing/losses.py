"""US-HASH losses. Each takes relaxed codes h in (-1, 1) (or logits) and returns a scalar.

- `contrastive`: symmetric cross-modal InfoNCE on relaxed codes; rows sharing a group are positives.
- `similarity_distillation`: code similarities pulled to a teacher space's cosines (every pair of the batch).
- `quantization`: pulls |h| to 1 so that sign() loses little.
- `balance`: each bit is +1 on half the batch (mean of each bit near 0).
- `decorrelation`: bits carry different information (off-diagonal of the bit covariance near 0).
- `prototype`: prototypes stay near-orthogonal, so bits do not collapse onto each other.
- `hamming_margin`: codes of different items kept a share of the bits apart (a cache-key option, off by default).
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F


def relax(logits: torch.Tensor, beta: float, mode: str = "tanh") -> torch.Tensor:
    """Differentiable stand-in for sign(): tanh(beta * l), or sign() with a straight-through gradient."""
    if mode == "tanh":
        return torch.tanh(beta * logits)
    if mode == "ste":
        soft = torch.tanh(beta * logits)
        return soft + (torch.sign(logits) - soft).detach()
    raise ValueError(f"relax mode {mode!r}: expected 'tanh' or 'ste'")


def contrastive(ha: torch.Tensor, hb: torch.Tensor, ga: torch.Tensor, gb: torch.Tensor,
                temperature: float | torch.Tensor = 0.2, similarity: str = "dot",
                positives: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric InfoNCE between two modalities' relaxed codes (or embeddings).

    similarity "dot": h_a . h_b / width (1 - 2 * Hamming / bits for exact codes); "cosine": the cosine of the
    rows, the same for exact codes and independent of how far tanh() has saturated.
    ga, gb: integer group ids; every (i, j) with ga[i] == gb[j] is a positive (several captions per image).
    temperature: a number or a 0-d tensor (a learned scale).
    positives: a [len(ha), len(hb)] boolean matrix of positives instead of the group equality (e.g. rows that
    share a class label too).
    """
    if similarity == "cosine":
        sim = F.normalize(ha, dim=-1) @ F.normalize(hb, dim=-1).T / temperature
    elif similarity == "dot":
        sim = ha @ hb.T / ha.shape[1] / temperature
    else:
        raise ValueError(f"similarity {similarity!r}: expected 'dot' or 'cosine'")
    pos = (ga[:, None] == gb[None, :]).float() if positives is None else positives.float()

    def _side(s: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        keep = p.sum(1) > 0
        if not keep.any():
            return s.new_zeros(())
        logp = F.log_softmax(s[keep], dim=1)
        p = p[keep]
        return -((logp * p).sum(1) / p.sum(1)).mean()

    return 0.5 * (_side(sim, pos) + _side(sim.T, pos.T))


DISTILL_KERNELS = ("cosine", "angular")


def distill_target(t: torch.Tensor, kernel: str = "cosine") -> torch.Tensor:
    """The code similarity (1 - 2 d_H / bits for exact codes) a teacher cosine t asks for. "cosine": t itself.
    "angular": 1 - 2 arccos(t) / pi, the expected code similarity of random-hyperplane codes of that pair
    (Charikar's SimHash), which spreads near neighbours over more bits than the linear map does: a teacher
    cosine of 0.9 asks for 9 of 64 bits apart instead of 3."""
    if kernel == "cosine":
        return t
    if kernel == "angular":
        return 1.0 - 2.0 * torch.arccos(t.clamp(-1.0, 1.0)) / math.pi
    raise ValueError(f"distillation kernel {kernel!r}: expected one of {DISTILL_KERNELS}")


def similarity_distillation(ha: torch.Tensor, hb: torch.Tensor, ta: torch.Tensor, tb: torch.Tensor,
                            kernel: str = "cosine") -> torch.Tensor:
    """Mean squared gap between the codes' similarities h_a . h_b / bits and the teacher's (t: unit rows,
    `distill_target` of their cosines), over every pair of the batch, positives and negatives alike: the codes
    keep the teacher space's neighbourhoods, not only the training pairs."""
    with torch.no_grad():
        target = distill_target(ta @ tb.T, kernel)
    return ((ha @ hb.T / ha.shape[1] - target) ** 2).mean()


def hamming_margin(h: torch.Tensor, g: torch.Tensor, fraction: float) -> torch.Tensor:
    """Rows of different groups at least `fraction` of the bits apart: the mean over those pairs of
    relu(1 - d_ij / fraction)^2, with d_ij = (1 - cos(h_i, h_j)) / 2 the share of bits in which they differ (exact
    for codes, and independent of how far tanh() has saturated, so it holds the codes sign() will make). A
    cache keyed by codes at radius r serves another item's answer for a pair closer than r bits: this keeps
    such pairs apart, where distillation and the contrastive term let near neighbours share a code."""
    hn = F.normalize(h, dim=-1)
    d = (1 - hn @ hn.T) / 2
    other = g[:, None] != g[None, :]
    if not other.any():
        return h.new_zeros(())
    return (F.relu(1.0 - d[other] / fraction) ** 2).mean()


def quantization(h: torch.Tensor) -> torch.Tensor:
    return ((h.abs() - 1.0) ** 2).mean()


def balance(h: torch.Tensor) -> torch.Tensor:
    return (h.mean(0) ** 2).mean()


def decorrelation(h: torch.Tensor) -> torch.Tensor:
    n, bits = h.shape
    if n < 2:
        return h.new_zeros(())
    c = h.T @ h / n
    off = c - torch.diag(torch.diagonal(c))
    return (off ** 2).sum() / (bits * (bits - 1))


def prototype(prototypes: torch.Tensor) -> torch.Tensor:
    p = F.normalize(prototypes, dim=-1)
    g = p @ p.T
    bits = g.shape[0]
    off = g - torch.eye(bits, device=g.device, dtype=g.dtype)
    return (off ** 2).sum() / (bits * max(bits - 1, 1))


# ---------------------------------------------------------------------------------------------- baselines
# Objectives of the trained baselines (ushash/hashing/methods/). Same relaxed codes h in (-1, 1), same pairing signal.

def pairwise_likelihood(ha: torch.Tensor, hb: torch.Tensor, ga: torch.Tensor, gb: torch.Tensor,
                        scale: float = 0.5, pos_weight: float | str = "balanced") -> torch.Tensor:
    """Negative log-likelihood of the pairwise similarities (DPSH, DCMH):

        theta_ij = scale * h_a[i] . h_b[j],   p(s_ij = 1) = sigmoid(theta_ij)
        L = sum_ij w_ij * (softplus(theta_ij) - s_ij * theta_ij) / sum_ij w_ij

    s_ij = 1 when rows i and j share a group. DCMH/DPSH use scale 0.5 and unweighted sums (pos_weight 1), which
    suits class labels (many similar pairs). With pairs as the only similarity, a batch of B groups has about
    B similar pairs among B^2, and the unweighted likelihood is minimised by codes that make every cross-modal
    pair dissimilar (one modality's codes the negation of the other's). pos_weight="balanced" gives the similar
    and the dissimilar pairs equal total weight (HashNet's weighted likelihood, Cao et al., ICCV 2017).
    """
    theta = scale * (ha @ hb.T)
    s = (ga[:, None] == gb[None, :]).to(theta.dtype)
    if pos_weight == "balanced":
        n_pos = s.sum()
        pos_weight = float((s.numel() - n_pos) / n_pos.clamp(min=1.0))
    w = 1.0 + (float(pos_weight) - 1.0) * s
    return (w * (F.softplus(theta) - s * theta)).sum() / w.sum()


def hadamard_centres(n: int, bits: int, seed: int = 0) -> torch.Tensor:
    """CSQ's hash centres: n codes in {-1, +1}^bits, pairwise far apart.

    The rows of a Sylvester Hadamard matrix H and of -H (2*bits centres, pairwise Hamming distance
    >= bits/2) come first, in a seeded random order; when n > 2*bits (or bits is not a power of two)
    the remaining centres are seeded Bernoulli(0.5) codes, as CSQ does for many classes.
    """
    gen = torch.Generator().manual_seed(int(seed))
    rows = []
    if bits & (bits - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < bits:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        had = torch.cat([h, -h], 0)
        rows.append(had[torch.randperm(len(had), generator=gen)][:n])
    rest = n - sum(len(r) for r in rows)
    if rest > 0:
        rows.append(torch.randint(0, 2, (rest, bits), generator=gen).float() * 2 - 1)
    return torch.cat(rows, 0)


def centre_bce(h: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """CSQ's central similarity loss: per-bit binary cross-entropy between (h+1)/2 and (c+1)/2."""
    p = ((h + 1) / 2).clamp(1e-6, 1 - 1e-6)
    t = (centres + 1) / 2
    return F.binary_cross_entropy(p, t)


def cosine_margin_ce(h: torch.Tensor, codebook: torch.Tensor, target: torch.Tensor, scale: float = 8.0,
                     margin: float = 0.2) -> torch.Tensor:
    """OrthoHash's objective: cross-entropy over cos(h, codebook row) with an additive margin on the target.

    codebook: [C, bits] fixed +-1 codes (near-orthogonal); target: [B] row of each code's own class.
    """
    cos = F.normalize(h, dim=-1) @ F.normalize(codebook, dim=-1).T
    cos = cos - margin * F.one_hot(target, cos.shape[1]).to(cos.dtype)
    return F.cross_entropy(scale * cos, target)
