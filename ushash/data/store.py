"""The feature store: frozen-encoder features on disk, one folder per (dataset, split, encoder, weights,
precision, rows).

Layout of `<root>/<dataset>/<split>/<encoder>-<fingerprint>[-fp16][-r<rows>]/`:

    meta.json            what produced it: store version, dataset, split, encoder name/config/fingerprint
                         (and precision when not fp32), rows fingerprint, dims and row counts per modality,
                         the versions of the libraries that computed the features (`libraries`), ushash
                         version, time
    <modality>.npy       float32 [N, D], read back with np.load(mmap_mode="r")
    <modality>.rows.jsonl  one line per row of the array: {"id", "group", "labels"}
    report.json          rows seen / ok / failed per modality, and each failed row with its reason
    verified.json        (once reused under other library versions) the versions under which a sample of
                         its rows encoded to its features again (ushash.data.extract.reuse)

A store is written into `<name>.partial/` and renamed into place when done (`finish`), so a finished
folder is always complete. Filling one from a dataset's rows is ushash.data.extract's job (and
ushash.data.shards'); this module reads and writes the folders. What a store is the features of (its
identity: dataset, split, encoder, rows) is said once, by `store_identity`; meta.json records it and
`identity_path` names the folder from it. The encoder's part is its name, weights fingerprint and the
precision it computed at (`Encoder.precision`): features under fp16 autocast (`amp` on CUDA) differ from fp32
ones, yet the fingerprint leaves `amp` and the device out (a head trained on CPU features serves on a GPU),
so a store of them is `-fp16`; an fp32 store's folder and meta.json have no precision, as before it was kept.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import ushash
from ushash.core.io import exclusive, fsync_dir, replace_folder, write_json  # noqa: F401  write_json: re-exported for older imports

STORE_VERSION = 1

#: The precisions an encoder computes at (`ushash.encoders.base.autocast_precision`), and the folder suffix of
#: each; fp32 is what every store made before precision was recorded holds.
FP32, FP16_AUTOCAST = "fp32", "fp16-autocast"
PRECISION_SUFFIX = {FP32: "", FP16_AUTOCAST: "-fp16"}


class FeatureStoreError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------- identity

def encoder_meta(encoder, config: dict | None = None) -> dict:
    """meta.json's "encoder" record of a live encoder: its name, weights fingerprint and config, and the
    precision it computes at where it is now (`Encoder.precision`) when that is not fp32. An fp32 record is
    the one made before precision was recorded, so fp32 stores keep their folders and checkpoints' records."""
    meta = {"name": encoder.name, "fingerprint": encoder.fingerprint, "config": config or {}}
    precision = getattr(encoder, "precision", FP32)
    if precision != FP32:
        meta["precision"] = precision
    return meta


def encoder_precision(encoder: dict) -> str:
    """The precision an `encoder_meta` record (or a checkpoint's provenance of one) says: fp32 when absent."""
    return encoder.get("precision") or FP32


def rows_fingerprint(rows) -> str:
    """16 hex digits over every row's modality, id, group, labels and source, in order: a caption by its
    text, a file by its path, size and modification time (a member of a container, `tar:...#m` or `hf:...#m`,
    by the container's; a container that is a folder by its files', `_folder_key`), over how a file is decoded
    (`decode_identity`) and, for rows with SVG files or members of containers (decoded as SVG by their bytes),
    over what renders them (`svg_renderer`). Another manifest,
    another split seed or fraction, an edited caption or label, a replaced image (even of the same size: an
    image of the same size and dimensions once reused the old pixels' store) or a change to decoding give
    another fingerprint, so a feature store is never reused for other rows or other pixels. Like make and
    rsync's quick check, a file copied over another with both its size and its modification time kept
    (`cp -p` of a same-size file) is not seen; remove the store (or touch the file) after such a copy."""
    from ushash.data.media import SVG_SUFFIXES
    h = hashlib.sha256()
    h.update(decode_identity().encode() + b"\n")
    sizes: dict[str, object] = {}
    svg = False
    for r in rows:
        h.update(f"{r.modality}\0{r.id}\0{r.group}\0{labels_key(r.labels)}\0".encode("utf-8", "surrogatepass"))
        h.update(_source_key(r, sizes).encode("utf-8", "surrogatepass") + b"\n")
        # a container's member is decoded as SVG by its bytes, whatever its name (`media._image_from_bytes`)
        svg = svg or (r.modality == "image" and (r.source.lower().endswith(SVG_SUFFIXES)
                                                 or packed_parts(r.source) is not None))
    if svg:
        h.update(b"svg renderer\0" + svg_renderer().encode() + b"\n")
    return h.hexdigest()[:16]


