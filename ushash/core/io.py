"""Files: one atomic write (temp file in the same folder, fsync, rename, fsync of the folder), one folder replaced
by renames (`replace_folder`), and one inter-process lock.

Every artifact ushash writes (feature-store metadata, results, checkpoints' companions, exports) goes
through `atomic_write` or `write_json` (a plot through `save_figure`), so a reader never sees half a file and
a crash leaves the old file whole. `exclusive(path)` is `filelock.FileLock` with a message when another process holds the lock.
`settings_digest` names a folder by everything that made what it holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock, Timeout

log = logging.getLogger(__name__)


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write `data` to `path` atomically: a temp file beside it, flushed and fsynced, then renamed over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # what open() would give: mkstemp makes 0600 files
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


def replace_synced(tmp: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Rename a finished temporary file (one another library wrote, a checkpoint) over `path` durably: its
    bytes reach the disk before the rename and the rename after it, so a power cut leaves the old file or
    the new one whole, never a short or empty one under the final name."""
    path = Path(path)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def replace_folder(work: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Put a finished folder `work` in the place of `out` (a sibling, on the same file system): an older `out`
    is renamed aside (`<out>.old`), `work` renamed into place, the old one removed after. A reader finds the
    old folder whole or the new one whole (or, between the two renames, none: a loader should retry); a kill
    at any point leaves either of them whole under its own name. Deleting the old folder first, a reader
    found a folder without its files, and a kill after the delete left none. The renames reach the disk;
    `work`'s files must have reached it before (the caller's to sync)."""
    work, out = Path(work), Path(out)
    old = out.with_name(out.name + ".old")
    if old.exists():       # left by a kill after an earlier rename aside
        shutil.rmtree(old)
    if out.exists():
        os.replace(out, old)
    os.replace(work, out)
    fsync_dir(out.parent)
    if old.exists():
        shutil.rmtree(old)
    return out


def fsync_dir(folder: Path) -> None:
    """The rename itself reaches the disk (a crash after it cannot bring the old file back, or none)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - a platform whose folders cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - a file system that cannot sync a folder
        pass
    finally:
        os.close(fd)


def save_figure(fig, path: str | os.PathLike, dpi: float | None = None) -> Path:
    """Write a matplotlib figure as a PNG at `path` atomically and close it (dpi None: matplotlib's default)."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return atomic_write(path, buf.getvalue())


def _umask() -> int:
    """The process's umask, read where the kernel reports it: setting it to read it (os.umask) leaves it 0 for
    a moment, and a file another thread creates then is world-writable."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)  # pragma: no cover - no /proc (not Linux)
    os.umask(mask)
    return mask


def settings_digest(obj, length: int = 16) -> str:
    """`length` hex digits of sha256 over `obj`'s JSON with sorted keys (anything JSON lacks as str): the
    digest in the name of a sweep's run, an evaluation's or a cachesim run's folder."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:length]


def write_json(path: str | os.PathLike, obj, compact: bool = False) -> Path:
    """Atomic JSON: indented (one key a line) by default, `compact` for large result files."""
    text = (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) if compact
            else json.dumps(obj, indent=1, ensure_ascii=False))
    return atomic_write(path, text + "\n")


@contextlib.contextmanager
def exclusive(lock_path: str | os.PathLike, what: str = ""):
    """Hold an inter-process lock on `lock_path` (created if missing); says so once when it must wait."""
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("another process holds %s%s; waiting for it", lock_path, f" ({what})" if what else "")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def set_aside(folder: str | os.PathLike, into: str | os.PathLike) -> Path:
    """Move `folder` to `into/<its name>[-<n>]` (the first free name) and return where it went: a run that
    must not be reused or resumed (it was made from other features) is kept, out of the way, not deleted."""
    folder, into = Path(folder), Path(into)
    into.mkdir(parents=True, exist_ok=True)
    aside, n = into / folder.name, 1
    while aside.exists():
        aside, n = into / f"{folder.name}-{n}", n + 1
    folder.rename(aside)
    return aside
