"""The continuous upper bound of the no-training baselines: cosine ranking of the float embeddings in the
shared input space they are fitted in (raw joint space, or the GCCA-aligned space). No sign(), no bits.
US-HASH's own continuous embedding z is reported beside its codes by the sweep ("ushash_float")."""

from __future__ import annotations

from ushash.hashing.methods import MethodSpec, register
from ushash.hashing.methods.base import FittedMethod


class FloatSpace(FittedMethod):
    output = "float"
    needs_pca = False

    def _fit(self, y):
        pass


register(MethodSpec(name="float", title="float (shared input space, cosine)", kind="fitted", output="float",
                    build=FloatSpace, aliases=("float_upper",),
                    reference="Upper bound for binary codes made from the same space."))
