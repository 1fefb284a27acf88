"""Sharded extraction: same store as unsharded, independent of world size, resumable, bad rows, tar streams."""

import io
import tarfile

import numpy as np
import pytest
from PIL import Image

from ushash.data import shards
from ushash.encoders import build_encoder
from ushash.data.extract import extract
from ushash.data.store import FeatureStoreError
from ushash.data.rows import Row


@pytest.fixture(scope="module")
def encoder():
    return build_encoder({"name": "tiny", "dim": 8, "modalities": ["image", "text"], "device": "cpu", "amp": False})


def _png(path, i):
    rng = np.random.default_rng(i)
    Image.fromarray(rng.integers(0, 255, (12, 10, 3), dtype=np.uint8)).save(path)


def _rows(tmp_path, n=24, corrupt=(), missing=(), empty=()):
    rows = []
    for i in range(n):
        p = tmp_path / f"img{i:03d}.png"
        if i in corrupt:
            p.write_bytes(b"\x89PNG\r\n\x1a\n not really")
        elif i not in missing:
            _png(p, i)
        rows.append(Row("image", f"i{i}", f"g{i}", str(p), (f"c{i % 3}",)))
        rows.append(Row("text", f"t{i}", f"g{i}", "" if i in empty else f"caption number {i}", (f"c{i % 3}",)))
    return rows


def _same(a, b):
    assert a.modalities == b.modalities
    for m in a.modalities:
        ta, tb = a.tables[m], b.tables[m]
        assert ta.ids == tb.ids and list(ta.groups) == list(tb.groups) and ta.labels == tb.labels
        np.testing.assert_allclose(np.asarray(ta.x), np.asarray(tb.x), rtol=1e-5, atol=1e-6)
    assert a.report["failed"] == b.report["failed"]


class Killed(Exception):
    pass


class KilledAfter:
    """The encoder, killed after `n` encode calls (a simulated crash part-way through)."""

    def __init__(self, enc, n):
        self.enc, self.n = enc, n

    def __getattr__(self, k):
        return getattr(self.enc, k)

    def encode(self, m, b):
        self.n -= 1
        if self.n < 0:
            raise Killed()
        return self.enc.encode(m, b)


def test_shard_of_is_stable():
    assert shards.shard_of("COCO_val2014_000000391895", 64) == shards.shard_of("COCO_val2014_000000391895", 64)
    counts = np.bincount([shards.shard_of(f"id{i}", 8) for i in range(4000)], minlength=8)
    assert counts.min() > 400  # roughly uniform


def test_lightning_sharded_equals_plain_extraction(tmp_path, encoder):
    rows = _rows(tmp_path, corrupt=(4,), empty=(7,))
    plain = extract(rows, encoder, tmp_path / "plain", "toy", "train", batch_size=5, num_workers=0, progress=False)
    sharded = shards.extract_sharded(rows, encoder, tmp_path / "sharded", "toy", "train", shards=3,
                                     accelerator="cpu", batch_size=5, num_workers=0, progress=False)
    _same(plain, sharded)
    assert sharded.meta["dataset"] == "toy" and sharded.meta["split"] == "train"
    assert sharded.report["modalities"]["image"] == {"rows": 24, "ok": 23, "failed": 1}
    assert sharded.report["shards"]["hash_shards"] == {"image": 3, "text": 3}
    assert not (sharded.path.parent / (sharded.path.name + ".shards")).exists()  # units removed after merge
    assert not list((tmp_path / "sharded").rglob("*.partial"))


