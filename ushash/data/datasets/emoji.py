"""Emoji: the second embedded dataset (a rendered image + several captions per emoji).

Sources, fetched at run time by `fetch(root)` into `<root>` and never committed:
- Debian `fonts-noto-color-emoji`: NotoColorEmoji.ttf, Google's colour emoji font (a CBDT bitmap font,
  SIL OFL 1.1, (c) 2013-2017 Google Inc.). Every emoji is rendered from it once, at fetch time, to
  `<root>/images/<id>.png`, so the normal image loader (ushash/data/media.py) reads them like any image.
- Debian `unicode-data`: `emoji-test.txt` (Unicode Emoji, UTS #51; Unicode licence), kept as
  `<root>/emoji-test.txt`: every emoji's code points, qualification status, CLDR name, group and
  subgroup. The rows are built from it on every load.
- PyPI `emoji` (a dependency, BSD): `emoji.EMOJI_DATA`, for the alias captions.

One item per base emoji:
- entries:   the fully-qualified lines of emoji-test.txt; minimally-qualified and unqualified lines
             (the same emoji without its presentation selectors) and the "Component" group (the bare
             skin tones and hair styles) are not items.
- variants:  a name whose qualifiers include a component name ("waving hand: medium skin tone",
             "man: red hair", "kiss: person, person, light skin tone, dark skin tone") is a variant of
             the name without them ("waving hand", "man", "kiss: person, person"; when that is not
             listed, the part before the colon: "kiss"), and is folded into it. Other qualifiers
             make their own items: "flag: Germany", "keycap: #", "woman: blond hair", "kiss: woman, man".
- id/group:  the code points as emoji-test.txt writes them, lower case, joined by "-" ("1f600",
             "263a-fe0f", "0023-fe0f-20e3", "1f1e9-1f1ea"): stable, unique, and the image's file name.
- image row: `<root>/images/<id>.png`, RGBA, 136x128 (Noto's bitmap size), the glyph centred.
             An emoji the font cannot draw (blank, its missing-glyph box, or several glyphs) has no
             image; `SOURCE.json` lists them.
- text rows: `<id>#0` the CLDR name ("grinning face with big eyes"); with `aliases=True` also
             `<id>#1`, `<id>#2`, ... from `emoji.EMOJI_DATA[char]`: its 'en' name and 'alias' list,
             normalised (colons stripped, "_" -> " ", lower case: ":sweat_smile:" -> "sweat smile")
             and dropped when they repeat the name or each other up to case, accents, apostrophes
             and ":_-,." (":upside_down_face:" repeats "upside-down face", ":kiss_woman_man:"
             repeats "kiss: woman, man"). All are captions of the same group.
- labels:    (group, group/subgroup), e.g. ("Smileys & Emotion", "Smileys & Emotion/face-smiling"):
             "share a label" relevance on them means "same group"; the subgroup is the stricter level.
Splits are per emoji, from a hash of (seed, id): all rows of an emoji share a split, and adding emoji
never moves existing ones.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import unicodedata
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ushash.core.io import atomic_write
from ushash.data.datasets import REPO_ROOT, SPLITS, check_fracs, fetched, hash_split, register, resolve_path
from ushash.data.rows import Row

if TYPE_CHECKING:
    from PIL import Image

FONT_PACKAGE = "fonts-noto-color-emoji"
DATA_PACKAGE = "unicode-data"
PACKAGES = (FONT_PACKAGE, DATA_PACKAGE)
LICENSES = {  # SPDX ids; the Debian copyright files are kept beside the data
    FONT_PACKAGE: ("OFL-1.1", "SIL-1.1"),
    DATA_PACKAGE: ("Unicode-DFS-2016", "Unicode, Inc. License Agreement - Data Files and Software"),
}
COPYRIGHTS = {
    FONT_PACKAGE: "2013-2017 Google Inc., Arjen Nienhuis",
    DATA_PACKAGE: "Unicode, Inc. (emoji-test.txt: 2022)",
}
FONT_IN_DEB = Path("usr/share/fonts/truetype/noto/NotoColorEmoji.ttf")
TEST_IN_DEB = Path("usr/share/unicode/emoji/emoji-test.txt")
DEFAULT_ROOT = REPO_ROOT / "data" / "emoji"
TEST_FILE = "emoji-test.txt"
IMAGES = "images"

FONT_SIZE = 109        # Noto Color Emoji's one bitmap strike: glyphs are 136x128 px at this size
CANVAS = (136, 128)    # every image is this size, the glyph centred on a transparent background
MAX_ADVANCE_EM = 1.8   # one Noto glyph advances 1.25 em; wider means the sequence was not one glyph
MAX_RENDER_FAILED = 0.05  # more emoji than this share failing to render: wrong font or no shaping
COMPONENT_GROUP = "Component"
STATUSES = ("component", "fully-qualified", "minimally-qualified", "unqualified")

_MANUAL = (
    "To fetch it by hand: `apt-get download {pkgs}` (on any Debian/Ubuntu; or download the .debs from "
    "https://packages.debian.org/stable/all/<package>/download), then call "
    "`ushash.data.datasets.emoji.fetch(ROOT, font_deb=FONT_DEB, unicode_deb=UNICODE_DEB)`; or unpack them "
    "yourself (`dpkg -x FILE TMP`, or `ar x FILE && tar xf data.tar.xz -C TMP`) and call "
    "`ushash.data.datasets.emoji.build(ROOT, font=TMP/{font}, emoji_test=TMP/{test})`."
)


class FetchError(RuntimeError):
    """The emoji data could not be fetched or rendered; the message says why and how to do it by hand."""


class RenderError(ValueError):
    """One emoji could not be drawn with the font (blank, the missing-glyph box, several glyphs)."""


def _manual() -> str:
    return _MANUAL.format(pkgs=" ".join(PACKAGES), font=FONT_IN_DEB, test=TEST_IN_DEB)


def _one_line(s: str) -> str:
    return " ".join(s.split())


# ------------------------------------------------------------------------------------------- parse
@dataclass(frozen=True)
class Entry:
    """One data line of emoji-test.txt."""

    code_points: tuple[str, ...]  # ("1F44B", "1F3FD")
    status: str                   # "fully-qualified", ...
    name: str                     # "waving hand: medium skin tone"
    group: str
    subgroup: str
    line: int

    @property
    def char(self) -> str:
        return "".join(chr(int(c, 16)) for c in self.code_points)


@dataclass(frozen=True)
class Emoji:
    """One item: a base emoji."""

    id: str        # "1f600"
    char: str      # "😀"
    name: str      # "grinning face"
    group: str     # "Smileys & Emotion"
    subgroup: str  # "face-smiling"
    variants: int = 0  # skin-tone / hair-style variants folded into it

    @property
    def labels(self) -> tuple[str, str]:
        return (self.group, f"{self.group}/{self.subgroup}")


_LINE = re.compile(r"^([0-9A-Fa-f]{4,6}(?: [0-9A-Fa-f]{4,6})*)\s*;\s*([a-z-]+)\s*#\s*\S+\s+E\d+\.\d+\s+(\S.*?)\s*$")


def parse_test_file(text: str, where: str = TEST_FILE) -> list[Entry]:
    """The data lines of an emoji-test.txt, in file order (CLDR order). Malformed lines raise ValueError."""
    group = subgroup = None
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            key, _, value = line[1:].partition(":")
            if key.strip() == "group":
                group, subgroup = value.strip(), None
            elif key.strip() == "subgroup":
                subgroup = value.strip()
            continue
        m = _LINE.match(line)
        if m is None:
            raise ValueError(f"{where} line {n}: expected 'CODE POINTS ; status # emoji E<version> name', "
                             f"got {_one_line(raw)[:120]!r}")
        cps, status, name = m.groups()
        if status not in STATUSES:
            raise ValueError(f"{where} line {n}: unknown status {status!r}; expected one of {STATUSES}")
        if group is None or subgroup is None:
            raise ValueError(f"{where} line {n}: emoji {name!r} comes before any '# group:' and '# subgroup:' line")
        out.append(Entry(tuple(c.upper() for c in cps.split()), status, name, group, subgroup, n))
    if not out:
        raise ValueError(f"{where}: no emoji lines; is it an emoji-test.txt?")
    return out


def read_test_file(path: str | os.PathLike) -> list[Entry]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise FileNotFoundError(f"{p}: cannot read ({e.strerror or e})") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not UTF-8 text ({e})") from e
    return parse_test_file(text, str(p))


def emoji_id(code_points: tuple[str, ...]) -> str:
    """"1f468-200d-1f9b0": the code points in lower-case hex, joined by "-"."""
    return "-".join(c.lower() for c in code_points)


def _qualifiers(name: str) -> tuple[str, list[str]]:
    """"kiss: woman, man, light skin tone" -> ("kiss", ["woman", "man", "light skin tone"])."""
    head, colon, rest = name.partition(":")
    return head, ([q.strip() for q in rest.split(",")] if colon else [])


def is_variant(name: str, components: set[str]) -> bool:
    """A skin-tone / hair-style variant: a qualifier after the colon is a component's name."""
    return any(q in components for q in _qualifiers(name)[1])


