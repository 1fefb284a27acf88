"""The served head's forward pass for one request row, compiled: what a single lookup's features cost.

    rows = RowPass(ops, tensors, unit)          # an export's layer list, its float32 tensors, unit prototypes
    code, z = rows(x)                           # x float32 [in_dim] -> (uint8 [bits / 8], float32 [dim])

A cache request is one row of features, where torch's per-op cost (argument parsing, dispatch, a tensor
per op), not arithmetic, is the price: ~50 µs for the default head's five ops in a tight loop and about
four times that between a server's other work (`./run bench row_pass`, docs/benchmarks.md). `RowPass`
runs the same layer list (`ushash.hashing.forward.OPS`: Linear, LayerNorm, GELU), then z = the output
over its L2 norm, the bit logits z · unit prototypes and bit = logit > 0, packed as
`ushash.core.codes.pack` packs, in one numba call per row.

The numbers are those of the float64 computation of each op, rounded to float32 at its output (the
tensor between two ops is float32, as torch's is); a Linear's sums run in input order. Where a float32
kernel overflows (a LayerNorm's variance or the norm's sum of squares beyond float32's range: features
of ~1e19 and more), so does the row pass, so that such a row is refused here as in a batch. torch's
float32 kernels round otherwise, and differ between a one-row and a many-row GEMM too, so z agrees with
`ExportedHead.encode` to float32 rounding (~1e-7) and a code bit can differ only where its logit is
within rounding of zero (tests/test_serve_rowpass.py measures both on seeded heads). `ExportedHead.encode`
(evaluation's bits, batches, a head on a GPU) stays torch's; the cache's one-row requests come here
(`ExportedHead.encode_row`, ushash.serving.cache.request).
"""

from __future__ import annotations

import math

import numpy as np

from ushash.core.jit import njit
from ushash.hashing.forward import OPS

_INV_SQRT2 = 0.7071067811865476          # GELU: x / sqrt(2) inside erf
_SQRT_2_OVER_PI = 0.7978845608028654     # GELU(approximate="tanh")
_NORM_EPS = 1e-12                        # ushash.hashing.forward.l2_normalize's eps
_F32_MAX = float(np.finfo(np.float32).max)   # a float32 sum beyond this overflows to inf
_LINEAR, _LAYER_NORM, _GELU, _GELU_TANH = range(4)   # a program row's op


@njit(cache=True, nogil=True, error_model="numpy")
def _linear(x, wt, bias):
    """x [in] @ wt [in, out] + bias [out] (or no bias: length 0), summed in float64 in input order."""
    n_in, n_out = wt.shape
    acc = np.zeros(n_out, np.float64)
    for k in range(n_in):
        xk = np.float64(x[k])
        row = wt[k]
        for j in range(n_out):
            acc[j] += xk * row[j]
    out = np.empty(n_out, np.float32)
    if bias.shape[0]:
        for j in range(n_out):
            out[j] = np.float32(acc[j] + bias[j])
    else:
        for j in range(n_out):
            out[j] = np.float32(acc[j])
    return out


@njit(cache=True, nogil=True, error_model="numpy")
def _layer_norm(x, weight, bias, eps):
    """(x - mean) / sqrt(biased variance + eps) * weight + bias over the row (weight, bias: length 0 = none).
    NaN where the row's sum or its sum of squared deviations is beyond float32's range, where torch's
    float32 kernel overflows (to NaN, or to a row of its bias)."""
    n = x.shape[0]
    s = 0.0
    for j in range(n):
        s += x[j]
    mean = s / n
    v = 0.0
    for j in range(n):
        d = x[j] - mean
        v += d * d
    out = np.empty(n, np.float32)
    if abs(s) > _F32_MAX or v > _F32_MAX:
        out[:] = np.nan
        return out
    inv = 1.0 / math.sqrt(v / n + eps)
    for j in range(n):
        y = (x[j] - mean) * inv
        if weight.shape[0]:
            y = y * weight[j]
        if bias.shape[0]:
            y = y + bias[j]
        out[j] = np.float32(y)
    return out


@njit(cache=True, nogil=True, error_model="numpy")
def _gelu(x, tanh):
    """GELU: x/2 (1 + erf(x / sqrt 2)), or with tanh its approximation, as torch's F.gelu."""
    out = np.empty(x.shape[0], np.float32)
    for j in range(x.shape[0]):
        v = np.float64(x[j])
        if tanh:
            out[j] = np.float32(0.5 * v * (1.0 + math.tanh(_SQRT_2_OVER_PI * (v + 0.044715 * v * v * v))))
        else:
            out[j] = np.float32(0.5 * v * (1.0 + math.erf(v * _INV_SQRT2)))
    return out


