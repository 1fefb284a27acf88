"""Emoji recipe on a tiny emoji-test.txt in the real format; rendering with a small real TTF (DejaVu
Sans); `fetch` with a fake apt-get and tiny real .debs. The real fetch + render is the slow test."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from ushash.data import media
from ushash.data.datasets import REPO_ROOT, SPLITS, config_keys, load_rows, resolve_path
from ushash.data.datasets import emoji as E
from ushash.data.datasets.emoji import FetchError, RenderError

PAD = 55  # emoji-test.txt pads the code point column to this width


def line(cps: str, status: str, char: str, version: str, name: str) -> str:
    return f"{cps:<{PAD}}; {status:<19} # {char} E{version} {name}"


TEST_TXT = "\n".join([
    "# emoji-test.txt",
    "# Date: 2022-08-12, 20:24:39 GMT",
    "# © 2022 Unicode®, Inc.",
    "#",
    "# Version: 15.0",
    "#",
    "# Format: code points; status # emoji name",
    "",
    "",
    "# group: Smileys & Emotion",
    "",
    "# subgroup: face-smiling",
    line("1F600", "fully-qualified", "😀", "1.0", "grinning face"),
    line("1F603", "fully-qualified", "😃", "0.6", "grinning face with big eyes"),
    "",
    "# subgroup: face-affection",
    line("263A FE0F", "fully-qualified", "☺️", "0.6", "smiling face"),
    line("263A", "unqualified", "☺", "0.6", "smiling face"),
    "",
    "# Smileys & Emotion subtotal:\t\t3",
    "# Smileys & Emotion subtotal:\t\t3\tw/o modifiers",
    "",
    "# group: People & Body",
    "",
    "# subgroup: hand-fingers-open",
    line("1F44B", "fully-qualified", "👋", "0.6", "waving hand"),
    line("1F44B 1F3FD", "fully-qualified", "👋🏽", "1.0", "waving hand: medium skin tone"),
    line("1F44B 1F3FF", "fully-qualified", "👋🏿", "1.0", "waving hand: dark skin tone"),
    "",
    "# subgroup: person",
    line("1F468", "fully-qualified", "👨", "0.6", "man"),
    line("1F468 200D 1F9B0", "fully-qualified", "👨‍🦰", "11.0", "man: red hair"),
    line("1F471 200D 2640 FE0F", "fully-qualified", "👱‍♀️", "4.0", "woman: blond hair"),
    line("1F471 200D 2640", "minimally-qualified", "👱‍♀", "4.0", "woman: blond hair"),
    "",
    "# subgroup: family",
    line("1F48F", "fully-qualified", "💏", "0.6", "kiss"),
    line("1F9D1 1F3FB 200D 2764 FE0F 200D 1F48B 200D 1F9D1 1F3FC", "fully-qualified", "🧑🏻‍❤️‍💋‍🧑🏼", "13.1",
         "kiss: person, person, light skin tone, medium-light skin tone"),
    line("1F469 200D 2764 FE0F 200D 1F48B 200D 1F468", "fully-qualified", "👩‍❤️‍💋‍👨", "2.0", "kiss: woman, man"),
    "",
    "# group: Component",
    "",
    "# subgroup: skin-tone",
    line("1F3FB", "component", "🏻", "1.0", "light skin tone"),
    line("1F3FC", "component", "🏼", "1.0", "medium-light skin tone"),
    line("1F3FD", "component", "🏽", "1.0", "medium skin tone"),
    line("1F3FF", "component", "🏿", "1.0", "dark skin tone"),
    "",
    "# subgroup: hair-style",
    line("1F9B0", "component", "🦰", "11.0", "red hair"),
    "",
    "# group: Symbols",
    "",
    "# subgroup: keycap",
    line("0023 FE0F 20E3", "fully-qualified", "#️⃣", "0.6", "keycap: #"),
    line("0023 20E3", "unqualified", "#⃣", "0.6", "keycap: #"),
    "",
    "# group: Flags",
    "",
    "# subgroup: country-flag",
    line("1F1E9 1F1EA", "fully-qualified", "🇩🇪", "2.0", "flag: Germany"),
    "",
    "#EOF",
]) + "\n"

ITEMS = {  # id -> (name, group, subgroup, variants folded into it)
    "1f600": ("grinning face", "Smileys & Emotion", "face-smiling", 0),
    "1f603": ("grinning face with big eyes", "Smileys & Emotion", "face-smiling", 0),
    "263a-fe0f": ("smiling face", "Smileys & Emotion", "face-affection", 0),
    "1f44b": ("waving hand", "People & Body", "hand-fingers-open", 2),
    "1f468": ("man", "People & Body", "person", 1),
    "1f471-200d-2640-fe0f": ("woman: blond hair", "People & Body", "person", 0),
    "1f48f": ("kiss", "People & Body", "family", 1),
    "1f469-200d-2764-fe0f-200d-1f48b-200d-1f468": ("kiss: woman, man", "People & Body", "family", 0),
    "0023-fe0f-20e3": ("keycap: #", "Symbols", "keycap", 0),
    "1f1e9-1f1ea": ("flag: Germany", "Flags", "country-flag", 0),
}

# A stand-in for emoji.EMOJI_DATA (the real one is tested below): 'en' names and alias lists.
ALIASES = {
    "😀": {"en": ":grinning_face:", "alias": [":grinning:"]},
    "😃": {"en": ":grinning_face_with_big_eyes:", "alias": [":smiley:", ":SMILEY:"]},
    "☺": {"en": ":smiling_face:", "alias": [":relaxed:"]},  # keyed without FE0F
    "👋": {"en": ":waving_hand:", "alias": [":wave:"]},
    "💏": {"en": ":kiss:", "alias": [":couplekiss:"]},
    "👩‍❤️‍💋‍👨": {"en": ":kiss_woman_man:", "alias": []},
    "#️⃣": {"en": ":keycap_#:", "alias": [":hash:"]},
    "🇩🇪": {"en": ":Germany:", "alias": [":flag_for_Germany:", ":de:", ":germany:"]},
}


def write_root(root: Path, text: str = TEST_TXT, images: bool = True) -> Path:
    """A fetched-looking root: emoji-test.txt and one small PNG per item (no font needed)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / E.TEST_FILE).write_text(text, encoding="utf-8")
    (root / E.IMAGES).mkdir(exist_ok=True)
    if images:
        items, _ = E.base_items(E.parse_test_file(text))
        for k, item in enumerate(items):
            fake_image(item.char, seed=k).save(root / E.IMAGES / f"{item.id}.png")
    return root


