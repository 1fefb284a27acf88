"""MS-COCO, two protocols, from the files COCO is distributed as.

`coco`: CLIP-style retrieval on the Karpathy split (`dataset_coco.json`, train2014/val2014 images).
    <root>/dataset_coco.json
    <root>/train2014/COCO_train2014_000000000009.jpg ...   (the `filepath` / `filename` of each image)
    <root>/val2014/COCO_val2014_000000000042.jpg ...
  Splits: "train" = Karpathy train + restval (113,287 images; `restval_in_train=false`: 82,783),
  "val" = Karpathy val (5,000), "test" = Karpathy test (5,000 images). One image row per image (id and
  group = the COCO image id), one text row per caption, the first `captions_per_image` (5) by sentence
  id: the 5k test set has 25,000 captions, each relevant to its own image only ("paired" relevance).
  With `labels=true` rows also carry the image's instance categories (from instances_*.json), so the
  "label" protocol can be reported beside the paired one.

`coco_hashing`: the cross-modal hashing protocol (DCMH, DJSRH, UCCH, DCMHT, MITH ...), from the 2017
annotations.
    <root>/annotations/captions_train2017.json, captions_val2017.json
    <root>/annotations/instances_train2017.json, instances_val2017.json
    <root>/train2017/000000000009.jpg, <root>/val2017/...   (or the same images as train2014/val2014)
  The pool is every train2017 + val2017 image with at least one instance annotation (122,218 of
  123,287). Pool images are ordered by sha256(seed, image id); the first `n_query` (5,000) are the
  queries, the rest (117,218) the retrieval database; the training set is the first `n_train` (10,000)
  database images in that order and the validation set the next `n_val` (2,000), so it is disjoint
  from the queries and from training. Labels are the names of the image's instance categories (80);
  relevance is "label" (share at least one). Text rows: the image's first `captions_per_image`
  captions by annotation id, with the image's labels.
  ushash splits: "train" and "val" as above, "test" = the query set. Evaluating queries against the
  database needs the database rows too: `hashing_rows("database", ...)` (see docs/datasets.md).

Paths are not opened here beyond a probe of the first images (a wrong root fails at once, with the
layout expected); a missing or corrupt image is a bad row, counted and skipped at extraction.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path

from ushash.data.datasets import SPLITS, listing, probe_files, register, resolve_path
from ushash.data.rows import Row
from ushash.data.textfiles import read_json

KARPATHY_FILE = "dataset_coco.json"
KARPATHY_SPLITS = {"train": ("train", "restval"), "val": ("val",), "test": ("test",)}
LAYOUT_KARPATHY = ("expected layout: {root}/dataset_coco.json (Karpathy split), {root}/train2014/*.jpg and "
                   "{root}/val2014/*.jpg (see docs/datasets.md, section MS-COCO)")
LAYOUT_2017 = ("expected layout: {root}/annotations/captions_train2017.json, captions_val2017.json, "
               "instances_train2017.json, instances_val2017.json, and the images in {root}/train2017 + "
               "{root}/val2017 (or train2014 + val2014) (see docs/datasets.md, section MS-COCO)")


# ------------------------------------------------------------------------------------------- helpers
def _file_key(p: Path) -> tuple[str, int, float]:
    st = p.stat()
    return str(p), st.st_size, st.st_mtime


# ----------------------------------------------------------------------------------------- Karpathy
@functools.lru_cache(maxsize=4)
def _karpathy(path: str, size: int, mtime: float) -> tuple:
    try:
        data = read_json(Path(path))
        images = data["images"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a Karpathy split file (a JSON object with an 'images' list): {e}") from e
    out, seen = [], {}
    for i, im in enumerate(images):
        try:
            cid = str(im["cocoid"])
            # a caption missing or null is an empty caption (extraction reports it), as in the 2017 files
            sents = sorted(((int(s["sentid"]), "" if s.get("raw") is None else s["raw"]) for s in im["sentences"]),
                           key=lambda t: t[0])
            rec = (cid, im["filepath"], im["filename"], im["split"], tuple(sents))
            bad = [k for k, v in (("filepath", rec[1]), ("filename", rec[2])) if not isinstance(v, str)]
            bad += [f"sentence {sid} raw" for sid, raw in sents if not isinstance(raw, str)]
            if bad:
                raise TypeError(f"{', '.join(bad[:3])} not a string")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: image #{i} lacks cocoid/filepath/filename/split/sentences ({e!r})") from e
        if cid in seen:
            raise ValueError(f"{path}: cocoid {cid} appears twice (images #{seen[cid]} and #{i}); "
                             "the Karpathy file is damaged")
        seen[cid] = i
        out.append(rec)
    return tuple(out)


def read_karpathy(path: Path) -> tuple:
    """(cocoid, filepath, filename, karpathy split, ((sentid, raw), ...)) per image, cached per process."""
    return _karpathy(*_file_key(path))


def karpathy_rows(root: str | os.PathLike, split: str, image_root: str | os.PathLike | None = None,
                  captions_per_image: int = 5, restval_in_train: bool = True,
                  labels: dict[str, tuple[str, ...]] | None = None) -> list[Row]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    root = Path(root).absolute()
    f = root / KARPATHY_FILE
    if not f.is_file():
        raise FileNotFoundError(f"no {KARPATHY_FILE} under {root}; {LAYOUT_KARPATHY.format(root=root)}. "
                                f"{listing(root)}")
    base = Path(image_root).absolute() if image_root else root
    wanted = KARPATHY_SPLITS[split] if restval_in_train or split != "train" else ("train",)
    out: list[Row] = []
    paths: list[str] = []
    for cid, fp, fn, ks, sents in read_karpathy(f):
        if ks not in wanted:
            continue
        labs = labels.get(cid, ()) if labels is not None else ()
        path = str(base / fp / fn)
        paths.append(path)
        out.append(Row("image", cid, cid, path, labs))
        for sid, raw in sents[: captions_per_image or None]:
            out.append(Row("text", str(sid), cid, raw, labs))
    probe_files(paths, f"coco/{split}", LAYOUT_KARPATHY.format(root=root), "images", "image_root")
    return out


# ------------------------------------------------------------------------------ 2017 annotations
ANNOTATION_SETS = ("train2017", "val2017")


@functools.lru_cache(maxsize=8)
def _instances(path: str, size: int, mtime: float) -> tuple[dict, dict]:
    """image id -> sorted category names, and image id -> file_name, from one instances_*.json."""
    try:
        data = read_json(Path(path))
        cats = {c["id"]: c["name"] for c in data["categories"]}
        names = {str(im["id"]): im["file_name"] for im in data["images"]}
        labs: dict[str, set] = {}
        for a in data["annotations"]:
            labs.setdefault(str(a["image_id"]), set()).add(cats[a["category_id"]])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a COCO instances file (images, annotations, categories): {e!r}") from e
    return {k: tuple(sorted(v)) for k, v in labs.items()}, names


@functools.lru_cache(maxsize=8)
def _captions(path: str, size: int, mtime: float) -> dict[str, tuple[tuple[int, str], ...]]:
    """image id -> ((caption id, caption), ...) sorted by caption id, from one captions_*.json."""
    try:
        data = read_json(Path(path))
        caps: dict[str, list] = {str(im["id"]): [] for im in data["images"]}
        seen: set[int] = set()
        for a in data["annotations"]:
            if a["id"] in seen:
                raise ValueError(f"{path}: caption id {a['id']} appears twice; the file is damaged")
            seen.add(a["id"])
            cap = a.get("caption") or ""
            if not isinstance(cap, str):
                raise TypeError(f"caption {a['id']} is not a string: {cap!r:.80}")
            caps.setdefault(str(a["image_id"]), []).append((int(a["id"]), cap))
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a COCO captions file (images, annotations): {e!r}") from e
    return {k: tuple(sorted(v)) for k, v in caps.items()}


def _annotation(root: Path, annotations_dir: str, kind: str, subset: str) -> Path:
    p = root / annotations_dir / f"{kind}_{subset}.json"
    if not p.is_file():
        raise FileNotFoundError(f"no {p.name} under {p.parent}; {LAYOUT_2017.format(root=root)}. "
                                f"{listing(p.parent if p.parent.is_dir() else root)}")
    return p


def instance_labels(root: str | os.PathLike, annotations_dir: str = "annotations") -> dict[str, tuple[str, ...]]:
    """COCO image id -> instance category names, over train2017 + val2017 (the 2014 images, same ids)."""
    root = Path(root).absolute()
    out: dict[str, tuple[str, ...]] = {}
    for subset in ANNOTATION_SETS:
        out.update(_instances(*_file_key(_annotation(root, annotations_dir, "instances", subset)))[0])
    return out


def _image_paths(root: Path, base: Path, names: dict[str, tuple[str, str]]) -> dict[str, str]:
    """image id -> path: <base>/<subset>/<file_name> (2017 folders), else the 2014 file of the same id."""
    if all((base / s).is_dir() for s in {s for s, _ in names.values()}):
        return {i: str(base / s / fn) for i, (s, fn) in names.items()}
    found: dict[str, str] = {}
    for sub in ("train2014", "val2014"):
        d = base / sub
        if d.is_dir():
            with os.scandir(d) as it:
                for e in it:   # COCO_train2014_000000000009.jpg; anything else (a copy "... (1).jpg") is not one
                    m = re.fullmatch(r"COCO_[a-z]+2014_(\d+)\.[A-Za-z]+", e.name)
                    if m:
                        found[str(int(m.group(1)))] = e.path
    if not found:
        missing = sorted({s for s, _ in names.values() if not (base / s).is_dir()})
        raise FileNotFoundError(f"no image folders {missing} (nor train2014/val2014) under {base}; "
                                f"{LAYOUT_2017.format(root=root)}. {listing(base)}")
    # ids absent from the 2014 folders point at where the 2017 file would be: a bad row at extraction
    return {i: found.get(i, str(base / s / fn)) for i, (s, fn) in names.items()}


def order_key(image_id: str, seed: int) -> bytes:
    """The protocol's image order: sha256 of (seed, image id); stable, independent of file order."""
    return hashlib.sha256(f"{seed}\x00{image_id}".encode()).digest()


