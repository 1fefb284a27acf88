"""`LSHHead`: random-hyperplane codes behind the same interface as an exported head.

    head = LSHHead({"image": 48, "text": 32}, bits=64, dim=64)   # random projections to a dim-d space
    head = LSHHead.over(exported_head, bits=64)                 # LSH of another head's float z

It is a `ushash.serving.artifact.ServedHead` like `ExportedHead` (bits, dim, modalities, in_dims, revision,
encoder, manifest, payload, encode/embed/codes), so it serves as
- the "float-embedding LSH codes" baseline of `ushash.cachesim`: the export's shared-space z hashed by
  sign(z @ R.T) with R Gaussian [bits, dim] (Charikar's SimHash), the same payload codec;
- a head for tests and benchmarks that need no training (per-modality Gaussian projections of the
  features into a dim-d space; with equal in_dims and `aligned=True`, one projection for all).
"""

from __future__ import annotations

import hashlib

import numpy as np

from ushash.core import codes as codes_lib
from ushash.core.checks import unit_rows
from ushash.serving.artifact import EncoderId, canonical_json
from ushash.serving.payload import PayloadCodec


_l2n = unit_rows


class LSHHead:
    def __init__(self, in_dims: dict[str, int], bits: int = 64, dim: int = 64, seed: int = 0, aligned: bool = False,
                 payload: PayloadCodec | None = None, base=None, revision: str | None = None,
                 encoder: EncoderId | None = None):
        codes_lib.check_bits(bits)
        self.bits, self.dim, self.seed, self.base = int(bits), int(dim), int(seed), base
        self.in_dims = {m: int(d) for m, d in in_dims.items()}
        rng = np.random.default_rng(seed)
        if base is None:
            if aligned:
                d0 = next(iter(self.in_dims.values()))
                w = rng.normal(size=(d0, self.dim)).astype(np.float32)
                self._proj = {m: w for m in self.in_dims}
            else:
                self._proj = {m: rng.normal(size=(d, self.dim)).astype(np.float32) for m, d in self.in_dims.items()}
        self._planes = rng.normal(size=(self.bits, self.dim)).astype(np.float32)
        self.payload = payload or PayloadCodec.default(self.dim, self.modalities)
        self.encoder = encoder or (base.encoder if base is not None else EncoderId("synthetic", "0" * 12))
        # everything that gives a code and a stored payload their meaning, the payload codec's settings and
        # channel scales included: entries stored through another codec must not be read as this one's
        h = hashlib.sha256(f"lsh|{self.bits}|{self.dim}|{seed}|{aligned}|{sorted(self.in_dims.items())}|"
                           f"{getattr(base, 'revision', '')}|".encode() + canonical_json(self.payload.settings()))
        for name, t in sorted(self.payload.tensors().items()):
            h.update(name.encode() + np.ascontiguousarray(t, np.float32).tobytes())
        self.revision = revision or h.hexdigest()[:16]
        self.manifest = {"encoder": {"name": self.encoder.name, "fingerprint": self.encoder.fingerprint,
                                     "config": dict(getattr(base, "manifest", {}).get("encoder", {}).get("config", {}))
                                     if base is not None else {}}}

    @classmethod
    def over(cls, base, bits: int | None = None, seed: int = 0) -> "LSHHead":
        """Random-hyperplane codes of `base`'s float embeddings (its payload codec, its encoder)."""
        return cls(dict(base.in_dims), bits=bits or base.bits, dim=base.dim, seed=seed, payload=base.payload, base=base)

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(self.in_dims)

    def embed(self, modality: str, features) -> np.ndarray:
        if modality not in self.in_dims:
            raise ValueError(f"no head for modality {modality!r}; this head has {self.modalities}")
        x = np.asarray(features, dtype=np.float32)
        if x.ndim == 1:
            x = x[None]
        if self.base is not None:
            return np.asarray(self.base.embed(modality, x), dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.in_dims[modality]:
            raise ValueError(f"{modality} features: expected [B, {self.in_dims[modality]}], got {list(x.shape)}")
        return _l2n(x @ self._proj[modality])

    def encode(self, modality: str, features) -> tuple[np.ndarray, np.ndarray]:
        z = self.embed(modality, features)
        return codes_lib.pack(z @ self._planes.T > 0), z

    def codes(self, modality: str, features) -> np.ndarray:
        return self.encode(modality, features)[0]
