"""ITQ: PCA then the rotation that minimises quantization error (Gong & Lazebnik), via faiss ITQTransform
(faiss centres and L2-normalises its input, then PCA + 50 ITQ iterations from a seeded random rotation)."""

from __future__ import annotations

import faiss
import numpy as np

from ushash.hashing.methods import MethodSpec, register
from ushash.hashing.methods.base import FittedMethod


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
