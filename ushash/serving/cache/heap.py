"""Freed heap pages back to the OS after a large column is replaced by a grown copy.

A column grows by a fresh, larger array; the old one is freed. glibc serves allocations below its mmap
threshold from the heap, and raises that threshold (up to 32 MiB) each time a mapped block is freed, so
the growing columns of a cache end up on the heap and the copies they leave behind become holes that the
process keeps (~40 B per entry after a fill to 1M entries, measured by benchmarks/cache_lookup.py).
`replaced` calls malloc_trim(0), which returns the whole free pages inside those holes, once a freed
array is at least `TRIM_MIN_BYTES`: a few dozen calls over a fill to millions of entries, none for a
small cache. Where the C library has no malloc_trim (not glibc) it does nothing.
"""

from __future__ import annotations

import ctypes

TRIM_MIN_BYTES = 1 << 20


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
