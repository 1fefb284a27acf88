"""Memory for the cache's growing columns: large arrays in pages of their own, and freed heap pages back
to the OS after a large array is replaced by a grown copy.

A column grows by a fresh, larger array; the old one is freed. glibc serves allocations below its mmap
threshold from the heap, and raises that threshold (up to 32 MiB) each time a mapped block is freed, so
growing columns end up on the heap: calloc then writes every page of a recycled block (the capacity
beyond the held entries costs memory too), and each old copy leaves a hole that the process keeps.
Measured by benchmarks/cache_lookup.py at 1M entries, that was ~45 B per entry.

`zeros` is np.zeros in an anonymous mapping of its own once the array is `MMAP_MIN_BYTES` or more: its
pages cost nothing until written, and they go back to the OS when the array is freed. The holes that the
fill's temporaries leave in the heap meanwhile (search results, batches of entries) are given back by
`replaced`, called when a grown column has replaced a large one: malloc_trim(0) once the freed array was
at least `TRIM_MIN_BYTES` (a few dozen calls over a fill to millions of entries, none for a small cache;
nothing where the C library has no malloc_trim).
"""

from __future__ import annotations

import ctypes
import math
import mmap

import numpy as np

MMAP_MIN_BYTES = 1 << 20
TRIM_MIN_BYTES = 1 << 20


def zeros(shape, dtype) -> np.ndarray:
    """np.zeros(shape, dtype); in an anonymous mapping of its own when it is MMAP_MIN_BYTES or more."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MMAP_MIN_BYTES:
        return np.zeros(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype).reshape(shape)


def _malloc_trim():
    try:
        f = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_size_t]
    f.restype = ctypes.c_int
    return f


_TRIM = _malloc_trim()
trims = 0   # calls made (tests)


def replaced(nbytes: int) -> None:
    """An array of `nbytes` has just been freed (replaced by a grown copy): give the heap's free pages
    back to the OS once such arrays are large."""
    global trims
    if _TRIM is not None and nbytes >= TRIM_MIN_BYTES:
        _TRIM(0)
        trims += 1