def test_world_size_change_and_resume_after_kill(tmp_path, encoder):
    rows = _rows(tmp_path, corrupt=(2,), missing=(9,))
    ref = extract(rows, encoder, tmp_path / "plain", "toy", "val", batch_size=4, num_workers=0, progress=False)

    def plan(enc):
        return shards.Plan(rows, enc, tmp_path / "feat", "toy", "val", shards=4, batch_size=4, num_workers=0,
                           progress=False)

    # world size 2: rank 0 finishes one shard and is killed inside the next; rank 1 never ran
    with pytest.raises(Killed):
        plan(KilledAfter(encoder, 3)).run_rank(KilledAfter(encoder, 3), rank=0, world_size=2)
    p = plan(encoder)
    assert 0 < sum(p.done(u) for u in p.units) < len(p.units)
    assert list(p.work.rglob("*.partial"))  # the interrupted shard's resumable state
    with pytest.raises(FeatureStoreError, match="not finished"):
        p.check()
    # restart with world size 3: ranks pick up the same units, finished ones are skipped
    for rank in range(3):
        p.run_rank(encoder, rank, 3)
    merged = p.merge(p.check())
    _same(ref, merged)
    assert not p.work.exists()
    # a finished store is reused as is
    again = shards.extract_sharded(rows, encoder, tmp_path / "feat", "toy", "val", shards=7, accelerator="cpu",
                                   num_workers=0, progress=False)
    assert again.path == merged.path and again.report["shards"]["hash_shards"] == {"image": 4, "text": 4}


def test_killed_before_the_merge_merges_without_encoding(tmp_path, encoder):
    rows = _rows(tmp_path, n=8)
    p = shards.Plan(rows, encoder, tmp_path / "feat", "toy", "train", shards=3, num_workers=0, progress=False)
    p.run_rank(encoder)  # every shard finished; the merge never ran
    split = shards.extract_sharded(rows, KilledAfter(encoder, 0), tmp_path / "feat", "toy", "train", shards=3,
                                   accelerator="cpu", num_workers=0, progress=False)
    assert len(split.tables["image"]) == len(split.tables["text"]) == 8 and not p.work.exists()


def test_bad_rows_across_shards_and_the_limit(tmp_path, encoder):
    # one shard whose image rows all fail must not break the others; the split-wide limit still applies
    rows = _rows(tmp_path, n=10, missing=(3,))
    p = shards.Plan(rows, encoder, tmp_path / "f1", "toy", "test", shards=10, num_workers=0, progress=False)
    p.run_rank(encoder)
    rep = p.check()
    assert rep["modalities"]["image"] == {"rows": 10, "ok": 9, "failed": 1}
    assert rep["failed"][0]["id"] == "i3" and "file not found" in rep["failed"][0]["reason"]
    split = p.merge(rep)
    assert "i3" not in split.tables["image"].ids and len(split.tables["text"]) == 10

    bad = _rows(tmp_path / "x", n=6, missing=(0, 1, 2, 3)) if (tmp_path / "x").mkdir() is None else None
    with pytest.raises(FeatureStoreError, match=r"4 of 6 image rows failed \(limit 50%\).*file not found"):
        shards.extract_sharded(bad, encoder, tmp_path / "f2", "toy", "test", shards=2, accelerator="cpu",
                               num_workers=0, progress=False)


def test_a_split_stopped_by_bad_rows_extracts_them_again_once_fixed(tmp_path, encoder, monkeypatch):
    """Stopped at max_bad_frac by a passing failure: the units holding failed rows were kept as finished, so
    every later run stopped the same way after the fix. They are extracted again; the store equals a fresh one."""
    from ushash.data import media

    rows = _rows(tmp_path, n=8)
    real = media.load
    monkeypatch.setattr(media, "load", lambda m, src, *a, **k: (_ for _ in ()).throw(
        media.MediaError(src, "needs cairosvg", media.NEEDS_DEPENDENCY)) if m == "image" and not src.endswith(
        "img000.png") else real(m, src, *a, **k))
    kw = dict(shards=3, accelerator="cpu", num_workers=0, progress=False)
    with pytest.raises(FeatureStoreError, match="7 of 8 image rows failed"):
        shards.extract_sharded(rows, encoder, tmp_path / "f", "toy", "test", **kw)
    monkeypatch.setattr(media, "load", real)
    split = shards.extract_sharded(rows, encoder, tmp_path / "f", "toy", "test", **kw)
    assert split.report["failed"] == [] and len(split.tables["image"]) == 8
    _same(split, extract(rows, encoder, tmp_path / "plain", "toy", "test", num_workers=0, progress=False))


