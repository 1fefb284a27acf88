"""Tux Paint stamps: the embedded default dataset (image + caption + sound per stamp).

Source: Debian package `tuxpaint-stamps-default` (GPL-2 or later, (c) 2002-2022 Bill Kendrick and
contributors), fetched at run time by `fetch(root)` into `<root>/stamps` and never committed.

One item per stamp. A stamp is an image file (`.png` or `.svg`) under `stamps/<category>/...`:
- id / group:  the path relative to `stamps/` without extension, e.g. "animals/mammals/cats/lion".
- image row:   the PNG; when a stamp ships both a PNG and an SVG, the PNG (decodes without the
               optional cairosvg, and does not make the dataset depend on what is installed).
               `<stem>_mirror.png` files are Tux Paint's pre-flipped variants of `<stem>`, not stamps.
- text row:    the English caption, the first line of `<stem>.txt` that is not a `lang.utf8=...`
               translation. Stamps without a caption have no text row (they still count).
- audio row:   `<stem>.ogg` (or `.wav`), the stamp's sound effect, when present. Spoken descriptions
               (`<stem>_desc*.ogg`) and localised sounds (`<stem>_<lang>.ogg`) are not used.
- labels:      every prefix of the stamp's category folder, with "cartoon" (a drawing-style folder,
               not a category) dropped: animals/mammals/cats/cartoon/tiger.svg ->
               ("animals", "animals/mammals", "animals/mammals/cats"). So labels hold the top-level
               category, the leaf category and everything between; "share a label" relevance on them
               means "same top-level category", finer levels are there for stricter relevance.
Splits are per stamp, from a hash of (seed, stamp id): all rows of a stamp share a split, and adding
stamps never moves existing ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ushash.core.io import atomic_write
from ushash.data.datasets import REPO_ROOT, SPLITS, check_fracs, fetched, hash_split, register, resolve_path
from ushash.data.rows import Row

PACKAGE = "tuxpaint-stamps-default"
LICENSE = "GPL-2.0-or-later"  # Debian copyright: "License: GPL-2" with the "or any later version" clause
STAMPS_IN_DEB = Path("usr/share/tuxpaint/stamps")
DEFAULT_ROOT = REPO_ROOT / "data" / "tuxpaint"
IMAGE_SUFFIXES = (".png", ".svg")  # preference order when a stamp has both
SOUND_SUFFIXES = (".ogg", ".wav")
STYLE_DIRS = frozenset({"cartoon"})
MIRROR_SUFFIX = "_mirror"

_MANUAL = (
    "To fetch it by hand: `apt-get download {pkg}` (on any Debian/Ubuntu; or download the .deb from "
    "https://packages.debian.org/stable/all/{pkg}/download), then either call "
    "`ushash.data.datasets.tuxpaint.fetch(ROOT, deb=FILE)`, or run `dpkg -x FILE TMP` (without dpkg: "
    "`ar x FILE && tar xf data.tar.xz -C TMP`) and move TMP/{inner} to ROOT/stamps."
)


class FetchError(RuntimeError):
    """The stamps could not be fetched; the message says why and how to fetch them by hand."""


def _manual() -> str:
    return _MANUAL.format(pkg=PACKAGE, inner=STAMPS_IN_DEB)


# ----------------------------------------------------------------------------------------------- fetch
def fetch(root: str | os.PathLike, deb: str | os.PathLike | None = None) -> Path:
    """Make `<root>/stamps` exist: download the Debian package (or use `deb`) and unpack it.

    Idempotent: returns at once when `<root>/stamps` exists. The stamps folder appears in one rename,
    after `<root>/SOURCE.json` (package, version, licence) and `<root>/copyright` are written, so a
    present `stamps/` is always a complete one.
    """
    root = Path(root)
    stamps = root / "stamps"
    if stamps.is_dir():
        return stamps
    need = ["dpkg", "dpkg-deb"] + ([] if deb else ["apt-get"])
    missing = [t for t in need if shutil.which(t) is None]
    if missing:
        raise FetchError(f"cannot fetch {PACKAGE} into {root}: {', '.join(missing)} not found. {_manual()}")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=root))
    try:
        if deb is None:
            _run(["apt-get", "download", PACKAGE], cwd=tmp, what="download",
                 hint="if apt says it cannot locate the package, run `apt-get update` first. ")
            debs = sorted(tmp.glob("*.deb"))
            if len(debs) != 1:
                raise FetchError(f"apt-get download left {len(debs)} .deb files in {tmp}. {_manual()}")
            deb_path = debs[0]
        else:
            deb_path = Path(deb)
            if not deb_path.is_file():
                raise FetchError(f"{deb_path}: no such .deb file. {_manual()}")
        fields = _run(["dpkg-deb", "-f", str(deb_path), "Package", "Version"], cwd=tmp, what="read")
        meta = dict(line.split(": ", 1) for line in fields.splitlines() if ": " in line)
        if meta.get("Package") != PACKAGE:
            raise FetchError(f"{deb_path} is package {meta.get('Package')!r}, expected {PACKAGE!r}")
        unpacked = tmp / "x"
        _run(["dpkg", "-x", str(deb_path), str(unpacked)], cwd=tmp, what="unpack")
        src = unpacked / STAMPS_IN_DEB
        if not src.is_dir():
            raise FetchError(f"{deb_path} has no {STAMPS_IN_DEB}/ folder")
        copyright_file = unpacked / "usr/share/doc" / PACKAGE / "copyright"
        if copyright_file.is_file():
            atomic_write(root / "copyright", copyright_file.read_bytes())
        source = {
            "package": PACKAGE,
            "version": meta.get("Version"),
            "license": LICENSE,
            "license_debian": "GPL-2",
            "copyright": "2002-2022 Bill Kendrick and contributors (see copyright)",
            "origin": "Debian archive, via `apt-get download`" if deb is None else f"local file {deb_path.name}",
            "deb": deb_path.name,
            "fetched": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        atomic_write(root / "SOURCE.json", json.dumps(source, indent=2) + "\n")
        try:
            os.rename(src, stamps)  # same filesystem (tmp is under root): atomic
        except OSError:
            if not stamps.is_dir():  # another process finishing first is fine; anything else is not
                raise
        return stamps
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(cmd: list[str], cwd: Path, what: str, hint: str = "") -> str:
    try:
        res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise FetchError(f"cannot {what} {PACKAGE}: {' '.join(cmd)} failed to start ({e}). {_manual()}") from e
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip()[-800:] or "(no output)"
        raise FetchError(
            f"cannot {what} {PACKAGE}: `{' '.join(cmd)}` exited {res.returncode}: {tail}\n{hint}{_manual()}"
        )
    return res.stdout


# ------------------------------------------------------------------------------------------------ scan
@dataclass(frozen=True)
class Stamp:
    id: str  # "animals/mammals/cats/lion"
    image: Path
    caption: str | None
    sound: Path | None
    labels: tuple[str, ...]


def read_caption(txt: Path) -> str | None:
    """First line of a Tux Paint description file that is not a `lang.utf8=` translation."""
    try:
        text = txt.read_text(encoding="utf-8-sig", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        line = line.strip()
        if not line or ".utf8=" in line.split(" ", 1)[0]:
            continue
        return line
    return None


def labels_for(stamp_id: str) -> tuple[str, ...]:
    """Category-path prefixes of a stamp id, style folders ("cartoon") dropped."""
    parts = [p for p in stamp_id.split("/")[:-1] if p not in STYLE_DIRS]
    return tuple("/".join(parts[: i + 1]) for i in range(len(parts)))


def scan(stamps: Path) -> tuple[list[Stamp], Counter]:
    """All stamps under `stamps`, sorted by id, plus counters of what was skipped or missing."""
    notes: Counter = Counter()
    images: dict[str, dict[str, Path]] = {}
    for dirpath, dirnames, filenames in os.walk(stamps):
        dirnames.sort()
        d = Path(dirpath)
        rel = d.relative_to(stamps).as_posix()
        for fn in sorted(filenames):
            stem, ext = os.path.splitext(fn)
            if ext.lower() in IMAGE_SUFFIXES:
                sid = stem if rel == "." else f"{rel}/{stem}"
                images.setdefault(sid, {})[ext.lower()] = d / fn
    out = []
    for sid in sorted(images):
        if sid.endswith(MIRROR_SUFFIX) and sid[: -len(MIRROR_SUFFIX)] in images:
            notes["mirror_variants_skipped"] += 1
            continue
        files = images[sid]
        if len(files) > 1:
            notes["png_and_svg"] += 1
        image = next(files[s] for s in IMAGE_SUFFIXES if s in files)
        base = stamps / sid
        caption = read_caption(base.with_name(base.name + ".txt"))
        sound = next((q for s in SOUND_SUFFIXES if (q := base.with_name(base.name + s)).is_file()), None)
        notes["svg_images"] += image.suffix.lower() == ".svg"
        notes["no_caption"] += caption is None
        out.append(Stamp(sid, image, caption, sound, labels_for(sid)))
    return out, notes


# ------------------------------------------------------------------------------------------------ rows
def stamps_dir(root: str | os.PathLike | None, allow_fetch: bool) -> Path:
    root = DEFAULT_ROOT if root is None else resolve_path(root)
    return fetched(root / "stamps", root, allow_fetch, fetch, "tuxpaint")


def split_of(stamp_id: str, seed: int, val_frac: float, test_frac: float) -> str:
    return hash_split(stamp_id, seed, val_frac, test_frac)


def rows(root: str | os.PathLike, split: str, val_frac: float = 0.1, test_frac: float = 0.1,
         seed: int = 0) -> list[Row]:
    """Rows of one split from an unpacked stamps tree at `<root>/stamps` (no fetching)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    check_fracs(val_frac, test_frac)
    stamps = Path(root).absolute() / "stamps"  # absolute sources, whatever the cwd
    if not stamps.is_dir():
        raise FileNotFoundError(f"{stamps} not found; fetch it with ushash.data.datasets.tuxpaint.fetch({str(root)!r})")
    found, _ = scan(stamps)
    out: list[Row] = []
    for s in found:
        if split_of(s.id, seed, val_frac, test_frac) != split:
            continue
        out.append(Row("image", s.id, s.id, str(s.image), s.labels))
        if s.caption is not None:
            out.append(Row("text", s.id, s.id, s.caption, s.labels))
        if s.sound is not None:
            out.append(Row("audio", s.id, s.id, str(s.sound), s.labels))
    return out


