"""numba's `njit` for ushash's compiled kernels, with an on-disk cache that cannot serve a stale kernel.

    from ushash.core.jit import njit

    @njit(cache=True, nogil=True)
    def kernel(...): ...

numba keys a cached kernel by the source file of the function alone, while a kernel compiles in every
kernel it calls: `l1._find_fused` holds `mindex._search` and the payload codec's cosine, so an edit to
mindex.py alone left the old search running from the cache (seen while measuring: a lookup batch at a
third of its speed until the cache files were removed). Here every ushash kernel's cache is stamped with
one digest of all ushash sources that define kernels (`kernel_sources_digest`): a change to any of them
recompiles them all on first use. Functions outside ushash (librosa's) keep numba's own locators.
"""

from __future__ import annotations

import functools
from pathlib import Path

from numba import njit as _njit
from numba.core import caching

from ushash.core.provenance import files_digest

PACKAGE = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def kernel_sources_digest(root: Path = PACKAGE) -> bytes:
    """sha256 over the path and content of every .py file under `root` that compiles kernels: any that names
    njit, this module's or numba's (every kernel under the package is stamped with this digest, so a file
    left out would serve its old kernels after an edit). Read once per process: a source changed while a
    process runs is that process's own concern, as with imports."""
    return files_digest(root, lambda path, text: b"njit" in text and path.name != "jit.py")


def _ours(py_file: str) -> bool:
    try:
        return Path(py_file).resolve().is_relative_to(PACKAGE)
    except OSError:
        return False


class _KernelStamp:
    """A locator mixin: the source stamp of a ushash kernel is the digest of all kernel sources; functions
    elsewhere are not located here (numba's next locator takes them)."""

    def get_source_stamp(self):
        return kernel_sources_digest()

    @classmethod
    def from_function(cls, py_func, py_file):
        if not _ours(py_file):
            return None
        return super().from_function(py_func, py_file)


def _numba_class(*names):
    """A class of numba.core.caching by its current name or an older one (0.59 had leading underscores)."""
    for name in names:
        if hasattr(caching, name):
            return getattr(caching, name)
    return None


def _install() -> bool:
    """Our three locators in front of numba's (NUMBA_CACHE_DIR, the package's __pycache__, the user's cache
    directory); False where this numba's caching classes are not the ones known here."""
    impl = _numba_class("CacheImpl", "_CacheImpl")
    bases = [_numba_class("UserProvidedCacheLocator", "_UserProvidedCacheLocator"),
             _numba_class("InTreeCacheLocator", "_InTreeCacheLocator"),
             _numba_class("UserWideCacheLocator", "_UserWideCacheLocator")]
    classes = getattr(impl, "_locator_classes", None)
    if not isinstance(classes, list) or None in bases:
        return False
    ours = [type(f"Kernel{b.__name__.lstrip('_')}", (_KernelStamp, b), {}) for b in bases]
    if not any(getattr(c, "_ushash_kernels", False) for c in classes):
        for c in ours:
            c._ushash_kernels = True
        classes[:0] = ours
    return True


CACHEABLE = _install()   # False: ushash's kernels compile in every process, never from a cache


def njit(*args, **kwargs):
    """numba.njit; `cache=True` only where the kernel-wide stamp is installed (else compiled per process)."""
    if not CACHEABLE:
        kwargs["cache"] = False
    return _njit(*args, **kwargs)


__all__ = ["CACHEABLE", "kernel_sources_digest", "njit"]
