"""Argument checks and row normalisation shared by the numpy-in, numpy-out modules (numpy only, so the
serving side can import it without faiss or torch)."""

from __future__ import annotations

import numpy as np


def float_rows(x, name: str, dim: int | None = None, error: type[Exception] = ValueError,
               vector_ok: bool = False, array_only: bool = False) -> np.ndarray:
    """`x` as C-contiguous float32 [N, dim] after checking its shape, dtype and finiteness; `error` names what
    failed. vector_ok: a [dim] vector is taken as one row; array_only: refuse what is not a numpy array."""
    expect = f"float [N, {dim if dim is not None else 'dim'}]"
    if array_only and not isinstance(x, np.ndarray):
        raise error(f"{name} must be a numpy array {expect}; got {type(x).__name__}")
    x = np.asarray(x)
    if vector_ok and x.ndim == 1:
        x = x[None]
    if x.ndim != 2 or (dim is not None and x.shape[1] != dim):
        raise error(f"{name} must be {expect}{f' (or [{dim}])' if vector_ok else ''}; got shape {x.shape}")
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise error(f"{name} must be {expect}; got dtype {x.dtype}")
    if x.shape[1] == 0:
        raise error(f"{name} must be {expect} with dim >= 1; got shape {x.shape}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise error(f"{name} contains NaN or inf; expected finite values")
    return x


def unit_rows(x: np.ndarray) -> np.ndarray:
    """Rows (the last axis) scaled to unit L2 norm, float32 C-contiguous; all-zero rows stay zero."""
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.ascontiguousarray(x / np.where(n > 0, n, 1.0), dtype=np.float32)
