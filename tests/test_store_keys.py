"""A feature store is never served for anything but what made it: each change below to the rows, their
files, their decoding or the encoder makes another store with the features the code gives now."""

import os
import sys

import numpy as np
import pytest
from PIL import Image

from ushash.data.extract import extract
from ushash.data.rows import Row
from ushash.encoders import build_encoder

from test_encoders import word_tokenizer

SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="20" height="20"><rect width="20" height="10" fill="red"/></svg>'


def _png(path, value, size=8):
    Image.fromarray(np.full((size, size, 3), value, np.uint8)).save(path)
    return str(path)


def _rows(tmp_path, n=4):
    rows = []
    for i in range(n):
        rows.append(Row("image", f"i{i}", f"g{i}", _png(tmp_path / f"{i}.png", 40 * i)))
        rows.append(Row("text", f"t{i}", f"g{i}", f"caption number {i}"))
    return rows


def _extract(rows, root, enc=None, **kw):
    enc = enc or build_encoder({"name": "tiny", "dim": 8, "modalities": ["image", "text"], "device": "cpu"})
    return extract(rows, enc, root, "toy", "train", batch_size=3, num_workers=0, progress=False, **kw)


def _fresh(rows, tmp_path, name, enc=None):
    return _extract(rows, tmp_path / name, enc)


def _same_as_fresh(split, fresh):
    for m in fresh.tables:
        assert split.tables[m].ids == fresh.tables[m].ids
        np.testing.assert_array_equal(np.asarray(split.tables[m].x), np.asarray(fresh.tables[m].x))


@pytest.mark.parametrize("change", ["caption", "image_same_name", "image_same_size", "reorder", "add_row",
                                    "labels", "group"])
