"""A feature store is used only for the rows that made it, and a checkpoint finds its stores wherever the
project is: another manifest, another split seed or an edited caption never reuse a store, and a checkpoint
copied to another clone evaluates on that clone's stores."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ushash.config import compose
from ushash.data.extract import run_extract
from ushash.data.store import FeatureStoreError
from ushash.evaluation.evaluate import run_eval
from ushash.hashing.module import load_checkpoint
from ushash.hashing.training import run_train

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white", "grey", "pink", "brown", "cyan"]


def write_manifest(folder, n, caption="a {} square", split_col=True):
    """n image-caption records with real PNG files; without split_col the recipe hashes groups into splits."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        img = folder / f"{i}.png"
        Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(img)
        rec = {"id": str(i), "image": img.name, "text": caption.format(COLOURS[i % len(COLOURS)]) + f" {i}"}
        if split_col:
            rec["split"] = "train" if i < n - 4 else ("val" if i < n - 2 else "test")
        lines.append(json.dumps(rec))
    path = folder / "manifest.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def cfg_for(root, manifest, *overrides):
    return compose("config", [f"paths.root={root}", "data=manifest", f"data.path={manifest}", "encoder=tiny",
                              "extract.num_workers=0", "extract.progress=false", "trainer.accelerator=cpu",
                              "trainer.max_epochs=1", "bits=16", "model.dim=16", "model.hidden=32",
                              "model.batch_size=4", "trainer.enable_progress_bar=false", *overrides])


def test_another_manifest_or_an_edited_caption_makes_another_store(tmp_path):
    first = run_extract(cfg_for(tmp_path, write_manifest(tmp_path / "m1", 12)), splits=["train"])["train"]
    other = run_extract(cfg_for(tmp_path, write_manifest(tmp_path / "m2", 8)), splits=["train"])["train"]
    assert first.path != other.path and first.path.parent == other.path.parent  # same dataset name and split
    assert len(first.tables["text"]) == 8 and len(other.tables["text"]) == 4
    edited = run_extract(cfg_for(tmp_path, write_manifest(tmp_path / "m1", 12, caption="one {} box")),
                         splits=["train"])["train"]
    assert edited.path not in (first.path, other.path)
    assert edited.tables["text"].ids == first.tables["text"].ids
    assert first.meta["rows_fingerprint"] != edited.meta["rows_fingerprint"]


def test_an_image_replaced_by_one_of_the_same_size_makes_another_store(tmp_path):
    """BMP files of the same dimensions have the same size whatever their pixels: the file's modification
    time keys it too, so the old pixels' store is not reused."""
    import os

    m = write_manifest(tmp_path / "m", 12)
    img = tmp_path / "m" / json.loads(m.read_text().splitlines()[0])["image"]
    pixels = np.asarray(Image.open(img))
    Image.fromarray(pixels).save(img, format="BMP")  # decoded by its content, whatever the name says
    first = run_extract(cfg_for(tmp_path, m), splits=["train"])["train"]
    size, mtime = img.stat().st_size, img.stat().st_mtime_ns
    Image.fromarray(pixels[::-1].copy()).save(img, format="BMP")
    os.utime(img, ns=(mtime + 10**9, mtime + 10**9))  # a coarse file system's clock may not have moved
    assert img.stat().st_size == size
    again = run_extract(cfg_for(tmp_path, m), splits=["train"])["train"]
    assert again.path != first.path and not np.array_equal(again.tables["image"].x, first.tables["image"].x)


def test_labels_key_tells_every_list_of_labels_apart():
    from ushash.data.store import labels_key

    cases = [[], [""], ["x", "y"], ["x|y"], ["x", ""], ["x\n"], ["\x01[\"x\"]"], ["x"], ["y", "x"]]
    assert len({labels_key(c) for c in cases}) == len(cases)
    assert labels_key(["animals", "cats"]) == "animals|cats"  # plain labels: the digests of existing stores