def hashing_parts(pool: list[str], n_query: int, n_train: int, n_val: int, seed: int) -> dict[str, list[str]]:
    """Split the pool's image ids into query / database / train / val (train, val inside the database)."""
    if min(n_query, n_train, n_val) < 0:
        raise ValueError(f"n_query, n_train and n_val must be >= 0; got {n_query}, {n_train}, {n_val}")
    if n_query + n_train + n_val > len(pool):
        raise ValueError(f"coco_hashing: {n_query} queries + {n_train} training + {n_val} validation images "
                         f"need {n_query + n_train + n_val}, but the pool has only {len(pool)} labelled images")
    order = sorted(pool, key=lambda i: order_key(i, seed))
    database = order[n_query:]
    return {"query": order[:n_query], "database": database, "train": database[:n_train],
            "val": database[n_train:n_train + n_val]}


def hashing_rows(part: str, root: str | os.PathLike, image_root: str | os.PathLike | None = None,
                 n_query: int = 5000, n_train: int = 10000, n_val: int = 2000, captions_per_image: int = 5,
                 seed: int = 0, annotations_dir: str = "annotations") -> list[Row]:
    """Rows of one part of the hashing protocol: "query", "database", "train" or "val"."""
    root = Path(root).absolute()
    base = Path(image_root).absolute() if image_root else root
    labels: dict[str, tuple[str, ...]] = {}
    names: dict[str, tuple[str, str]] = {}
    caps: dict[str, tuple] = {}
    for subset in ANNOTATION_SETS:
        labs, files = _instances(*_file_key(_annotation(root, annotations_dir, "instances", subset)))
        labels.update(labs)
        names.update({i: (subset, fn) for i, fn in files.items()})
        caps.update(_captions(*_file_key(_annotation(root, annotations_dir, "captions", subset))))
    pool = sorted(i for i in names if labels.get(i))
    parts = hashing_parts(pool, n_query, n_train, n_val, seed)
    if part not in parts:
        raise ValueError(f"unknown part {part!r}; expected one of {sorted(parts)}")
    ids = parts[part]
    paths = _image_paths(root, base, {i: names[i] for i in ids})
    out: list[Row] = []
    for i in sorted(ids, key=int):
        out.append(Row("image", i, i, paths[i], labels[i]))
        for cid, cap in caps.get(i, ())[: captions_per_image or None]:
            out.append(Row("text", str(cid), i, cap, labels[i]))
    probe_files([paths[i] for i in sorted(ids, key=int)], f"coco_hashing/{part}", LAYOUT_2017.format(root=root),
                "images", "image_root")
    return out


