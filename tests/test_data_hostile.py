"""Hostile data set files: a manifest or annotation file that is damaged, or a tar whose member declares more
bytes than it holds, gives one clear error (naming the file and line) or one counted bad row; never a
traceback of the reader nor an allocation of what a header claims."""

import io
import json
import tarfile

import numpy as np
import pytest
from PIL import Image

from ushash.data import media, shards
from ushash.data.datasets import coco, manifest
from ushash.data.rows import Row
from ushash.encoders import build_encoder


def _rows(path):
    return manifest.rows(path, "train", val_frac=0, test_frac=0)


def test_a_deeply_nested_jsonl_record_is_one_clear_error(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"text": "ok"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(ValueError, match=r"m\.jsonl:2: JSON nested too deeply"):
        _rows(p)


@pytest.mark.parametrize("suffix, body", [(".jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": "\xff\xfe"}\n'),
                                          (".csv", b"text\na\n\xff\xfe\nb\n")])
def test_a_manifest_that_is_not_utf8_names_the_line(tmp_path, suffix, body):
    p = tmp_path / f"m{suffix}"
    p.write_bytes(body)
    with pytest.raises(ValueError, match=rf"m\{suffix}:3: not UTF-8 text .*save the manifest as UTF-8"):
        _rows(p)


def test_a_csv_field_over_the_csv_limit_names_the_manifest(tmp_path):
    p = tmp_path / "m.csv"
    p.write_text("text\nshort\n" + "a" * 200_000 + "\n")
    with pytest.raises(ValueError, match=r"manifest .*m\.csv: unreadable CSV .*field larger than field limit"):
        _rows(p)


def test_a_nul_in_a_manifest_value_names_the_line(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"text": "ok"}\n{"image": "a\\u0000b.png"}\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2: Row '2': its source holds a NUL"):
        _rows(p)


def test_a_row_of_a_non_string_field_is_a_clear_error():
    with pytest.raises(ValueError, match="its source must be a string, got int 5"):
        Row("text", "1", "1", 5)
    with pytest.raises(ValueError, match="its source must be a string, got list"):
        Row("text", "1", "1", ["a"])


@pytest.mark.parametrize("name, body, match", [
    ("m.csv", "image,text\na.jpg,A dog, running on the beach\n",
     r"m\.csv:2: 3 fields where the header has 2 .*quote values that hold a comma"),
    ("m.csv", "image,text,labels\na.jpg,A dog, running,dog\n", r"m\.csv:2: 4 fields where the header has 3"),
    ("m.tsv", 'image\ttext\na.jpg\tA red car\nb.jpg\t"Stop sign\nc.jpg\tA dog\n',
     r"m\.tsv: unreadable TSV after line \d.*starts with a double quote"),
    ("m.tsv", 'image\ttext\nb.jpg\t"Stop sign\nc.jpg\tA dog"\nd.jpg\tTwo cats\n',
     r"m\.tsv:\d: a value runs over several lines"),
    ("m.csv", "image,text,image\nfront.jpg,a car,back.jpg\n", r"m\.csv:1: column 'image' appears more than once"),
    ("m.csv", "id,image,text,labels,split\n1,a.jpg,a cat,cat,train\n2,b.jpg,a dog,test\n",
     r"m\.csv:3: 4 fields where the header has 5 \(no value for 'split'\): write an empty field"),
])
def test_a_csv_record_read_otherwise_than_written_is_refused(tmp_path, name, body, match):
    """An unquoted comma in a caption, a TSV value opened with a quote, a column named twice, a record with a
    field left out: DictReader cut the caption (or took its words as a label), swallowed the next records, kept
    one of the two columns, or read the record's split as its labels (a test item in training)."""
    p = tmp_path / name
    p.write_text(body)
    with pytest.raises(ValueError, match=match):
        _rows(p)


def test_a_csv_line_with_a_trailing_separator_or_blank_lines_is_read(tmp_path):
    """What the checks above must not refuse: an empty extra field, blank lines, a quoted comma."""
    p = tmp_path / "m.csv"
    p.write_text('text,labels\n"a dog, running",dog,\n\n\nbird,\n')
    rows = _rows(p)
    assert [(r.source, r.labels) for r in rows] == [("a dog, running", ("dog",)), ("bird", ())]


@pytest.mark.parametrize("column", ["id", "group", "split"])
def test_a_lone_surrogate_in_a_manifest_key_names_the_line(tmp_path, column):
    p = tmp_path / "m.jsonl"
    value = "train\\ud83d" if column == "split" else "x\\ud83d"
    p.write_text('{"text": "ok"}\n{"text": "b", "%s": "%s"}\n' % (column, value))
    with pytest.raises(ValueError, match=rf"m\.jsonl:2: column '{column}' holds a lone surrogate"):
        _rows(p)
    with pytest.raises(ValueError, match=f"its {column if column != 'split' else 'id'} holds a lone surrogate"):
        Row("text", "x\ud83d", "g", "a") if column != "group" else Row("text", "x", "g\ud83d", "a")


def test_a_caption_that_is_not_text_is_a_reported_row_not_a_failed_extraction(tmp_path):
    """Its report entry is written with the surrogate escaped: writing it as it was stopped the extraction,
    and every rerun of it, at report.json."""
    from ushash.data.extract import extract

    p = tmp_path / "m.jsonl"
    p.write_text("".join('{"id": "r%d", "text": "%s"}\n' % (i, "a cat \\ud83d" if i == 2 else f"caption {i}")
                         for i in range(6)))
    enc = build_encoder({"name": "tiny", "dim": 8, "modalities": ["text"], "device": "cpu"})
    store = extract(_rows(p), enc, tmp_path / "feat", "mine", "train", batch_size=4, num_workers=0, progress=False)
    assert len(store.tables["text"].ids) == 5
    assert [(f["id"], f["code"], f["source"]) for f in store.report["failed"]] == [("r2", "not_text", "a cat \\ud83d")]


def test_a_jsonl_integer_past_pythons_digit_limit_names_the_line(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"text": "ok"}\n{"text": "b", "id": ' + "9" * 5000 + "}\n")
    with pytest.raises(ValueError, match=r"m\.jsonl:2: invalid JSON .*write ids as strings"):
        _rows(p)


@pytest.fixture
def karpathy(tmp_path):
    (tmp_path / "val2014").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "val2014" / "a.jpg")

    def write(image):
        rec = {"cocoid": 1, "filepath": "val2014", "filename": "a.jpg", "split": "val",
               "sentences": [{"sentid": 1, "raw": "a cat"}], **image}
        (tmp_path / coco.KARPATHY_FILE).write_text(json.dumps({"images": [rec]}))
        coco._karpathy.cache_clear()
        return tmp_path
    yield write
    coco._karpathy.cache_clear()


@pytest.mark.parametrize("image, what", [({"sentences": [{"sentid": 1, "raw": 5}]}, "sentence 1 raw"),
                                         ({"filepath": None}, "filepath"), ({"filename": 3}, "filename")])
def test_a_karpathy_field_of_the_wrong_type_names_the_file_and_image(karpathy, image, what):
    with pytest.raises(ValueError, match=rf"dataset_coco\.json: image #0 .*{what} not a string"):
        coco.karpathy_rows(karpathy(image), "val")


def test_a_null_karpathy_caption_is_an_empty_caption_row(karpathy):
    rows = coco.karpathy_rows(karpathy({"sentences": [{"sentid": 1, "raw": None}]}), "val")
    assert [(r.modality, r.source) for r in rows if r.modality == "text"] == [("text", "")]


def _sparse_tar(name: str, declared: int, data: bytes) -> bytes:
    """A tar of one old-GNU sparse member: `data` on disk, `declared` bytes (zeros after it) once extracted."""
    ti = tarfile.TarInfo(name)
    ti.size, ti.type = len(data), tarfile.GNUTYPE_SPARSE
    buf = bytearray(ti.tobuf(tarfile.GNU_FORMAT)[:512])

    def octal(n):
        return b"%011o\0" % n
    buf[386:398], buf[398:410] = octal(0), octal(len(data))  # one sparse chunk: the data, at offset 0
    buf[482], buf[483:495] = 0, octal(declared)              # no extension header; the real size
    buf[148:156] = b" " * 8
    buf[148:156] = b"%06o\0 " % sum(buf)
    return bytes(buf) + data + b"\0" * (-len(data) % 512) + b"\0" * 1024


def test_a_tar_member_declaring_more_than_the_cap_is_refused_unread(tmp_path, monkeypatch):
    png = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(png, "PNG")
    tar = tmp_path / "00000.tar"
    tar.write_bytes(_sparse_tar("k.png", 8 << 20, png.getvalue()))  # 2.5 KB on disk, 8 MiB extracted
    monkeypatch.setattr(shards, "MAX_MEMBER_BYTES", 1 << 20, raising=False)
    [(name, data)] = list(shards.read_container(f"tar:{tar}", {"k.png": 0}))
    assert name == "k.png" and isinstance(data, media.MediaError) and data.code == media.OVER_LIMIT
    # through extraction: the row is counted and named, the others extracted
    tar2 = tmp_path / "00001.tar"
    with tarfile.open(tar2, "w") as tf:
        ti = tarfile.TarInfo("g.png")
        ti.size = len(png.getvalue())
        tf.addfile(ti, io.BytesIO(png.getvalue()))
    rows = [Row("image", "k", "k", f"tar:{tar}#k.png"), Row("image", "g", "g", f"tar:{tar2}#g.png")]
    enc = build_encoder({"name": "tiny", "dim": 8, "modalities": ["image"], "device": "cpu", "amp": False})
    split = shards.extract_sharded(rows, enc, tmp_path / "feat", "toy", "train", accelerator="cpu", batch_size=2,
                                   num_workers=0, progress=False, max_bad_frac=0.9)
    assert split.tables["image"].ids == ["g"]
    [bad] = split.report["failed"]
    assert bad["id"] == "k" and bad["code"] == media.OVER_LIMIT and bad["source"] == f"tar:{tar}#k.png"
    assert "declares 8388608 bytes" in bad["reason"] and np.isfinite(np.asarray(split.tables["image"].x)).all()


def test_a_cc3m_caption_member_declaring_too_many_bytes_is_refused_unread(tmp_path, monkeypatch):
    from ushash.data.datasets import cc3m

    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "00000.tar").write_bytes(_sparse_tar("k.txt", 8 << 20, b"a cat"))  # 2 KB: 8 MiB
    monkeypatch.setattr(cc3m, "MAX_CAPTION_BYTES", 1 << 20, raising=False)
    reads = []
    real = tarfile.ExFileObject.read
    monkeypatch.setattr(tarfile.ExFileObject, "read", lambda self, *a: reads.append(a) or real(self, *a))
    cc3m._index_cached.cache_clear()
    with pytest.raises(ValueError, match=r"00000\.tar: caption member k\.txt declares 8388608 bytes"):
        cc3m.rows(tmp_path, "train", val_frac=0)
    assert reads == []
    cc3m._index_cached.cache_clear()