@register("tuxpaint")
def load(split: str, *, root: str | None = None, val_frac: float = 0.1, test_frac: float = 0.1,
         seed: int = 0, fetch: bool = True) -> list[Row]:
    """Recipe for `load_rows("tuxpaint", split, ...)`: root None means <repo>/data/tuxpaint."""
    stamps = stamps_dir(root, allow_fetch=fetch)
    return rows(stamps.parent, split, val_frac=val_frac, test_frac=test_frac, seed=seed)


def summary(root: str | os.PathLike, val_frac: float = 0.1, test_frac: float = 0.1, seed: int = 0) -> dict:
    """Counts: stamps and rows per split and modality, plus what the scan skipped."""
    found, notes = scan(Path(root) / "stamps")
    counts = {s: {"stamps": 0, "image": 0, "text": 0, "audio": 0} for s in SPLITS}
    for s in found:
        c = counts[split_of(s.id, seed, val_frac, test_frac)]
        c["stamps"] += 1
        c["image"] += 1
        c["text"] += s.caption is not None
        c["audio"] += s.sound is not None
    total = {k: sum(c[k] for c in counts.values()) for k in ("stamps", "image", "text", "audio")}
    return {
        "splits": counts,
        "total": total,
        "labels": len({lab for s in found for lab in s.labels}),
        "top_level_categories": len({s.labels[0] for s in found if s.labels}),
        "notes": dict(sorted(notes.items())),
    }


def main(argv: list[str] | None = None) -> None:
    """Fetch if needed and print `summary` as JSON:
    python -c 'from ushash.data.datasets import tuxpaint; tuxpaint.main()' [--root DIR] [--no-fetch]
    """
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=None, help=f"data folder (default {DEFAULT_ROOT})")
    ap.add_argument("--no-fetch", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    stamps = stamps_dir(a.root, allow_fetch=not a.no_fetch)
    print(json.dumps(summary(stamps.parent, seed=a.seed), indent=2))