def base_name(name: str, components: set[str], names: set[str]) -> str:
    """The base emoji's name for a skin-tone / hair-style variant, else `name` itself (also for a
    variant whose base is not in `names`)."""
    if not is_variant(name, components):
        return name  # "grinning face", "flag: Germany", "keycap: #", "kiss: woman, man"
    head, quals = _qualifiers(name)
    keep = [q for q in quals if q not in components]
    for cand in ((f"{head}: {', '.join(keep)}" if keep else head), head):
        if cand in names:
            return cand
    return name


def base_items(entries: list[Entry]) -> tuple[list[Emoji], Counter]:
    """Items (base emoji, in file order) from parsed entries, plus counters of what was left out."""
    notes: Counter = Counter()
    components = {e.name for e in entries if e.group == COMPONENT_GROUP}
    full = []
    for e in entries:
        if e.group == COMPONENT_GROUP:
            notes["components_skipped"] += 1
        elif e.status != "fully-qualified":
            notes[f"{e.status.replace('-', '_')}_skipped"] += 1
        else:
            full.append(e)
    names = {e.name for e in full}
    seen: dict[str, Entry] = {}
    folded: Counter = Counter()
    bases = []
    for e in full:
        eid = emoji_id(e.code_points)
        if eid in seen:
            raise ValueError(f"emoji-test.txt lines {seen[eid].line} and {e.line}: code points {eid} listed twice")
        seen[eid] = e
        b = base_name(e.name, components, names)
        if b != e.name:
            folded[b] += 1
            continue
        if is_variant(e.name, components):
            notes["variants_without_base"] += 1  # kept as an item of its own
        bases.append(e)
    by_name: dict[str, Entry] = {}
    for e in bases:
        if e.name in by_name:
            raise ValueError(f"emoji-test.txt lines {by_name[e.name].line} and {e.line}: name {e.name!r} listed twice")
        by_name[e.name] = e
    notes["variants_folded"] = sum(folded.values())
    items = [Emoji(emoji_id(e.code_points), e.char, e.name, e.group, e.subgroup, folded[e.name]) for e in bases]
    return items, notes


