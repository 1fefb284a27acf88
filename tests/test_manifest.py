"""Generic manifest recipe (JSONL / CSV) and the dataset registry."""

import json
from pathlib import Path

import pytest

from ushash.data.datasets import DATASETS, REPO_ROOT, SPLITS, config_keys, load_rows, register
from ushash.data.datasets.manifest import rows
from ushash.data.rows import Row


def write_jsonl(path: Path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


RECORDS = [
    {"id": "a", "image": "img/a.png", "text": "A cat.", "audio": "snd/a.ogg", "labels": ["cat", "animal"],
     "group": "g1", "split": "train"},
    {"id": "b", "image": "img/a.png", "text": "Another cat.", "group": "g1", "split": "train"},  # same image
    {"id": "c", "text": "A lone caption.", "labels": [], "split": "test"},  # text only, own group
    {"id": "d", "audio": "/abs/d.wav", "image": "", "text": None, "split": "validation"},  # alias, empties
    {"id": "e", "image": "img/e.png", "labels": "x|y", "split": "val"},
]


def all_splits(path, **kw):
    return {s: rows(path, s, **kw) for s in SPLITS}


def test_jsonl(tmp_path):
    (tmp_path / "sub").mkdir()
    m = write_jsonl(tmp_path / "sub/m.jsonl", RECORDS)
    got = all_splits(m)
    train = got["train"]
    assert [(r.modality, r.id) for r in train] == [("image", "a"), ("text", "a"), ("audio", "a"), ("text", "b")]
    img = train[0]
    assert img.source == str(tmp_path / "sub/img/a.png")  # relative to the manifest file
    assert img.group == "g1" and img.labels == ("cat", "animal")
    assert train[3] == Row("text", "b", "g1", "Another cat.", ())  # the repeated image is one row
    assert got["test"] == [Row("text", "c", "c", "A lone caption.", ())]  # group defaults to id
    val = got["val"]
    assert [(r.modality, r.id, r.source) for r in val] == [
        ("audio", "d", "/abs/d.wav"), ("image", "e", str(tmp_path / "sub/img/e.png"))]
    assert val[1].labels == ("x", "y")


def test_csv_with_missing_columns_and_cells(tmp_path):
    (tmp_path / "m.csv").write_text(
        "id,image,text,labels,group\n"
        "1,a.jpg,A dog.,dog|animal,g\n"
        "2,,Just text.,,\n"
        "3,c.jpg,,animal,g\n"
        "\n"
    )
    got = all_splits(tmp_path / "m.csv", val_frac=0.0, test_frac=0.0)  # no split column: all hashed to train
    assert got["val"] == got["test"] == []
    tr = got["train"]
    assert [(r.modality, r.id, r.group) for r in tr] == [
        ("image", "1", "g"), ("text", "1", "g"), ("text", "2", "2"), ("image", "3", "g")]
    assert tr[0].labels == ("dog", "animal") and tr[2].labels == () and tr[3].labels == ("animal",)
    assert tr[0].source == str(tmp_path / "a.jpg")


def test_tsv_and_default_ids_are_line_numbers(tmp_path):
    (tmp_path / "m.tsv").write_text("text\tsplit\nhello\ttest\nworld\ttest\n")
    assert [(r.id, r.source) for r in rows(tmp_path / "m.tsv", "test")] == [("2", "hello"), ("3", "world")]
    write_jsonl(tmp_path / "m.jsonl", [{"text": "x", "split": "val"}, {"text": "y", "split": "val"}])
    assert [r.id for r in rows(tmp_path / "m.jsonl", "val")] == ["1", "2"]


def test_hash_split_keeps_groups_together(tmp_path):
    recs = [{"image": f"{g}.png", "text": f"caption {g} {k}", "group": f"g{g}"} for g in range(200) for k in range(3)]
    m = write_jsonl(tmp_path / "m.jsonl", recs)
    got = all_splits(m, val_frac=0.2, test_frac=0.2, seed=1)
    where = {}
    for s, rs in got.items():
        for r in rs:
            where.setdefault(r.group, set()).add(s)
    assert len(where) == 200 and all(len(v) == 1 for v in where.values())
    assert 20 < len({r.group for r in got["val"]}) < 60
    assert all_splits(m, val_frac=0.2, test_frac=0.2, seed=1) == got


def test_custom_split_column(tmp_path):
    m = write_jsonl(tmp_path / "m.jsonl", [{"text": "a", "fold": "test", "split": "train"}])
    assert rows(m, "test", split_col="fold")[0].source == "a"
    with pytest.raises(ValueError, match="split column 'nope' not found"):
        rows(m, "test", split_col="nope")


@pytest.mark.parametrize("content,err,match", [
    (None, FileNotFoundError, "not found"),
    ('{"group": "g", "labels": ["x"]}\n', ValueError, r"no modality column.*found \['group', 'labels'\]"),
    ('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n', ValueError, r"duplicate ids.*'a' \(lines 1 and 2\)"),
    ('{"text": "x"}\n{oops\n', ValueError, r"m\.jsonl:2: invalid JSON"),
    ('["text"]\n', ValueError, "expected a JSON object"),
    ('{"text": "x", "split": "holdout"}\n', ValueError, "unknown split 'holdout'"),
    ('{"text": 3}\n', ValueError, "column 'text' must be a string"),
    ('{"text": "x", "labels": {"a": 1}}\n', ValueError, "labels must be"),
    ('{"text": "x", "group": "g", "split": "train"}\n{"text": "y", "group": "g", "split": "test"}\n',
     ValueError, "group 'g' is in split 'test' here but 'train' on line 1"),
])
def test_manifest_errors(tmp_path, content, err, match):
    m = tmp_path / "m.jsonl"
    if content is not None:
        m.write_text(content)
    with pytest.raises(err, match=match):
        rows(m, "train")


def test_csv_without_modality_column(tmp_path):
    (tmp_path / "m.csv").write_text("id,labels\n1,a\n")
    with pytest.raises(ValueError, match="no modality column"):
        rows(tmp_path / "m.csv", "train")
    (tmp_path / "m.txt").write_text("")
    with pytest.raises(ValueError, match="unknown format"):
        rows(tmp_path / "m.txt", "train")


# ----------------------------------------------------------------------------------------- registry
def test_registry_and_load_rows(tmp_path):
    assert {"tuxpaint", "manifest"} <= set(DATASETS)
    m = write_jsonl(tmp_path / "m.jsonl", RECORDS)
    assert load_rows("manifest", "train", path=str(m)) == rows(m, "train")
    with pytest.raises(ValueError, match=r"unknown dataset 'no_such_set'.*known datasets: \[.*'manifest'.*'tuxpaint'"):
        load_rows("no_such_set", "train")
    with pytest.raises(TypeError, match=r"unknown config keys \['pth', 'x'\]"):
        load_rows("manifest", "train", pth="m.jsonl", x=1)
    with pytest.raises(ValueError, match="needs a path"):
        load_rows("manifest", "train", path="???")
    write_jsonl(tmp_path / "t.jsonl", [{"text": "only train", "split": "train"}])
    with pytest.raises(ValueError, match=r"split 'test' is empty \(other splits: train: 1 rows, val: 0 rows\).*"
                                         r"name the others: extract\.splits=\[train\]"):
        load_rows("manifest", "test", path=str(tmp_path / "t.jsonl"))


def test_load_rows_checks_row_ids_are_unique(monkeypatch):
    def dup(split):
        return [Row("text", "x", "x", "a"), Row("text", "x", "y", "b")]

    monkeypatch.setitem(DATASETS, "dup-test", dup)
    with pytest.raises(ValueError, match="duplicate row ids"):
        load_rows("dup-test", "train")


def test_register_refuses_a_second_recipe_under_one_name():
    with pytest.raises(ValueError, match="already registered"):
        register("manifest")(lambda split: [])


def test_relative_manifest_path_is_taken_from_the_repo_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=str(REPO_ROOT / "data/raw/none.jsonl")):
        load_rows("manifest", "train", path="data/raw/none.jsonl")