# ------------------------------------------------------------------------------------------ recipes
@register("coco")
def load(split: str, *, root: str = "data/coco", image_root: str | None = None, captions_per_image: int = 5,
         restval_in_train: bool = True, labels: bool = False, annotations_dir: str = "annotations") -> list[Row]:
    """CLIP retrieval protocol on the Karpathy split; a relative root is taken from the repo root."""
    r = resolve_path(root)
    labs = instance_labels(r, annotations_dir) if labels else None
    return karpathy_rows(r, split, image_root=resolve_path(image_root) if image_root else None,
                         captions_per_image=captions_per_image, restval_in_train=restval_in_train, labels=labs)


HASHING_PART = {"train": "train", "val": "val", "test": "query", "database": "database"}


@register("coco_hashing", extra_splits=("database",))
def load_hashing(split: str, *, root: str = "data/coco", image_root: str | None = None, n_query: int = 5000,
                 n_train: int = 10000, n_val: int = 2000, captions_per_image: int = 5, seed: int = 0,
                 annotations_dir: str = "annotations") -> list[Row]:
    """Cross-modal hashing protocol (2017 captions + instances); "test" is the query set, "database" the
    retrieval set it is ranked against (`python -m ushash.eval ... database=database`)."""
    if split not in HASHING_PART:
        raise ValueError(f"unknown split {split!r}; expected one of {tuple(HASHING_PART)}")
    return hashing_rows(HASHING_PART[split], resolve_path(root),
                        image_root=resolve_path(image_root) if image_root else None, n_query=n_query,
                        n_train=n_train, n_val=n_val, captions_per_image=captions_per_image, seed=seed,
                        annotations_dir=annotations_dir)
