"""Conceptual Captions 3M as img2dataset writes it: webdataset .tar shards, read as a stream.

Layout (`img2dataset --output_format webdataset`, one run per TSV; see docs/datasets.md):

    <root>/train/00000.tar         {key}.jpg, {key}.txt (the caption), {key}.json per downloaded sample
    <root>/train/00000.parquet     optional: key, status, caption per sample (img2dataset writes it)
    <root>/validation/00000.tar    the same, from Validation_GCC-1.1.0-Validation.tsv

One item per sample, id = group = its key ("000120034": img2dataset's key is the sample's line in the
TSV, so it is stable across re-downloads and restarts); in the test split (the validation run) it is
"<test_dir>/<key>" ("validation/000000000"): each img2dataset run numbers its samples from 000000000, so
the bare keys of the two runs name different samples alike, and an evaluation of test queries against a
train or val database (`python -m ushash.eval database=train`) would count them as each other's pairs.
The image row's source is the member inside
its tar, `tar:<abs path>#<key>.jpg`: it is never unpacked, and ushash.data.shards streams each tar once
(one extraction unit per tar). The text row is the caption from `{key}.txt`.

Splits: "test" is CC3M's validation set (the paired-relevance protocol), "train" and "val" split the
training shards by a hash of (seed, key), `val_frac` of the samples going to "val" (checkpoint
selection, never the test set).

The sample list of a tar comes from its `.parquet` when that has `key`, `status` and `caption` columns
(rows with status "success"; the image member is `{key}.{image_ext}`), else from a scan of the tar's
headers and `.txt` members (~0.6 s per 10,000-sample tar from a warm disk). Both are cached per process.
"""

from __future__ import annotations

import functools
import os
import tarfile
from pathlib import Path

from ushash.data import media
from ushash.data.datasets import SPLITS, check_fracs, hash_split, register, resolve_path
from ushash.data.rows import Row

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
#: The most bytes a {key}.txt caption member may declare (a CC3M caption is a sentence, under 1 KB)
MAX_CAPTION_BYTES = 1 << 20
LAYOUT = (
    "expected the img2dataset webdataset layout: {root}/{train}/00000.tar, 00001.tar, ... and "
    "{root}/{test}/00000.tar, ..., each tar holding {{key}}.jpg, {{key}}.txt and {{key}}.json "
    "(see docs/datasets.md, section CC3M)"
)


def tar_source(tar: str | os.PathLike, member: str) -> str:
    """The row source of a member inside a tar (read by ushash.data.shards as a stream)."""
    return f"tar:{tar}#{member}"


@functools.lru_cache(maxsize=4096)
def _index_cached(path: str, size: int, mtime: float, image_ext: str) -> tuple[tuple[str, str | None, str | None], ...]:
    p = Path(path)
    pq = p.with_suffix(".parquet")
    if pq.is_file():
        try:
            import pyarrow.parquet as papq

            cols = set(papq.read_schema(pq).names)
            if {"key", "status", "caption"} <= cols:
                t = papq.read_table(pq, columns=["key", "status", "caption"]).to_pydict()
                return tuple((str(k), f"{k}.{image_ext}", c if c is not None else "")
                             for k, s, c in zip(t["key"], t["status"], t["caption"]) if s == "success")
        except Exception:  # an unreadable sidecar: scan the tar instead
            pass
    images: dict[str, str] = {}
    captions: dict[str, str] = {}
    order: list[str] = []
    try:
        with tarfile.open(p, mode="r:") as tf:  # seekable: skips over image bytes
            for ti in tf:
                if not ti.isfile():
                    continue
                key, _, ext = ti.name.rpartition(".")
                ext = ext.lower()
                if not key or (ext not in IMAGE_EXTS and ext != "txt"):
                    continue
                if key not in images and key not in captions:
                    order.append(key)
                if ext == "txt":
                    if ti.size > MAX_CAPTION_BYTES:  # from the header: a sparse member is gigabytes of zeros
                        raise ValueError(f"{p}: caption member {ti.name} declares {ti.size} bytes, over "
                                         f"{MAX_CAPTION_BYTES} (a sparse or damaged tar?); remove it from the tar")
                    f = tf.extractfile(ti)
                    captions[key] = media.decode_text(f.read()) if f is not None else ""
                else:
                    images.setdefault(key, ti.name)
    except (tarfile.TarError, OSError, EOFError) as e:
        # A truncated tar still gives the samples before the damage; the stream reports the rest.
        if not order:
            raise ValueError(f"{p}: not a readable tar ({type(e).__name__}: {e})") from e
    return tuple((k, images.get(k), captions.get(k)) for k in order)


def read_index(tar: Path, image_ext: str = "jpg") -> tuple[tuple[str, str | None, str | None], ...]:
    """(key, image member or None, caption or None) per sample of one tar, in the tar's order."""
    st = tar.stat()
    return _index_cached(str(tar), st.st_size, st.st_mtime, image_ext)


def find_tars(root: Path, sub: str, train: str, test: str) -> list[Path]:
    d = root / sub
    tars = sorted(d.glob("*.tar")) if d.is_dir() else []
    if tars:
        return tars
    found = sorted(q.name for q in root.iterdir())[:12] if root.is_dir() else None
    hint = ""
    if found and any(n.endswith(".tsv") for n in found):
        hint = " The TSVs are here but no shards: download them with img2dataset first (docs/datasets.md)."
    where = f"{root} holds {found}" if found is not None else f"{root} does not exist"
    raise FileNotFoundError(f"no .tar shards under {d}; {LAYOUT.format(root=root, train=train, test=test)}. "
                            f"{where}.{hint}")


def rows(root: str | os.PathLike, split: str, train_dir: str = "train", test_dir: str = "validation",
         val_frac: float = 0.005, seed: int = 0, image_ext: str = "jpg") -> list[Row]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    check_fracs(val_frac, 0.0)
    root = Path(root).absolute()
    tars = find_tars(root, test_dir if split == "test" else train_dir, train_dir, test_dir)
    out: list[Row] = []
    where: dict[str, Path] = {}
    dups: list[str] = []
    for tar in tars:
        for key, member, caption in read_index(tar, image_ext):
            if key in where:
                dups.append(f"{key!r} ({where[key].name} and {tar.name})")
                continue
            where[key] = tar
            if split != "test" and hash_split(key, seed, val_frac, 0.0) != split:
                continue
            item = f"{test_dir}/{key}" if split == "test" else key
            if member is not None:
                out.append(Row("image", item, item, tar_source(tar, member)))
            if caption is not None:
                out.append(Row("text", item, item, caption))
    if dups:
        raise ValueError(f"cc3m: {len(dups)} keys occur in more than one shard under {tars[0].parent}, e.g. "
                         f"{', '.join(dups[:5])}; mixing two img2dataset runs in one folder gives duplicate keys")
    return out


@register("cc3m")
def load(split: str, *, root: str = "data/cc3m", train_dir: str = "train", test_dir: str = "validation",
         val_frac: float = 0.005, seed: int = 0, image_ext: str = "jpg") -> list[Row]:
    """Recipe for `load_rows("cc3m", split, root=...)`; a relative root is taken from the repo root."""
    return rows(resolve_path(root), split, train_dir=train_dir, test_dir=test_dir, val_frac=val_frac, seed=seed,
                image_ext=image_ext)
