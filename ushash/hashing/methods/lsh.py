"""LSH: random hyperplanes (Charikar 2002, sign random projections) in the shared input space."""

from __future__ import annotations

import numpy as np

from ushash.hashing.methods import MethodSpec, register
from ushash.hashing.methods.base import FittedMethod


class LSH(FittedMethod):
    needs_pca = False

    def _fit(self, y):
        # Only the hyperplanes are random; the shared space (centring per modality) is fitted on train.
        self.planes = np.random.default_rng(self.seed).normal(size=(y.shape[1], self.bits))

    def _project(self, y):
        return y @ self.planes


register(MethodSpec(name="lsh", title="LSH (random hyperplanes)", kind="fitted", build=LSH,
                    reference="Charikar, STOC 2002: sign of Gaussian random projections."))