def test_a_changed_row_never_reuses_the_store(tmp_path, change):
    rows = _rows(tmp_path)
    first = _extract(rows, tmp_path / "feat")
    if change == "caption":
        rows[1] = Row("text", "t0", "g0", "another caption")
    elif change == "image_same_name":
        _png(rows[2].source, 250, size=12)
    elif change == "image_same_size":  # same bytes count and dimensions, other pixels, a later mtime
        size = os.path.getsize(rows[2].source)
        Image.fromarray(np.full((8, 8, 3), 7, np.uint8)).save(rows[2].source)
        st = os.stat(rows[2].source)
        os.utime(rows[2].source, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert os.path.getsize(rows[2].source) == size
    elif change == "reorder":
        rows = rows[2:] + rows[:2]
    elif change == "add_row":
        rows.append(Row("text", "t9", "g9", "one more"))
    elif change == "labels":
        rows[1] = Row("text", "t0", "g0", rows[1].source, ("new",))
    elif change == "group":
        rows[1] = Row("text", "t0", "g1", rows[1].source)
    again = _extract(rows, tmp_path / "feat")
    assert again.path != first.path
    _same_as_fresh(again, _fresh(rows, tmp_path, "fresh"))


@pytest.mark.parametrize("setting", [{"image_size": 16}, {"seed": 1}, {"vocab_size": 512}])
def test_another_encoder_setting_or_weights_never_reuses_the_store(tmp_path, setting):
    rows = _rows(tmp_path)
    first = _extract(rows, tmp_path / "feat")
    enc = build_encoder({"name": "tiny", "dim": 8, "modalities": ["image", "text"], "device": "cpu", **setting})
    again = _extract(rows, tmp_path / "feat", enc)
    assert again.path != first.path
    assert not np.allclose(np.asarray(again.tables["image" if "vocab_size" not in setting else "text"].x),
                           np.asarray(first.tables["image" if "vocab_size" not in setting else "text"].x))


def test_an_svg_store_made_without_cairosvg_is_not_reused_once_it_is_installed(tmp_path, monkeypatch):
    """Without cairosvg the SVG rows fail (needs_dependency); under max_bad_frac the store is finished without
    them. It was reused, still without them, after cairosvg was installed: the SVG renderer is part of the
    rows fingerprint of rows with SVG files."""
    pytest.importorskip("cairosvg")
    rows = _rows(tmp_path, n=3)
    (tmp_path / "s.svg").write_bytes(SVG)
    rows.append(Row("image", "svg", "g0", str(tmp_path / "s.svg")))
    monkeypatch.setitem(sys.modules, "cairosvg", None)     # import cairosvg raises ImportError
    without = _extract(rows, tmp_path / "feat")
    assert "svg" not in without.tables["image"].ids
    assert [f["code"] for f in without.report["failed"]] == ["needs_dependency"]
    monkeypatch.delitem(sys.modules, "cairosvg")
    with_svg = _extract(rows, tmp_path / "feat")
    assert with_svg.path != without.path
    assert "svg" in with_svg.tables["image"].ids and with_svg.report["failed"] == []


def test_a_dataset_folder_saved_again_over_the_same_files_gives_other_rows(tmp_path):
    """`hf:<dataset dir>#...` rows were keyed by the folder's own size and time, which change only when an
    entry is added or removed: a dataset saved again over the same .arrow files kept its fingerprint."""
    from ushash.data.store import rows_fingerprint

    ds = tmp_path / "coco_hf"
    (ds / "test").mkdir(parents=True)
    arrow = ds / "test" / "data-00000-of-00001.arrow"
    arrow.write_bytes(b"images, version 1")
    rows = [Row("image", "0", "g0", f"hf:{ds}#test/0/image")]
    before = rows_fingerprint(rows)
    folder_time = os.stat(ds).st_mtime_ns
    with open(arrow, "r+b") as f:  # rewritten in place: same name, same size
        f.write(b"images, version 2")
    st = os.stat(arrow)
    os.utime(arrow, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert os.stat(ds).st_mtime_ns == folder_time
    assert rows_fingerprint(rows) != before


def test_a_dataset_split_folder_linked_in_is_tracked(tmp_path):
    """A split folder that is a symbolic link (data kept on another disk) was not walked: its .arrow files
    rewritten with other images kept the fingerprint. A link back up the tree is walked once."""
    from ushash.data.store import rows_fingerprint

    real = tmp_path / "disk2" / "test"
    real.mkdir(parents=True)
    arrow = real / "data-00000-of-00001.arrow"
    arrow.write_bytes(b"images, version 1")
    ds = tmp_path / "coco_hf"
    ds.mkdir()
    os.symlink(real, ds / "test")
    os.symlink(ds, real / "loop")
    rows = [Row("image", "0", "g0", f"hf:{ds}#test/0/image")]
    before = rows_fingerprint(rows)
    arrow.write_bytes(b"images, version 2, another size")
    assert rows_fingerprint(rows) != before


def test_svg_bytes_in_a_container_are_keyed_by_the_svg_renderer(tmp_path, monkeypatch):
    """A tar member or a dataset cell is decoded as SVG by its bytes whatever its name, so rows inside a
    container carry the renderer in their fingerprint as .svg files do (a store made without cairosvg would
    otherwise be reused, without those rows, once it is installed)."""
    from ushash.data import store

    tar = tmp_path / "00000.tar"
    tar.write_bytes(b"a tar")
    rows = [Row("image", "1", "1", f"tar:{tar}#000001.jpg")]
    keys = set()
    for renderer in ("none (ImportError)", "cairosvg 2.7.1, cairo 1.18.0"):
        monkeypatch.setattr(store, "svg_renderer", lambda r=renderer: r)
        keys.add(store.rows_fingerprint(rows))
    assert len(keys) == 2


def test_a_plain_row_naming_a_folder_is_not_walked(tmp_path, monkeypatch):
    """Only a container is keyed by the files in it: a manifest cell naming a folder ("photos/", or "/") fails
    at extraction (not_a_file), and its fingerprint once walked and stat'ed the whole tree under it first."""
    from ushash.data import store

    (tmp_path / "photos" / "a" / "b").mkdir(parents=True)
    calls = []
    monkeypatch.setattr(store, "_folder_key", lambda path: calls.append(path) or "folder walked")
    store.rows_fingerprint([Row("image", "1", "1", str(tmp_path / "photos"))])
    assert calls == []
    store.rows_fingerprint([Row("image", "1", "1", f"hf:{tmp_path / 'photos'}#test/0/image")])
    assert calls == [str(tmp_path / "photos")]


def test_a_tar_in_a_folder_whose_name_holds_a_hash_is_tracked(tmp_path):
    """The tar's path was cut at the first '#', so /data/cc3m#v1/00000.tar was looked up as /data/cc3m
    ("missing"): the tar rewritten with other images kept the fingerprint and its old features."""
    from ushash.data.store import container_file, container_path, rows_fingerprint

    tar = tmp_path / "cc3m#v1" / "00000.tar"
    tar.parent.mkdir()
    tar.write_bytes(b"tar, version 1")
    rows = [Row("image", "0", "g0", f"tar:{tar}#000000000.jpg")]
    assert container_path(rows[0].source) == str(tar)
    assert container_path(f"hf:{tmp_path / 'd#1'}#test/7/image") == str(tmp_path / "d#1")
    assert container_path(str(tar)) is None
    assert container_file(f"hf:{tmp_path / 'd#1'}#test@3") == str(tmp_path / "d#1")
    assert container_file(f"tar:{tar}") == str(tar)
    before = rows_fingerprint(rows)
    tar.write_bytes(b"tar, version 2 with other images")
    assert rows_fingerprint(rows) != before


def test_a_store_replaced_by_a_run_killed_midway_is_found_whole(tmp_path, monkeypatch):
    """`finish` removed the older store in place: a kill midway left a half-deleted store that every later
    run found, could not open, and would not replace. It is renamed aside first, then removed."""
    from ushash.data import store

    def table(value):
        return {"text": {"x": np.full((2, 4), value, np.float32), "ids": ["a", "b"], "groups": ["a", "b"]}}

    enc = {"name": "tiny", "fingerprint": "0" * 12, "config": {}}
    out = tmp_path / "toy" / "train" / "tiny-000000000000-r0123456789abcdef"
    store.write_split(out, "toy", "train", table(1.0), enc, rows="0123456789abcdef")
    store.write_split(tmp_path / "new", "toy", "train", table(2.0), enc, rows="0123456789abcdef")
    os.replace(tmp_path / "new", store.partial_path(out))
    rmtree = store.shutil.rmtree

    def killed(path, *a, **kw):
        os.unlink(os.path.join(path, "meta.json"))
        raise KeyboardInterrupt("killed while removing the older store")

    monkeypatch.setattr(store.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        store.finish(store.partial_path(out), out)
    monkeypatch.setattr(store.shutil, "rmtree", rmtree)
    assert float(np.asarray(store.open_split(out).tables["text"].x)[0, 0]) == 2.0
    assert store.stores_named(out.with_name("tiny-000000000000")) == [out]   # not the one set aside


def _tokenized_clip(tmp_path):
    """A tiny CLIP saved in a folder with a word-level tokenizer: (the folder, the tokenizer's words, a function
    that builds the encoder from the folder)."""
    from test_encoders import TINY_CLIP

    model = tmp_path / "clip"
    # the text tower pools where its eos id is: the tokenizer's below (else it pools the first token alone)
    config = {**TINY_CLIP, "text_config": {**TINY_CLIP["text_config"], "pad_token_id": 0, "bos_token_id": 1,
                                           "eos_token_id": 2}}
    tiny = build_encoder({"name": "hf_clip", "config": config, "device": "cpu"})
    tiny.model.save_pretrained(model)
    tiny.image_processor.save_pretrained(model)
    words = ["caption", "number", "0", "1", "2", "3"]
    word_tokenizer(model, words)
    return model, words, lambda: build_encoder({"name": "hf_clip", "model": str(model), "device": "cpu"})


def test_a_store_made_with_other_tokenizer_files_under_the_same_path_is_checked_not_reused_as_it_is(tmp_path):
    """The encoder's fingerprint covers its weights and config, not the tokenizer files beside them: a tokenizer
    replaced under the same model folder tokenises the captions otherwise, yet the store of the old one was reused
    as it was. A store records the tokenizer's digest; where it is another, a sample of its rows is encoded again
    and, giving other text features, the store is refused (as a store of other library versions is)."""
    pytest.importorskip("transformers")
    from ushash.data.store import FeatureStoreError

    model, words, enc = _tokenized_clip(tmp_path)
    rows = _rows(tmp_path)
    first = _extract(rows, tmp_path / "feat", enc())
    digest = first.meta["libraries"]["text tokenizer"]
    assert digest == enc().tokenizer_digests()["text tokenizer"]
    assert _extract(rows, tmp_path / "feat", enc()).path == first.path      # the same files: reused
    word_tokenizer(model, list(reversed(words)))                           # other ids for the same words
    swapped = enc()
    assert swapped.fingerprint == enc().fingerprint and swapped.tokenizer_digests()["text tokenizer"] != digest
    with pytest.raises(FeatureStoreError, match=rf"made with text tokenizer {digest} -> \w+, .*extract again"):
        _extract(rows, tmp_path / "feat", swapped)
    word_tokenizer(model, words)                                            # back: reused, unchecked
    back = _extract(rows, tmp_path / "feat", enc())
    assert back.path == first.path and back.tokenizers == {"text tokenizer": digest}
    # a store made before stores recorded the digest: checked once, then known to be of these files (what the
    # checkpoint's provenance, and so the export, records)
    import json

    meta = json.loads((first.path / "meta.json").read_text())
    del meta["libraries"]["text tokenizer"]
    (first.path / "meta.json").write_text(json.dumps(meta))
    (first.path / "verified.json").unlink(missing_ok=True)
    older = _extract(rows, tmp_path / "feat", enc())
    assert "text tokenizer" not in older.meta["libraries"] and older.tokenizers == {"text tokenizer": digest}
    assert json.loads((first.path / "verified.json").read_text())[-1]["text tokenizer"] == digest


def test_an_export_refuses_raw_text_through_other_tokenizer_files_than_its_features_were_made_with(tmp_path):
    """An export records the tokenizer digest of the store its head was trained on; a cache building the encoder
    from the export encodes raw text only where the tokenizer files are those (the weights fingerprint alone let
    other files through: a head fed other token ids, serving meaningless codes)."""
    pytest.importorskip("transformers")
    import torch

    from ushash.hashing.heads import USHash
    from ushash.serving.artifact import load_export
    from ushash.serving.cache.request import QueryEncoder, RequestError
    from ushash.serving.export import write_export

    model, words, enc = _tokenized_clip(tmp_path)
    made = enc()
    torch.manual_seed(0)
    out = write_export(USHash({"image": 16, "text": 16}, bits=32, dim=24), tmp_path / "e",
                       {"name": "hf_clip", "fingerprint": made.fingerprint, "config": {"model": str(model)},
                        "tokenizers": made.tokenizer_digests()})
    head = load_export(out)
    assert head.manifest["encoder"]["tokenizers"] == made.tokenizer_digests() != {}
    assert QueryEncoder(head).features("text", "caption number 1").shape == (16,)
    word_tokenizer(model, list(reversed(words)))
    with pytest.raises(RequestError, match=r"reads other tokenizer files .* than the export's features were made with"):
        QueryEncoder(head).features("text", "caption number 1")


def test_the_tokenizer_digest_is_of_its_files_not_of_their_folder_or_the_object(tmp_path):
    """The digest is of the files (name and bytes): the same files in another folder give the same digest, the
    tokenizer's calls (which set its truncation and padding) change nothing, a tokenizer made in memory has
    none, and MiniLM's bundled one has one."""
    pytest.importorskip("transformers")
    import shutil

    from transformers import AutoTokenizer

    from ushash.encoders.text_minilm import bundled_model_dir
    from ushash.encoders.tokenizing import HFTokenizer, tokenizer_digest

    model, words, enc = _tokenized_clip(tmp_path)
    digest = tokenizer_digest(AutoTokenizer.from_pretrained(model))
    shutil.copytree(model, tmp_path / "elsewhere")
    moved = AutoTokenizer.from_pretrained(tmp_path / "elsewhere")
    HFTokenizer(moved, 8)(["caption number 1", "caption"])   # padding and truncation set on the object
    assert tokenizer_digest(moved) == digest == enc().tokenizer_digests()["text tokenizer"]
    (tmp_path / "elsewhere" / "tokenizer.json").write_bytes((model / "tokenizer.json").read_bytes() + b" ")
    assert tokenizer_digest(AutoTokenizer.from_pretrained(tmp_path / "elsewhere")) != digest
    moved.name_or_path = ""
    assert tokenizer_digest(moved) is None
    assert tokenizer_digest(AutoTokenizer.from_pretrained(bundled_model_dir())) is not None
