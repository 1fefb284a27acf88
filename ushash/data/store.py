"""The feature store: frozen-encoder features on disk, one folder per (dataset, split, encoder, weights).

Layout of `<root>/<dataset>/<split>/<encoder>-<fingerprint>/`:

    meta.json            what produced it: store version, dataset, split, encoder name/config/fingerprint,
                         dims and row counts per modality, ushash version, time
    <modality>.npy       float32 [N, D], read back with np.load(mmap_mode="r")
    <modality>.rows.jsonl  one line per row of the array: {"id", "group", "labels"}
    report.json          rows seen / ok / failed per modality, and each failed row with its reason

Extraction writes into `<name>.partial/` and renames it into place when done, so a finished folder is
always complete. An interrupted extraction resumes from `progress` in the partial folder. A row that fails
to decode (corrupt image, unreadable audio, empty caption) or gives non-finite features is recorded in
the report and left out of the arrays; pairing is by `group`, so nothing else shifts.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

import ushash
from ushash.data import media
from ushash.data.rows import Row, check_unique

STORE_VERSION = 1


class FeatureStoreError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------- files

def write_json(path: Path, obj) -> None:
    """Atomic JSON write: tmp file + fsync + rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def decode_workers(value) -> int:
    """DataLoader workers for decoding: an int, or "auto" = one per core left after the encoder's
    main process (1 on 2 cores, where a second worker would take CPU from the forward pass), at most 8."""
    if value == "auto":
        return max(1, min(8, (os.cpu_count() or 2) - 1))
    return int(value)


def store_path(root: str | Path, dataset: str, split: str, encoder_name: str, fingerprint: str) -> Path:
    return Path(root) / dataset / split / f"{encoder_name}-{fingerprint}"


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

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(m for m in ushash.MODALITIES if m in self.tables)

    @property
    def report(self) -> dict:
        return json.loads((self.path / "report.json").read_text())


