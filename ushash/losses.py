"""US-HASH losses. Each takes relaxed codes h in (-1, 1) (or logits) and returns a scalar.

- `contrastive`: symmetric cross-modal InfoNCE on relaxed codes; rows sharing a group are positives.
- `quantization`: pulls |h| to 1 so that sign() loses little.
- `balance`: each bit is +1 on half the batch (mean of each bit near 0).
- `decorrelation`: bits carry different information (off-diagonal of the bit covariance near 0).
- `prototype`: prototypes stay near-orthogonal, so bits do not collapse onto each other.
"""

from __future__ import annotations

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
                temperature: float = 0.2) -> torch.Tensor:
    """Symmetric InfoNCE between two modalities' relaxed codes.

    Similarity is the normalised inner product h_a . h_b / bits (1 - 2 * Hamming / bits for exact codes).
    ga, gb: integer group ids; every (i, j) with ga[i] == gb[j] is a positive (several captions per image).
    """
    bits = ha.shape[1]
    sim = ha @ hb.T / bits / temperature
    pos = (ga[:, None] == gb[None, :]).float()

    def _side(s: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        keep = p.sum(1) > 0
        if not keep.any():
            return s.new_zeros(())
        logp = F.log_softmax(s[keep], dim=1)
        p = p[keep]
        return -((logp * p).sum(1) / p.sum(1)).mean()

    return 0.5 * (_side(sim, pos) + _side(sim.T, pos.T))


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