def _tar(path, members, truncate_at=None):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    data = buf.getvalue()
    path.write_bytes(data if truncate_at is None else data[:truncate_at])


def test_tar_stream_matches_files_and_names_bad_members(tmp_path, encoder):
    files = []
    for i in range(6):
        _png(tmp_path / f"{i}.png", i)
        files.append((tmp_path / f"{i}.png").read_bytes())
    _tar(tmp_path / "a.tar", [("k0.png", files[0]), ("k0.txt", b"zero"), ("k1.png", b"garbage"),
                              ("k2.png", files[2]), ("k3.png", b"")])
    _tar(tmp_path / "b.tar", [("k4.png", files[4]), ("k5.png", files[5] * 2)], truncate_at=700)
    keys = {"a.tar": ["k0", "k1", "k2", "k3", "k9"], "b.tar": ["k4", "k5"]}
    rows = [Row("image", k, k, f"tar:{tmp_path / t}#{k}.png") for t, ks in keys.items() for k in ks]
    assert shards.packed_source(rows[0]) == (f"tar:{tmp_path / 'a.tar'}", "k0.png")
    assert shards.needs_shards(rows) and not shards.needs_shards([Row("text", "x", "x", "tar:a#b")])
    split = shards.extract_sharded(rows, encoder, tmp_path / "feat", "toy", "train", accelerator="cpu",
                                   batch_size=2, num_workers=0, progress=False, max_bad_frac=0.9)
    img = split.tables["image"]
    assert img.ids == ["k0", "k2"]  # row order, not tar order
    why = {f["id"]: f["reason"] for f in split.report["failed"]}
    assert set(why) == {"k1", "k3", "k9", "k4", "k5"}
    assert "cannot decode image" in why["k1"] and "empty member" in why["k3"]
    assert "not found" in why["k9"] and "unreadable after" in why["k4"]
    # the streamed features are those of the same images read from files
    ref = extract([Row("image", f"k{i}", f"k{i}", str(tmp_path / f"{i}.png")) for i in (0, 2)], encoder,
                  tmp_path / "ref", "toy", "train", num_workers=0, progress=False)
    np.testing.assert_allclose(np.asarray(img.x), np.asarray(ref.tables["image"].x), rtol=1e-5, atol=1e-6)


def test_a_reused_store_of_tar_members_is_checked_by_reading_them_out_of_their_tars(tmp_path, encoder, monkeypatch,
                                                                                  caplog):
    """Under other library versions a reused store is checked by encoding a sample of its rows again; rows inside
    a tar could not be read by path, so such a store was reused unchecked ("none of its rows could be encoded
    again"). They are read out of their tars now: the same features verify it, other features refuse it."""
    import json
    import logging

    import torch

    from ushash.data import extract as extract_mod

    files = []
    for i in range(8):
        _png(tmp_path / f"{i}.png", i)
        files.append((f"k{i}.png", (tmp_path / f"{i}.png").read_bytes()))
    _tar(tmp_path / "a.tar", files[:5])
    _tar(tmp_path / "b.tar", files[5:])
    rows = [Row("image", f"k{i}", f"k{i}", f"tar:{tmp_path / ('a.tar' if i < 5 else 'b.tar')}#k{i}.png")
            for i in range(8)] + [Row("text", f"t{i}", f"k{i}", f"caption {i}") for i in range(8)]
    kw = dict(accelerator="cpu", batch_size=4, num_workers=0, progress=False)
    made = shards.extract_sharded(rows, encoder, tmp_path / "feat", "toy", "train", **kw)
    upgraded = {**made.meta["libraries"], "pillow": "99.0"}
    monkeypatch.setattr(extract_mod, "libraries", lambda: upgraded)
    with caplog.at_level(logging.INFO, logger="ushash.data.extract"):
        again = shards.extract_sharded(rows, encoder, tmp_path / "feat", "toy", "train", **kw)
    assert again.path == made.path and "none of its rows" not in caplog.text
    assert f"{2 * extract_mod.REUSE_SAMPLE} of its rows encode to its features here" in caplog.text
    assert json.loads((made.path / extract_mod.VERIFIED).read_text()) == [upgraded]

    class Decodes(type(encoder)):   # the same weights; images now decode to other features
        def encode(self, modality, batch):
            out = super().encode(modality, batch)
            return out + 1.0 if modality == "image" else out

    other = Decodes.__new__(Decodes)
    other.__dict__.update(encoder.__dict__)
    monkeypatch.setattr(extract_mod, "libraries", lambda: {**upgraded, "pillow": "100.0"})
    with pytest.raises(FeatureStoreError, match=r"made with pillow \S+ -> 100\.0.*lowest cosine"):
        shards.extract_sharded(rows, other, tmp_path / "feat", "toy", "train", **kw)