def svg_renderer() -> str:
    """What rasterises SVG rows here: cairosvg's and the cairo library's versions, or "none" without them.
    Part of the rows fingerprint of rows with SVG files: extracted without cairosvg, their SVG rows fail
    (needs_dependency) and the store, finished without them, was reused after cairosvg was installed; another
    cairo may render other pixels."""
    try:
        import cairocffi
        import cairosvg
    except (ImportError, OSError) as e:  # OSError: cairocffi without the cairo C library
        return f"none ({type(e).__name__})"
    return f"cairosvg {cairosvg.__version__}, cairo {cairocffi.cairo_version_string()}"


def content_digest(split: FeatureSplit) -> str:
    """16 hex digits over what a store holds: per modality its name, the features' dtype, shape and bytes, and
    every row's id, group and labels. What a result computed from the store depends on, whatever the folder is
    called: a store made again from the same pixels has the same digest, one with other features another."""
    h = hashlib.sha256()
    for m in sorted(split.tables):
        t = split.tables[m]
        x = np.ascontiguousarray(t.x)
        h.update(f"{m}\0{x.dtype.str}\0{x.shape}\n".encode())
        h.update(memoryview(x).cast("B"))
        for rid, g, labs in zip(t.ids, t.groups, t.labels):
            h.update(f"{rid}\0{g}\0{labels_key(labs)}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:16]


def labels_key(labels) -> str:
    """A row's labels as one string that no other list of labels gives: joined by "|" when every label is
    non-empty and holds no "|" or control character (what the digests have always read), else a marker
    byte and the JSON list (["x", "y"] and ["x|y"] once gave the same digest)."""
    labels = [str(x) for x in labels]
    if all(x and "|" not in x and x.isprintable() for x in labels):
        return "|".join(labels)
    return "\x01" + json.dumps(labels)


def decode_identity() -> str:
    """What turns a row's file into the encoder's input, as text: the dataset loaders' decode settings
    (`media.FILE_LIMITS`: e.g. `decode_side`, which reduces large images) and the SVG raster size, with
    `media.DECODE_VERSION` for a change to decoding that no setting shows. (A store made before decoding
    reduced large images was once reused after that change: 9 of Tux Paint's 950 images then had other
    features than the code gives.)"""
    import dataclasses

    from ushash.data import media

    limits = dataclasses.asdict(media.FILE_LIMITS)
    for later in ("max_image_segments", "max_jpeg_scans", "max_exif_bytes"):   # limits added later: unset, they
        if limits[later] is None:                    # refuse nothing, and the stores made before them keep their identity
            del limits[later]
    return json.dumps({"version": media.DECODE_VERSION, "file_limits": limits, "svg_size": media.SVG_SIZE},
                      sort_keys=True)


def _source_key(row, sizes: dict) -> str:
    if row.modality == "text":
        return "text:" + str(row.source)
    src = str(row.source)
    container = container_path(src)
    path = container or src
    if path not in sizes:
        try:
            st = os.stat(path)
            if os.path.isdir(path):   # a folder is walked only as a container: a plain row naming one fails
                sizes[path] = _folder_key(path) if container else "folder"   # (not_a_file) at extraction
            else:
                sizes[path] = f"{st.st_size}\0{st.st_mtime_ns}"
        except OSError:
            sizes[path] = "missing"
    return f"{src}\0{sizes[path]}"


def packed_parts(source: str) -> tuple[str, str] | None:
    """(container, member) of a source inside a container, or None for a plain path:

    `tar:/data/cc3m/train/00012.tar#000120034.jpg` -> ("tar:/data/cc3m/train/00012.tar", "000120034.jpg")
    `hf:/data/coco_hf#test/17/image`               -> ("hf:/data/coco_hf#test", "17/image")

    Split at the last '#' (for hf:, at the last two '/'): a '#' in the path itself (`/data/cc3m#v1/...`)
    belongs to the path."""
    if source.startswith("tar:") and "#" in source:
        c, _, m = source.rpartition("#")
        return c, m
    if source.startswith("hf:") and "#" in source:
        c, _, col = source.rpartition("/")   # hf:<dir>#<split>/<index>/<column>: the container keeps <split>
        c, _, idx = c.rpartition("/")
        return c, f"{idx}/{col}"
    return None


def container_path(source: str) -> str | None:
    """The file or folder a packed source lives in (`packed_parts`' container less its scheme, and for hf:
    less its split), or None for a plain path."""
    parts = packed_parts(source)
    return None if parts is None else container_file(parts[0])


def container_file(container: str) -> str:
    """The file or folder of a container (`packed_parts`' first part, an hf: one with or without its
    `@chunk`): less its scheme, and for hf: less its split."""
    return container[4:] if container.startswith("tar:") else container[3:].rpartition("#")[0]


def _folder_key(path: str) -> str:
    """A container that is a folder (`hf:<dataset dir>#...`, a Hugging Face dataset saved to disk) by the
    names, sizes and modification times of the files in it: a folder's own size and time change only when
    an entry is added, removed or renamed, so a dataset saved again over the same files (its .arrow files
    rewritten in place with other images) once kept its rows fingerprint and its old features. Hidden files
    and `datasets`' cache files (`cache-*.arrow`, written beside the data by a map or filter) are left out."""
    h = hashlib.sha256()
    seen = set()
    for dirpath, dirnames, filenames in os.walk(path, followlinks=True):   # a split folder linked in counts too
        real = os.path.realpath(dirpath)
        if real in seen:      # a link back up the tree: walked once
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames.sort()
        for name in sorted(filenames):
            if name.startswith((".", "cache-")):  # locks, and `datasets`' own cache files of a map or filter
                continue
            full = os.path.join(dirpath, name)
            try:
                st = os.stat(full)
            except OSError:
                continue
            rel = os.path.relpath(full, path)
            h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogatepass"))
    return "folder " + h.hexdigest()[:16]


def store_identity(dataset: str, split: str, encoder: dict, rows: str | None = None) -> dict:
    """What a store holds the features of: `dataset`'s `split` through `encoder` (an `encoder_meta` record),
    from the rows with fingerprint `rows` (`rows_fingerprint`; None for stores whose dataset name already says
    what made them, as the synthetic ones do).

    meta.json records it and `identity_path` names the store's folder from it: whatever must make a
    different store belongs here, and only here (the precision the features were computed at is the
    encoder record's, `encoder_meta`).
    """
    return {"dataset": dataset, "split": split, "encoder": encoder, "rows_fingerprint": rows}


def identity_path(root: str | Path, identity: dict) -> Path:
    """The folder of the store with this identity under `root`:
    <dataset>/<split>/<encoder>-<weights>[-fp16][-r<rows>] (`store_path`)."""
    enc = identity["encoder"]
    path = store_path(root, identity["dataset"], identity["split"], enc["name"], enc["fingerprint"],
                      encoder_precision(enc))
    rows = identity.get("rows_fingerprint")
    return path.with_name(f"{path.name}-r{rows}") if rows else path


def store_path(root: str | Path, dataset: str, split: str, encoder_name: str, fingerprint: str,
               precision: str = FP32) -> Path:
    """<root>/<dataset>/<split>/<encoder>-<weights>, with `PRECISION_SUFFIX[precision]` after it: nothing for
    fp32 (every store's folder before precision was part of it), `-fp16` for fp16 autocast. An unknown
    precision is refused rather than given the fp32 folder."""
    if precision not in PRECISION_SUFFIX:
        raise ValueError(f"unknown encoder precision {precision!r}; known: {sorted(PRECISION_SUFFIX)}")
    return Path(root) / dataset / split / f"{encoder_name}-{fingerprint}{PRECISION_SUFFIX[precision]}"


def other_precisions(root: str | Path, identity: dict) -> dict[str, list[Path]]:
    """{precision: folders} of the finished stores of this identity at each other precision under `root`: what
    a lookup that found none at its own can name (features of another precision are never used instead).
    An identity without a rows fingerprint names every store of its dataset, split and encoder at that
    precision (`stores_named`)."""
    own = encoder_precision(identity["encoder"])
    out = {}
    for precision in PRECISION_SUFFIX:
        if precision != own:
            path = identity_path(root, {**identity, "encoder": {**identity["encoder"], "precision": precision}})
            found = stores_named(path) if not identity.get("rows_fingerprint") else \
                [path] if (path / "meta.json").exists() else []
            if found:
                out[precision] = found
    return out


def stores_named(folder: Path) -> list[Path]:
    """The finished stores `folder` (an `identity_path` without rows) names, with or without a rows
    fingerprint (`folder`, `folder-r<rows>`)."""
    folder = Path(folder)
    named = re.compile(re.escape(folder.name) + r"(-r[0-9a-f]{16})?")   # not a `.partial` or `.old` beside them
    return sorted(p for p in folder.parent.glob(folder.name + "*")
                  if (p / "meta.json").exists() and named.fullmatch(p.name))


# ---------------------------------------------------------------------------------------------- reading

@dataclass
class Table:
    """One modality of one split: features plus, for each feature row, its id, group and labels."""

    modality: str
    x: np.ndarray                   # float32 [N, D] (memory-mapped)
    ids: list[str]
    groups: np.ndarray              # str [N]
    labels: list[tuple[str, ...]]

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class FeatureSplit:
    path: Path
    meta: dict
    tables: dict[str, Table]
    #: the tokenizer digests its features are known to be made by where they were checked against an encoder
    #: here (`extract.reuse`: that encoder's); None: those meta.json records (`tokenizers`)
    checked_tokenizers: dict | None = None

    @property
    def tokenizers(self) -> dict[str, str]:
        """{"text tokenizer": digest} of the tokenizer files its features are those of (none for an encoder
        without, or a store made before stores recorded them and not checked since)."""
        if self.checked_tokenizers is not None:
            return dict(self.checked_tokenizers)
        return {k: v for k, v in (self.meta.get("libraries") or {}).items() if k.endswith(" tokenizer")}

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(m for m in ushash.MODALITIES if m in self.tables)

    @property
    def report(self) -> dict:
        return json.loads((self.path / "report.json").read_text(encoding="utf-8"))

    @functools.cached_property
    def content(self) -> str:
        """`content_digest` of this opened store, computed once (a sweep's run and its training share it)."""
        return content_digest(self)


def open_split(path: str | Path, check_finite: bool = True) -> FeatureSplit:
    """Open a finished store folder. Raises FeatureStoreError naming what is missing or bad."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.exists():
        partial = partial_path(path)
        hint = (" An unfinished extraction is in " + str(partial) + "; run ushash.extract again to resume it."
                if partial.exists() else " Run `python -m ushash.extract` for this dataset and encoder first.")
        raise FeatureStoreError(f"no feature store at {path}.{hint}")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise FeatureStoreError(f"{meta_file} is corrupt ({e}); delete the folder and extract again") from e
    if meta.get("store_version") != STORE_VERSION:
        raise FeatureStoreError(f"{path}: store version {meta.get('store_version')} but this ushash reads "
                                f"version {STORE_VERSION}; extract again")
    tables = {}
    for m, info in meta["modalities"].items():
        try:
            x = np.load(path / f"{m}.npy", mmap_mode="r")
        except (OSError, ValueError) as e:
            raise FeatureStoreError(f"{path / (m + '.npy')} is missing or corrupt ({e}); extract again") from e
        if x.shape != (info["count"], info["dim"]):
            raise FeatureStoreError(f"{path / (m + '.npy')}: shape {x.shape}, meta.json says "
                                    f"{(info['count'], info['dim'])}; the store is damaged, extract again")
        recs = [json.loads(line) for line in (path / f"{m}.rows.jsonl").read_text().splitlines() if line]
        if len(recs) != len(x):
            raise FeatureStoreError(f"{path}: {m} has {len(x)} feature rows but {len(recs)} row records")
        if check_finite:
            bad = ~np.isfinite(np.asarray(x)).all(axis=1)
            if bad.any():
                ids = [recs[i]["id"] for i in np.flatnonzero(bad)[:10]]
                raise FeatureStoreError(f"{path}: {int(bad.sum())} {m} rows have NaN/inf features, e.g. {ids}")
        tables[m] = Table(m, x, [r["id"] for r in recs], np.array([r["group"] for r in recs], dtype=object),
                          [tuple(r["labels"]) for r in recs])
    return FeatureSplit(path, meta, tables)


# ---------------------------------------------------------------------------------------------- writing

def partial_path(out: Path) -> Path:
    """Where the store `out` is written before `finish` renames it into place."""
    return out.with_name(out.name + ".partial")


def store_lock(out: Path):
    """One writer per store folder at a time (two processes would write the same partial files)."""
    return exclusive(out.with_name(out.name + ".lock"), f"extracting {out}")


def write_rows(path: Path, ids, groups, labels) -> None:
    """`<modality>.rows.jsonl`: one {"id", "group", "labels"} line per feature row. A row's labels are a list
    (or tuple) of names: a bare string is refused, as it would be stored as its characters."""
    with open(path, "w") as f:
        for rid, g, labs in zip(ids, groups, labels):
            if isinstance(labs, (str, bytes)):
                raise ValueError(f"{path.name}: the labels of row {rid!r} are the string {labs!r}; pass a list of "
                                 f"labels ({[labs]!r})")
            f.write(json.dumps({"id": str(rid), "group": str(g), "labels": list(labs)}) + "\n")


#: The distributions whose code turns media into features (decoding, tokenising, the networks), beside the
#: encoder's weights and config that its fingerprint covers. A store records their versions (`libraries`).
FEATURE_LIBRARIES = ("torch", "torchvision", "transformers", "tokenizers", "timm", "open_clip_torch", "pillow",
                     "librosa", "soundfile", "cairosvg", "numpy")


@functools.cache
def libraries() -> dict[str, str | None]:
    """{distribution: version here (None: not installed)} of `FEATURE_LIBRARIES`, read once per process (the
    installed code does not change under a running one; reading them costs milliseconds per store opened)."""
    from importlib import metadata

    out = {}
    for name in FEATURE_LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def write_meta(work: Path, identity: dict, modalities: dict[str, dict], tokenizers: dict | None = None) -> None:
    """meta.json: the store's identity (`store_identity`), {modality: {"dim", "count"}} and the versions of
    the libraries that computed the features (`libraries`), with the digests of the encoder's tokenizer files
    where it reads them (`Encoder.tokenizer_digests`); written last."""
    write_json(work / "meta.json", {
        "store_version": STORE_VERSION, "ushash_version": ushash.__version__, **identity, "modalities": modalities,
        "libraries": {**libraries(), **(tokenizers or {})}, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def finish(work: Path, out: Path) -> FeatureSplit:
    """Rename a complete `<out>.partial` folder into place (replacing an older `out`) and open it.

    Every file of it is fsynced first, and the folders after the rename: only meta.json (written by
    `write_json`) was, so a power cut after the rename could leave a finished-looking store whose arrays or
    row lists had not reached the disk (zeros or a short file under a whole meta.json).

    An older `out` is renamed aside before the new one takes its place, and removed after: removed in place,
    a kill midway left a half-deleted store that every later run found, could not open, and would not
    replace (the finished `.partial` beside it unused)."""
    _sync_tree(work)
    replace_folder(work, out)
    return open_split(out)


def _sync_tree(folder: Path) -> None:
    for p in sorted(folder.iterdir()):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(folder)


def write_split(out: str | Path, dataset: str, split: str, tables: dict[str, dict], encoder: dict,
                report: dict | None = None, rows: str | None = None) -> FeatureSplit:
    """Write a finished store from in-memory arrays (synthetic data, merged shards), atomically.

    tables: modality -> {"x": float32 [N, D], "ids": [N], "groups": [N], "labels": [N] of tuples (optional)}
    encoder: {"name", "fingerprint", "config"[, "precision"]} (`encoder_meta`); rows: the rows' fingerprint
    (`store_identity`)
    """
    out = Path(out)
    work = partial_path(out)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    meta_mods = {}
    for m, t in tables.items():
        x = np.ascontiguousarray(t["x"], dtype=np.float32)
        if x.ndim != 2 or len(x) != len(t["ids"]) or len(x) != len(t["groups"]):
            raise ValueError(f"{m}: x must be [N, D] with N ids and N groups; got {x.shape}, "
                             f"{len(t['ids'])} ids, {len(t['groups'])} groups")
        bad = ~np.isfinite(x).all(axis=1)
        if bad.any():
            raise FeatureStoreError(f"{m}: NaN/inf features in rows {[t['ids'][i] for i in np.flatnonzero(bad)[:10]]}")
        np.save(work / f"{m}.npy", x)
        write_rows(work / f"{m}.rows.jsonl", t["ids"], t["groups"], t.get("labels") or [()] * len(x))
        meta_mods[m] = {"dim": int(x.shape[1]), "count": int(len(x))}
    write_json(work / "report.json", report or {"dataset": dataset, "split": split, "failed": [],
                                                "modalities": {m: {"rows": v["count"], "ok": v["count"], "failed": 0}
                                                               for m, v in meta_mods.items()}})
    write_meta(work, store_identity(dataset, split, encoder, rows), meta_mods)
    return finish(work, out)