@njit(cache=True, nogil=True, error_model="numpy")
def _code(h, unit_t):
    """z = h / max(||h||, eps), the logits z @ unit_t [dim, bits] and the packed code (bit = logit > 0:
    0 for a logit of zero or NaN, bit i = bit i % 8 of byte i // 8). A sum of squares beyond float32's
    range is inf, as torch's float32 norm is: z is then 0 (or NaN where h holds an inf)."""
    s = 0.0
    for j in range(h.shape[0]):
        s += np.float64(h[j]) * h[j]
    norm = math.inf if s > _F32_MAX else max(math.sqrt(s), _NORM_EPS)
    z = np.empty(h.shape[0], np.float32)
    for j in range(h.shape[0]):
        z[j] = np.float32(h[j] / norm)
    bits = unit_t.shape[1]
    logits = np.zeros(bits, np.float64)
    for k in range(z.shape[0]):
        zk = np.float64(z[k])
        row = unit_t[k]
        for i in range(bits):
            logits[i] += zk * row[i]
    code = np.zeros(bits // 8, np.uint8)
    for i in range(bits):
        if logits[i] > 0:
            code[i >> 3] |= np.uint8(1 << (i & 7))
    return code, z


@njit(cache=True, nogil=True, error_model="numpy")
def _run(x, program, eps, params, unit_t):
    """The program's ops on row x, then `_code`: one call per request. program int64 [ops, 5]: (op, a, n, m,
    b): the op's first tensor is params[a : a + n * m] as [n, m] (a Linear's weights transposed, [in, out];
    a LayerNorm's weight, [1, width], or n = 0 for none), its second params[b : b + m] (a bias; b = -1 for
    none); eps float64 [ops]: a LayerNorm's eps."""
    h = x
    for r in range(program.shape[0]):
        op, a, n, m, b = program[r, 0], program[r, 1], program[r, 2], program[r, 3], program[r, 4]
        first = params[a:a + n * m].reshape(n, m)
        second = params[b:b + m] if b >= 0 else params[:0]
        if op == _LINEAR:
            h = _linear(h, first, second)
        elif op == _LAYER_NORM:
            h = _layer_norm(h, first[0] if n else params[:0], second, eps[r])
        else:
            h = _gelu(h, op == _GELU_TANH)
    return _code(h, unit_t)


def _f32(t) -> np.ndarray:
    a = t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)
    if a.dtype != np.float32:
        raise TypeError(f"RowPass takes float32 tensors; got {a.dtype}")
    return a


class RowPass:
    """One modality's layers, the L2 normalisation, the logits and the packed code, for one row at a time.

    ops: an export's layer list for the modality (ushash.hashing.forward.to_ops); tensors: the names they
    refer to -> float32 tensors or arrays; unit: the unit prototypes [bits, dim]
    (`ushash.hashing.forward.unit_prototypes`). The tensors are copied (the Linear weights transposed, so
    that each input's row of weights is contiguous)."""

    def __init__(self, ops: list[dict], tensors: dict, unit):
        parts: list[np.ndarray] = []                      # every tensor, flat, in one float32 buffer
        size = 0
        unit_t = np.ascontiguousarray(_f32(unit).T)
        program, eps = [], []
        in_dim = width = None                             # width: the row's length between ops

        def add(a: np.ndarray) -> int:
            nonlocal size
            parts.append(np.ascontiguousarray(a, np.float32).reshape(-1))
            size += parts[-1].size
            return size - parts[-1].size

        def vector(name, length: int, what: str) -> int:
            """The offset of a vector the op takes (-1: none), checked against the row's length."""
            if not name:
                return -1
            a = _f32(tensors[name]).reshape(-1)
            if a.size != length:
                raise ValueError(f"RowPass: layer {i}'s {what} has {a.size} values for a row of {length}")
            return add(a)

        for i, op in enumerate(ops):
            kind = op.get("op")
            if kind == "linear":
                w = _f32(tensors[op["weight"]])
                if w.ndim != 2 or (width is not None and w.shape[1] != width):
                    raise ValueError(f"RowPass: layer {i}'s weight is {list(w.shape)} for a row of {width}")
                in_dim = w.shape[1] if in_dim is None else in_dim
                at = add(w.T)                             # [in, out]: each input's weights contiguous
                program.append((_LINEAR, at, w.shape[1], w.shape[0], vector(op.get("bias"), w.shape[0], "bias")))
                width = w.shape[0]
            elif kind == "layer_norm":
                shape = list(op["normalized_shape"])
                if width is None and len(shape) == 1:
                    in_dim = width = shape[0]
                if len(shape) != 1 or shape[0] != width:
                    raise ValueError(f"RowPass: layer {i} normalises over {shape}; a row's LayerNorm is over "
                                     f"its one dimension ({width})")
                at = vector(op.get("weight"), width, "weight")
                program.append((_LAYER_NORM, max(at, 0), int(at >= 0), width, vector(op.get("bias"), width, "bias")))
            elif kind == "gelu":
                approximate = op.get("approximate", "none")
                if approximate not in ("none", "tanh"):
                    raise ValueError(f"RowPass: layer {i} is GELU(approximate={approximate!r}); torch knows "
                                     f"'none' and 'tanh'")
                program.append((_GELU_TANH if approximate == "tanh" else _GELU, 0, 0, 0, -1))
            else:
                raise ValueError(f"RowPass: layer {i} is {kind!r}; it runs {OPS}")
            eps.append(float(op.get("eps", 0.0)))
        if width is None:                                 # no op fixes the width: the row is z itself
            in_dim = width = unit_t.shape[0]
        self.in_dim = in_dim
        if unit_t.shape[0] != width:
            raise ValueError(f"RowPass: the layers give rows of {width}, the prototypes are of {unit_t.shape[0]}")
        self.bits = unit_t.shape[1]
        if self.bits % 8:
            raise ValueError(f"RowPass: {self.bits} prototypes; codes are whole bytes (a multiple of 8)")
        self._program = np.array(program, np.int64).reshape(-1, 5)
        self._eps = np.array(eps, np.float64)
        self._params = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        self._unit_t = unit_t

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(packed code uint8 [bits / 8], z float32 [dim]) of one float32 row x [in_dim] (C-contiguous)."""
        if x.dtype != np.float32 or x.shape != (self.in_dim,) or not x.flags.c_contiguous:
            raise ValueError(f"RowPass: a row is C-contiguous float32 [{self.in_dim}]; got {x.dtype} {list(x.shape)}")
        return _run(x, self._program, self._eps, self._params, self._unit_t)

    def warm_up(self) -> None:
        """Compile or load the kernels now (numba's first call), not during a first request."""
        self(np.zeros(self.in_dim, np.float32))
