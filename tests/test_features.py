"""Feature store: extraction, bad rows, NaN rejection, resume after a kill, atomic finished folders."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from ushash.data import store as features
from ushash.data.store import FeatureStoreError, extract, open_split
from ushash.data.rows import Row


class CountingEncoder(torch.nn.Module):
    """A deterministic stand-in: feature = simple statistics of the input; counts encoded rows."""

    name, fingerprint, modalities = "counting", "abc123", ("image", "text")
    dims = {"image": 3, "text": 2}
    sample_rate, audio_seconds = None, None

    def __init__(self, fail_after=None, nan_text=None):
        super().__init__()
        self.seen, self.fail_after, self.nan_text = 0, fail_after, nan_text

    def preprocess(self, modality, raw):
        if modality == "image":
            return torch.tensor(np.asarray(raw, dtype=np.float32).mean(axis=(0, 1)))
        return raw

    def collate(self, modality, xs):
        return torch.stack(xs) if modality == "image" else list(xs)

    def encode(self, modality, batch):
        self.seen += len(batch)
        if self.fail_after is not None and self.seen > self.fail_after:
            raise KeyboardInterrupt("simulated kill")
        if modality == "image":
            return batch
        out = torch.tensor([[len(s), s.count("a")] for s in batch], dtype=torch.float32)
        if self.nan_text:
            for i, s in enumerate(batch):
                if s == self.nan_text:
                    out[i, 0] = float("nan")
        return out


def _rows(tmp_path, n=12, corrupt=(3,), empty_caption=(5,)):
    rows = []
    for i in range(n):
        p = tmp_path / f"img{i}.png"
        if i in corrupt:
            p.write_bytes(b"\x89PNG\r\n\x1a\n garbage")
        else:
            Image.fromarray(np.full((4, 4, 3), i * 5, np.uint8)).save(p)
        rows.append(Row("image", f"i{i}", f"g{i}", str(p), (f"c{i % 3}",)))
        rows.append(Row("text", f"t{i}", f"g{i}", "" if i in empty_caption else f"a caption {'a' * i}", (f"c{i % 3}",)))
    return rows


def test_extract_skips_bad_rows_without_shifting_pairs(tmp_path):
    rows = _rows(tmp_path)
    split = extract(rows, CountingEncoder(), tmp_path / "feat", "toy", "train", batch_size=4, num_workers=0,
                    progress=False)
    img, txt = split.tables["image"], split.tables["text"]
    assert len(img) == 11 and "i3" not in img.ids
    assert len(txt) == 11 and "t5" not in txt.ids
    # every remaining feature row still belongs to its own group
    for rid, g, x in zip(img.ids, img.groups, img.x):
        i = int(rid[1:])
        assert g == f"g{i}" and np.allclose(x, i * 5)
    for rid, g, x in zip(txt.ids, txt.groups, txt.x):
        i = int(rid[1:])
        assert g == f"g{i}" and x[1] == i + 2  # "a caption " has two a's
    rep = split.report
    assert rep["modalities"]["image"] == {"rows": 12, "ok": 11, "failed": 1}
    reasons = {f["id"]: f["reason"] for f in rep["failed"]}
    assert set(reasons) == {"i3", "t5"} and "empty" in reasons["t5"]
    assert split.meta["encoder"]["fingerprint"] == "abc123"
    assert not list((tmp_path / "feat").rglob("*.partial"))


def test_nan_features_rejected_and_named(tmp_path):
    rows = _rows(tmp_path, corrupt=(), empty_caption=())
    with pytest.warns(UserWarning, match="t4"):
        split = extract(rows, CountingEncoder(nan_text="a caption aaaa"), tmp_path / "feat", "toy", "train",
                        batch_size=4, num_workers=0, progress=False)
    assert "t4" not in split.tables["text"].ids
    assert any(f["id"] == "t4" and "NaN" in f["reason"] for f in split.report["failed"])


def test_store_with_nan_refuses_to_open(tmp_path):
    split = extract(_rows(tmp_path, corrupt=(), empty_caption=()), CountingEncoder(), tmp_path / "feat", "toy",
                    "train", batch_size=4, num_workers=0, progress=False)
    arr = np.load(split.path / "image.npy", mmap_mode="r+")
    arr[2, 0] = np.inf
    arr.flush()
    with pytest.raises(FeatureStoreError, match="i2"):
        open_split(split.path)


def test_resume_after_kill_encodes_each_row_once(tmp_path):
    rows = _rows(tmp_path, n=40, corrupt=(), empty_caption=())
    enc = CountingEncoder(fail_after=24)
    with pytest.raises(KeyboardInterrupt):
        extract(rows, enc, tmp_path / "feat", "toy", "train", batch_size=4, num_workers=0, progress=False,
                flush_every=1)
    partial = next((tmp_path / "feat").rglob("*.partial"))
    assert json.loads((partial / "image.progress.json").read_text())["done"] == 24
    enc2 = CountingEncoder()
    split = extract(rows, enc2, tmp_path / "feat", "toy", "train", batch_size=4, num_workers=0, progress=False)
    assert enc2.seen == 40 + 16  # text (40) + the 16 images left; finished images are not redone
    assert len(split.tables["image"]) == 40
    np.testing.assert_allclose(split.tables["image"].x[:, 0], [i * 5 for i in range(40)])
    # a finished store is reused as it is
    enc3 = CountingEncoder()
    extract(rows, enc3, tmp_path / "feat", "toy", "train", num_workers=0, progress=False)
    assert enc3.seen == 0


def test_most_rows_bad_stops_with_what_was_found(tmp_path):
    rows = _rows(tmp_path, n=6, corrupt=(0, 1, 2, 3, 4))
    with pytest.raises(FeatureStoreError, match=r"5 of 6 image rows failed"):
        extract(rows, CountingEncoder(), tmp_path / "feat", "toy", "train", num_workers=0, progress=False)


def test_duplicate_ids_refused(tmp_path):
    rows = _rows(tmp_path, n=3, corrupt=())
    rows.append(rows[0])
    with pytest.raises(ValueError, match="duplicate"):
        extract(rows, CountingEncoder(), tmp_path / "feat", "toy", "train", num_workers=0, progress=False)


def test_missing_or_damaged_store_messages(tmp_path):
    with pytest.raises(FeatureStoreError, match="ushash.extract"):
        open_split(tmp_path / "nothing")
    split = extract(_rows(tmp_path, n=4, corrupt=()), CountingEncoder(), tmp_path / "feat", "toy", "train",
                    num_workers=0, progress=False)
    (split.path / "text.npy").write_bytes(b"junk")
    with pytest.raises(FeatureStoreError, match="text.npy"):
        open_split(split.path)


def test_worker_processes_give_same_result(tmp_path):
    rows = _rows(tmp_path, n=10)
    a = extract(rows, CountingEncoder(), tmp_path / "a", "toy", "train", batch_size=3, num_workers=0, progress=False)
    b = extract(rows, CountingEncoder(), tmp_path / "b", "toy", "train", batch_size=3, num_workers=2, progress=False)
    for m in ("image", "text"):
        assert a.tables[m].ids == b.tables[m].ids
        np.testing.assert_array_equal(a.tables[m].x, b.tables[m].x)


def test_concurrent_extractions_of_one_store_take_turns(tmp_path):
    import threading
    rows = _rows(tmp_path, n=4, corrupt=())
    enc = CountingEncoder()
    out = features.store_path(tmp_path / "feat", "toy", "train", enc.name, enc.fingerprint)
    result = {}
    with features._exclusive(out.with_name(out.name + ".lock")):
        t = threading.Thread(target=lambda: result.setdefault(
            "split", extract(rows, enc, tmp_path / "feat", "toy", "train", num_workers=0, progress=False)))
        t.start()
        t.join(timeout=1.0)
        assert t.is_alive() and enc.seen == 0  # waiting for the lock, nothing encoded yet
    t.join(timeout=30)
    assert len(result["split"].tables["image"]) == 4


def test_decode_workers_auto_leaves_a_core_for_the_encoder(monkeypatch):
    monkeypatch.setattr(features.os, "cpu_count", lambda: 2)
    assert features.decode_workers("auto") == 1
    monkeypatch.setattr(features.os, "cpu_count", lambda: 64)
    assert features.decode_workers("auto") == 8
    assert features.decode_workers(3) == 3
