"""A local copy of a Hugging Face COCO caption dataset, read with `datasets` (never from the hub).

`path` is either a folder written by `save_to_disk` (holds dataset_dict.json or state.json), or a
downloaded dataset repository of data files (parquet / arrow / json / csv ...: `load_dataset(path)`,
which converts them once into the `datasets` cache). Either way nothing is fetched: run with
HF_DATASETS_OFFLINE=1 (see docs/datasets.md for `huggingface-cli download` / `save_to_disk`).

Columns, found by name unless given (`image_col`, `caption_col`, `id_col`):
    image     an `Image` feature (bytes inside the dataset: streamed by ushash.data.shards, never unpacked)
              or a path string (relative paths: from `image_root`, else the dataset folder); without an
              image column, `filepath` + `filename` (the Karpathy JSON's fields) under `image_root`
    captions  "sentences" / "captions" / "caption" / "text": a string, a list of strings, or a list of
              {"raw": ...} (Karpathy style; also as a Sequence of such structs, which arrives as a dict of
              lists); caption ids from "sentids" when present
    id        "cocoid" / "image_id" / "imgid" / "id"; else the row number
Datasets with one row per caption (the same image id on several rows) give one image row per id and
all of its captions (the first `captions_per_image`). ushash split -> dataset split: `train_split`,
`val_split`, `test_split` ("train+restval" concatenates two). Relevance is "paired" (the CLIP protocol).
"""

from __future__ import annotations

import os
from pathlib import Path

from ushash.data.datasets import SPLITS, register, resolve_path
from ushash.data.rows import Row

IMAGE_COLS = ("image", "img")
PATH_COLS = ("file_name", "filename", "image_path", "path")
CAPTION_COLS = ("sentences", "captions", "caption", "text", "raw")
ID_COLS = ("cocoid", "image_id", "imgid", "id")
LAYOUT = ("expected a local Hugging Face dataset at {path}: a `save_to_disk` folder (dataset_dict.json or "
          "state.json) or a folder of data files (e.g. data/test-00000-of-00001.parquet) that "
          "`datasets.load_dataset` reads (see docs/datasets.md, section MS-COCO from Hugging Face)")


def open_dataset(path: str | os.PathLike, split: str):
    """One split of a local dataset (`save_to_disk` folder or data-file folder); never the hub."""
    import datasets

    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"no dataset folder {p}; {LAYOUT.format(path=p)}")
    parts = [s for s in split.split("+") if s]
    try:
        if (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                missing = [s for s in parts if s not in ds]
                if missing:
                    raise KeyError(f"split(s) {missing} not in {p}; it has {sorted(ds)}")
                return datasets.concatenate_datasets([ds[s] for s in parts]) if len(parts) > 1 else ds[parts[0]]
            return ds
        return datasets.load_dataset(str(p), split=split)
    except KeyError as e:
        raise ValueError(f"coco_hf: {e.args[0]}") from e
    except (ValueError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as e:
        raise ValueError(f"coco_hf: cannot read {p} as a dataset ({type(e).__name__}: {e}); "
                         f"{LAYOUT.format(path=p)}") from e


def _pick(cols, given: str | None, candidates, what: str, required: bool = True):
    if given:
        if given not in cols:
            raise ValueError(f"coco_hf: {what} column {given!r} not found; columns are {sorted(cols)}")
        return given
    for c in candidates:
        if c in cols:
            return c
    if required:
        raise ValueError(f"coco_hf: no {what} column (looked for {list(candidates)}); columns are {sorted(cols)}; "
                         f"name it with data.{what}_col=...")
    return None


def _captions(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):   # a Sequence of {raw, sentid, ...} structs arrives as a dict of lists
        if "raw" not in value:
            raise ValueError(f"coco_hf: a caption column of structs needs a 'raw' field; got fields {sorted(value)}")
        value = value["raw"]
        value = [value] if isinstance(value, str) else value
    out = []
    for v in value:
        out.append(v.get("raw", "") if isinstance(v, dict) else ("" if v is None else str(v)))
    return out


def rows(path: str | os.PathLike, split: str, hf_split: str, image_col: str | None = None,
         caption_col: str | None = None, id_col: str | None = None, image_root: str | os.PathLike | None = None,
         captions_per_image: int = 5) -> list[Row]:
    import datasets

    path = Path(path).absolute()
    base = Path(image_root).absolute() if image_root else path
    out: list[Row] = []
    images: dict[str, int] = {}
    n_caps: dict[str, int] = {}
    for one in [s for s in hf_split.split("+") if s]:
        ds = open_dataset(path, one)
        cols = set(ds.column_names)
        img = _pick(cols, image_col, IMAGE_COLS, "image", required=False)
        cap = _pick(cols, caption_col, CAPTION_COLS, "caption")
        rid = _pick(cols, id_col, ID_COLS, "id", required=False)
        packed = img is not None and isinstance(ds.features[img], datasets.Image)
        if img is None:
            if not {"filepath", "filename"} <= cols and not any(c in cols for c in PATH_COLS):
                raise ValueError(f"coco_hf: no image column (looked for {list(IMAGE_COLS)}, filepath + filename, "
                                 f"{list(PATH_COLS)}); columns are {sorted(cols)}")
        if packed:  # paths of Image features with no bytes inside are ordinary files
            first = ds.cast_column(img, datasets.Image(decode=False))[0][img] if len(ds) else None
            packed = bool(first and first.get("bytes"))
        meta_cols = [c for c in (cap, rid, "sentids", "filepath", "filename", *PATH_COLS,
                                 img if img and not isinstance(ds.features[img], datasets.Image) else None)
                     if c and c in cols]
        meta = ds.select_columns(list(dict.fromkeys(meta_cols))).to_dict()
        if img is not None and isinstance(ds.features[img], datasets.Image) and not packed:
            meta[img] = [v["path"] for v in ds.cast_column(img, datasets.Image(decode=False))[img]]
        for i in range(len(ds)):
            key = str(meta[rid][i]) if rid else f"{one}/{i}"
            if key not in images:
                images[key] = i
                if packed:
                    src = f"hf:{path}#{one}/{i}/{img}"
                elif img is not None:
                    src = str(base / meta[img][i])
                elif "filepath" in meta and "filename" in meta:
                    src = str(base / meta["filepath"][i] / meta["filename"][i])
                else:
                    col = next(c for c in PATH_COLS if c in meta)
                    src = str(base / meta[col][i])
                out.append(Row("image", key, key, src))
            sids = meta.get("sentids", [None] * len(ds))[i] or []
            for j, text in enumerate(_captions(meta[cap][i])):
                k = n_caps.get(key, 0)
                if captions_per_image and k >= captions_per_image:
                    break
                n_caps[key] = k + 1
                tid = str(sids[j]) if j < len(sids) else f"{key}#{k}"
                out.append(Row("text", tid, key, text))
    return out


@register("coco_hf")
def load(split: str, *, path: str = "data/coco_hf", train_split: str = "train", val_split: str = "validation",
         test_split: str = "test", image_col: str | None = None, caption_col: str | None = None,
         id_col: str | None = None, image_root: str | None = None, captions_per_image: int = 5) -> list[Row]:
    """Recipe for `load_rows("coco_hf", split, path=...)`; a relative path is taken from the repo root."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    hf_split = {"train": train_split, "val": val_split, "test": test_split}[split]
    return rows(resolve_path(path), split, hf_split, image_col=image_col, caption_col=caption_col, id_col=id_col,
                image_root=resolve_path(image_root) if image_root else None, captions_per_image=captions_per_image)
