"""CC3M recipe on img2dataset-style webdataset tars, streamed through ushash.data.shards, end to end."""

import io
import json
import tarfile

import numpy as np
import pytest
from PIL import Image

from ushash.data import shards
from ushash.config import compose
from ushash.data.datasets import hash_split, load_rows
from ushash.evaluation.evaluate import run_eval
from ushash.data.extract import run_extract
from ushash.hashing.training import run_train

VAL_FRAC = 0.5
CORRUPT = {("train", "000000003"), ("validation", "000000005")}   # image bytes that are not a JPEG
EMPTY_CAPTION = "000000007"            # in train
NO_CAPTION = "000010002"               # a sample whose .txt is missing: image row only
TRUNCATED_TAR, TRUNCATE_AFTER = "00001", 9   # this train tar is cut inside sample 9's image
PARQUET_TAR, NOT_DOWNLOADED = "00002", "000020004"  # sample listed by the .parquet as failed


def jpeg(seed):
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (20, 28, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=80)
    return buf.getvalue()


def add(tf, name, data):
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    tf.addfile(ti, io.BytesIO(data))


def write_shard(folder, shard, n, base, seed=None):
    """An img2dataset webdataset shard: {key}.jpg, {key}.txt, {key}.json; returns the keys. The images are drawn
    from seeds `seed` + i (default: `base` + i)."""
    seed = base if seed is None else seed
    path = folder / f"{shard}.tar"
    keys = [f"{base + i:09d}" for i in range(n)]
    buf = io.BytesIO()
    cut = None
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for i, k in enumerate(keys):
            if shard == PARQUET_TAR and k == NOT_DOWNLOADED:
                continue
            if folder.name == "train" and shard == TRUNCATED_TAR and i == TRUNCATE_AFTER:
                cut = buf.tell() + 512 + 100  # inside this image's data
            add(tf, f"{k}.jpg", b"not a jpeg at all" if (folder.name, k) in CORRUPT else jpeg(seed + i))
            if k != NO_CAPTION:
                empty = folder.name == "train" and k == EMPTY_CAPTION
                add(tf, f"{k}.txt", ("" if empty else f"caption of sample {k} in {folder.name}").encode())
            add(tf, f"{k}.json", json.dumps({"key": k, "status": "success", "url": f"http://x/{k}.jpg"}).encode())
    data = buf.getvalue()
    path.write_bytes(data if cut is None or folder.name != "train" else data[:cut])
    if shard == PARQUET_TAR:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"key": keys, "url": [f"http://x/{k}.jpg" for k in keys],
                                 "caption": [f"caption of sample {k} (parquet)" for k in keys],
                                 "status": ["failed_to_download" if k == NOT_DOWNLOADED else "success" for k in keys]}),
                       folder / f"{shard}.parquet")
    return keys


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = tmp_path_factory.mktemp("cc3m") / "cc3m"
    (r / "train").mkdir(parents=True)
    (r / "validation").mkdir()
    train = [k for s in range(3) for k in write_shard(r / "train", f"{s:05d}", 14, 10000 * s)]
    write_shard(r / "validation", "00000", 13, 0, seed=100000)   # each img2dataset run numbers from 000000000
    (r / "Train_GCC-training.tsv").write_text("".join(f"caption {k}\thttp://x/{k}.jpg\n" for k in train))
    return r