def fake_image(char: str, seed: int = 0) -> Image.Image:
    """An RGBA 136x128 image, a coloured square on transparency, that depends on `char`."""
    h = sum(map(ord, char)) + seed
    im = Image.new("RGBA", E.CANVAS, (0, 0, 0, 0))
    im.paste((h % 256, (h * 7) % 256, (h * 13) % 256, 255), (30, 30, 100, 100))
    return im


@pytest.fixture
def root(tmp_path):
    return write_root(tmp_path / "emoji")


@pytest.fixture
def aliases(monkeypatch):
    monkeypatch.setattr(E, "alias_table", lambda: ALIASES)
    return ALIASES


def all_rows(root, **kw):
    return {s: E.rows(root, s, **kw) for s in SPLITS}


def dejavu() -> str:
    """A small real TTF: matplotlib's DejaVu Sans (a dependency), else fontconfig's."""
    try:
        import matplotlib
        p = Path(matplotlib.get_data_path()) / "fonts/ttf/DejaVuSans.ttf"
        if p.is_file():
            return str(p)
    except ImportError:
        pass
    if shutil.which("fc-list"):
        out = subprocess.run(["fc-list", ":family=DejaVu Sans:style=Book", "file"], capture_output=True, text=True)
        for f in out.stdout.split():
            if f.rstrip(":").endswith(".ttf"):
                return f.rstrip(":")
    pytest.skip("no DejaVu Sans TTF (matplotlib's or fontconfig's) to render with")


def needs_raqm():
    from PIL import features
    if not features.check("raqm"):
        pytest.skip("Pillow has no libraqm (complex text layout)")


