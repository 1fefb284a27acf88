"""Hashing methods compared in ushash: one registry, one module per method, one config per method.

Adding a method = one module in this package that calls `register(MethodSpec(...))` at import, and
`configs/method/<name>.yaml` (`name: <name>` and its `args`): every module of the package is imported. The registry is ushash.core.registry's, as for datasets and encoders.

Kinds
- "fitted": no training; `build(bits=, seed=, **args)` returns an object with `fit(train_split)` and
  `encode(modality, x) -> ("codes", packed uint8) | ("float", float32)`; fitted on the training split only.
- "trained": trained by the one Lightning loop (`ushash.hashing.module.USHashModule(method=<name>)`) on the same
  network (per-modality projection heads + a linear hash layer) from the same closed-form start;
  `objective(module, h, z, g, present, args, teacher=None)` returns `(parts, weights)`, the loss terms and
  their weights (`teacher`: modality -> the closed-form space's embedding of the batch, or None).

Every method sees the same features, splits and evaluation code (ushash.evaluation.retrieval, ushash.eval).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ushash.core.registry import Registry, import_all

KINDS = ("fitted", "trained")


@dataclass(frozen=True)
class MethodSpec:
    name: str                       # registry key and config file name: configs/method/<name>.yaml
    title: str                      # what it implements, as tables and plots print it
    kind: str                       # "fitted" or "trained"
    output: str = "codes"           # "codes" (Hamming ranking) or "float" (cosine ranking)
    build: Callable | None = None   # fitted: build(bits=, seed=, **args) -> object with fit() / encode()
    objective: Callable | None = None  # trained: objective(module, h, z, g, present, args, teacher) -> (parts, weights)
    aliases: tuple[str, ...] = field(default_factory=tuple)
    reference: str = ""             # the paper(s) it follows, and how it departs from them

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"method {self.name}: kind {self.kind!r} not in {KINDS}")
        if self.output not in ("codes", "float"):
            raise ValueError(f"method {self.name}: output {self.output!r} must be 'codes' or 'float'")
        if (self.kind == "fitted") != (self.build is not None) or (self.kind == "trained") != (self.objective is not None):
            raise ValueError(f"method {self.name}: a fitted method needs build, a trained one needs objective")


METHODS = Registry("method", "ushash/hashing/methods")


def register(spec: MethodSpec) -> MethodSpec:
    return METHODS.add(spec.name, spec, aliases=spec.aliases)


def get(name: str) -> MethodSpec:
    """The method registered under `name` (or one of its aliases, case-insensitive)."""
    return METHODS.lookup(name)


def names(kind: str | None = None) -> list[str]:
    return sorted(n for n, s in METHODS.items() if kind is None or s.kind == kind)


def build(name: str, bits: int, seed: int = 0, **args):
    """An unfitted no-training method (kind "fitted")."""
    spec = get(name)
    if spec.kind != "fitted":
        raise ValueError(f"method {spec.name} is trained, not fitted: train it with ushash.train method={spec.name}")
    return spec.build(bits=int(bits), seed=int(seed), **args)


# Every module of this package is imported: the ones that register themselves fill the registry.
import_all(__name__, __path__)  # noqa: E402