def open_split(path: str | Path, check_finite: bool = True) -> FeatureSplit:
    """Open a finished store folder. Raises FeatureStoreError naming what is missing or bad."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.exists():
        partial = path.with_name(path.name + ".partial")
        hint = (" An unfinished extraction is in " + str(partial) + "; run ushash.extract again to resume it."
                if partial.exists() else " Run `python -m ushash.extract` for this dataset and encoder first.")
        raise FeatureStoreError(f"no feature store at {path}.{hint}")
    try:
        meta = json.loads(meta_file.read_text())
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

class _Decode(Dataset):
    """Decodes and preprocesses rows in DataLoader workers; a failure becomes (index, None, reason)."""

    def __init__(self, rows: list[Row], encoder, start: int):
        self.rows, self.encoder, self.start = rows, encoder, start

    def __len__(self) -> int:
        return len(self.rows) - self.start

    def __getitem__(self, i: int):
        i += self.start
        row = self.rows[i]
        try:
            raw = media.load(row.modality, row.source, sample_rate=self.encoder.sample_rate,
                             seconds=self.encoder.audio_seconds)
            return i, self.encoder.preprocess(row.modality, raw), None
        except media.MediaError as e:
            return i, None, str(e)
        except Exception as e:  # a decoder bug on one file must not kill a long extraction
            return i, None, f"{type(e).__name__}: {e}"


def _identity(batch):
    return batch


def _rows_digest(rows: list[Row]) -> str:
    h = hashlib.sha256()
    for r in rows:
        h.update(f"{r.id}\0{r.group}\0{r.source}\n".encode())
    return h.hexdigest()[:16]


def _extract_modality(rows: list[Row], encoder, work: Path, modality: str, batch_size: int,
                      num_workers: int, progress: bool, flush_every: int) -> dict:
    """Fill `work/<m>.full.npy` row by row (resumable). Returns the progress record."""
    dim = encoder.dims[modality]
    prog_file, arr_file = work / f"{modality}.progress.json", work / f"{modality}.full.npy"
    digest = _rows_digest(rows)
    prog = json.loads(prog_file.read_text()) if prog_file.exists() else None
    if prog is not None and (prog["rows_digest"] != digest or not arr_file.exists()):
        warnings.warn(f"{work}: the {modality} rows changed since the interrupted run; starting this modality over")
        prog = None
    if prog is None:
        prog = {"rows_digest": digest, "n_rows": len(rows), "done": 0, "ok": [], "failed": {}}
        arr = np.lib.format.open_memmap(arr_file, mode="w+", dtype=np.float32, shape=(len(rows), dim))
        del arr
        write_json(prog_file, prog)
    if prog["done"] >= len(rows):
        return prog
    arr = np.load(arr_file, mmap_mode="r+")
    ok = set(prog["ok"])
    loader = DataLoader(_Decode(rows, encoder, prog["done"]), batch_size=batch_size, num_workers=num_workers,
                        collate_fn=_identity, shuffle=False,
                        persistent_workers=False, prefetch_factor=4 if num_workers else None)
    bar = tqdm(total=len(rows), initial=prog["done"], desc=f"extract {modality}", unit="item",
               disable=not progress, dynamic_ncols=True)
    for step, batch in enumerate(loader):
        good = [(i, x) for i, x, err in batch if err is None]
        for i, _, err in batch:
            if err is not None:
                prog["failed"][rows[i].id] = err
        if good:
            feats = encoder.encode(modality, encoder.collate(modality, [x for _, x in good]))
            feats = feats.detach().float().cpu().numpy()
            finite = np.isfinite(feats).all(axis=1)
            for (i, _), f, fin in zip(good, feats, finite):
                if fin:
                    arr[i] = f
                    ok.add(i)
                else:
                    prog["failed"][rows[i].id] = "non-finite features (NaN/inf) from the encoder"
            if not finite.all():
                bad_ids = [rows[i].id for (i, _), fin in zip(good, finite) if not fin]
                warnings.warn(f"{modality}: rejected {len(bad_ids)} rows with NaN/inf features: {bad_ids[:10]}")
        prog["done"] = batch[-1][0] + 1
        bar.update(len(batch))
        if (step + 1) % flush_every == 0 or prog["done"] >= len(rows):
            arr.flush()
            prog["ok"] = sorted(ok)
            write_json(prog_file, prog)
    bar.close()
    arr.flush()
    prog["ok"] = sorted(ok)
    write_json(prog_file, prog)
    return prog


def extract(rows: list[Row], encoder, root: str | Path, dataset: str, split: str, encoder_cfg: dict | None = None,
            batch_size: int = 64, num_workers: int = 2, progress: bool = True, max_bad_frac: float = 0.5,
            overwrite: bool = False, flush_every: int = 20) -> FeatureSplit:
    """Extract features for `rows` once; a finished store is reused, an unfinished one resumed."""
    out = store_path(root, dataset, split, encoder.name, encoder.fingerprint)
    if out.exists() and not overwrite:
        return open_split(out)
    check_unique(rows, f"{dataset}/{split}")
    with _exclusive(out.with_name(out.name + ".lock")):
        if out.exists() and not overwrite:  # another process finished it while we waited
            return open_split(out)
        return _extract_locked(rows, encoder, out, dataset, split, encoder_cfg, batch_size, num_workers, progress,
                               max_bad_frac, flush_every)


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """One extraction per store folder at a time (two processes would write the same partial arrays)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[extract] another process is extracting {lock_path.with_suffix('')}; waiting for it", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _extract_locked(rows, encoder, out: Path, dataset, split, encoder_cfg, batch_size, num_workers, progress,
                    max_bad_frac, flush_every) -> FeatureSplit:
    work = out.with_name(out.name + ".partial")
    work.mkdir(parents=True, exist_ok=True)
    report = {"dataset": dataset, "split": split, "modalities": {}, "failed": []}
    meta_mods = {}
    for m in ushash.MODALITIES:
        mrows = [r for r in rows if r.modality == m]
        if not mrows:
            continue
        if m not in encoder.modalities:
            report["modalities"][m] = {"rows": len(mrows), "skipped": f"encoder {encoder.name} has no {m} tower"}
            continue
        prog = _extract_modality(mrows, encoder, work, m, batch_size, num_workers, progress, flush_every)
        ok_idx = np.asarray(prog["ok"], dtype=np.int64)
        n_bad = len(mrows) - len(ok_idx)
        report["modalities"][m] = {"rows": len(mrows), "ok": int(len(ok_idx)), "failed": n_bad}
        report["failed"] += [{"modality": m, "id": rid, "source": _short(r.source), "reason": why}
                             for r in mrows for rid, why in [(r.id, prog["failed"].get(r.id))] if why]
        if len(ok_idx) == 0 or n_bad > max_bad_frac * len(mrows):
            # messages read "<path>: <reason>"; summarise by reason, without the path
            reasons = sorted({why.rsplit(": ", 1)[-1].split(" (")[0] for why in prog["failed"].values()})[:5]
            write_json(work / "report.json", report)
            raise FeatureStoreError(
                f"{dataset}/{split}: {n_bad} of {len(mrows)} {m} rows failed (limit {max_bad_frac:.0%}); "
                f"reasons include {reasons}. Full list: {work / 'report.json'}. Check the data root.")
        full = np.load(work / f"{m}.full.npy", mmap_mode="r")
        final = np.lib.format.open_memmap(work / f"{m}.npy", mode="w+", dtype=np.float32,
                                          shape=(len(ok_idx), full.shape[1]))
        for s in range(0, len(ok_idx), 65536):
            final[s:s + 65536] = full[ok_idx[s:s + 65536]]
        final.flush()
        del final, full
        with open(work / f"{m}.rows.jsonl", "w") as f:
            for i in ok_idx:
                r = mrows[i]
                f.write(json.dumps({"id": r.id, "group": r.group, "labels": list(r.labels)}) + "\n")
        meta_mods[m] = {"dim": int(encoder.dims[m]), "count": int(len(ok_idx))}
    if not meta_mods:
        raise FeatureStoreError(f"{dataset}/{split}: no rows for any modality of encoder {encoder.name} "
                                f"({encoder.modalities}); found {len(rows)} rows")
    for m in meta_mods:
        (work / f"{m}.full.npy").unlink(missing_ok=True)
        (work / f"{m}.progress.json").unlink(missing_ok=True)
    write_json(work / "report.json", report)
    write_json(work / "meta.json", {
        "store_version": STORE_VERSION, "ushash_version": ushash.__version__, "dataset": dataset, "split": split,
        "encoder": {"name": encoder.name, "fingerprint": encoder.fingerprint, "config": encoder_cfg or {}},
        "modalities": meta_mods, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })
    if out.exists():
        shutil.rmtree(out)
    os.replace(work, out)
    return open_split(out)


