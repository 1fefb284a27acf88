"""Tux Paint recipe on a tiny fake stamps tree; `fetch` with a fake apt-get and a tiny real .deb."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from ushash.data import media
from ushash.data.datasets import REPO_ROOT, SPLITS, config_keys, load_rows, resolve_path, tuxpaint
from ushash.data.datasets.tuxpaint import FetchError, fetch, labels_for, rows, split_of, summary

SVG = '<svg xmlns="http://www.w3.org/2000/svg" width="30" height="60"><circle cx="15" cy="30" r="10"/></svg>'


def caption_file(path: Path, english: str, lang_first: bool = False):
    lines = ["fr.utf8=Une chose.", "de.utf8=Ein Ding."]
    body = lines + [english] if lang_first else [english] + lines
    path.write_text("\n".join(body) + "\n", encoding="utf-8")


def png(path: Path, alpha: bool = False, seed: int = 0):
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, size=(16, 24, 4 if alpha else 3), dtype=np.uint8)
    if alpha:
        arr[:4, :, 3] = 0
    Image.fromarray(arr, "RGBA" if alpha else "RGB").save(path)


def sound(path: Path, sr=22050, **kw):
    sf.write(path, (0.1 * np.sin(np.arange(sr // 2) / 5)).astype(np.float32), sr, **kw)


def make_tree(root: Path) -> Path:
    """stamps/ with the cases the recipe must handle; returns root."""
    s = root / "stamps"
    cats = s / "animals/mammals/cats"
    (cats / "cartoon").mkdir(parents=True)
    png(cats / "lion.png", alpha=True)
    caption_file(cats / "lion.txt", "A lion.")
    sound(cats / "lion.ogg", format="OGG", subtype="VORBIS")
    for extra in ("lion_desc.ogg", "lion_fr.ogg", "lion_desc_fr.ogg"):  # never the stamp's sound
        sound(cats / extra, format="OGG", subtype="VORBIS")
    (cats / "cartoon/tiger.svg").write_text(SVG)
    caption_file(cats / "cartoon/tiger.txt", "A cartoon tiger.", lang_first=True)
    birds = s / "animals/birds"
    birds.mkdir(parents=True)
    png(birds / "owl.png", seed=1)
    (birds / "owl.svg").write_text(SVG)  # both formats: one stamp, the PNG
    caption_file(birds / "owl.txt", "An owl.")
    sound(birds / "owl.wav", sr=16000)
    food = s / "food"
    food.mkdir()
    (food / "bread.png").write_bytes(b"\x89PNG\r\n\x1a\n corrupt")
    caption_file(food / "bread.txt", "Bread.")
    png(food / "apple.png", seed=2)  # no caption
    veh = s / "vehicles"
    veh.mkdir()
    png(veh / "truck.png", seed=3)
    png(veh / "truck_mirror.png", seed=4)  # Tux Paint's flipped variant, not a stamp
    caption_file(veh / "truck.txt", "A truck.")
    season = s / "seasonal"
    season.mkdir()
    caption_file(season / "gift.txt", "A gift.")  # caption and sound but no image: not a stamp
    sound(season / "gift.ogg", format="OGG", subtype="VORBIS")
    return root


STAMP_IDS = {
    "animals/mammals/cats/lion",
    "animals/mammals/cats/cartoon/tiger",
    "animals/birds/owl",
    "food/bread",
    "food/apple",
    "vehicles/truck",
}


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path / "tux")


def all_rows(root, **kw):
    return {s: rows(root, s, **kw) for s in SPLITS}


def test_rows_cover_every_stamp_with_its_modalities(tree):
    by_split = all_rows(tree)
    flat = [r for rs in by_split.values() for r in rs]
    images = {r.id: r for r in flat if r.modality == "image"}
    texts = {r.id: r for r in flat if r.modality == "text"}
    audio = {r.id: r for r in flat if r.modality == "audio"}
    assert set(images) == STAMP_IDS
    assert set(texts) == STAMP_IDS - {"food/apple"}
    assert set(audio) == {"animals/mammals/cats/lion", "animals/birds/owl"}
    assert images["animals/birds/owl"].source.endswith("owl.png")
    assert images["animals/mammals/cats/cartoon/tiger"].source.endswith("tiger.svg")
    assert Path(audio["animals/mammals/cats/lion"].source).name == "lion.ogg"
    assert Path(audio["animals/birds/owl"].source).name == "owl.wav"
    assert texts["animals/mammals/cats/lion"].source == "A lion."
    assert texts["animals/mammals/cats/cartoon/tiger"].source == "A cartoon tiger."  # lang lines skipped
    for r in flat:
        assert r.group == r.id
        if r.modality != "text":
            assert Path(r.source).is_absolute() and Path(r.source).is_file()


def test_labels_are_category_prefixes_without_style_folders(tree):
    flat = [r for rs in all_rows(tree).values() for r in rs]
    labels = {r.id: r.labels for r in flat}
    cats = ("animals", "animals/mammals", "animals/mammals/cats")
    assert labels["animals/mammals/cats/lion"] == cats
    assert labels["animals/mammals/cats/cartoon/tiger"] == cats
    assert labels["food/apple"] == ("food",)
    assert labels_for("x") == ()
    assert all(r.labels == labels[r.id] for r in flat)  # same labels on every modality of a stamp


def test_splits_are_disjoint_deterministic_and_per_stamp(tree):
    a = all_rows(tree, seed=3)
    b = all_rows(tree, seed=3)
    assert a == b
    where: dict[str, set] = {}
    for s, rs in a.items():
        for r in rs:
            where.setdefault(r.group, set()).add(s)
    assert all(len(v) == 1 for v in where.values())  # all rows of a stamp share a split
    assert set(where) == STAMP_IDS
    for s, rs in a.items():
        assert all(split_of(r.group, 3, 0.1, 0.1) == s for r in rs)


def test_split_is_stable_under_adding_stamps_and_has_the_right_fractions(tree):
    before = {r.id: s for s, rs in all_rows(tree, val_frac=0.3, test_frac=0.3).items() for r in rs}
    png(tree / "stamps/food/pear.png", seed=9)
    png(tree / "stamps/aaa.png", seed=10)
    after = {r.id: s for s, rs in all_rows(tree, val_frac=0.3, test_frac=0.3).items() for r in rs}
    assert {k: after[k] for k in before} == before
    assert {"food/pear", "aaa"} <= set(after)
    ids = [f"cat{i}/stamp{i}" for i in range(5000)]
    counts = {s: sum(split_of(i, 0, 0.1, 0.2) == s for i in ids) for s in SPLITS}
    assert abs(counts["val"] / 5000 - 0.1) < 0.02 and abs(counts["test"] / 5000 - 0.2) < 0.02
    other_seed = [split_of(i, 1, 0.1, 0.2) for i in ids]
    assert other_seed != [split_of(i, 0, 0.1, 0.2) for i in ids]


def test_summary(tree):
    s = summary(tree)
    assert s["total"] == {"stamps": 6, "image": 6, "text": 5, "audio": 2}
    assert sum(c["stamps"] for c in s["splits"].values()) == 6
    assert s["notes"]["mirror_variants_skipped"] == 1
    assert s["notes"]["png_and_svg"] == 1
    assert s["notes"]["no_caption"] == 1
    assert s["top_level_categories"] == 3


def test_decoding_the_rows(tree):
    """Every row decodes except the corrupt PNG, which raises MediaError naming it."""
    failed = []
    for rs in all_rows(tree).values():
        for r in rs:
            if r.modality == "image" and r.source.endswith(".svg"):
                pytest.importorskip("cairosvg")
            try:
                x = media.load(r.modality, r.source, sample_rate=16000, seconds=1.0)
            except media.MediaError as e:
                failed.append((r.id, str(e)))
                continue
            if r.modality == "audio":
                assert x.shape == (16000,)
            if r.modality == "image":
                assert x.mode == "RGB"
    assert [f[0] for f in failed] == ["food/bread"]
    assert "bread.png" in failed[0][1]


def test_load_rows_registry(tree):
    train = load_rows("tuxpaint", "train", root=str(tree), fetch=False, val_frac=0.0, test_frac=0.0)
    assert {r.id for r in train if r.modality == "image"} == STAMP_IDS
    with pytest.raises(ValueError, match=r"split 'val' is empty.*train: 13 rows"):
        load_rows("tuxpaint", "val", root=str(tree), fetch=False, val_frac=0.0, test_frac=0.0)
    with pytest.raises(TypeError, match="unknown config keys.*'roots'"):
        load_rows("tuxpaint", "train", roots=str(tree))
    with pytest.raises(ValueError, match="unknown split"):
        load_rows("tuxpaint", "training", root=str(tree), fetch=False)
    with pytest.raises(ValueError, match="must each be in"):
        load_rows("tuxpaint", "train", root=str(tree), fetch=False, val_frac=0.6, test_frac=0.5)
    with pytest.raises(FileNotFoundError, match="fetch=False"):
        load_rows("tuxpaint", "train", root=str(tree / "nowhere"), fetch=False)


def test_config_file_matches_the_recipe(tree):
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load((REPO_ROOT / "configs/data/tuxpaint.yaml").read_text())
    assert cfg["name"] == "tuxpaint" and cfg["root"] is None
    assert set(cfg) - {"name"} == set(config_keys("tuxpaint"))
    cfg.update(root=str(tree), fetch=False)
    assert load_rows(split="train", **cfg)


def test_default_root_does_not_depend_on_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert tuxpaint.DEFAULT_ROOT == REPO_ROOT / "data" / "tuxpaint"
    assert (REPO_ROOT / "pyproject.toml").is_file()
    assert resolve_path("data/x") == REPO_ROOT / "data" / "x"
    assert resolve_path(tmp_path) == tmp_path


# -------------------------------------------------------------------------------------------- fetch
def build_deb(tmp: Path, version="2099.01.01-1") -> Path:
    """A tiny real .deb named like the package, with one stamp and a copyright file."""
    pkg = tmp / "pkg"
    stamps = pkg / "usr/share/tuxpaint/stamps/animals"
    stamps.mkdir(parents=True)
    png(stamps / "frog.png")
    caption_file(stamps / "frog.txt", "A frog.")
    doc = pkg / "usr/share/doc" / tuxpaint.PACKAGE
    doc.mkdir(parents=True)
    (doc / "copyright").write_text("License: GPL-2\n")
    (pkg / "DEBIAN").mkdir()
    (pkg / "DEBIAN/control").write_text(
        f"Package: {tuxpaint.PACKAGE}\nVersion: {version}\nArchitecture: all\n"
        "Maintainer: Test <t@example.org>\nDescription: test stamps\n"
    )
    deb = tmp / f"{tuxpaint.PACKAGE}_{version}_all.deb"
    subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(pkg), str(deb)], check=True,
                   capture_output=True)
    return deb


def fake_apt_get(bindir: Path, script: str, monkeypatch):
    bindir.mkdir(exist_ok=True)
    exe = bindir / "apt-get"
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")


needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-deb") is None or shutil.which("dpkg") is None,
                                reason="needs dpkg and dpkg-deb")


@needs_dpkg
def test_fetch_with_fake_apt_get(tmp_path, monkeypatch):
    deb = build_deb(tmp_path)
    fake_apt_get(tmp_path / "bin", f'[ "$1" = download ] && cp "{deb}" . || exit 1\n', monkeypatch)
    root = tmp_path / "data"
    stamps = fetch(root)
    assert stamps == root / "stamps" and (stamps / "animals/frog.png").is_file()
    src = json.loads((root / "SOURCE.json").read_text())
    assert src["package"] == tuxpaint.PACKAGE and src["version"] == "2099.01.01-1"
    assert src["license"] == "GPL-2.0-or-later"
    assert (root / "copyright").read_text().startswith("License: GPL-2")
    assert sorted(p.name for p in root.iterdir()) == ["SOURCE.json", "copyright", "stamps"]  # tmp cleaned
    # Idempotent: a second call neither downloads nor touches anything.
    (root / "stamps/marker").write_text("")
    fake_apt_get(tmp_path / "bin2", "exit 1\n", monkeypatch)
    assert fetch(root) == stamps and (stamps / "marker").exists()
    # and the registered recipe fetches on demand
    fake_apt_get(tmp_path / "bin3", f'cp "{deb}" .\n', monkeypatch)
    rows_ = load_rows("tuxpaint", "train", root=str(tmp_path / "other"), val_frac=0, test_frac=0)
    texts = [(r.id, r.source) for r in rows_ if r.modality == "text"]
    assert texts == [("animals/frog", "A frog.")]


@needs_dpkg
def test_fetch_from_a_local_deb(tmp_path, monkeypatch):
    deb = build_deb(tmp_path)
    fake_apt_get(tmp_path / "bin", "exit 1\n", monkeypatch)  # apt-get is not used with deb=
    assert (fetch(tmp_path / "d", deb=deb) / "animals/frog.txt").is_file()
    assert "local file" in json.loads((tmp_path / "d/SOURCE.json").read_text())["origin"]


def test_fetch_without_tools_says_how_to_fetch_by_hand(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(FetchError, match=r"apt-get.*not found.*apt-get download tuxpaint-stamps-default"):
        fetch(tmp_path / "data")
    assert not (tmp_path / "data/stamps").exists()


@needs_dpkg
def test_fetch_when_apt_get_fails(tmp_path, monkeypatch):
    fake_apt_get(tmp_path / "bin", 'echo "E: Unable to locate package $2" >&2; exit 100\n', monkeypatch)
    root = tmp_path / "data"
    with pytest.raises(FetchError, match=r"exited 100: E: Unable to locate package(.|\n)*apt-get update"):
        fetch(root)
    assert not (root / "stamps").exists() and list(root.iterdir()) == []  # nothing half-made left


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs apt-get")
def test_fetch_real_package(tmp_path):
    """Downloads the real package (~161 MB) from the Debian mirror."""
    stamps = fetch(tmp_path)
    src = json.loads((tmp_path / "SOURCE.json").read_text())
    assert src["package"] == "tuxpaint-stamps-default" and src["version"]
    s = summary(tmp_path)
    assert s["total"]["stamps"] > 900 and s["total"]["audio"] > 100
    assert s["top_level_categories"] >= 10
    assert (stamps / "animals").is_dir()