def test_stream_failures_carry_codes_and_match_file_failures(tmp_path, encoder):
    _png(tmp_path / "0.png", 0)
    good = (tmp_path / "0.png").read_bytes()
    _tar(tmp_path / "a.tar", [("k0.png", good), ("k1.png", b"garbage"), ("k2.png", b"")])
    _tar(tmp_path / "b.tar", [("k3.png", good), ("k4.png", good * 2)], truncate_at=700)
    keys = {"a.tar": ["k0", "k1", "k2", "k9"], "b.tar": ["k3", "k4"]}
    rows = [Row("image", k, k, f"tar:{tmp_path / t}#{k}.png") for t, ks in keys.items() for k in ks]
    split = shards.extract_sharded(rows, encoder, tmp_path / "feat", "toy", "train", accelerator="cpu",
                                   batch_size=2, num_workers=0, progress=False, max_bad_frac=0.9)
    codes = {f["id"]: f["code"] for f in split.report["failed"]}
    assert codes == {"k1": "undecodable", "k2": "empty", "k9": "not_in_container", "k3": "unreadable_container",
                     "k4": "unreadable_container"}
    # the same bytes as files fail with the same code and reason, the source aside
    (tmp_path / "k1.png").write_bytes(b"garbage")
    files = [Row("image", "k1", "k1", str(tmp_path / "k1.png")), Row("image", "k0", "k0", str(tmp_path / "0.png"))]
    plain = extract(files, encoder, tmp_path / "plain", "toy", "train", num_workers=0, progress=False)
    (f_plain,), f_stream = plain.report["failed"], split.report["failed"][0]
    assert f_plain["code"] == f_stream["code"]
    assert f_plain["reason"].removeprefix(f_plain["source"]) == f_stream["reason"].removeprefix(f_stream["source"])
    with pytest.raises(FeatureStoreError, match=r"5 of 6 image rows failed \(limit 50%\); reasons include "
                                                r"\['cannot decode', 'empty', 'not found in its container', "
                                                r"'unreadable container'\]"):
        shards.extract_sharded(rows, encoder, tmp_path / "feat2", "toy", "train", accelerator="cpu", batch_size=2,
                               num_workers=0, progress=False)


def test_a_dataset_cell_is_read_by_its_container_with_or_without_a_chunk(tmp_path):
    """A reused store's check reads a packed row by its own container (`packed_source`: hf:<dir>#<split>);
    only stream units carried the @<chunk> suffix read_container expected, so the check read nothing there."""
    import datasets

    png = io.BytesIO()
    Image.new("RGB", (4, 4), (255, 0, 0)).save(png, "PNG")
    feats = datasets.Features({"image": datasets.Image(), "cocoid": datasets.Value("int64")})
    ds = datasets.Dataset.from_list([{"image": {"bytes": png.getvalue(), "path": None}, "cocoid": 7}], features=feats)
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "d@1"))
    row = Row("image", "7", "7", f"hf:{tmp_path / 'd@1'}#test/0/image")
    container, member = shards.packed_source(row)
    for c in (container, container + "@0"):
        assert [(m, data) for m, data in shards.read_container(c, {member: 0})] == [(member, png.getvalue())]