# ----------------------------------------------------------------------------------------- captions
def normalise_alias(s: str) -> str:
    """":sweat_smile:" -> "sweat smile": colons stripped, underscores to spaces, lower case."""
    return " ".join(s.strip().strip(":").replace("_", " ").split()).lower()


def _same(s: str) -> str:
    """The comparison key of a caption: two captions that differ only in case, accents, apostrophes
    or the punctuation ":_-,." are the same caption ("kiss: woman, man" / "kiss woman man",
    "man\u2019s shoe" / "mans shoe", "pi\u00f1ata" / "pinata")."""
    s = "".join(c for c in unicodedata.normalize("NFKD", s) if not unicodedata.combining(c))
    s = re.sub(r"['\u2019]", "", s.lower())
    return " ".join(re.sub(r"[:_\-,.]", " ", s).split())


def alias_table() -> dict:
    """`emoji.EMOJI_DATA` from the PyPI package `emoji` (a dependency of ushash)."""
    try:
        import emoji as emoji_pkg  # the PyPI package (absolute import), not this module
    except ImportError as e:
        raise ImportError(f"the emoji dataset's alias captions need the `emoji` package (pip install emoji), "
                          f"or set aliases=false (data.aliases=false): {e}") from e
    return emoji_pkg.EMOJI_DATA


