"""A held-out real set, brought in through the manifest as a new user brings one: Openclipart's clip art
(Debian `openclipart-svg`, public domain), each drawing's title as its caption and its folder as its label.

    python scripts/openclipart.py                   # fetch the package into data/openclipart/, write its manifest
    python scripts/openclipart.py --deb FILE.deb    # from a .deb downloaded by hand (`apt-get download openclipart-svg`)
    python -m ushash.sweep -m experiment=sweep_openclipart64

No default, setting or option of the project was chosen on it: it is where the defaults chosen on Tux Paint and
emoji are tried on data they never saw (docs/baselines.md, "A held-out set through the manifest").

What it keeps (`rows`): a drawing's title is the first `<dc:title>` of its SVG outside a `<cc:Agent>` (those name
its creator and publisher). A drawing is kept when its title
- is there and has at least two words (one-word titles are mostly file-like names: "card", "gramastar"),
- is its own: no other drawing of the package has the same title, case and spacing aside (a shared title names a
  series or a collection, "Nicu Buculei", not what one drawing shows),
- does not name its author or collection: it holds none of "clipart by", "collection", "theme" (any case).
Titles are as their authors wrote them, in English, Italian, French and others: the text encoder reads English
best, and that is part of what a held-out set tests. The SVGs are rasterised by the loader like Tux Paint's.
"""

from __future__ import annotations

import argparse
import collections
import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ushash.core.io import atomic_write  # noqa: E402
from ushash.data.extract import relative_to_root  # noqa: E402

PACKAGE = "openclipart-svg"
SVG_IN_DEB = "usr/share/openclipart/svg"
TITLE = re.compile(r"<dc:title>([^<]*)</dc:title>")
AGENT = re.compile(r"<cc:Agent\b.*?</cc:Agent>", re.S)   # a creator's, publisher's or rights holder's name
NOT_A_SUBJECT = re.compile(r"clipart by|collection|theme", re.I)


def fetch(root: Path, deb: Path | None = None) -> Path:
    """Make `<root>/svg` exist: download the package with apt-get (or use `deb`) and unpack it; the folder appears
    in one rename, after `<root>/SOURCE.json` and `<root>/copyright`. Returns at once when it exists."""
    svg = root / "svg"
    if svg.is_dir():
        return svg
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=root))
    try:
        if deb is None:
            run(["apt-get", "download", PACKAGE], tmp)
            debs = sorted(tmp.glob("*.deb"))
            if len(debs) != 1:
                raise SystemExit(f"apt-get download {PACKAGE} left {len(debs)} .deb files in {tmp}")
            deb = debs[0]
        fields = dict(line.split(": ", 1) for line in
                      run(["dpkg-deb", "-f", str(deb), "Package", "Version"], tmp).splitlines() if ": " in line)
        if fields.get("Package") != PACKAGE:
            raise SystemExit(f"{deb} is package {fields.get('Package')!r}, expected {PACKAGE!r}")
        run(["dpkg-deb", "-x", str(deb), str(tmp / "x")], tmp)
        if not (tmp / "x" / SVG_IN_DEB).is_dir():
            raise SystemExit(f"{deb} has no {SVG_IN_DEB}/ folder")
        copyright_file = tmp / "x" / "usr/share/doc" / PACKAGE / "copyright"
        if copyright_file.is_file():
            atomic_write(root / "copyright", copyright_file.read_bytes())
        atomic_write(root / "SOURCE.json", json.dumps({
            "package": PACKAGE, "version": fields.get("Version"), "license": "public domain (Openclipart)",
            "origin": "Debian archive, via `apt-get download`", "deb": deb.name,
            "fetched": datetime.now(timezone.utc).isoformat(timespec="seconds")}, indent=2) + "\n")
        (tmp / "x" / SVG_IN_DEB).rename(svg)
        return svg
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(cmd: list[str], cwd: Path) -> str:
    if shutil.which(cmd[0]) is None:
        raise SystemExit(f"{cmd[0]} not found: on a Debian or Ubuntu machine run `apt-get download {PACKAGE}`, "
                         f"then pass the file: python scripts/openclipart.py --deb FILE.deb")
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {res.returncode}): {(res.stderr or res.stdout).strip()[-400:]}")
    return res.stdout


def title(svg: Path) -> str:
    """The drawing's title: its SVG's first <dc:title> outside an agent's, entities decoded, spacing collapsed
    ("" without one)."""
    m = TITLE.search(AGENT.sub("", svg.read_text(encoding="utf-8", errors="replace")))
    return " ".join(html.unescape(m.group(1)).split()) if m else ""


def rows(svg_root: Path, base: Path) -> tuple[list[dict], collections.Counter]:
    """The manifest's records (image path relative to `base`, the title as text, the folder as label) of the
    drawings kept, in path order, and how many were dropped for each rule (the module's docstring)."""
    found = [(p, title(p)) for p in sorted(svg_root.rglob("*.svg"))]
    count = collections.Counter(t.casefold() for _, t in found if t)
    kept, dropped = [], collections.Counter()
    for path, t in found:
        why = ("no title" if not t else "one word" if len(t.split()) < 2 else "shared title" if count[t.casefold()] > 1
               else "names its author or collection" if NOT_A_SUBJECT.search(t) else None)
        if why:
            dropped[why] += 1
            continue
        kept.append({"image": path.relative_to(base).as_posix(), "text": t,
                     "labels": [path.parent.relative_to(svg_root).as_posix()]})
    return kept, dropped


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT / "data" / "openclipart", help="where the data goes")
    ap.add_argument("--deb", type=Path, default=None,
                    help="a downloaded openclipart-svg .deb (else apt-get), when <root>/svg is not there yet")
    args = ap.parse_args(argv)
    svg = fetch(args.root, args.deb)
    kept, dropped = rows(svg, args.root)
    out = args.root / "manifest.jsonl"
    atomic_write(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
    labels = len({r["labels"][0] for r in kept})
    print(f"[openclipart] {len(kept)} drawings kept of {len(kept) + sum(dropped.values())} "
          f"({', '.join(f'{n} dropped: {why}' for why, n in dropped.most_common())}), {labels} folders as labels "
          f"-> {relative_to_root(out, ROOT)}", flush=True)   # no machine's folder in the log


if __name__ == "__main__":
    main()