def test_a_nul_inside_a_row_field_is_refused():
    """The digests join id, group and source with NUL: ("a\\0b", "c") and ("a", "b\\0c") once gave one
    fingerprint. Such a row is refused, naming the field; every other character stays allowed."""
    import pytest

    from ushash.data.rows import Row
    from ushash.data.store import rows_fingerprint

    for field in ("id", "group", "source"):
        kw = {"modality": "text", "id": "a", "group": "g", "source": "a frog", field: "x\0y"}
        with pytest.raises(ValueError, match=f"its {field} holds a NUL character"):
            Row(**kw)
    odd = [Row("text", "a\nb", "g|h", "a caption\nwith a newline\x01"), Row("text", "b", "g", "x")]
    assert rows_fingerprint(odd) != rows_fingerprint([Row("text", "a", "b\ng|h", "a caption\nwith a newline\x01"),
                                                      Row("text", "b", "g", "x")])


def test_another_way_of_decoding_makes_another_store(tmp_path, monkeypatch):
    """The same rows decoded otherwise (a decode setting, or DECODE_VERSION for a change no setting shows)
    are another store, never the old one reused."""
    import dataclasses

    from ushash.data import media

    m = write_manifest(tmp_path / "m", 12)
    first = run_extract(cfg_for(tmp_path, m), splits=["train"])["train"]
    assert run_extract(cfg_for(tmp_path, m), splits=["train"])["train"].path == first.path   # reused as it is
    monkeypatch.setattr(media, "FILE_LIMITS", dataclasses.replace(media.FILE_LIMITS, decode_side=224))
    reduced = run_extract(cfg_for(tmp_path, m), splits=["train"])["train"]
    monkeypatch.setattr(media, "FILE_LIMITS", dataclasses.replace(media.FILE_LIMITS, decode_side=448))
    monkeypatch.setattr(media, "DECODE_VERSION", media.DECODE_VERSION + 1)
    bumped = run_extract(cfg_for(tmp_path, m), splits=["train"])["train"]
    assert len({first.path, reduced.path, bumped.path}) == 3
    assert first.tables["text"].ids == reduced.tables["text"].ids == bumped.tables["text"].ids


def test_content_digest_is_what_a_store_holds_not_its_name(tmp_path, monkeypatch):
    """A store made again from the same pixels under another name (a bumped DECODE_VERSION) has the same content
    digest; a changed feature value, or another row's labels, gives another (checked against a naive rehash)."""
    import shutil

    import numpy as np

    from ushash.data import media
    from ushash.data.store import content_digest, open_split

    m = write_manifest(tmp_path / "m", 12)
    first = run_extract(cfg_for(tmp_path, m), splits=["train"])["train"]
    monkeypatch.setattr(media, "DECODE_VERSION", media.DECODE_VERSION + 1)
    again = run_extract(cfg_for(tmp_path, m), splits=["train"])["train"]
    assert again.path != first.path and content_digest(again) == content_digest(first)
    copy = tmp_path / "copy"
    shutil.copytree(first.path, copy)
    x = np.load(copy / "text.npy")
    x[3, 5] = np.nextafter(x[3, 5], np.float32(np.inf))  # one float32 ulp
    np.save(copy / "text.npy", x)
    assert content_digest(open_split(copy)) != content_digest(first)
    shutil.rmtree(copy)
    shutil.copytree(first.path, copy)
    rows = (copy / "image.rows.jsonl").read_text().splitlines()
    rec = json.loads(rows[0])
    rec["labels"] = rec["labels"] + ["extra"]
    (copy / "image.rows.jsonl").write_text("\n".join([json.dumps(rec), *rows[1:]]) + "\n")
    assert content_digest(open_split(copy)) != content_digest(first)


def test_another_split_seed_makes_another_store(tmp_path):
    m = write_manifest(tmp_path / "m", 12, split_col=False)
    a = run_extract(cfg_for(tmp_path, m, "data.val_frac=0.3", "data.seed=0"), splits=["train"])["train"]
    b = run_extract(cfg_for(tmp_path, m, "data.val_frac=0.3", "data.seed=5"), splits=["train"])["train"]
    assert a.path != b.path and a.tables["text"].ids != b.tables["text"].ids


def test_a_manifest_carries_its_own_name(tmp_path):
    split = run_extract(cfg_for(tmp_path, write_manifest(tmp_path / "m", 8), "data.name=mine"),
                        splits=["train"])["train"]
    assert split.meta["dataset"] == "mine" and split.path.parts[-3] == "mine"


