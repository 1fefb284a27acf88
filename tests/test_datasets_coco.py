"""MS-COCO recipes on tiny fixtures in the real formats: Karpathy JSON, 2017 captions + instances, HF copy."""

import hashlib
import json

import numpy as np
import pytest
from PIL import Image

from ushash.core import metrics
from ushash.config import compose
from ushash.data.datasets import load_rows
from ushash.data.datasets import coco
from ushash.encoders import build_encoder
from ushash.evaluation.evaluate import run_eval

from ushash.core.index import HammingIndex
from ushash.hashing.module import load_checkpoint
from ushash.data.extract import extract, run_extract, stored_split
from ushash.hashing.training import run_train

# The fixture: 40 COCO images. Karpathy splits: 1-12 train (train2014), 13 restval, 14-25 val, 26-39 test
# (val2014), 40 in none. Image 6's file is missing, 28 is corrupt, 29 truncated; image 26 has 6 captions,
# 27 an empty one. 2017: 1-25 in train2017, 26-40 in val2017; image 40 has no instance annotation (and no
# file). Splits keep >= 10 good images: retrieval.evaluate needs a database of at least k=10 items.
KARPATHY_SPLIT = {**{i: "train" for i in range(1, 13)}, 13: "restval", **{i: "val" for i in range(14, 26)},
                  **{i: "test" for i in range(26, 40)}}
PATTERNS = [("cat",), ("dog",), ("cat", "person"), ("car",), ("dog", "person"), ("car", "cat")]
LABELS = {**{i: PATTERNS[i % 6] for i in range(1, 40)}, 40: ()}
MISSING, CORRUPT, TRUNCATED, SIX_CAPTIONS, EMPTY_CAPTION = 6, 28, 29, 26, 27
CATEGORIES = {1: "person", 3: "car", 17: "cat", 18: "dog"}
COLOURS = {"cat": (200, 30, 30), "dog": (30, 200, 30), "car": (30, 30, 200), "person": (200, 200, 30)}


def captions(i):
    caps = [f"a photo of {' and '.join(LABELS[i]) or 'nothing'}, number {i}, view {j}" for j in range(5)]
    if i == SIX_CAPTIONS:
        caps.append("a sixth caption that the CLIP protocol drops")
    if i == EMPTY_CAPTION:
        caps[2] = "   "
    return caps


def sentid(i, j):
    return 100 * i + j


def make_coco(root):
    (root / "annotations").mkdir(parents=True)
    for sub in ("train2014", "val2014"):
        (root / sub).mkdir()
    images = []
    for i, ks in KARPATHY_SPLIT.items():
        sub = "train2014" if ks == "train" else "val2014"
        fn = f"COCO_{sub}_{i:012d}.jpg"
        path = root / sub / fn
        rgb = np.array(COLOURS[LABELS[i][0]], np.uint8)
        arr = np.clip(rgb + np.random.default_rng(i).integers(-20, 20, (24, 32, 3)), 0, 255).astype(np.uint8)
        if i == CORRUPT:
            path.write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
        elif i != MISSING:
            Image.fromarray(arr).save(path, quality=90)
            if i == TRUNCATED:
                path.write_bytes(path.read_bytes()[:200])
        images.append({"filepath": sub, "filename": fn, "imgid": i - 1, "split": ks, "cocoid": i,
                       "sentids": [sentid(i, j) for j in range(len(captions(i)))],
                       "sentences": [{"raw": c, "tokens": c.split(), "imgid": i - 1, "sentid": sentid(i, j)}
                                     for j, c in enumerate(captions(i))]})
    (root / "dataset_coco.json").write_text(json.dumps({"images": images[::-1], "dataset": "coco"}))
    cats = [{"id": k, "name": v, "supercategory": "x"} for k, v in CATEGORIES.items()]
    by_name = {v: k for k, v in CATEGORIES.items()}
    for subset, ids in (("train2017", range(1, 26)), ("val2017", range(26, 41))):
        imgs = [{"id": i, "file_name": f"{i:012d}.jpg", "width": 32, "height": 24} for i in ids]
        inst = [{"id": 1000 * i + n, "image_id": i, "category_id": by_name[lab], "bbox": [0, 0, 1, 1], "area": 1.0,
                 "iscrowd": 0, "segmentation": []} for i in ids for n, lab in enumerate(LABELS[i])]
        caps = [{"id": sentid(i, j), "image_id": i, "caption": c} for i in ids for j, c in enumerate(captions(i))]
        (root / "annotations" / f"instances_{subset}.json").write_text(
            json.dumps({"images": imgs, "annotations": inst, "categories": cats}))
        (root / "annotations" / f"captions_{subset}.json").write_text(json.dumps({"images": imgs, "annotations": caps}))
    return root


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_coco(tmp_path_factory.mktemp("coco") / "coco")


