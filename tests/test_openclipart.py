"""scripts/openclipart.py: which drawings the held-out set keeps, and that its manifest reads as a manifest."""

import importlib.util
import json

from ushash.config import ROOT
from ushash.data.datasets.manifest import rows as manifest_rows

SVG = ('<svg xmlns="http://www.w3.org/2000/svg" xmlns:dc="http://purl.org/dc/elements/1.1/"><metadata>{meta}'
       '</metadata><rect width="4" height="4" fill="#c00"/></svg>')


def _script():
    spec = importlib.util.spec_from_file_location("openclipart", ROOT / "scripts" / "openclipart.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _drawing(root, rel, *titles):
    """An SVG whose metadata holds these titles (one starting with "<" is written as it is)."""
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = "".join(t if t.startswith("<") else f"<dc:title>{t}</dc:title>" for t in titles)
    path.write_text(SVG.format(meta=meta), encoding="utf-8")


def test_the_held_out_set_keeps_drawings_whose_title_is_their_own(tmp_path):
    oc = _script()
    svg = tmp_path / "svg"
    _drawing(svg, "animals/cats/gatto.svg", "  Gatto\n Nero ", "Darek Adamkiewicz")   # the first title is the work's
    _drawing(svg, "food/lemon.svg", "Lemon &amp; lime")
    _drawing(svg, "office/card.svg", "card")                                         # one word
    _drawing(svg, "shapes/a.svg", "Star series")                                    # shared, case aside
    _drawing(svg, "shapes/b.svg", "star  SERIES")
    _drawing(svg, "shapes/arrow.svg", "Clipart by Nicu Buculei - arrow08_4")        # its author
    _drawing(svg, "icons/set.svg", "Part of the Flat Icon Collection")              # its collection
    _drawing(svg, "unsorted/none.svg")                                              # no title
    _drawing(svg, "tools/saw.svg", "<cc:Agent><dc:title>Ann Author</dc:title></cc:Agent>", "Hand saw")   # not
    # the agent's title, the work's
    kept, dropped = oc.rows(svg, tmp_path)
    assert kept == [{"image": "svg/animals/cats/gatto.svg", "text": "Gatto Nero", "labels": ["animals/cats"]},
                    {"image": "svg/food/lemon.svg", "text": "Lemon & lime", "labels": ["food"]},
                    {"image": "svg/tools/saw.svg", "text": "Hand saw", "labels": ["tools"]}]
    assert dropped == {"one word": 1, "shared title": 2, "names its author or collection": 2, "no title": 1}


def test_its_manifest_is_read_by_the_manifest_recipe(tmp_path, capsys):
    """main() on a fetched folder (fetch returns at once when <root>/svg exists): the JSONL it writes loads as
    data=manifest does, one item per drawing (its image and its title), its folder as its label."""
    oc = _script()
    svg = tmp_path / "svg"
    for i in range(12):
        _drawing(svg, f"animals/a{i}.svg" if i % 2 else f"food/f{i}.svg", f"drawing number {i}")
    oc.main(["--root", str(tmp_path)])
    assert "12 drawings kept of 12" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "manifest.jsonl").read_text().splitlines()]
    assert len(records) == 12
    got = [r for split in ("train", "val", "test") for r in manifest_rows(tmp_path / "manifest.jsonl", split)]
    images = {r.source: r for r in got if r.modality == "image"}
    texts = {r.group: r for r in got if r.modality == "text"}
    assert len(images) == len(texts) == 12
    cat = images[str(svg / "animals/a1.svg")]
    assert cat.labels == ("animals",) and texts[cat.group].source == "drawing number 1"