# -------------------------------------------------------------------------------------------- parse
def test_parse_reads_every_data_line_with_its_group():
    entries = E.parse_test_file(TEST_TXT)
    assert len(entries) == 22  # subtotal lines, headers and #EOF are comments
    first = entries[0]
    assert first.code_points == ("1F600",) and first.status == "fully-qualified"
    assert (first.name, first.group, first.subgroup, first.char) == ("grinning face", "Smileys & Emotion",
                                                                     "face-smiling", "😀")
    assert TEST_TXT.splitlines()[first.line - 1].startswith("1F600")
    kiss = next(e for e in entries if e.name.startswith("kiss: person"))
    assert kiss.code_points[:2] == ("1F9D1", "1F3FB") and kiss.subgroup == "family"
    assert [e.group for e in entries if e.status == "component"] == ["Component"] * 5
    assert entries[-1].name == "flag: Germany" and entries[-1].char == "\U0001F1E9\U0001F1EA"


def test_items_are_base_emoji_fully_qualified_without_components():
    items, notes = E.base_items(E.parse_test_file(TEST_TXT))
    got = {i.id: (i.name, i.group, i.subgroup, i.variants) for i in items}
    assert got == ITEMS
    assert [i.id for i in items] == list(ITEMS)  # file (CLDR) order
    assert notes == {"components_skipped": 5, "unqualified_skipped": 2, "minimally_qualified_skipped": 1,
                     "variants_folded": 4}
    assert len({i.id for i in items}) == len(items)
    flag = next(i for i in items if i.name == "flag: Germany")
    assert flag.labels == ("Flags", "Flags/country-flag")
    assert items[0].labels == ("Smileys & Emotion", "Smileys & Emotion/face-smiling")


def test_variant_rules():
    comps = {"light skin tone", "medium skin tone", "dark skin tone", "red hair", "bald"}
    names = {"waving hand", "man", "kiss", "kiss: woman, man", "woman: blond hair", "flag: Germany"}
    assert E.base_name("waving hand: dark skin tone", comps, names) == "waving hand"
    assert E.base_name("man: red hair", comps, names) == "man"
    assert E.base_name("man: bald, dark skin tone", comps, names) == "man"
    assert E.base_name("kiss: woman, man, light skin tone, dark skin tone", comps, names) == "kiss: woman, man"
    assert E.base_name("kiss: person, person, light skin tone, dark skin tone", comps, names) == "kiss"
    assert E.base_name("woman: blond hair", comps, names) == "woman: blond hair"  # not a component
    assert E.base_name("flag: Germany", comps, names) == "flag: Germany"
    assert E.base_name("keycap: #", comps, names) == "keycap: #"
    # a variant whose base is not listed stays an item of its own, and is counted
    text = TEST_TXT.replace(line("1F44B", "fully-qualified", "👋", "0.6", "waving hand") + "\n", "")
    items, notes = E.base_items(E.parse_test_file(text))
    assert {i.name for i in items if i.name.startswith("waving")} == {"waving hand: medium skin tone",
                                                                       "waving hand: dark skin tone"}
    assert notes["variants_without_base"] == 2


def test_emoji_ids_are_code_point_slugs():
    assert E.emoji_id(("1F600",)) == "1f600"
    assert E.emoji_id(("0023", "FE0F", "20E3")) == "0023-fe0f-20e3"


def test_parse_errors_are_one_clear_line():
    bad_line = TEST_TXT.replace("1F603                ", "1F603 ZZZZ           ", 1)
    with pytest.raises(ValueError, match=r"^emoji-test.txt line 14: expected 'CODE POINTS ; status") as e:
        E.parse_test_file(bad_line)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"line 13: unknown status 'fully-qualifed'"):
        E.parse_test_file(TEST_TXT.replace("fully-qualified", "fully-qualifed", 1))
    with pytest.raises(ValueError, match=r"line 1: emoji 'grinning face' comes before any '# group:'"):
        E.parse_test_file(line("1F600", "fully-qualified", "😀", "1.0", "grinning face") + "\n")
    with pytest.raises(ValueError, match="no emoji lines"):
        E.parse_test_file("# just a comment\n")
    dup = TEST_TXT.replace(line("1F603", "fully-qualified", "😃", "0.6", "grinning face with big eyes"),
                           line("1F600", "fully-qualified", "😀", "1.0", "grinning face again"))
    with pytest.raises(ValueError, match=r"lines 13 and 14: code points 1f600 listed twice"):
        E.base_items(E.parse_test_file(dup))


