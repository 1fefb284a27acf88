"""Feature store: extraction, bad rows, NaN rejection, resume after a kill, atomic finished folders."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from ushash.core.io import exclusive
from ushash.data import extract as extraction, store as features
from ushash.data.extract import extract
from ushash.data.store import FeatureStoreError, open_split
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


def test_rows_that_failed_are_tried_again_when_the_extraction_resumes(tmp_path, monkeypatch):
    """A passing failure (an optional decoder missing, a read that failed) stops the extraction at
    `max_bad_frac`; once it is fixed, the resumed extraction decodes those rows again instead of keeping their
    old failures (which stopped every later run the same way), and equals one made from scratch."""
    from ushash.data import media

    rows = _rows(tmp_path, n=10, corrupt=(), empty_caption=())
    real = media.load

    def flaky(modality, source, *a, **k):
        if modality == "image" and not source.endswith(("img0.png", "img1.png")):
            raise media.MediaError(source, "SVG needs cairosvg", media.NEEDS_DEPENDENCY)
        return real(modality, source, *a, **k)

    monkeypatch.setattr(media, "load", flaky)
    with pytest.raises(FeatureStoreError, match="8 of 10 image rows failed"):
        extract(rows, CountingEncoder(), tmp_path / "feat", "toy", "train", batch_size=3, num_workers=0,
                progress=False)
    monkeypatch.setattr(media, "load", real)
    enc = CountingEncoder()
    split = extract(rows, enc, tmp_path / "feat", "toy", "train", batch_size=3, num_workers=0, progress=False)
    assert enc.seen == 8 + 0 + 10  # the 8 failed images again (the 2 good ones are kept), then the text
    assert split.report["failed"] == [] and split.report["modalities"]["image"] == {"rows": 10, "ok": 10, "failed": 0}
    fresh = extract(rows, CountingEncoder(), tmp_path / "fresh", "toy", "train", batch_size=4, num_workers=0,
                    progress=False)
    assert split.tables["image"].ids == fresh.tables["image"].ids
    np.testing.assert_array_equal(split.tables["image"].x, fresh.tables["image"].x)


@pytest.mark.parametrize("fails", [1, 2, 99])
def test_a_file_the_system_fails_to_read_is_read_again_before_it_counts(tmp_path, monkeypatch, fails):
    """An image whose reads fail with EIO `fails` times (a flaky disk, a network file system): it is read
    again after each pause of READ_RETRY_PAUSES, so a passing failure leaves no row out of the finished store
    (it was recorded as undecodable and left out for good); one that keeps failing is counted once, as
    unreadable. A file whose content is bad is not read again."""
    import errno

    from ushash.data import media

    monkeypatch.setattr(extraction, "READ_RETRY_PAUSES", (0.0, 0.0))
    rows = _rows(tmp_path, n=6, corrupt=(3,), empty_caption=())
    real_open, tries = media.Image.open, {"img2.png": 0, "img3.png": 0}

    def flaky(fp, *a, **k):
        name = str(fp).rsplit("/", 1)[-1]
        if name in tries:
            tries[name] += 1
            if name == "img2.png" and tries[name] <= fails:
                raise OSError(errno.EIO, "Input/output error", str(fp))
        return real_open(fp, *a, **k)

    monkeypatch.setattr(media.Image, "open", flaky)
    split = extract(rows, CountingEncoder(), tmp_path / "feat", "toy", "train", batch_size=4, num_workers=0,
                    progress=False)
    codes = {f["id"]: f["code"] for f in split.report["failed"]}
    assert tries["img3.png"] == 1 and codes["i3"] == "undecodable"   # its content: tried once
    if fails <= len(extraction.READ_RETRY_PAUSES):
        assert tries["img2.png"] == fails + 1 and "i2" in split.tables["image"].ids and "i2" not in codes
    else:
        assert tries["img2.png"] == 1 + len(extraction.READ_RETRY_PAUSES) and codes["i2"] == "unreadable"
        assert "i2" not in split.tables["image"].ids


def test_a_kill_while_failed_rows_are_retried_loses_none_of_them(tmp_path, monkeypatch):
    """Killed while retrying: each row is still either encoded or recorded as failed, never neither."""
    from ushash.data import media

    rows = _rows(tmp_path, n=10, corrupt=(), empty_caption=())
    real = media.load
    monkeypatch.setattr(media, "load", lambda m, src, *a, **k: (_ for _ in ()).throw(
        media.MediaError(src, "read failed", media.UNDECODABLE)) if m == "image" else real(m, src, *a, **k))
    with pytest.raises(FeatureStoreError):
        extract(rows, CountingEncoder(), tmp_path / "feat", "toy", "train", batch_size=3, num_workers=0,
                progress=False)
    monkeypatch.setattr(media, "load", real)
    with pytest.raises(KeyboardInterrupt):
        extract(rows, CountingEncoder(fail_after=3), tmp_path / "feat", "toy", "train", batch_size=3,
                num_workers=0, progress=False, flush_every=1)
    partial = next((tmp_path / "feat").rglob("*.partial"))
    prog = json.loads((partial / "image.progress.json").read_text())
    assert len(prog["ok"]) == 3 and len(prog["failed"]) == 7
    assert {rows[2 * i].id for i in prog["ok"]}.isdisjoint(prog["failed"])
    split = extract(rows, CountingEncoder(), tmp_path / "feat", "toy", "train", batch_size=3, num_workers=0,
                    progress=False)
    assert len(split.tables["image"]) == 10


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
    out = features.identity_path(tmp_path / "feat", features.store_identity(
        "toy", "train", features.encoder_meta(enc), features.rows_fingerprint(rows)))
    result = {}
    with exclusive(out.with_name(out.name + ".lock")):
        t = threading.Thread(target=lambda: result.setdefault(
            "split", extract(rows, enc, tmp_path / "feat", "toy", "train", num_workers=0, progress=False)))
        t.start()
        t.join(timeout=1.0)
        assert t.is_alive() and enc.seen == 0  # waiting for the lock, nothing encoded yet
    t.join(timeout=30)
    assert len(result["split"].tables["image"]) == 4


def test_decode_workers_auto_leaves_a_core_for_the_encoder(monkeypatch):
    monkeypatch.setattr(extraction.os, "cpu_count", lambda: 2)
    assert extraction.decode_workers("auto") == 1
    monkeypatch.setattr(extraction.os, "cpu_count", lambda: 64)
    assert extraction.decode_workers("auto") == 8
    assert extraction.decode_workers(3) == 3


# ------------------------------------------------------------------------------- the shared pieces
def test_failures_carry_codes(tmp_path):
    rows = _rows(tmp_path, n=8, corrupt=(3,), empty_caption=(5,))
    rows.append(Row("image", "i-missing", "g-missing", str(tmp_path / "nope.png")))
    with pytest.warns(UserWarning, match="t4"):
        split = extract(rows, CountingEncoder(nan_text="a caption aaaa"), tmp_path / "feat", "toy", "train",
                        batch_size=4, num_workers=0, progress=False)
    codes = {f["id"]: f["code"] for f in split.report["failed"]}
    assert codes == {"i3": "undecodable", "i-missing": "not_found", "t4": "non_finite_features", "t5": "empty"}
    assert all(set(f) == {"modality", "id", "source", "reason", "code"} for f in split.report["failed"])


def test_prepare_turns_every_decoding_failure_into_a_record(tmp_path):
    class Broken(CountingEncoder):
        def preprocess(self, modality, raw):
            raise TypeError("a bug")

    x, fail = extraction.prepare(CountingEncoder(), "text", "  a caption ")
    assert x == "a caption" and fail is None
    assert extraction.prepare(CountingEncoder(), "text", " ") == (None, {"code": "empty", "reason": "empty caption"})
    assert extraction.prepare(Broken(), "text", "fine") == (None, {"code": "decoder_error",
                                                                   "reason": "TypeError: a bug"})
    _, fail = extraction.prepare(CountingEncoder(), "image", str(tmp_path / "nope.png"))
    assert fail == {"code": "not_found", "reason": f"{tmp_path / 'nope.png'}: file not found"}
    png = tmp_path / "a.png"
    Image.fromarray(np.full((4, 4, 3), 10, np.uint8)).save(png)
    from_file, _ = extraction.prepare(CountingEncoder(), "image", str(png))
    from_bytes, _ = extraction.prepare(CountingEncoder(), "image", "tar:x.tar#a.png", png.read_bytes())
    assert torch.equal(from_file, from_bytes)


def test_encode_batch_rejects_non_finite_rows_by_position():
    enc = CountingEncoder(nan_text="b")
    with pytest.warns(UserWarning, match=r"rejected 1 rows with NaN/inf features: \['id-b'\]"):
        feats, bad = extraction.encode_batch(enc, "text", ["a", "b", "c"], ["id-a", "id-b", "id-c"])
    assert feats.dtype == np.float32 and feats.shape == (3, 2)
    assert bad == {1: {"code": "non_finite_features", "reason": "non-finite features (NaN/inf) from the encoder"}}


def test_check_bad_rows_summarises_by_reason_and_writes_the_report(tmp_path):
    failed = [{"modality": "image", "id": f"i{k}", "source": f"/d/{k}.png", "reason": f"/d/{k}.png: file not found",
               "code": "not_found"} for k in range(3)]
    failed += [{"modality": "image", "id": "i9", "source": "/d/9.png", "reason": "/d/9.png: cannot decode image (x)",
                "code": "undecodable"},
               {"modality": "image", "id": "old", "source": "/d/o.png", "reason": "written before codes"},
               {"modality": "text", "id": "t0", "source": "", "reason": "empty caption", "code": "empty"}]
    report = {"dataset": "toy", "split": "val", "failed": failed,
              "modalities": {"image": {"rows": 8, "ok": 3, "failed": 5}, "text": {"rows": 8, "ok": 7, "failed": 1}}}
    extraction.check_bad_rows(report, "text", 0.5, tmp_path / "report.json")  # within the limit
    assert not (tmp_path / "report.json").exists()
    with pytest.raises(FeatureStoreError) as e:
        extraction.check_bad_rows(report, "image", 0.5, tmp_path / "report.json")
    assert str(e.value) == ("toy/val: 5 of 8 image rows failed (limit 50%); reasons include ['cannot decode', "
                            f"'file not found', 'unknown']. Full list: {tmp_path / 'report.json'}. "
                            "Check the data root.")
    assert json.loads((tmp_path / "report.json").read_text()) == report
    report["modalities"]["text"]["ok"] = 0  # nothing left is always too many
    with pytest.raises(FeatureStoreError, match="toy/val: 1 of 8 text rows failed.*'empty'"):
        extraction.check_bad_rows(report, "text", 0.5, tmp_path / "no such folder" / "report.json")


def test_store_identity_names_the_folder_and_fills_meta(tmp_path):
    enc = CountingEncoder()
    rows = _rows(tmp_path, n=3, corrupt=())
    fp = features.rows_fingerprint(rows)
    identity = features.store_identity("toy", "train", features.encoder_meta(enc, {"name": "counting", "k": 1}), fp)
    assert identity == {"dataset": "toy", "split": "train", "encoder": {
        "name": "counting", "fingerprint": "abc123", "config": {"name": "counting", "k": 1}}, "rows_fingerprint": fp}
    out = features.identity_path(tmp_path, identity)
    assert out == tmp_path / "toy" / "train" / f"counting-abc123-r{fp}"
    split = extract(rows, enc, tmp_path, "toy", "train",
                    encoder_cfg={"name": "counting", "k": 1}, num_workers=0, progress=False)
    assert split.path == out
    keys = ["store_version", "ushash_version", "dataset", "split", "encoder", "rows_fingerprint", "modalities",
            "libraries", "created"]
    assert list(split.meta) == keys and {k: split.meta[k] for k in identity} == identity
    written = features.write_split(tmp_path / "w", "toy", "train", {"text": {"x": np.ones((1, 2)), "ids": ["a"],
                                                                            "groups": ["g"]}}, identity["encoder"], rows=fp)
    assert list(written.meta) == keys and {k: written.meta[k] for k in identity} == identity


def test_a_rows_labels_given_as_a_bare_string_are_refused_not_stored_as_its_characters(tmp_path):
    tables = {"text": {"x": np.ones((2, 2), np.float32), "ids": ["a", "b"], "groups": ["g", "h"],
                       "labels": [("cat",), "dog"]}}
    enc = {"name": "counting", "fingerprint": "abc123", "config": {}}
    with pytest.raises(ValueError, match=r"labels of row 'b' are the string 'dog'; pass a list of labels \(\['dog'\]\)"):
        features.write_split(tmp_path / "w", "toy", "train", tables, enc)
    assert not (tmp_path / "w").exists()
    tables["text"]["labels"] = [("cat",), ["dog"]]
    assert features.write_split(tmp_path / "w", "toy", "train", tables, enc).tables["text"].labels == [("cat",), ("dog",)]


def test_a_store_made_under_other_library_versions_is_reused_only_if_a_sample_encodes_to_its_features(
        tmp_path, monkeypatch):
    """A store's key covers the encoder's weights, config and precision, not the code of the libraries that
    decode, tokenise and run it: a store made under other versions (a transformers upgrade that tokenises
    otherwise) was reused as it was. Under the versions it records it is reused unchecked; under others a
    sample of its rows is encoded again: the same features mark it verified for them (checked once), other
    features refuse it, naming the versions that changed."""
    import json

    from ushash.data import extract as extract_mod

    rows = _rows(tmp_path, corrupt=(), empty_caption=())
    enc = CountingEncoder()
    made = extract(rows, enc, tmp_path / "feat", "toy", "train", num_workers=0, progress=False)
    assert made.meta["libraries"] == features.libraries() and made.meta["libraries"]["numpy"] == np.__version__
    seen = enc.seen
    assert extract(rows, enc, tmp_path / "feat", "toy", "train", num_workers=0, progress=False).path == made.path
    assert enc.seen == seen                                    # the versions it records: nothing encoded again
    upgraded = {**features.libraries(), "transformers": "99.0"}
    monkeypatch.setattr(extract_mod, "libraries", lambda: upgraded)
    again = extract(rows, enc, tmp_path / "feat", "toy", "train", num_workers=0, progress=False)
    assert again.path == made.path and enc.seen == seen + 2 * extract_mod.REUSE_SAMPLE
    assert json.loads((made.path / extract_mod.VERIFIED).read_text()) == [upgraded]
    extract(rows, enc, tmp_path / "feat", "toy", "train", num_workers=0, progress=False)
    assert enc.seen == seen + 2 * extract_mod.REUSE_SAMPLE    # verified for these versions once
    monkeypatch.setattr(extract_mod, "libraries", lambda: {**upgraded, "transformers": "100.0"})

    class Tokenises(CountingEncoder):   # the same weights and config; the text now encodes otherwise
        def encode(self, modality, batch):
            out = super().encode(modality, batch)
            return out + torch.tensor([0.0, 1.0]) if modality == "text" else out

    with pytest.raises(features.FeatureStoreError, match=r"made with transformers \S+ -> 100\.0,.*"
                                                         r"lowest cosine to its features is 0\.9.*extract again"):
        extract(rows, Tokenises(), tmp_path / "feat", "toy", "train", num_workers=0, progress=False)
    assert not any("100.0" in str(v) for v in json.loads((made.path / extract_mod.VERIFIED).read_text()))


def test_store_uses_the_one_atomic_write_and_lock(tmp_path):
    from filelock import FileLock, Timeout

    import ushash.core.io as core_io

    assert features.write_json is core_io.write_json  # re-exported for modules that import it from here
    out = tmp_path / "toy" / "train" / "counting-abc123"
    with features.store_lock(out):
        with pytest.raises(Timeout):
            FileLock(str(out.with_name(out.name + ".lock"))).acquire(timeout=0)


def test_every_file_of_a_store_reaches_the_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """Only meta.json was fsynced: after a power cut a finished-looking store could hold arrays and row lists
    that never reached the disk. Each file is fsynced before the rename, the folder too."""
    import os

    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else fd)
        return real_fsync(fd)

    def replace(a, b):
        renamed.append((str(a), len(synced)))
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    split = extract(_rows(tmp_path, n=3, corrupt=(), empty_caption=()), CountingEncoder(), tmp_path / "feat",
                    "toy", "train", num_workers=0, progress=False)
    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc to name the fsynced files")
    partial = str(split.path) + ".partial"
    before = synced[:[n for a, n in renamed if a == partial][0]]
    for name in ("image.npy", "text.npy", "image.rows.jsonl", "text.rows.jsonl", "report.json", "meta.json"):
        assert os.path.join(partial, name) in before, name
    assert partial in before


def test_run_extract_logs_one_summary_line_per_split(tmp_path, caplog):
    import logging

    from ushash.config import compose

    recs = [{"text": f"caption {i}", "group": f"g{i}", "split": "train"} for i in range(3)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = compose("config", [f"paths.root={tmp_path}", "data=manifest", f"data.path={tmp_path / 'm.jsonl'}",
                             "encoder=tiny", "encoder.modalities=[text]", "extract.num_workers=0",
                             "extract.progress=false", "extract.splits=[train]"])
    with caplog.at_level(logging.INFO, logger="ushash.data.extract"):
        split = extraction.run_extract(cfg)["train"]
    lines = [r.getMessage() for r in caplog.records if r.name == "ushash.data.extract"]
    assert lines == [f"manifest/train: text 3/3 ok; 0 failed -> {split.path}"]  # the console adds "[extract] "
