"""PCA + random rotation: PCA to `bits` dims, then a seeded random orthogonal rotation, then sign (ITQ's
starting point, and the "PCA-RR" baseline of Gong & Lazebnik)."""

from __future__ import annotations

from ushash.hashing.methods import MethodSpec, register
from ushash.hashing.methods.base import FittedMethod, pca, random_rotation


class PCARotation(FittedMethod):
    def _fit(self, y):
        self.mean, axes = pca(y, self.bits)
        self.proj = axes @ random_rotation(self.bits, self.seed)

    def _project(self, y):
        return (y - self.mean) @ self.proj


register(MethodSpec(name="pca_rotation", title="PCA + random rotation", kind="fitted", build=PCARotation,
                    reference="PCA-RR in Gong & Lazebnik, CVPR 2011 / TPAMI 2013."))