def test_empty_captions_are_counted_and_reported(tmp_path):
    m = write_manifest(tmp_path / "m", 8)
    recs = [json.loads(line) for line in m.read_text().splitlines()]
    recs[0]["text"], recs[1]["text"] = "", "   "
    m.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rep = run_extract(cfg_for(tmp_path, m), splits=["train"])["train"].report
    assert rep["modalities"]["text"] == {"rows": 4, "ok": 2, "failed": 2}
    assert sorted((f["id"], f["reason"]) for f in rep["failed"]) == [("0", "empty caption"), ("1", "empty caption")]


def test_eval_refuses_a_store_of_other_rows(tmp_path):
    m = write_manifest(tmp_path / "m", 12)
    cfg = cfg_for(tmp_path, m)
    splits = run_extract(cfg, splits=["train", "val", "test"])
    out = run_train(cfg, splits={"train": splits["train"], "val": splits["val"]})
    write_manifest(tmp_path / "m", 12, caption="one {} box")  # the manifest changed after training
    with pytest.raises(FeatureStoreError, match="no feature store of manifest/test for the rows .* extract it"):
        run_eval(compose("eval", [f"paths.root={tmp_path}", f"ckpt={out['last']}"]))


def test_a_copied_checkpoint_uses_the_stores_of_the_clone_it_is_in(tmp_path):
    m = write_manifest(tmp_path / "media", 12)
    a, b = tmp_path / "a", tmp_path / "b"
    cfg = cfg_for(a, m)
    splits = run_extract(cfg, splits=["train", "val", "test"])
    out = run_train(cfg, splits={"train": splits["train"], "val": splits["val"]})
    prov = load_checkpoint(out["last"]).hparams.provenance
    assert prov["features_dir"] == "data/features"  # relative to the project root, not this machine's path
    assert prov["stores"]["train"] == splits["train"].meta["rows_fingerprint"]
    want = run_eval(compose("eval", [f"paths.root={a}", f"ckpt={out['last']}"]))["rows"]
    shutil.copytree(a, b)
    shutil.rmtree(a)  # the old clone is gone: only b's stores can be read
    ckpt = b / Path(out["last"]).relative_to(a)
    got = run_eval(compose("eval", [f"paths.root={b}", f"ckpt={ckpt}"]))
    assert got["rows"] == want and str(b) in got["out"]


def test_a_store_of_another_manifest_of_the_same_name_is_never_used(tmp_path):
    """Where a checkpoint's rows cannot be listed (its manifest moved, or an export that leaves the path out)
    the store is the one its recorded rows fingerprint names, or none: never the one store of that name,
    which was another manifest's."""
    from ushash.data.extract import stored_split
    from ushash.serving.export import _stores

    a, b = write_manifest(tmp_path / "a", 12), write_manifest(tmp_path / "b", 12, caption="one {} box")
    out = run_train(cfg_for(tmp_path, a, "data.name=shared"))
    prov = dict(load_checkpoint(out["best"]).hparams.provenance)
    run_extract(cfg_for(tmp_path, b, "data.name=shared"), splits=["test"])   # another manifest's test split
    feats = tmp_path / "data" / "features"
    recorded = _stores(prov)   # what an export records while the manifest is there: the test split too
    assert set(recorded) == {"train", "val", "test"} and all(recorded.values())
    a.rename(a.with_suffix(".moved"))
    with pytest.raises(FeatureStoreError, match="cannot list the rows of shared/test"):
        stored_split(prov, "test", feats)
    with pytest.raises(FeatureStoreError, match="no feature store of shared/test"):   # named, and not there
        stored_split({**prov, "stores": recorded}, "test", feats)
    assert stored_split(prov, "train", feats).meta["rows_fingerprint"] == recorded["train"]  # the checkpoint's record
    a.with_suffix(".moved").rename(a)
    run_extract(cfg_for(tmp_path, a, "data.name=shared"), splits=["test"])
    a.rename(a.with_suffix(".moved"))
    assert stored_split({**prov, "stores": recorded}, "test", feats).meta["rows_fingerprint"] == recorded["test"]
