"""US-HASH: per-modality projection heads into one shared space, and learned semantic prototypes.

    z    = normalize(head_m(x))            # shared space, `dim`-d, per modality m
    l    = z @ normalize(P).T              # bits logits, P: [bits, dim] learned prototypes
    code = sign(l)  -> packed to bits/8 bytes

Normalising the prototype rows does not change sign(l); it keeps the logits in [-1, 1], so the
tanh(beta * l) relaxation has the same meaning at every width. The forward pass itself (embed, logits,
encode) is ushash.hashing.forward's, which the serving loader runs on an export too.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ushash.hashing import forward as fwd


def _mlp(d_in: int, hidden: int, d_out: int, layers: int, dropout: float) -> nn.Sequential:
    mods: list[nn.Module] = []
    d = d_in
    for _ in range(layers - 1):
        mods += [nn.Linear(d, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Dropout(dropout)]
        d = hidden
    mods.append(nn.Linear(d, d_out))
    return nn.Sequential(*mods)


class USHash(nn.Module):
    """Projection heads (one per modality) + prototypes. Arguments are primitives only."""

    def __init__(self, in_dims: dict[str, int], bits: int = 64, dim: int = 128, hidden: int = 512,
                 layers: int = 2, dropout: float = 0.1):
        super().__init__()
        if bits % 8 or not 8 <= bits <= 1024:
            raise ValueError(f"bits={bits}: must be a multiple of 8 between 8 and 1024 (e.g. 16, 32, 64, 128)")
        if not in_dims:
            raise ValueError("in_dims is empty: the head needs at least one modality's feature dimension")
        self.in_dims = {m: int(d) for m, d in in_dims.items()}
        self.bits, self.dim = bits, dim
        self.heads = nn.ModuleDict({m: _mlp(d, hidden, dim, layers, dropout) for m, d in self.in_dims.items()})
        proto = torch.empty(bits, dim)
        if bits <= dim:
            nn.init.orthogonal_(proto)
        else:
            nn.init.normal_(proto)
        self.prototypes = nn.Parameter(proto)

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(self.heads.keys())

    def embed(self, modality: str, x: torch.Tensor) -> torch.Tensor:
        """Shared-space embedding z, L2-normalised. x: [B, in_dims[modality]]."""
        if modality not in self.heads:
            raise ValueError(f"no head for modality {modality!r}; this model has {self.modalities}")
        if x.ndim != 2 or x.shape[1] != self.in_dims[modality]:
            raise ValueError(f"{modality} features: expected [B, {self.in_dims[modality]}], got {list(x.shape)}")
        return fwd.embed(self.heads[modality], x)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """Bit logits in [-1, 1]: cosine of z with each prototype."""
        return fwd.logits(z, self.prototypes)

    def forward(self, modality: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.embed(modality, x)
        return z, self.logits(z)

    def encode(self, modality: str, x: torch.Tensor | np.ndarray,
               batch_size: int = fwd.BATCH) -> tuple[np.ndarray, np.ndarray]:
        """(packed codes uint8 [N, bits/8], z float32 [N, dim]) for raw encoder features (in eval mode)."""
        was_training = self.training
        self.eval()
        try:
            return fwd.encode(lambda xb: self.embed(modality, xb), self.prototypes, x, self.bits, self.dim,
                                  batch_size)
        finally:
            self.train(was_training)
