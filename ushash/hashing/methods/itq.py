"""ITQ: PCA then the rotation that minimises quantization error (Gong & Lazebnik, CVPR 2011). As faiss's
ITQTransform prepares its input: the training rows are centred and L2-normalised, PCA to `bits` dimensions,
then 50 ITQ iterations from a seeded random rotation; a row is coded as sign((y - mean) . rotation^T).

The rotation is ITQ's own alternation (`itq_rotation`), not faiss's: faiss 1.15's `ITQMatrix` updates the
rotation with the transpose of the right singular vectors, so its quantisation loss does not decrease and its
rotation stays close to the random start. `scripts/itq_check.py` measures both in the same space
(docs/baselines.md, "ITQ as faiss fits it")."""

from __future__ import annotations

import numpy as np

from ushash.hashing.methods import MethodSpec, register
from ushash.hashing.methods.base import FittedMethod, pca, random_rotation

ITERATIONS = 50


def itq_rotation(v: np.ndarray, seed: int, iterations: int = ITERATIONS) -> np.ndarray:
    """[c, c]: the rotation ITQ learns for centred, projected data `v` [n, c] (Gong & Lazebnik, CVPR 2011): from
    a seeded random rotation, B = sign(v R), then R = W U^T from the SVD B^T v = U S W^T (the orthogonal
    Procrustes solution of min ||B - v R||), in turn; neither step increases the quantisation loss."""
    v = np.asarray(v, np.float64)
    r = random_rotation(v.shape[1], seed)
    for _ in range(int(iterations)):
        u, _, wt = np.linalg.svd(np.where(v @ r < 0, -1.0, 1.0).T @ v)
        r = wt.T @ u.T
    return r


def normalised_rows(y: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """(y - mean) with every row scaled to unit length (a zero row stays zero): what ITQ is trained on."""
    c = np.asarray(y, np.float64) - mean
    return c / np.maximum(np.linalg.norm(c, axis=1, keepdims=True), 1e-12)


class ITQ(FittedMethod):
    def _fit(self, y):
        self.mean = np.asarray(y, np.float64).mean(axis=0)
        yn = normalised_rows(y, self.mean)
        centre, axes = pca(yn, self.bits)
        self.proj = axes @ itq_rotation((yn - centre) @ axes, self.seed)   # [dim, bits]

    def _project(self, y):
        return (np.asarray(y, np.float64) - self.mean) @ self.proj

    def rotation(self) -> np.ndarray:
        """[bits, dim], orthonormal rows: PCA then the ITQ rotation as one matrix (applied to y - mean)."""
        return np.ascontiguousarray(self.proj.T, dtype=np.float32)


register(MethodSpec(name="itq", title="ITQ", kind="fitted", build=ITQ,
                    reference="Gong & Lazebnik, CVPR 2011 (PCA, then ITQ's alternation; input centred and "
                              "L2-normalised as faiss's ITQTransform prepares it)."))