def test_config_file_matches_the_recipe(tmp_path):
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load((REPO_ROOT / "configs/data/manifest.yaml").read_text())
    assert cfg["name"] == cfg["recipe"] == "manifest" and cfg["path"] == "???"
    assert set(cfg) - {"name", "recipe"} == set(config_keys("manifest"))
    cfg["path"] = str(write_jsonl(tmp_path / "m.jsonl", RECORDS))
    cfg.pop("recipe")
    assert load_rows(split="train", **cfg)


# ------------------------------------------------------------------- records that name no group
def test_records_sharing_a_file_without_group_are_one_item(tmp_path):
    """An image listed once per caption with no group column is one item: its captions are its pairs, and
    the hash split keeps them with it (before, each record was its own group, so one image could be a train
    item and a test item at once)."""
    recs = [{"image": f"img/{i}.png", "text": f"caption {i} {k}"} for i in range(60) for k in range(4)]
    m = write_jsonl(tmp_path / "m.jsonl", recs)
    got = all_splits(m)
    where = {}
    for s, rs in got.items():
        for r in rs:
            where.setdefault(r.group, set()).add(s)
            if r.modality == "text":
                assert r.group == str(4 * int(r.source.split()[1]) + 1)  # the first record's id (line number)
    assert all(len(v) == 1 for v in where.values())
    assert sum(r.modality == "image" for rs in got.values() for r in rs) == 60  # one row per image
    assert sum(r.modality == "text" for rs in got.values() for r in rs) == 240
    assert all(len(rs) for rs in got.values())


def test_groups_by_file_join_through_other_files(tmp_path):
    """A record naming an image and a sound joins the items of both; the group is named by the earliest record."""
    recs = [{"id": "x", "audio": "b.wav"}, {"id": "y", "image": "a.png"}, {"id": "z", "image": "a.png", "audio": "b.wav"},
            {"id": "w", "text": "alone"}, {"id": "v", "image": "c.png", "group": "mine"}]
    m = write_jsonl(tmp_path / "m.jsonl", [dict(r, split="train") for r in recs])
    got = {(r.modality, r.id): r.group for r in rows(m, "train")}
    assert got == {("audio", "x"): "x", ("image", "y"): "x", ("text", "w"): "w", ("image", "v"): "mine"}


