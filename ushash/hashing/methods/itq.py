"""ITQ: PCA then the rotation that minimises quantization error (Gong & Lazebnik), via faiss ITQTransform
(faiss centres and L2-normalises its input, then PCA + 50 ITQ iterations from a seeded random rotation).

faiss 1.15's rotation update uses the transpose of the right singular vectors where ITQ's Procrustes step
needs them (`itq_rotation` below is the step as published): its quantisation loss does not decrease over
the iterations, so the registry's `itq` is close to PCA with a random rotation. `scripts/itq_check.py`
measures both in the same space (docs/baselines.md, "ITQ as faiss fits it")."""

from __future__ import annotations

import faiss
import numpy as np

from ushash.hashing.methods import MethodSpec, register
from ushash.hashing.methods.base import FittedMethod, random_rotation


def itq_rotation(v: np.ndarray, seed: int, iterations: int = 50) -> np.ndarray:
    """[c, c]: the rotation ITQ learns for centred, projected data `v` [n, c] (Gong & Lazebnik, CVPR 2011): from
    a seeded random rotation, B = sign(v R), then R = W U^T from the SVD B^T v = U S W^T (the orthogonal
    Procrustes solution of min ||B - v R||), in turn; neither step increases the quantisation loss."""
    v = np.asarray(v, np.float64)
    r = random_rotation(v.shape[1], seed)
    for _ in range(int(iterations)):
        u, _, wt = np.linalg.svd(np.where(v @ r < 0, -1.0, 1.0).T @ v)
        r = wt.T @ u.T
    return r


class ITQ(FittedMethod):
    def _fit(self, y):
        self.itq = faiss.ITQTransform(y.shape[1], self.bits, True)
        self.itq.itq.seed = self.seed
        self.itq.train(np.ascontiguousarray(y, dtype=np.float32))

    def _project(self, y):
        return self.itq.apply(np.ascontiguousarray(y, dtype=np.float32))

    def rotation(self) -> np.ndarray:
        """[bits, dim]: PCA then the ITQ rotation as one matrix (faiss applies it to y - mean)."""
        lt = self.itq.pca_then_itq
        return faiss.vector_to_array(lt.A).reshape(lt.d_out, lt.d_in).astype(np.float32)


register(MethodSpec(name="itq", title="ITQ (faiss ITQTransform)", kind="fitted", build=ITQ,
                    reference="Gong & Lazebnik, CVPR 2011; faiss ITQTransform (factory 'ITQ<bits>,LSH')."))
