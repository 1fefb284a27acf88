"""ushash's compiled kernels: their on-disk cache is stamped by every kernel source, so an edit to a kernel
that another one compiles in (mindex._search inside l1._find_fused) cannot leave the old code cached."""

from pathlib import Path

import numba

from ushash.core import jit


def _tree(root: Path, files: dict) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_digest_covers_every_kernel_source_and_nothing_else(tmp_path):
    kernels = {"a/search.py": "from ushash.core.jit import njit\n", "b/fused.py": "from ushash.core.jit import njit\n"}
    root = _tree(tmp_path, {**kernels, "c/plain.py": "x = 1\n"})
    d0 = jit.kernel_sources_digest.__wrapped__(root)
    (root / "c/plain.py").write_text("x = 2\n")                       # not a kernel source
    assert jit.kernel_sources_digest.__wrapped__(root) == d0
    (root / "a/search.py").write_text("from ushash.core.jit import njit\n# the search changed\n")
    d1 = jit.kernel_sources_digest.__wrapped__(root)
    assert d1 != d0                                                  # a callee's edit restamps every kernel
    (root / "a/search.py").rename(root / "a/other.py")               # the same text under another name
    assert jit.kernel_sources_digest.__wrapped__(root) not in (d0, d1)
    (root / "d/numba_direct.py").parent.mkdir()
    (root / "d/numba_direct.py").write_text("from numba import njit\n")   # numba's own njit: a kernel source too
    d2 = jit.kernel_sources_digest.__wrapped__(root)
    (root / "d/numba_direct.py").write_text("from numba import njit\n# edited\n")
    assert jit.kernel_sources_digest.__wrapped__(root) != d2


def test_every_kernel_source_of_the_package_is_in_the_digest(tmp_path):
    """An edit to any ushash file that compiles a kernel restamps them all (mindex.py, whose search
    l1._find_fused compiles in, was once left out: an edit to it kept the old kernels cached). Checked on a
    copy of the package's sources."""
    sources = [p for p in sorted(jit.PACKAGE.rglob("*.py")) if b"@njit" in p.read_bytes() and p.name != "jit.py"]
    assert any(p.name == "mindex.py" for p in sources)
    root = _tree(tmp_path, {str(p.relative_to(jit.PACKAGE)): p.read_text() for p in sources})
    d0 = jit.kernel_sources_digest.__wrapped__(root)
    assert d0 == jit.kernel_sources_digest.__wrapped__(jit.PACKAGE)   # the copy holds every kernel source
    for p in sources:
        copy = root / p.relative_to(jit.PACKAGE)
        copy.write_text(p.read_text() + "\n# edited\n")
        assert jit.kernel_sources_digest.__wrapped__(root) != d0, p
        copy.write_text(p.read_text())


def test_ushash_kernels_are_stamped_by_the_digest_and_others_keep_numbas_locators():
    from ushash.serving.cache import l1, mindex

    assert jit.CACHEABLE
    for kernel in (l1._find_fused, mindex._search):
        locator = kernel._cache._impl.locator
        assert getattr(type(locator), "_ushash_kernels", False)
        assert locator.get_source_stamp() == jit.kernel_sources_digest()
    assert jit.kernel_sources_digest() == jit.kernel_sources_digest.__wrapped__(jit.PACKAGE)
    foreign = numba.njit(cache=True)(lambda x: x + 1)                # defined in this test file, outside ushash
    assert not getattr(type(foreign._cache._impl.locator), "_ushash_kernels", False)
    assert foreign(1) == 2