def _short(source: str, n: int = 200) -> str:
    return source if len(source) <= n else source[: n - 3] + "..."


def write_split(out: str | Path, dataset: str, split: str, tables: dict[str, dict], encoder: dict,
                report: dict | None = None) -> FeatureSplit:
    """Write a finished store from in-memory arrays (synthetic data, merged shards), atomically.

    tables: modality -> {"x": float32 [N, D], "ids": [N], "groups": [N], "labels": [N] of tuples (optional)}
    encoder: {"name", "fingerprint", "config"}
    """
    out = Path(out)
    work = out.with_name(out.name + ".partial")
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
        labels = t.get("labels") or [()] * len(x)
        with open(work / f"{m}.rows.jsonl", "w") as f:
            for rid, g, labs in zip(t["ids"], t["groups"], labels):
                f.write(json.dumps({"id": str(rid), "group": str(g), "labels": list(labs)}) + "\n")
        meta_mods[m] = {"dim": int(x.shape[1]), "count": int(len(x))}
    write_json(work / "report.json", report or {"dataset": dataset, "split": split, "failed": [],
                                                "modalities": {m: {"rows": v["count"], "ok": v["count"], "failed": 0}
                                                               for m, v in meta_mods.items()}})
    write_json(work / "meta.json", {
        "store_version": STORE_VERSION, "ushash_version": ushash.__version__, "dataset": dataset, "split": split,
        "encoder": encoder, "modalities": meta_mods, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    if out.exists():
        shutil.rmtree(out)
    os.replace(work, out)
    return open_split(out)