def test_rows_and_splits(root):
    train, val, test = (load_rows("cc3m", s, root=str(root), val_frac=VAL_FRAC) for s in ("train", "val", "test"))
    keys = lambda rows, m: [r.id for r in rows if r.modality == m]  # noqa: E731
    # test = the validation shards: 13 samples, named by their run's folder (its keys are the train run's too)
    assert keys(test, "image") == [f"validation/{i:09d}" for i in range(13)] == keys(test, "text")
    assert not {r.group for r in test} & {r.group for r in train + val}
    img = next(r for r in test if r.modality == "image")
    assert img.source == f"tar:{root / 'validation' / '00000.tar'}#000000000.jpg"
    assert shards.packed_source(img) == (f"tar:{root / 'validation' / '00000.tar'}", "000000000.jpg")
    # train/val: a hash of the key splits the training shards; the truncated tar still lists its intact samples
    listed = [f"{i:09d}" for i in range(14)] + [f"{10000 + i:09d}" for i in range(TRUNCATE_AFTER + 1)] + \
             [f"{20000 + i:09d}" for i in range(14) if f"{20000 + i:09d}" != NOT_DOWNLOADED]
    expect = {s: [k for k in listed if hash_split(k, 0, VAL_FRAC, 0.0) == s] for s in ("train", "val")}
    assert keys(train, "image") == expect["train"] and keys(val, "image") == expect["val"]
    assert min(len(expect["train"]), len(expect["val"])) >= 12
    assert NO_CAPTION not in keys(train, "text") + keys(val, "text")
    caption = {r.id: r.source for r in train + val if r.modality == "text"}
    assert caption[EMPTY_CAPTION] == "" and caption["000020001"] == "caption of sample 000020001 (parquet)"


def test_wrong_root_and_duplicates(root, tmp_path):
    (tmp_path / "Train_GCC-training.tsv").write_text("a cat\thttp://x/1.jpg\n")
    with pytest.raises(FileNotFoundError, match=r"no \.tar shards under .*train; expected the img2dataset "
                                                r"webdataset layout.*download them with img2dataset"):
        load_rows("cc3m", "train", root=str(tmp_path))
    dup = tmp_path / "dup" / "train"
    dup.mkdir(parents=True)
    write_shard(dup, "00000", 3, 0)
    write_shard(dup, "00007", 3, 0)
    with pytest.raises(ValueError, match=r"keys occur in more than one shard.*'000000000' \(00000.tar and 00007.tar\)"):
        load_rows("cc3m", "train", root=str(dup.parent))


def test_extract_train_eval(root, tmp_path):
    cfg = compose("config", [f"paths.root={tmp_path}", "data=cc3m", f"data.root={root}", f"data.val_frac={VAL_FRAC}",
                             "encoder=tiny", "encoder.modalities=[image,text]", "extract.num_workers=0",
                             "extract.progress=false", "trainer.accelerator=cpu", "trainer.max_epochs=2", "bits=16",
                             "model.dim=16", "model.hidden=32", "model.batch_size=8",
                             "trainer.enable_progress_bar=false"])
    splits = run_extract(cfg)
    test, train, val = splits["test"], splits["train"], splits["val"]
    assert test.report["modalities"] == {"image": {"rows": 13, "ok": 12, "failed": 1},
                                         "text": {"rows": 13, "ok": 13, "failed": 0}}
    why = {(f["modality"], f["id"]): f["reason"] for s in (train, val, test) for f in s.report["failed"]}
    assert "cannot decode image" in why[("image", "validation/000000005")]
    assert "cannot decode image" in why[("image", "000000003")]
    assert "empty caption" in why[("text", EMPTY_CAPTION)]
    assert "00001.tar: unreadable after" in why[("image", f"{10000 + TRUNCATE_AFTER:09d}")]
    # pairing by key survives the bad rows; image and text rows of a sample share its group
    for s in (train, val, test):
        for t in s.tables.values():
            assert list(t.ids) == list(t.groups)
    assert "validation/000000005" not in test.tables["image"].ids and "validation/000000005" in test.tables["text"].ids
    out = run_train(cfg, splits={"train": train, "val": val})
    res = run_eval(compose("eval", [f"paths.root={tmp_path}", f"ckpt={out['last']}"]))
    t2i = next(r for r in res["rows"] if r["direction"] == "T→I" and r["kind"] == "codes")
    assert t2i["protocol"] == "paired" and t2i["n_queries"] == 13 and t2i["n_no_relevant"] == 1
    # against the train split's database no test caption has a pair: the two runs' keys are alike, their samples not
    res = run_eval(compose("eval", [f"paths.root={tmp_path}", f"ckpt={out['last']}", "database=train"]))
    t2i = next(r for r in res["rows"] if r["direction"] == "T→I" and r["kind"] == "codes")
    assert t2i["n_queries"] == 13 and t2i["n_no_relevant"] == 13
