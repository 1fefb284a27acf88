"""core/io: the atomic write keeps the old file on failure, leaves no temp files, and sets open()'s mode."""

import os
import stat

import pytest

from ushash.core.io import atomic_write, exclusive, write_json


def test_atomic_write_replaces_whole_files_with_the_usual_mode(tmp_path):
    p = tmp_path / "a" / "f.json"
    write_json(p, {"x": 1})
    assert p.read_text() == '{\n "x": 1\n}\n'
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~mask
    atomic_write(p, b"new")
    assert p.read_bytes() == b"new" and [q.name for q in p.parent.iterdir()] == ["f.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "f"
    atomic_write(p, "old")

    def broken(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk gone"):
        atomic_write(p, "new")
    assert p.read_text() == "old" and [q.name for q in tmp_path.iterdir()] == ["f"]  # no temp file left


def test_exclusive_is_reentrant_across_uses(tmp_path):
    with exclusive(tmp_path / "lock"):
        pass
    with exclusive(tmp_path / "lock"):
        pass


def test_the_rename_reaches_the_disk_too(tmp_path, monkeypatch):
    """The file is fsynced before the rename and its folder after it: without the folder's, a crash could
    bring the old file back (or none) after the write had returned."""
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    atomic_write(tmp_path / "f", "x")
    assert synced == [False, True]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the umask from /proc")
def test_the_mode_is_found_without_setting_the_umask(tmp_path, monkeypatch):
    """os.umask(0) to read the mask left it 0 for a moment: a file another thread made then was world-writable."""
    def no_umask(mask):
        raise AssertionError("os.umask called")

    mask = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", no_umask)
        p = atomic_write(tmp_path / "f", "x")
        assert stat.S_IMODE(p.stat().st_mode) == 0o640
    finally:
        monkeypatch.undo()
        os.umask(mask)
