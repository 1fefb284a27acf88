"""What made a result besides its settings: the code that computed it and the numerical packages under it.

    made_by()  ->  {"code": "<16 hex>", "versions": {"torch": "2.14.1", "numpy": "2.4.6", ...}, "cpu": "AMD EPYC"}

A stored result that is reused rather than made again (a sweep's run under experiments/<name>/runs/, a
budget head) is keyed by these as well as by its settings and its features: the same settings gave other
numbers under other numpy and scipy builds (GCCA's eigensolver, ITQ's iterations), and a run made by
older training or evaluation code must not be served as this code's. The CPU model is part of it too: the
same code, packages and features gave other trained heads and ITQ codes on another CPU model (the float
space agreed to the third decimal; the codes' mAP@10 moved by up to about twice a seed's spread), since
kernels that round differently send ITQ's iterations and training down other paths. `code_digest` covers every source
file of the package except the cache runtime and the simulator (`NOT_RESULTS`), which no training,
fitting or evaluation reads.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path
from typing import Callable

PACKAGE = Path(__file__).resolve().parents[1]
#: the packages whose versions change a result (reported by ./run reproduce in every table too)
VERSIONED = ("torch", "numpy", "scipy", "faiss-cpu", "pytorch-lightning")
#: subpackages no training, fitting or evaluation result depends on
NOT_RESULTS = ("serving", "sim")


def files_digest(root: Path, keep: Callable[[Path, bytes], bool]) -> bytes:
    """sha256 over the relative path and content of every .py file under `root` that `keep(path, text)`."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        text = path.read_bytes()
        if keep(path, text):
            h.update(str(path.relative_to(root)).encode() + b"\0" + text + b"\0")
    return h.digest()


@functools.lru_cache(maxsize=None)
def code_digest(root: Path = PACKAGE) -> str:
    """16 hex digits over the package's sources that results depend on (read once per process)."""
    def keep(path: Path, _text: bytes) -> bool:
        rel = path.relative_to(root).parts
        return not (rel and rel[0] in NOT_RESULTS) and "__pycache__" not in rel

    return files_digest(root, keep).hex()[:16]


@functools.lru_cache(maxsize=None)
def runtime_digest(root: Path = PACKAGE) -> str:
    """16 hex digits over the cache runtime's and the simulator's sources (`NOT_RESULTS`, which
    `code_digest` leaves out): what a stored result of the cache (a calibration benchmark's) is keyed by
    besides `made_by`."""
    def keep(path: Path, _text: bytes) -> bool:
        rel = path.relative_to(root).parts
        return bool(rel) and rel[0] in NOT_RESULTS and "__pycache__" not in rel

    return files_digest(root, keep).hex()[:16]


def package_versions() -> dict[str, str]:
    """The installed version of each of VERSIONED (a package not installed is left out)."""
    from importlib import metadata

    out = {}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """The CPU's model name ("model name" in /proc/cpuinfo where there is one, else platform.processor(),
    else the architecture), e.g. "AMD EPYC" or "Intel(R) Xeon(R) Processor"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_summary() -> str:
    """The architecture, CPU model and core count, e.g. "x86_64 (AMD EPYC), 2 cores": the machine line of the
    benchmarks' results and headers."""
    return f"{platform.machine()} ({cpu_model()}), {os.cpu_count()} cores"


def made_by() -> dict:
    """{"code": code_digest(), "versions": package_versions(), "cpu": cpu_model()}: what a stored result is
    keyed by besides its settings."""
    return {"code": code_digest(), "versions": package_versions(), "cpu": cpu_model()}


__all__ = ["NOT_RESULTS", "VERSIONED", "code_digest", "cpu_model", "files_digest", "machine_summary", "made_by", "package_versions",
           "runtime_digest"]
