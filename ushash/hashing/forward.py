"""The hash head, torch only: its protocol, its one forward pass, and the layer list an export stores.

    z    = l2_normalize(layers[m](x))            # per-modality layers: Linear / LayerNorm / GELU (/ Dropout)
    l    = z @ l2_normalize(prototypes).T        # bit logits in [-1, 1], one per prototype
    code = ushash.core.codes.pack(l > 0)         # bits / 8 bytes, bit i = bit i % 8 of byte i // 8

`USHash` (training, ushash.hashing.heads) and `ExportedHead` (serving, ushash.serving.artifact) both run
`embed`, `logits` and `encode` below on their torch layers, so training, evaluation and the cache make the
same bits by construction. An export stores each modality's layers as a list of ops (`to_ops`); the
serving loader rebuilds the same torch modules from it (`from_ops`), and runs them through the same calls.

A served head answers one row at a time, where torch's per-call overhead, not arithmetic, is the cost. So
it computes once at load what is constant in eval (`unit_prototypes`, passed to `encode`) and runs its
layers as `eval_steps`: the very torch ops each module's forward calls, bound to the module's own tensors,
without nn.Module's call machinery. Neither changes a number (tests/test_serve_forward.py checks codes and
z bit-identical to the module path); training runs the modules as before.

This module imports torch, numpy and ushash.core.codes only: the serving loader imports it, and must not
pull in Lightning, Hydra or training code.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ushash.core import codes as codes_lib

BATCH = 8192  # rows per forward pass in `encode`: the same batches, the same kernels, the same bits everywhere
OPS = ("linear", "layer_norm", "gelu")  # what an export's layer list may hold (Dropout is left out)


@runtime_checkable
class HashHead(Protocol):
    """What every head offers, trained (`USHash`), exported (`ExportedHead`) or random (`LSHHead`):
    `encode(modality, features [N, in_dims[modality]])` -> (packed codes uint8 [N, bits / 8], z float32 [N, dim])."""

    bits: int
    dim: int
    in_dims: dict[str, int]

    @property
    def modalities(self) -> tuple[str, ...]: ...

    def encode(self, modality: str, features) -> tuple[np.ndarray, np.ndarray]: ...


# ---------------------------------------------------------------------------------------------- forward

def l2_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """x / max(||x||_2, eps) along the last dimension: F.normalize(x, dim=-1) op for op (its norm is
    torch.linalg.vector_norm), values and gradients alike, without its Python wrappers."""
    return x / torch.linalg.vector_norm(x, 2.0, -1, keepdim=True).clamp_min(eps)


def embed(layers: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Shared-space embedding z: the modality's layers, L2-normalised."""
    return l2_normalize(layers(x))


def unit_prototypes(prototypes: torch.Tensor) -> torch.Tensor:
    """The prototypes, each row L2-normalised: what `logits` multiplies by (constant for a served head)."""
    return l2_normalize(prototypes)


def logits(z: torch.Tensor, prototypes: torch.Tensor, unit: torch.Tensor | None = None) -> torch.Tensor:
    """Bit logits in [-1, 1]: the cosine of z with each prototype (normalising the prototypes does not
    change sign(l); it keeps the relaxation's scale the same at every width). unit: `unit_prototypes(
    prototypes)` computed beforehand (a served head's, once at load); computed here when None."""
    return z @ (unit_prototypes(prototypes) if unit is None else unit).T