def emoji_package_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("emoji")
    except Exception:
        return None


def captions(item: Emoji, table: dict | None) -> list[str]:
    """The item's captions: its CLDR name, then (with a table) its distinct normalised aliases."""
    out = [item.name]
    if table is None:
        return out
    data = table.get(item.char) or table.get(item.char.replace("\ufe0f", ""))
    if not data:
        return out
    seen = {_same(item.name)}
    for raw in [data.get("en")] + list(data.get("alias") or []):
        if not raw:
            continue
        a = normalise_alias(raw)
        if a and _same(a) not in seen:
            seen.add(_same(a))
            out.append(a)
    return out


# ------------------------------------------------------------------------------------------- render
def check_shaping() -> None:
    """Raise RenderError unless Pillow has complex-text layout (libraqm): emoji sequences (flags,
    keycaps, ZWJ sequences, skin tones) are single glyphs only when shaped."""
    from PIL import features

    if not features.check("raqm"):
        raise RenderError("Pillow was built without libraqm, so it cannot shape emoji sequences (flags, "
                          "families, skin tones) into one glyph; install Pillow's PyPI wheel (it bundles "
                          "libraqm) or the libraqm library")


def open_font(path: str | os.PathLike, size: int = FONT_SIZE):
    """The font at `path`, laid out with libraqm (see `check_shaping`)."""
    from PIL import ImageFont

    check_shaping()
    try:
        return ImageFont.truetype(str(path), size, layout_engine=ImageFont.Layout.RAQM)
    except OSError as e:
        raise RenderError(f"{path}: cannot open as a font at size {size} ({e})") from e


def _draw(char: str, font):
    from PIL import Image, ImageDraw

    left, top, right, bottom = font.getbbox(char)
    x0, y0 = -min(left, 0) + 2, -min(top, 0) + 2
    im = Image.new("RGBA", (int(math.ceil(max(right, 1) + x0 + 2)), int(math.ceil(max(bottom, 1) + y0 + 2))),
                   (0, 0, 0, 0))
    ImageDraw.Draw(im).text((x0, y0), char, font=font, fill=(0, 0, 0, 255), embedded_color=True)
    return im