def by(rows, modality):
    return [r for r in rows if r.modality == modality]


# ------------------------------------------------------------------------------------- Karpathy / CLIP
def test_karpathy_splits_and_paired_relevance(root):
    train, val, test = (load_rows("coco", s, root=str(root)) for s in ("train", "val", "test"))
    ids = lambda rows: [int(r.id) for r in by(rows, "image")]  # noqa: E731
    assert ids(train) == list(range(13, 0, -1))  # restval included; the JSON's own order (reversed here)
    assert ids(load_rows("coco", "train", root=str(root), restval_in_train=False)) == list(range(12, 0, -1))
    assert ids(val) == list(range(25, 13, -1))
    img, txt = by(test, "image"), by(test, "text")
    assert ids(test) == list(range(39, 25, -1))
    assert len(txt) == 14 * 5  # 5 captions per image: image 26's sixth caption is dropped
    assert str(sentid(SIX_CAPTIONS, 5)) not in {r.id for r in txt}
    assert img[0].source == str(root / "val2014" / "COCO_val2014_000000000039.jpg")
    assert all(r.labels == () for r in test)
    # paired relevance: each caption has exactly its own image; each image its five captions
    groups_i = np.array([r.group for r in img])
    groups_t = np.array([r.group for r in txt])
    I = np.tile(np.arange(len(img)), (len(txt), 1))
    rel, n_rel = metrics.relevance(I, groups_t, groups_i, "paired")
    assert (n_rel == 1).all() and (rel.sum(1) == 1).all()
    assert [int(img[j].id) for j in rel.argmax(1)] == [sid // 100 for sid in map(int, (t.id for t in txt))]
    _, n_rel_i = metrics.relevance(np.zeros((len(img), 1), np.int64), groups_i, groups_t, "paired")
    assert (n_rel_i == 5).all()
    # labels=true attaches the instance categories
    lab = load_rows("coco", "test", root=str(root), labels=True)
    assert {r.id: r.labels for r in by(lab, "image")}["35"] == ("car", "cat")


def test_wrong_roots_say_what_was_expected(root, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no dataset_coco.json under .*expected layout: .*train2014"):
        load_rows("coco", "test", root=str(tmp_path))
    (tmp_path / "dataset_coco.json").write_text((root / "dataset_coco.json").read_text())
    with pytest.raises(FileNotFoundError, match="none of the first 14 images exists"):
        load_rows("coco", "test", root=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"no instances_train2017.json under .*annotations; expected layout"):
        load_rows("coco_hashing", "test", root=str(tmp_path), n_query=1, n_train=1, n_val=1)
    bad = tmp_path / "dup"
    bad.mkdir()
    data = json.loads((root / "dataset_coco.json").read_text())
    data["images"].append(data["images"][0])
    (bad / "dataset_coco.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="cocoid 39 appears twice"):
        load_rows("coco", "test", root=str(bad))
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "dataset_coco.json").write_bytes('{"images": [\n{"raw": "caf\u00e9"}]}'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"dataset_coco\.json:2: not UTF-8 text .*save the file as UTF-8"):
        load_rows("coco", "test", root=str(latin))


# -------------------------------------------------------------------------------------- hashing protocol
FROZEN_QUERIES = ["14", "8", "31", "1"]  # seed 0: sha256 order of the pool
HASHING = dict(n_query=13, n_train=10, n_val=13)


def test_hashing_protocol_parts(root):
    pool = [str(i) for i in range(1, 40)]  # image 40 has no category: pruned
    order = sorted(pool, key=lambda i: hashlib.sha256(f"0\x00{i}".encode()).digest())
    parts = coco.hashing_parts(pool, seed=0, **HASHING)
    assert parts["query"] == order[:13] and parts["database"] == order[13:]
    assert parts["train"] == order[13:23] and parts["val"] == order[23:36]
    assert parts["query"][:4] == FROZEN_QUERIES  # the protocol's split must never drift
    assert len(parts["database"]) == 26 and not set(parts["val"]) & set(parts["query"])
    assert not set(parts["val"]) & set(parts["train"])
    with pytest.raises(ValueError, match="the pool has only 39 labelled images"):
        coco.hashing_parts(pool, 30, 5, 5, 0)

    split = {s: load_rows("coco_hashing", s, root=str(root), **HASHING) for s in ("train", "val", "test")}
    assert [r.id for r in by(split["test"], "image")] == sorted(parts["query"], key=int)
    assert [r.id for r in by(split["train"], "image")] == sorted(parts["train"], key=int)
    assert [r.id for r in by(split["val"], "image")] == sorted(parts["val"], key=int)
    txt = by(split["test"], "text")
    assert len(txt) == 13 * 5 and {r.group for r in txt} == set(parts["query"])
    assert all(r.labels == LABELS[int(r.group)] for r in split["test"])
    # the 2014 folders stand in for train2017/val2017
    first = by(split["test"], "image")[0]
    sub = "train2014" if int(first.id) <= 12 else "val2014"
    assert first.source == str(root / sub / f"COCO_{sub}_{int(first.id):012d}.jpg")

    # label relevance of query images against the database texts, by hand from LABELS
    db = coco.hashing_rows("database", root, **HASHING)
    q_img, db_txt = by(split["test"], "image"), by(db, "text")
    names = sorted({lab for labs in LABELS.values() for lab in labs})
    mh = lambda rows: np.array([[n in r.labels for n in names] for r in rows])  # noqa: E731
    I = np.tile(np.arange(len(db_txt)), (len(q_img), 1))
    rel, n_rel = metrics.relevance(I, None, None, "label", mh(q_img), mh(db_txt))
    database = set(map(int, parts["database"]))
    for qi, q in enumerate(q_img):
        expect = {t for t in database if set(LABELS[t]) & set(LABELS[int(q.id)])}
        got = {int(db_txt[j].group) for j in np.flatnonzero(rel[qi])}
        assert got == expect and n_rel[qi] == 5 * len(expect)
    # e.g. a "dog" query: database images whose pattern has a dog (i % 6 in {1, 4})
    dog = next(q for q in q_img if LABELS[int(q.id)] == ("dog",))
    assert {int(db_txt[j].group) for j in np.flatnonzero(rel[q_img.index(dog)])} == {
        t for t in database if t % 6 in (1, 4)}


# ----------------------------------------------------------------------------- extract -> train -> eval
def run_all(tmp_path, data, *overrides):
    cfg = compose("config", [f"paths.root={tmp_path}", f"data={data}", "encoder=tiny", "extract.num_workers=0",
                             "extract.progress=false", "trainer.accelerator=cpu", "trainer.max_epochs=2",
                             "bits=16", "model.dim=16", "model.hidden=32", "model.batch_size=8",
                             "trainer.enable_progress_bar=false", *overrides])
    splits = run_extract(cfg)
    out = run_train(cfg, splits={"train": splits["train"], "val": splits["val"]})
    res = run_eval(compose("eval", [f"paths.root={tmp_path}", f"ckpt={out['last']}"]))
    return splits, res, out


def test_coco_extract_train_eval(root, tmp_path):
    splits, res, _ = run_all(tmp_path, "coco", f"data.root={root}")
    test = splits["test"]
    rep = test.report
    assert rep["modalities"]["image"] == {"rows": 14, "ok": 12, "failed": 2}
    assert rep["modalities"]["text"] == {"rows": 70, "ok": 69, "failed": 1}
    why = {(f["modality"], f["id"]): f["reason"] for f in rep["failed"]}
    empty = ("text", str(sentid(EMPTY_CAPTION, 2)))
    assert set(why) == {("image", str(CORRUPT)), ("image", str(TRUNCATED)), empty}
    assert "cannot decode image" in why[("image", str(CORRUPT))] and "empty caption" in why[empty]
    assert "file not found" in next(f["reason"] for f in splits["train"].report["failed"] if f["id"] == str(MISSING))
    # pairing survives the bad rows: every caption row still belongs to its own image's group
    t = test.tables["text"]
    assert all(g == str(int(i) // 100) for i, g in zip(t.ids, t.groups))
    rows = {(r["method"], r["direction"], r["protocol"]): r for r in res["rows"]}
    t2i = rows[("US-HASH 16-bit codes", "T→I", "paired")] if ("US-HASH 16-bit codes", "T→I", "paired") in rows \
        else next(r for k, r in rows.items() if k[1:] == ("T→I", "paired") and r["kind"] == "codes")
    assert t2i["n_queries"] == 69 and t2i["n_no_relevant"] == 10  # the captions of the two bad images
    assert t2i["n_database"] == 12 and 0 <= t2i["map@10"] <= 1


def test_coco_hashing_extract_train_eval(root, tmp_path):
    splits, res, out = run_all(tmp_path, "coco_hashing", f"data.root={root}", "data.n_query=13", "data.n_train=10",
                               "data.n_val=13")
    assert {r["protocol"] for r in res["rows"]} == {"paired", "label"}
    queries = coco.hashing_parts([str(i) for i in range(1, 40)], 13, 10, 13, 0)["query"]
    bad = {str(MISSING), str(CORRUPT), str(TRUNCATED)} & set(queries)
    assert splits["test"].tables["image"].ids == [q for q in sorted(queries, key=int) if q not in bad]
    assert splits["test"].report["modalities"]["image"] == {"rows": 13, "ok": 13 - len(bad), "failed": len(bad)}

    # queries against the database, as docs/datasets.md shows it (eval.py evaluates within one split)
    module = load_checkpoint(out["last"])
    prov = module.hparams.provenance
    enc = build_encoder(prov["encoder"]["config"])
    feats = tmp_path / prov["features_dir"]  # recorded relative to the project root
    query = stored_split(prov, "test", feats)
    db = extract(coco.hashing_rows("database", root, n_query=13, n_train=10, n_val=13), enc, feats,
                 "coco_hashing", "database", num_workers=0, progress=False)
    code = module.code_method()
    names = sorted({lab for s in (query, db) for t in s.tables.values() for labs in t.labels for lab in labs})

    def multihot(t):
        return np.array([[n in labs for n in names] for labs in t.labels])

    _, qc = code("image", np.asarray(query.tables["image"].x))
    _, dc = code("text", np.asarray(db.tables["text"].x))
    _, I = HammingIndex(dc).search(qc, len(dc))
    rep = metrics.retrieval_report(I, None, None, "label", k=len(dc), denominator="all",
                                   q_labels=multihot(query.tables["image"]), db_labels=multihot(db.tables["text"]))
    assert rep["n_queries"] == 13 - len(bad) and rep["n_no_relevant"] == 0 and 0 < rep[f"map@{len(dc)}"] <= 1
    assert len(db.tables["image"]) == 26 - len({str(MISSING), str(CORRUPT), str(TRUNCATED)} - set(queries))


# ------------------------------------------------------------------------------------ Hugging Face copy
def make_hf(root, tmp):
    import datasets

    recs = {s: [] for s in ("train", "validation", "test")}
    split_of = {"train": "train", "restval": "train", "val": "validation", "test": "test"}
    for i, ks in sorted(KARPATHY_SPLIT.items()):
        if i in (MISSING, CORRUPT, TRUNCATED):
            continue
        sub = "train2014" if ks == "train" else "val2014"
        recs[split_of[ks]].append({"image": str(root / sub / f"COCO_{sub}_{i:012d}.jpg"), "cocoid": i,
                                   "sentences": captions(i), "sentids": [sentid(i, j) for j in range(len(captions(i)))]})
    feats = datasets.Features({"image": datasets.Image(), "cocoid": datasets.Value("int64"),
                               "sentences": datasets.List(datasets.Value("string")),
                               "sentids": datasets.List(datasets.Value("int64"))})
    dd = datasets.DatasetDict({s: datasets.Dataset.from_list(r, features=feats) for s, r in recs.items()})
    dd = dd.map(lambda ex: ex, features=feats)  # embeds image bytes as a hub copy has them
    out = tmp / "coco_hf"
    dd.save_to_disk(str(out))
    return out


def test_coco_hf_streams_embedded_images(root, tmp_path):
    path = make_hf(root, tmp_path)
    test = load_rows("coco_hf", "test", path=str(path))
    img = by(test, "image")
    good = [str(i) for i in range(26, 40) if i not in (CORRUPT, TRUNCATED)]
    assert [r.id for r in img] == good and len(by(test, "text")) == 12 * 5
    assert img[0].source.startswith(f"hf:{path}#test/0/image")
    splits, res, _ = run_all(tmp_path, "coco_hf", f"data.path={path}")
    assert splits["test"].tables["image"].ids == good
    assert splits["test"].report["modalities"]["text"]["failed"] == 1  # the empty caption
    # streamed bytes give the features of the files themselves
    ref = run_extract(compose("config", [f"paths.root={tmp_path / 'ref'}", "data=coco", f"data.root={root}",
                                         "encoder=tiny", "extract.num_workers=0", "extract.progress=false"]),
                      splits=["test"])["test"]
    pos = {i: k for k, i in enumerate(ref.tables["image"].ids)}
    np.testing.assert_allclose(np.asarray(splits["test"].tables["image"].x),
                               np.asarray(ref.tables["image"].x)[[pos[i] for i in good]], atol=1e-6)


def test_coco_hf_captions_as_a_sequence_of_structs(tmp_path):
    """A Karpathy "sentences" column declared as Sequence({raw, sentid}) arrives as a dict of lists: its keys
    ("raw", "sentid") were taken as the captions."""
    import datasets

    from ushash.data.datasets import hf

    feats = datasets.Features({"cocoid": datasets.Value("int64"), "file_name": datasets.Value("string"),
                               "sentences": datasets.Sequence({"raw": datasets.Value("string"),
                                                               "sentid": datasets.Value("int64")})})
    ds = datasets.Dataset.from_dict({"cocoid": [9, 42], "file_name": ["img/9.jpg", "img/42.jpg"],
                                     "sentences": [{"raw": ["a dog runs", "a brown dog"], "sentid": [90, 91]},
                                                   {"raw": ["a red bus"], "sentid": [420]}]}, features=feats)
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "ds"))
    got = [(r.id, r.source) for r in hf.rows(tmp_path / "ds", "test", "test") if r.modality == "text"]
    assert got == [("9#0", "a dog runs"), ("9#1", "a brown dog"), ("42#0", "a red bus")]
    assert hf._captions({"raw": "one caption", "sentid": 1}) == ["one caption"]
    with pytest.raises(ValueError, match="needs a 'raw' field"):
        hf._captions({"tokens": [["a"]]})


def test_a_stray_file_in_a_2014_folder_is_not_an_image_of_the_set(root, tmp_path):
    """A browser's second download ("COCO_train2014_000000000003 (1).jpg") stopped loading with a bare
    int() error naming no file; it is not a file of the set, so it is passed over."""
    import shutil

    copy = tmp_path / "coco"
    shutil.copytree(root, copy)
    (copy / "train2014" / "COCO_train2014_000000000003 (1).jpg").write_bytes(b"x")
    (copy / "train2014" / "COCO_train2014_notes.txt").write_bytes(b"x")
    rows = load_rows("coco_hashing", "train", root=str(copy), **HASHING)
    want = load_rows("coco_hashing", "train", root=str(root), **HASHING)
    assert [(r.id, r.source.replace(str(copy), str(root))) for r in rows] == [(r.id, r.source) for r in want]