@torch.inference_mode()
def encode(embed_fn: Callable[[torch.Tensor], torch.Tensor], prototypes: torch.Tensor, x, bits: int, dim: int,
           batch_size: int = BATCH, unit: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(packed codes uint8 [N, bits / 8], z float32 [N, dim]) of features x [N, in_dim] (numpy or CPU
    tensor), in batches of `batch_size` rows on the prototypes' device. embed_fn: x batch -> z. unit:
    `unit_prototypes(prototypes)` if the caller keeps them (computed here, once per call, otherwise)."""
    device = prototypes.device
    on_cpu = device.type == "cpu"
    if unit is None:
        unit = unit_prototypes(prototypes)
    packed, zs = [], []
    for i in range(0, len(x), batch_size):
        # a copy: x may be a read-only memmap of the feature store, and torch wants to own its memory
        xb = torch.from_numpy(np.array(x[i:i + batch_size], dtype=np.float32))
        z = embed_fn(xb if on_cpu else xb.to(device))
        l = logits(z, prototypes, unit)
        # bit = logit > 0, the same IEEE comparison either way (NaN and -0.0 give 0); on the CPU numpy's is
        # cheaper than a torch op with a scalar, on a GPU the bools are what crosses to the host
        packed.append(codes_lib.pack(l.numpy() > 0 if on_cpu else (l > 0).cpu().numpy()))
        zs.append(z.float().cpu().numpy())
    if not packed:
        return np.zeros((0, bits // 8), np.uint8), np.zeros((0, dim), np.float32)
    if len(packed) == 1:  # one batch (every served request): its arrays as they are, no copy
        return packed[0], zs[0]
    return np.concatenate(packed), np.concatenate(zs)


def eval_steps(layers: nn.Sequential) -> Callable[[torch.Tensor], torch.Tensor]:
    """`layers` in eval mode as one function: for each module, the torch op its forward calls, bound to
    the module's own tensors (Linear -> F.linear, LayerNorm -> torch.layer_norm, GELU -> F.gelu; Dropout,
    the identity in eval, left out). The same kernels on the same tensors, so the same numbers as
    `layers(x)` in eval, without nn.Module's per-call machinery (hooks, which a served head has none of)
    and Python wrappers: for one row, about a third less time in the layers. Any other module type is
    refused, as `to_ops` does. The modules' tensors are referenced, not copied: the steps follow the modules' weights only as
    long as those are not reassigned."""
    if layers.training:
        raise ValueError("eval_steps: the layers are in training mode (Dropout would not be the identity); "
                         "call .eval() first")
    steps: list[Callable[[torch.Tensor], torch.Tensor]] = []
    for i, mod in enumerate(layers):
        if isinstance(mod, nn.Linear):
            steps.append(partial(F.linear, weight=mod.weight, bias=mod.bias))
        elif isinstance(mod, nn.LayerNorm):
            # F.layer_norm's own call, less its torch-function dispatch check
            steps.append(partial(_layer_norm, shape=tuple(mod.normalized_shape), weight=mod.weight,
                                 bias=mod.bias, eps=mod.eps))
        elif isinstance(mod, nn.GELU):
            steps.append(partial(F.gelu, approximate=mod.approximate))
        elif isinstance(mod, nn.Dropout):
            continue
        else:
            raise TypeError(f"eval_steps: layer {i} is a {type(mod).__name__}; it knows Linear, LayerNorm, GELU "
                            f"(and skips Dropout)")

    def run(x: torch.Tensor) -> torch.Tensor:
        for step in steps:
            x = step(x)
        return x

    return run


def _layer_norm(x, shape, weight, bias, eps):
    return torch.layer_norm(x, shape, weight, bias, eps, torch.backends.cudnn.enabled)


# ---------------------------------------------------------------------------------------------- layer list

def to_ops(layers: nn.Sequential, prefix: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The inference-time layers of one head as export ops, and the tensors they name (`prefix.i.weight`).

    Dropout is the identity at inference and is left out; any other module type is refused, so an export
    never silently differs from the model it came from."""
    ops, tensors = [], {}

    def name(i: int, key: str, t) -> str | None:
        if t is None:
            return None
        tensors[f"{prefix}.{i}.{key}"] = t
        return f"{prefix}.{i}.{key}"

    for i, mod in enumerate(layers):
        if isinstance(mod, nn.Linear):
            ops.append({"op": "linear", "weight": name(i, "weight", mod.weight), "bias": name(i, "bias", mod.bias),
                        "in_features": mod.in_features, "out_features": mod.out_features})
        elif isinstance(mod, nn.LayerNorm):
            ops.append({"op": "layer_norm", "normalized_shape": list(mod.normalized_shape), "eps": float(mod.eps),
                        "weight": name(i, "weight", mod.weight), "bias": name(i, "bias", mod.bias)})
        elif isinstance(mod, nn.GELU):
            ops.append({"op": "gelu", "approximate": mod.approximate})
        elif isinstance(mod, nn.Dropout):
            continue
        else:
            raise TypeError(f"cannot export {prefix} layer {i} ({type(mod).__name__}); "
                            f"the serving loader knows Linear, LayerNorm, GELU (and skips Dropout)")
    return ops, tensors


def from_ops(ops: list[dict], tensors: dict[str, torch.Tensor]) -> nn.Sequential:
    """The torch modules of an export's layer list, holding `tensors` (no copy, no gradients). Modules are
    built on the meta device and then given the tensors, so loading draws nothing from torch's RNG."""
    def param(key):
        return None if not key else nn.Parameter(tensors[key], requires_grad=False)

    mods: list[nn.Module] = []
    for op in ops:
        kind = op["op"]
        if kind == "linear":
            w = tensors[op["weight"]]
            mod = nn.Linear(w.shape[1], w.shape[0], device="meta")
        elif kind == "layer_norm":
            mod = nn.LayerNorm(tuple(op["normalized_shape"]), eps=float(op["eps"]), device="meta")
        elif kind == "gelu":
            mods.append(nn.GELU(approximate=op.get("approximate", "none")))
            continue
        else:
            raise ValueError(f"unknown layer op {kind!r}; known: {OPS}")
        mod.weight, mod.bias = param(op.get("weight")), param(op.get("bias"))
        mods.append(mod)
    return nn.Sequential(*mods).eval()