# ------------------------------------------------------------------------------------------ captions
def test_alias_captions_are_normalised_and_deduped_against_the_name():
    items = {i.id: i for i in E.base_items(E.parse_test_file(TEST_TXT))[0]}
    cap = {k: E.captions(i, ALIASES) for k, i in items.items()}
    assert cap["1f600"] == ["grinning face", "grinning"]  # 'en' repeats the name: dropped
    assert cap["1f603"] == ["grinning face with big eyes", "smiley"]  # ":SMILEY:" repeats "smiley"
    assert cap["263a-fe0f"] == ["smiling face", "relaxed"]  # found without FE0F
    assert cap["1f469-200d-2764-fe0f-200d-1f48b-200d-1f468"] == ["kiss: woman, man"]  # "kiss woman man"
    assert cap["0023-fe0f-20e3"] == ["keycap: #", "hash"]
    assert cap["1f1e9-1f1ea"] == ["flag: Germany", "germany", "flag for germany", "de"]
    assert cap["1f468"] == ["man"]  # no entry in the table
    assert E.captions(items["1f600"], None) == ["grinning face"]
    assert E.normalise_alias(":Sweat_Smile:") == "sweat smile"


def test_captions_from_the_real_emoji_package():
    pytest.importorskip("emoji")
    table = E.alias_table()
    items = {i.id: i for i in E.base_items(E.parse_test_file(TEST_TXT))[0]}
    assert E.captions(items["1f600"], table) == ["grinning face", "grinning"]
    assert E.captions(items["1f603"], table) == ["grinning face with big eyes", "smiley"]
    flag = E.captions(items["1f1e9-1f1ea"], table)
    assert flag[0] == "flag: Germany" and "germany" in flag
    for caps in map(lambda i: E.captions(i, table), items.values()):
        assert len({E._same(c) for c in caps}) == len(caps)
        assert all(c == c.lower() and ":" not in c and "_" not in c for c in caps[1:])


# ---------------------------------------------------------------------------------------------- rows
def test_rows_cover_every_item_with_an_image_and_its_captions(root, aliases):
    flat = [r for rs in all_rows(root).values() for r in rs]
    images = {r.id: r for r in flat if r.modality == "image"}
    texts = {r.id: r for r in flat if r.modality == "text"}
    assert set(images) == set(ITEMS)
    assert {r.modality for r in flat} == {"image", "text"}  # no audio
    assert texts["1f600#0"].source == "grinning face" and texts["1f600#1"].source == "grinning"
    assert [texts[f"1f1e9-1f1ea#{j}"].source for j in range(4)] == ["flag: Germany", "germany",
                                                                     "flag for germany", "de"]
    assert "1f468#1" not in texts
    for r in flat:
        name, group, sub, _ = ITEMS[r.group]
        assert r.labels == (group, f"{group}/{sub}")
        if r.modality == "image":
            assert r.id == r.group and Path(r.source).is_absolute() and Path(r.source).name == f"{r.id}.png"
        else:
            assert r.id.startswith(r.group + "#")
    assert len(texts) == sum(len(E.captions(i, ALIASES)) for i in E.load_items(root)[0])
    for s, rs in all_rows(root).items():
        keys = [(r.modality, r.id) for r in rs]
        assert len(keys) == len(set(keys))


def test_aliases_off_gives_one_caption_per_item(root, aliases):
    texts = [r for rs in all_rows(root, aliases=False).values() for r in rs if r.modality == "text"]
    assert sorted(r.id for r in texts) == sorted(f"{k}#0" for k in ITEMS)
    assert {r.group: r.source for r in texts} == {k: v[0] for k, v in ITEMS.items()}


def test_an_item_without_an_image_keeps_its_captions(root, aliases):
    (root / "images/1f600.png").unlink()
    flat = [r for rs in all_rows(root).values() for r in rs]
    assert "1f600" not in {r.id for r in flat if r.modality == "image"}
    assert {"1f600#0", "1f600#1"} <= {r.id for r in flat if r.modality == "text"}
    assert E.summary(root)["total"]["image"] == len(ITEMS) - 1


def test_decoding_the_rows(root, aliases):
    for r in [r for rs in all_rows(root).values() for r in rs]:
        x = media.load(r.modality, r.source)
        if r.modality == "image":
            assert x.mode == "RGB" and x.size == E.CANVAS
            assert x.getpixel((0, 0)) == (255, 255, 255)  # transparency composited on white
        else:
            assert x == r.source


