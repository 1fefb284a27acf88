"""PCA-sign: sign of the top-`bits` principal components of all modalities' training embeddings."""

from __future__ import annotations

from ushash.hashing.methods import MethodSpec, register
from ushash.hashing.methods.base import FittedMethod, pca


class PCASign(FittedMethod):
    def _fit(self, y):
        self.mean, self.axes = pca(y, self.bits)

    def _project(self, y):
        return (y - self.mean) @ self.axes


register(MethodSpec(name="pca_sign", title="PCA-sign", kind="fitted", build=PCASign,
                    reference="PCAH (e.g. Wang et al., CVPR 2010 baseline): sign of PCA projections."))