def test_an_ungrouped_items_split_stays_when_lines_move(tmp_path):
    """Without id and group columns an item was named and split by its line number: the same records reordered,
    or after one blank line more, put other items in test (a test item of one version in training in the next)."""
    recs = [{"image": f"img{i}.jpg", "text": f"caption {i}"} for i in range(40)] + \
           [{"text": f"a caption alone {i}"} for i in range(10)]

    def split_of(path):
        return {r.source.rsplit("/", 1)[-1] if r.modality == "image" else r.source: s
                for s, rs in all_splits(path).items() for r in rs}

    a = split_of(write_jsonl(tmp_path / "a.jsonl", recs))
    b = split_of(write_jsonl(tmp_path / "b.jsonl", recs[::-1]))
    c = tmp_path / "c.jsonl"
    c.write_text("\n" + (tmp_path / "a.jsonl").read_text())
    assert a == b == split_of(c)
    assert set(a.values()) == {"train", "val", "test"}


@pytest.mark.parametrize("second", [{"group": "g2", "split": "test"}, {"group": "g2", "split": "train"}, {}])
def test_one_file_in_two_groups_is_refused(tmp_path, second):
    """One image in two groups was two items: in two splits (a test image in training), or in one split two
    database rows of one file, each counted irrelevant to the other's captions; a record without a group
    sharing the file of a grouped one was its own item too."""
    m = write_jsonl(tmp_path / "m.jsonl", [{"image": "a.png", "text": "t", "group": "g1", "split": "train"},
                                           {"image": "a.png", "text": "u", **second}])
    with pytest.raises(ValueError, match=r"m\.jsonl:2: file '.*a\.png' is in group '(g2|2)' here but 'g1' on line 1"):
        rows(m, "train")


def test_one_file_linked_under_two_names_is_one_file(tmp_path):
    """Paths were compared as written: an image and a symbolic link to it were two files, two items hashed
    into different splits: a test image in training."""
    import os

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(b"png")
    os.symlink("a.png", tmp_path / "img" / "link.png")
    recs = [{"id": "r0", "image": "img/a.png", "text": "a red square"}] + \
           [{"id": f"x{i}", "image": f"img/other{i}.png", "text": f"other {i}"} for i in range(30)] + \
           [{"id": "r1", "image": "img/link.png", "text": "a red square, again"}]
    got = all_splits(write_jsonl(tmp_path / "m.jsonl", recs))
    mine = [(s, r.modality, r.id, r.group) for s, rs in got.items() for r in rs if r.group == "r0"]
    assert sorted(x[1:] for x in mine) == [("image", "r0", "r0"), ("text", "r0", "r0"), ("text", "r1", "r0")]
    assert len({x[0] for x in mine}) == 1   # one item, one split, one image row
    both = [dict(recs[0], split="train"), dict(recs[-1], group="other", split="test")]
    with pytest.raises(ValueError, match=r"file '.*a\.png' is in group 'other' here but 'r0'"):
        rows(write_jsonl(tmp_path / "two.jsonl", both), "train")


def test_a_group_that_is_also_an_ungrouped_records_id_is_refused(tmp_path):
    """An ungrouped record's group is its id (its line number by default): a cat with group "3" and a dog on
    line 3 with none were one item, each other's pairs."""
    m = tmp_path / "m.csv"
    m.write_text("image,text,group,split\ncat.jpg,a cat on a mat,3,test\ndog.jpg,a dog in the park,,test\n")
    with pytest.raises(ValueError, match=r"m\.csv:2: group '3' is also the id of the record on line 3"):
        rows(m, "test")
    m.write_text("image,text,group,split\ncat.jpg,a cat on a mat,cats,test\ndog.jpg,a dog in the park,,test\n")
    assert sorted(r.group for r in rows(m, "test")) == ["3", "3", "cats", "cats"]


def test_a_row_of_several_records_has_the_labels_of_all(tmp_path):
    """An image listed once per caption became one row with the first record's labels only."""
    m = write_jsonl(tmp_path / "m.jsonl", [{"image": "a.png", "text": "a cat", "labels": ["cat"], "split": "train"},
                                           {"image": "a.png", "text": "a dog", "labels": ["dog", "cat"], "split": "train"}])
    got = {(r.modality, r.id): r.labels for r in rows(m, "train")}
    assert got == {("image", "1"): ("cat", "dog"), ("text", "1"): ("cat",), ("text", "2"): ("dog", "cat")}


@pytest.mark.parametrize("column", ["Split", "Image", "LABELS", " Group"])
def test_a_column_named_in_another_case_is_refused_not_ignored(tmp_path, column):
    """A "Split" column was not the split column: the records declared test were hash-split instead."""
    m = tmp_path / "m.csv"
    m.write_text(f"text,{column}\na caption,test\n")
    with pytest.raises(ValueError, match=r"column\(s\) \[.*\] are read only in lower case; rename them"):
        rows(m, "test")