def test_splits_are_disjoint_deterministic_and_per_item(root, aliases):
    a, b = all_rows(root, seed=3), all_rows(root, seed=3)
    assert a == b
    where: dict[str, set] = {}
    for s, rs in a.items():
        for r in rs:
            where.setdefault(r.group, set()).add(s)
    assert set(where) == set(ITEMS) and all(len(v) == 1 for v in where.values())
    for s, rs in a.items():
        assert all(E.split_of(r.group, 3, 0.1, 0.1) == s for r in rs)


def test_adding_emoji_never_moves_existing_ones(tmp_path, aliases):
    small = write_root(tmp_path / "a")
    before = {r.id: s for s, rs in all_rows(small, val_frac=0.3, test_frac=0.3).items() for r in rs}
    extra = "\n".join([
        "# group: Animals & Nature", "# subgroup: animal-mammal",
        line("1F435", "fully-qualified", "🐵", "0.6", "monkey face"),
        line("1F412", "fully-qualified", "🐒", "0.6", "monkey"),
    ]) + "\n"
    more = TEST_TXT.replace("# group: Smileys & Emotion", extra + "\n# group: Smileys & Emotion")
    big = write_root(tmp_path / "b", more)
    after = {r.id: s for s, rs in all_rows(big, val_frac=0.3, test_frac=0.3).items() for r in rs}
    assert {k: after[k] for k in before} == before
    assert {"1f435", "1f412", "1f435#0"} <= set(after)
    ids = [f"{0x1f000 + i:x}" for i in range(5000)]
    counts = {s: sum(E.split_of(i, 0, 0.1, 0.1) == s for i in ids) for s in SPLITS}
    assert abs(counts["val"] / 5000 - 0.1) < 0.02 and abs(counts["test"] / 5000 - 0.1) < 0.02


def test_summary(root, aliases):
    s = E.summary(root)
    assert s["total"] == {"items": 10, "image": 10, "text": 10 + 9, "alias_text": 9}
    assert sum(c["items"] for c in s["splits"].values()) == 10
    assert s["groups"] == 4 and s["subgroups"] == 7
    assert s["per_group"]["People & Body"] == 5
    assert s["notes"]["variants_folded"] == 4


def test_load_rows_registry(root, aliases):
    train = load_rows("emoji", "train", root=str(root), fetch=False, val_frac=0.0, test_frac=0.0)
    assert {r.id for r in train if r.modality == "image"} == set(ITEMS)
    with pytest.raises(ValueError, match=r"split 'val' is empty.*train: 29 rows"):
        load_rows("emoji", "val", root=str(root), fetch=False, val_frac=0.0, test_frac=0.0)
    with pytest.raises(TypeError, match="unknown config keys.*'alias'"):
        load_rows("emoji", "train", root=str(root), alias=False)
    with pytest.raises(ValueError, match="must each be in"):
        load_rows("emoji", "train", root=str(root), fetch=False, val_frac=0.6, test_frac=0.5)
    with pytest.raises(FileNotFoundError, match=r"images not found and fetch=False.*emoji.fetch"):
        load_rows("emoji", "train", root=str(root / "nowhere"), fetch=False)
    (root / E.TEST_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=r"emoji-test.txt not found .*fetch again"):
        load_rows("emoji", "train", root=str(root), fetch=False)


def test_config_file_matches_the_recipe(root, aliases):
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load((REPO_ROOT / "configs/data/emoji.yaml").read_text())
    assert cfg["name"] == "emoji" and cfg["root"] is None and cfg["aliases"] is True
    assert (cfg["val_frac"], cfg["test_frac"], cfg["seed"], cfg["fetch"]) == (0.1, 0.1, 0, True)
    assert set(cfg) - {"name"} == set(config_keys("emoji"))
    cfg.update(root=str(root), fetch=False, val_frac=0.0, test_frac=0.0)
    assert len(load_rows(split="train", **cfg)) == 29
    cfg["aliases"] = False
    assert len(load_rows(split="train", **cfg)) == 20