def render(char: str, font, canvas: tuple[int, int] = CANVAS, tofu=None):
    """`char` drawn with `font` (colour glyphs in colour), cropped to its pixels and centred on a
    transparent `canvas`-sized RGBA image (scaled down only if larger). `tofu` is `missing_glyph(font)`.
    Raises RenderError when the font draws nothing, its missing-glyph box, or more than one glyph."""
    from PIL import Image

    advance = font.getlength(char)
    if advance > MAX_ADVANCE_EM * font.size:
        raise RenderError(f"drawn {advance / font.size:.1f} em wide: several glyphs, not one")
    im = _draw(char, font)
    box = im.getchannel("A").getbbox()
    if box is None:
        raise RenderError("blank: the font has no glyph for it")
    glyph = im.crop(box)
    if tofu is not None and glyph.size == tofu.size and glyph.tobytes() == tofu.tobytes():
        raise RenderError("the font has no glyph for it (it draws its missing-glyph box)")
    if glyph.width > canvas[0] or glyph.height > canvas[1]:
        glyph.thumbnail(canvas, Image.Resampling.LANCZOS)
    out = Image.new("RGBA", canvas, (0, 0, 0, 0))
    out.paste(glyph, ((canvas[0] - glyph.width) // 2, (canvas[1] - glyph.height) // 2))
    return out


def missing_glyph(font):
    """What the font draws for a code point no font has (U+10FFFF), cropped; None when it draws nothing."""
    im = _draw("\U0010ffff", font)
    box = im.getchannel("A").getbbox()
    return None if box is None else im.crop(box)


def make_renderer(font_path: str | os.PathLike) -> Callable[[str], "Image.Image"]:
    """`draw(char) -> RGBA image` with the font at `font_path` (raises RenderError like `render`)."""
    font = open_font(font_path)
    tofu = missing_glyph(font)
    return lambda char: render(char, font, tofu=tofu)


def render_all(items: list[Emoji], font_path: str | os.PathLike, out_dir: str | os.PathLike,
               progress: bool = True) -> dict[str, str]:
    """Write `<out_dir>/<id>.png` for every item; returns {id: reason} for those that did not render."""
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    draw = make_renderer(font_path)
    failed: dict[str, str] = {}
    for item in tqdm(items, desc="render emoji", unit="emoji", disable=not progress):
        try:
            img = draw(item.char)
        except RenderError as e:
            failed[item.id] = f"{item.name}: {e}"
            continue
        img.save(out / f"{item.id}.png")
    return failed


# -------------------------------------------------------------------------------------------- fetch
def build(root: str | os.PathLike, font: str | os.PathLike, emoji_test: str | os.PathLike,
          source: dict | None = None, progress: bool = True) -> Path:
    """Make `<root>/images` from a font file and an emoji-test.txt: render every item, then write
    `<root>/emoji-test.txt`, `<root>/SOURCE.json` and rename the images folder into place last, in one
    step, so a present `images/` is always a complete one. Idempotent: returns at once when it exists."""
    root = Path(root)
    images = root / IMAGES
    if images.is_dir():
        return images
    font, emoji_test = Path(font), Path(emoji_test)
    for p, what in ((font, "font"), (emoji_test, "emoji-test.txt")):
        if not p.is_file():
            raise FetchError(f"{p}: no such {what} file. {_manual()}")
    try:
        entries = read_test_file(emoji_test)
        items, notes = base_items(entries)
    except (OSError, ValueError) as e:
        raise FetchError(f"cannot read the emoji list: {_one_line(str(e))}") from e
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        try:
            failed = render_all(items, font, tmp / IMAGES, progress=progress)
        except RenderError as e:
            raise FetchError(f"cannot render the emoji with {font}: {_one_line(str(e))}") from e
        if len(failed) > MAX_RENDER_FAILED * len(items):
            eg = next(iter(failed.items()))
            raise FetchError(f"{len(failed)} of {len(items)} emoji did not render with {font} (e.g. {eg[0]} "
                             f"{eg[1]}); is the font older than {emoji_test.name}, or not a colour emoji font?")
        from PIL import __version__ as pillow_version, features

        header = _header(emoji_test)
        meta = dict(source or {})
        meta.update({
            "emoji_test": {"file": TEST_FILE, **header},
            "render": {"font": font.name, "size": FONT_SIZE, "canvas": list(CANVAS), "pillow": pillow_version,
                       "raqm": features.version("raqm"), "items": len(items), "rendered": len(items) - len(failed),
                       "failed": failed},
            "items": {"base_emoji": len(items), **dict(sorted(notes.items()))},
            "built": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        })
        atomic_write(root / TEST_FILE, emoji_test.read_bytes())
        atomic_write(root / "SOURCE.json", json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
        try:
            os.rename(tmp / IMAGES, images)  # same filesystem (tmp is under root): atomic
        except OSError:
            if not images.is_dir():  # another process finishing first is fine; anything else is not
                raise
        return images
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _header(path: Path) -> dict:
    """Version and date from an emoji-test.txt's header comments."""
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                break
            key, _, value = line[1:].partition(":")
            if key.strip() in ("Version", "Date") and value.strip():
                out[key.strip().lower()] = value.strip()
    return out


def fetch(root: str | os.PathLike, font_deb: str | os.PathLike | None = None,
          unicode_deb: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Make `<root>/images` exist: download the two Debian packages (or use the given .deb files),
    unpack them, render every emoji (`build`). Idempotent: returns at once when `<root>/images` exists."""
    root = Path(root)
    images = root / IMAGES
    if images.is_dir():
        return images
    given = {FONT_PACKAGE: font_deb, DATA_PACKAGE: unicode_deb}
    need = ["dpkg", "dpkg-deb"] + ([] if all(given.values()) else ["apt-get"])
    missing = [t for t in need if shutil.which(t) is None]
    if missing:
        raise FetchError(f"cannot fetch {' and '.join(PACKAGES)} into {root}: {', '.join(missing)} not found. "
                         f"{_manual()}")
    try:
        check_shaping()  # before downloading anything
    except RenderError as e:
        raise FetchError(f"cannot render emoji here: {e}") from e
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=root))
    try:
        unpacked = tmp / "x"
        packages = []
        for pkg, deb in given.items():
            deb_path = _get_deb(pkg, deb, tmp)
            fields = _run(["dpkg-deb", "-f", str(deb_path), "Package", "Version"], cwd=tmp, what="read", pkg=pkg)
            meta = dict(line.split(": ", 1) for line in fields.splitlines() if ": " in line)
            if meta.get("Package") != pkg:
                raise FetchError(f"{deb_path} is package {meta.get('Package')!r}, expected {pkg!r}")
            _run(["dpkg", "-x", str(deb_path), str(unpacked)], cwd=tmp, what="unpack", pkg=pkg)
            copyright_file = unpacked / "usr/share/doc" / pkg / "copyright"
            if copyright_file.is_file():
                atomic_write(root / f"copyright.{pkg}", copyright_file.read_bytes())
            packages.append({
                "package": pkg,
                "version": meta.get("Version"),
                "license": LICENSES[pkg][0],
                "license_debian": LICENSES[pkg][1],
                "copyright": f"{COPYRIGHTS[pkg]} (see copyright.{pkg})",
                "origin": "Debian archive, via `apt-get download`" if deb is None else f"local file {deb_path.name}",
                "deb": deb_path.name,
            })
        for inner, pkg in ((FONT_IN_DEB, FONT_PACKAGE), (TEST_IN_DEB, DATA_PACKAGE)):
            if not (unpacked / inner).is_file():
                raise FetchError(f"the {pkg} package has no {inner}")
        source = {
            "packages": packages,
            "aliases": {"package": "emoji (PyPI)", "license": "BSD-3-Clause", "note": "read at load time"},
            "fetched": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        return build(root, unpacked / FONT_IN_DEB, unpacked / TEST_IN_DEB, source=source, progress=progress)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _get_deb(pkg: str, deb: str | os.PathLike | None, tmp: Path) -> Path:
    if deb is not None:
        p = Path(deb)
        if not p.is_file():
            raise FetchError(f"{p}: no such .deb file (for {pkg}). {_manual()}")
        return p
    d = tmp / f"download-{pkg}"
    d.mkdir()
    _run(["apt-get", "download", pkg], cwd=d, what="download", pkg=pkg,
         hint="if apt says it cannot locate the package, run `apt-get update` first. ")
    debs = sorted(d.glob("*.deb"))
    if len(debs) != 1:
        raise FetchError(f"apt-get download {pkg} left {len(debs)} .deb files. {_manual()}")
    return debs[0]


def _run(cmd: list[str], cwd: Path, what: str, pkg: str, hint: str = "") -> str:
    try:
        res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise FetchError(f"cannot {what} {pkg}: {' '.join(cmd)} failed to start ({e}). {_manual()}") from e
    if res.returncode != 0:
        tail = _one_line((res.stderr or res.stdout).strip()[-800:]) or "(no output)"
        raise FetchError(f"cannot {what} {pkg}: `{' '.join(cmd)}` exited {res.returncode}: {tail}. {hint}{_manual()}")
    return res.stdout


# --------------------------------------------------------------------------------------------- rows
def data_dir(root: str | os.PathLike | None, allow_fetch: bool) -> Path:
    root = DEFAULT_ROOT if root is None else resolve_path(root)
    fetched(root / IMAGES, root, allow_fetch, fetch, "emoji")
    return root


def split_of(emoji_id_: str, seed: int, val_frac: float, test_frac: float) -> str:
    return hash_split(emoji_id_, seed, val_frac, test_frac)


def load_items(root: str | os.PathLike) -> tuple[list[Emoji], Counter]:
    root = Path(root)
    test_file = root / TEST_FILE
    if not test_file.is_file():
        raise FileNotFoundError(f"{test_file} not found (a fetch leaves it beside {IMAGES}/); delete {root / IMAGES} "
                                f"and fetch again with ushash.data.datasets.emoji.fetch({str(root)!r})")
    return base_items(read_test_file(test_file))


def item_rows(item: Emoji, images: Path | None, table: dict | None) -> list[Row]:
    """The rows of one item: its image (when `<images>/<id>.png` exists) and its captions."""
    out = []
    if images is not None and (png := images / f"{item.id}.png").is_file():
        out.append(Row("image", item.id, item.id, str(png), item.labels))
    for j, text in enumerate(captions(item, table)):
        out.append(Row("text", f"{item.id}#{j}", item.id, text, item.labels))
    return out


def rows(root: str | os.PathLike, split: str, val_frac: float = 0.1, test_frac: float = 0.1,
         seed: int = 0, aliases: bool = True) -> list[Row]:
    """Rows of one split from a fetched `<root>` (emoji-test.txt + images/; no fetching)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    check_fracs(val_frac, test_frac)
    root = Path(root).absolute()  # absolute sources, whatever the cwd
    images = root / IMAGES
    if not images.is_dir():
        raise FileNotFoundError(f"{images} not found; fetch it with ushash.data.datasets.emoji.fetch({str(root)!r})")
    items, _ = load_items(root)
    table = alias_table() if aliases else None
    out: list[Row] = []
    for item in items:
        if split_of(item.id, seed, val_frac, test_frac) == split:
            out.extend(item_rows(item, images, table))
    return out


@register("emoji")
def load(split: str, *, root: str | None = None, val_frac: float = 0.1, test_frac: float = 0.1,
         seed: int = 0, fetch: bool = True, aliases: bool = True) -> list[Row]:
    """Recipe for `load_rows("emoji", split, ...)`: root None means <repo>/data/emoji."""
    d = data_dir(root, allow_fetch=fetch)
    return rows(d, split, val_frac=val_frac, test_frac=test_frac, seed=seed, aliases=aliases)


def summary(root: str | os.PathLike, val_frac: float = 0.1, test_frac: float = 0.1, seed: int = 0,
            aliases: bool = True) -> dict:
    """Counts: items and rows per split and modality, labels, and what the parse left out."""
    root = Path(root)
    items, notes = load_items(root)
    table = alias_table() if aliases else None
    keys = ("items", "image", "text", "alias_text")
    counts = {s: dict.fromkeys(keys, 0) for s in SPLITS}
    for item in items:
        c = counts[split_of(item.id, seed, val_frac, test_frac)]
        rs = item_rows(item, root / IMAGES, table)
        c["items"] += 1
        c["image"] += sum(r.modality == "image" for r in rs)
        c["text"] += sum(r.modality == "text" for r in rs)
        c["alias_text"] += sum(r.modality == "text" for r in rs) - 1
    total = {k: sum(c[k] for c in counts.values()) for k in keys}
    return {
        "splits": counts,
        "total": total,
        "groups": len({i.group for i in items}),
        "subgroups": len({i.labels[1] for i in items}),
        "per_group": dict(Counter(i.group for i in items)),
        "notes": dict(sorted(notes.items())),
        "emoji_package": emoji_package_version() if aliases else None,
    }


def main(argv: list[str] | None = None) -> None:
    """Fetch if needed and print `summary` as JSON:
    python -c 'from ushash.data.datasets import emoji; emoji.main()' [--root DIR] [--no-fetch] [--no-aliases]
    """
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=None, help=f"data folder (default {DEFAULT_ROOT})")
    ap.add_argument("--no-fetch", action="store_true")
    ap.add_argument("--no-aliases", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    d = data_dir(a.root, allow_fetch=not a.no_fetch)
    print(json.dumps(summary(d, seed=a.seed, aliases=not a.no_aliases), indent=2, ensure_ascii=False))