def test_default_root_does_not_depend_on_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert E.DEFAULT_ROOT == REPO_ROOT / "data" / "emoji"
    assert resolve_path("data/emoji") == E.DEFAULT_ROOT


# -------------------------------------------------------------------------------------------- render
def test_render_with_a_real_font():
    needs_raqm()
    font = E.open_font(dejavu(), 64)
    tofu = E.missing_glyph(font)
    assert tofu is not None  # DejaVu draws a box for what it lacks
    im = E.render("\u263a\ufe0f", font, tofu=tofu)  # DejaVu has U+263A; the selector is not drawn
    assert im.mode == "RGBA" and im.size == E.CANVAS
    l, t, r, b = im.getchannel("A").getbbox()
    assert abs((l + r) - E.CANVAS[0]) <= 1 and abs((t + b) - E.CANVAS[1]) <= 1  # centred
    assert (r - l) > 20 and (b - t) > 20
    with pytest.raises(RenderError, match="blank"):
        E.render(" ", font, tofu=tofu)
    with pytest.raises(RenderError, match="several glyphs"):
        E.render("WWW", font, tofu=tofu)
    with pytest.raises(RenderError, match="missing-glyph box"):
        E.render("\U000f0000", font, tofu=tofu)  # a private-use code point no font has
    big = E.render("\u263a", E.open_font(dejavu(), 400))
    assert big.size == E.CANVAS  # larger glyphs are scaled down to fit


def test_build_renders_with_a_real_font(tmp_path):
    """The whole build on a list of symbols DejaVu Sans has, with no stand-ins."""
    needs_raqm()
    text = "\n".join(["# Version: 15.0", "# group: Symbols", "# subgroup: other-symbol",
                      line("263A FE0F", "fully-qualified", "☺️", "0.6", "smiling face"),
                      line("2665 FE0F", "fully-qualified", "♥️", "0.6", "heart suit"),
                      line("2708 FE0F", "fully-qualified", "✈️", "0.6", "airplane")]) + "\n"
    src = tmp_path / "emoji-test.txt"
    src.write_text(text, encoding="utf-8")
    root = tmp_path / "d"
    images = E.build(root, dejavu(), src, progress=False)
    assert sorted(p.name for p in images.iterdir()) == ["263a-fe0f.png", "2665-fe0f.png", "2708-fe0f.png"]
    x = media.load_image(images / "2708-fe0f.png")
    assert x.size == E.CANVAS and x.getextrema()[0][0] < 50  # a dark glyph on white
    src_json = json.loads((root / "SOURCE.json").read_text())
    assert src_json["render"]["rendered"] == 3 and src_json["render"]["failed"] == {}
    assert src_json["emoji_test"]["version"] == "15.0"
    assert sorted(p.name for p in root.iterdir()) == ["SOURCE.json", "emoji-test.txt", "images"]


@pytest.fixture
def fake_renderer(monkeypatch):
    """Rendering without a colour emoji font: a square that depends on the emoji."""
    calls = []

    def make(font_path):
        calls.append(str(font_path))
        return lambda char: fake_image(char)

    monkeypatch.setattr(E, "make_renderer", make)
    return calls


def test_build_writes_everything_in_one_step(tmp_path, fake_renderer, aliases):
    src = tmp_path / "in/emoji-test.txt"
    src.parent.mkdir()
    src.write_text(TEST_TXT, encoding="utf-8")
    (tmp_path / "in/font.ttf").write_bytes(b"not read by the fake renderer")
    root = tmp_path / "d"
    images = E.build(root, tmp_path / "in/font.ttf", src, source={"packages": []}, progress=False)
    assert sorted(p.stem for p in images.iterdir()) == sorted(ITEMS)
    assert sorted(p.name for p in root.iterdir()) == ["SOURCE.json", "emoji-test.txt", "images"]
    meta = json.loads((root / "SOURCE.json").read_text())
    assert meta["items"]["base_emoji"] == 10 and meta["render"]["size"] == E.FONT_SIZE
    assert meta["packages"] == []
    # idempotent: a second build renders nothing
    assert E.build(root, tmp_path / "in/font.ttf", src) == images and len(fake_renderer) == 1
    assert len(load_rows("emoji", "train", root=str(root), fetch=False, val_frac=0, test_frac=0)) == 29


def test_build_refuses_a_font_that_cannot_draw_them(tmp_path, monkeypatch):
    def make(font_path):
        def draw(char):
            raise RenderError("blank: the font has no glyph for it")
        return draw

    monkeypatch.setattr(E, "make_renderer", make)
    src = tmp_path / "emoji-test.txt"
    src.write_text(TEST_TXT, encoding="utf-8")
    font = tmp_path / "f.ttf"
    font.write_bytes(b"")
    root = tmp_path / "d"
    with pytest.raises(FetchError, match=r"^10 of 10 emoji did not render with .*f.ttf \(e.g. 1f600 grinning face: "
                                         r"blank.*is the font older than emoji-test.txt") as e:
        E.build(root, font, src)
    assert "\n" not in str(e.value)
    assert list(root.iterdir()) == []  # nothing half-made left
    with pytest.raises(FetchError, match=r"nope.ttf: no such font file"):
        E.build(root, tmp_path / "nope.ttf", src)


# --------------------------------------------------------------------------------------------- fetch
def build_deb(tmp: Path, package: str, files: dict[str, bytes], version: str = "2099.01-1") -> Path:
    """A tiny real .deb holding `files` and a copyright file."""
    pkg = tmp / f"pkg-{package}"
    for rel, data in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_bytes(data)
    doc = pkg / "usr/share/doc" / package
    doc.mkdir(parents=True)
    (doc / "copyright").write_text(f"Files: *\nLicense: test licence of {package}\n")
    (pkg / "DEBIAN").mkdir()
    (pkg / "DEBIAN/control").write_text(
        f"Package: {package}\nVersion: {version}\nArchitecture: all\n"
        "Maintainer: Test <t@example.org>\nDescription: test package\n"
    )
    deb = tmp / f"{package}_{version}_all.deb"
    subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(pkg), str(deb)], check=True, capture_output=True)
    return deb


def both_debs(tmp: Path) -> tuple[Path, Path]:
    font = build_deb(tmp, E.FONT_PACKAGE, {str(E.FONT_IN_DEB): b"a font"})
    data = build_deb(tmp, E.DATA_PACKAGE, {str(E.TEST_IN_DEB): TEST_TXT.encode("utf-8")}, version="15.0.0-1")
    return font, data


def fake_apt_get(bindir: Path, script: str, monkeypatch):
    bindir.mkdir(exist_ok=True)
    exe = bindir / "apt-get"
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")


needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-deb") is None or shutil.which("dpkg") is None,
                                reason="needs dpkg and dpkg-deb")


@needs_dpkg
def test_fetch_with_fake_apt_get(tmp_path, monkeypatch, fake_renderer, aliases):
    needs_raqm()
    font, data = both_debs(tmp_path)
    fake_apt_get(tmp_path / "bin", f'[ "$1" = download ] || exit 1\ncase "$2" in\n'
                 f'  {E.FONT_PACKAGE}) cp "{font}" . ;;\n  {E.DATA_PACKAGE}) cp "{data}" . ;;\n  *) exit 100 ;;\nesac\n',
                 monkeypatch)
    root = tmp_path / "data"
    images = E.fetch(root, progress=False)
    assert images == root / "images" and sorted(p.stem for p in images.iterdir()) == sorted(ITEMS)
    assert fake_renderer[0].endswith(str(E.FONT_IN_DEB))
    src = json.loads((root / "SOURCE.json").read_text())
    assert [(p["package"], p["version"], p["license"]) for p in src["packages"]] == [
        (E.FONT_PACKAGE, "2099.01-1", "OFL-1.1"), (E.DATA_PACKAGE, "15.0.0-1", "Unicode-DFS-2016")]
    assert src["emoji_test"] == {"file": "emoji-test.txt", "date": "2022-08-12, 20:24:39 GMT", "version": "15.0"}
    assert (root / f"copyright.{E.FONT_PACKAGE}").read_text().startswith("Files: *")
    assert sorted(p.name for p in root.iterdir()) == sorted(  # temporary folders cleaned
        ["SOURCE.json", "emoji-test.txt", "images", f"copyright.{E.FONT_PACKAGE}", f"copyright.{E.DATA_PACKAGE}"])
    # Idempotent: a second call neither downloads nor renders.
    fake_apt_get(tmp_path / "bin2", "exit 1\n", monkeypatch)
    assert E.fetch(root) == images and len(fake_renderer) == 1
    # and the registered recipe fetches on demand
    fake_apt_get(tmp_path / "bin3", f'case "$2" in {E.FONT_PACKAGE}) cp "{font}" . ;; *) cp "{data}" . ;; esac\n',
                 monkeypatch)
    rows_ = load_rows("emoji", "train", root=str(tmp_path / "other"), val_frac=0, test_frac=0)
    assert len(rows_) == 29


@needs_dpkg
def test_fetch_from_local_debs(tmp_path, monkeypatch, fake_renderer):
    needs_raqm()
    font, data = both_debs(tmp_path)
    fake_apt_get(tmp_path / "bin", "exit 1\n", monkeypatch)  # apt-get is not used with both debs given
    assert len(list(E.fetch(tmp_path / "d", font_deb=font, unicode_deb=data, progress=False).iterdir())) == 10
    src = json.loads((tmp_path / "d/SOURCE.json").read_text())
    assert all("local file" in p["origin"] for p in src["packages"])
    with pytest.raises(FetchError, match=r"is package 'unicode-data', expected 'fonts-noto-color-emoji'"):
        E.fetch(tmp_path / "e", font_deb=data, unicode_deb=data)
    with pytest.raises(FetchError, match=r"missing.deb: no such .deb file \(for unicode-data\)"):
        E.fetch(tmp_path / "e", font_deb=font, unicode_deb=tmp_path / "missing.deb")
    assert not (tmp_path / "e/images").exists()


def test_fetch_without_tools_says_how_to_fetch_by_hand(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(FetchError, match=r"apt-get.*not found.*apt-get download fonts-noto-color-emoji unicode-data"
                                         r".*emoji.build\(ROOT") as e:
        E.fetch(tmp_path / "data")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "data").exists()


@needs_dpkg
def test_fetch_when_apt_get_fails(tmp_path, monkeypatch):
    needs_raqm()
    fake_apt_get(tmp_path / "bin", 'echo "E: Unable to locate package $2" >&2; exit 100\n', monkeypatch)
    root = tmp_path / "data"
    with pytest.raises(FetchError, match=r"^cannot download fonts-noto-color-emoji: .*exited 100: "
                                         r"E: Unable to locate package fonts-noto-color-emoji\. .*apt-get update") as e:
        E.fetch(root)
    assert "\n" not in str(e.value)
    assert list(root.iterdir()) == []  # nothing half-made left


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs apt-get")
def test_fetch_real_packages(tmp_path):
    """Downloads the two real packages (~18 MB) from the Debian mirror and renders every emoji."""
    images = E.fetch(tmp_path)
    src = json.loads((tmp_path / "SOURCE.json").read_text())
    assert [p["package"] for p in src["packages"]] == [E.FONT_PACKAGE, E.DATA_PACKAGE]
    s = E.summary(tmp_path)
    assert 1800 <= s["total"]["items"] <= 1900
    assert s["total"]["image"] == s["total"]["items"] and src["render"]["failed"] == {}
    assert s["groups"] == 9 and s["per_group"]["Flags"] > 250
    assert s["total"]["alias_text"] > 1000
    assert s["notes"]["variants_folded"] > 1500
    for name in ("1f600", "1f1e9-1f1ea", "1f468-200d-1f469-200d-1f467", "0023-fe0f-20e3"):
        im = Image.open(images / f"{name}.png")
        assert im.mode == "RGBA" and im.size == E.CANVAS
        alpha = im.getchannel("A").point(lambda v: 255 if v > 128 else 0).histogram()[255]
        assert alpha > 0.5 * E.CANVAS[0] * E.CANVAS[1]  # one large glyph, not a blank or a small box
        assert len(media.load_image(images / f"{name}.png").getcolors(1 << 16)) >= 15  # a picture
    r, g, b = Image.open(images / "1f600.png").convert("RGB").getpixel((68, 30))
    assert r > 200 and g > 150 and b < 100  # the grinning face is yellow
    colours = {c for _, c in Image.open(images / "1f1e9-1f1ea.png").convert("RGB").getcolors(1 << 16)}
    assert any(r > 180 and g < 60 and b < 60 for r, g, b in colours)  # the German flag's red stripe
