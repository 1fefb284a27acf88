"""Sharded extraction: one split's features in shards, on one process or as Lightning DDP prediction.

    split = extract_sharded(rows, encoder, features_dir, dataset, split)        # what ushash.extract calls
    python -m ushash.extract data=cc3m +extract.strategy=ddp +extract.devices=8 # one rank per GPU

The rows of each modality are cut into *units*, each extracted and finished on its own, then merged:
- file-backed rows (a path, or a caption) go to shard `hash(row id) % n` (blake2b of the id, so a row's
  shard depends on its id and `n` alone, never on the world size or the row order). `n` is
  `extract.shards`, or ceil(rows / 10,000) per modality when that is 0. A shard is extracted with
  `ushash.data.extract.extract` into `<store>.shards/<modality>-<k>-of-<n>/`, so it resumes row by row
  after a kill and records its bad rows exactly as an unsharded extraction does.
- packed rows, whose media sit inside a container that is read as a stream, go to one unit per
  container: `tar:<path>#<member>` (a webdataset / img2dataset .tar, one unit per tar) and
  `hf:<dataset dir>#<hf split>/<index>/<column>` (image bytes inside a local Hugging Face dataset, one
  unit per 10,000 indices). An IterableDataset hands whole units to DataLoader workers; a unit's store is
  written (`store.write_split`) when its last member is encoded, so a kill loses at most the units in
  flight.
Every rank takes units `i % world_size == rank` (sorted by name) and skips finished ones, so a restart
with another world size resumes the same units. When all ranks are done, every rank checks the bad-row
counts (`check_bad_rows`, the same `max_bad_frac` rule as extract's, applied to the whole split), global
rank 0 merges the units into a normal finished store in the original row order (identical to an unsharded
extraction of the same rows) with `store.write_split` (written in `<store>.partial/`, renamed in one
step), and removes `<store>.shards/`.

With `strategy="auto"` and one device this runs in-process (tests, CPU); `strategy="ddp"` launches one
process per device the Lightning way (each rank re-runs the command line). The encoder is a submodule of
a LightningModule, so Lightning puts each rank's copy on its own device; `predict_step` runs one task
(a shard, or this rank's share of the stream units).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tarfile
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from tqdm.auto import tqdm

import ushash
from ushash.data import media
from ushash.data.extract import (check_bad_rows, collate_list, decode_workers, encode_batch, extract, failure,
                                 failure_of, failure_records, modality_counts, prepare, reuse, skipped)
from ushash.data.rows import Row, check_unique
from ushash.data.store import (FP32, FeatureSplit, FeatureStoreError, container_file, encoder_meta, encoder_precision,
                               identity_path, open_split, packed_parts, partial_path, rows_fingerprint, store_identity,
                               store_lock, write_split)

SHARD_ROWS = 10_000  # rows per hash shard when the shard count is automatic
HF_CHUNK = 10_000    # indices of a Hugging Face dataset per stream unit
END = -1             # position of the end-of-unit marker in a stream


# ------------------------------------------------------------------------------------ packed sources
def packed_source(row: Row) -> tuple[str, str] | None:
    """(container, member) for a row whose media lives inside a container (`store.packed_parts`), else None.
    Captions are never packed (a caption may start with "tar:")."""
    return None if row.modality == "text" else packed_parts(row.source)


def needs_shards(rows: list[Row]) -> bool:
    """True when some rows can only be read as a stream (their split must go through extract_sharded)."""
    return any(packed_source(r) is not None for r in rows)


def wanted(extract_cfg, rows: list[Row]) -> bool:
    """Whether ushash.extract should use extract_sharded for these rows and `extract.*` options."""
    get = extract_cfg.get
    return bool(get("shards", 0)) or get("strategy", None) not in (None, "none") \
        or get("devices", 1) not in (1, "1") or needs_shards(rows)


def options(extract_cfg) -> dict:
    """extract_sharded keyword arguments from the `extract` config (missing keys: defaults)."""
    get = extract_cfg.get
    device = str(get("device", "auto"))
    accelerator = {"auto": "auto", "cpu": "cpu"}.get(device, "gpu" if device.startswith("cuda") else device)
    return dict(shards=int(get("shards", 0) or 0), strategy=str(get("strategy", None) or "auto"),
                accelerator=accelerator, devices=get("devices", 1), num_nodes=int(get("num_nodes", 1)),
                batch_size=int(get("batch_size", 64)), num_workers=decode_workers(get("num_workers", "auto")),
                progress=bool(get("progress", True)), max_bad_frac=float(get("max_bad_frac", 0.5)))


def shard_of(row_id: str, n: int) -> int:
    """The hash shard of a row id: stable across runs, machines, row orders and world sizes."""
    h = hashlib.blake2b(row_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "big") % n


# ------------------------------------------------------------------------------------------- the plan
@dataclass
class Unit:
    """Rows of one modality that are extracted and finished together."""

    name: str                  # folder under <store>.shards/, stable across runs
    modality: str
    rows: list[Row]            # in the split's row order
    container: str | None = None  # set for stream units
    members: list[str] = field(default_factory=list)  # per row, for stream units


class Plan:
    """What a sharded extraction of one split consists of; every rank builds the same plan."""

    def __init__(self, rows: list[Row], encoder, root: str | Path, dataset: str, split: str,
                 encoder_cfg: dict | None = None, shards: int = 0, batch_size: int = 64, num_workers: int = 2,
                 progress: bool = True, max_bad_frac: float = 0.5, shard_rows: int = SHARD_ROWS):
        self.dataset, self.split, self.encoder_cfg = dataset, split, encoder_cfg or {}
        self.enc_name, self.encoder_meta = encoder.name, encoder_meta(encoder, self.encoder_cfg)
        self.enc_modalities, self.dims = tuple(encoder.modalities), dict(encoder.dims)
        self.batch_size, self.num_workers, self.progress = batch_size, num_workers, progress
        self.max_bad_frac = max_bad_frac
        self.rows_fingerprint = rows_fingerprint(rows)
        self.out = identity_path(root, store_identity(dataset, split, self.encoder_meta, self.rows_fingerprint))
        self.work = self.out.with_name(self.out.name + ".shards")
        self.rows = {m: [r for r in rows if r.modality == m] for m in ushash.MODALITIES}
        self.rows = {m: rs for m, rs in self.rows.items() if rs}
        self.skipped = {m: len(rs) for m, rs in self.rows.items() if m not in self.enc_modalities}
        self.n_shards: dict[str, int] = {}
        units: list[Unit] = []
        for m, mrows in self.rows.items():
            if m in self.skipped:
                continue
            plain: list[Row] = []
            packed: dict[str, list[tuple[Row, str]]] = defaultdict(list)
            for r in mrows:
                p = packed_source(r)
                if p is None:
                    plain.append(r)
                else:
                    container, member = p
                    if container.startswith("hf:"):
                        container += f"@{int(member.split('/', 1)[0]) // HF_CHUNK}"
                    packed[container].append((r, member))
            if plain:
                n = int(shards) if shards else max(1, math.ceil(len(plain) / shard_rows))
                self.n_shards[m] = n
                buckets: list[list[Row]] = [[] for _ in range(n)]
                for r in plain:
                    buckets[shard_of(r.id, n)].append(r)
                units += [Unit(f"{m}-{k:05d}-of-{n:05d}", m, b) for k, b in enumerate(buckets) if b]
            for container, items in packed.items():
                tag = hashlib.blake2b(container.encode(), digest_size=5).hexdigest()
                stem = Path(container_file(container)).name.split(".")[0][:40]
                units.append(Unit(f"{m}-stream-{stem}-{tag}", m, [r for r, _ in items], container,
                                  [mb for _, mb in items]))
        self.units = sorted(units, key=lambda u: u.name)

    # -- paths and state ---------------------------------------------------------------------
    def unit_store(self, u: Unit) -> Path:
        return identity_path(self.work, store_identity(u.name, self.split, self.encoder_meta, rows_fingerprint(u.rows)))

    def done(self, u: Unit) -> bool:
        return (self.unit_store(u) / "meta.json").exists()

    def tasks(self, rank: int, world_size: int) -> list[list[int]]:
        """This rank's work: one task per hash shard, one task for all its stream units; finished units left out."""
        mine = [i for i, u in enumerate(self.units) if i % world_size == rank and not self.done(self.units[i])]
        rows_tasks = [[i] for i in mine if self.units[i].container is None]
        stream = [i for i in mine if self.units[i].container is not None]
        return rows_tasks + ([stream] if stream else [])

    def run_task(self, task: list[int], encoder) -> None:
        here = getattr(encoder, "precision", FP32)
        if here != encoder_precision(self.encoder_meta):
            # the units' stores are keyed by the precision the plan was made at: features of another would land
            # in folders the merge never reads (or, were the key left out, among features of the other one)
            raise FeatureStoreError(
                f"{self.dataset}/{self.split}: the encoder computes at {here} on {encoder.device}, "
                f"but this extraction's store {self.out.name} is keyed by {encoder_precision(self.encoder_meta)}; "
                f"put the encoder on the device the extraction runs on (extract.device) before extracting")
        units = [self.units[i] for i in task]
        if units[0].container is None:
            for u in units:
                self._run_rows_unit(u, encoder)
        else:
            self._run_stream_units(units, encoder)

    def run_rank(self, encoder, rank: int = 0, world_size: int = 1) -> None:
        """Everything one rank does before the merge (what each DDP process runs in predict)."""
        for task in self.tasks(rank, world_size):
            self.run_task(task, encoder)

    # -- file-backed shards: extract ---------------------------------------------------------
    def _run_rows_unit(self, u: Unit, encoder) -> None:
        try:
            extract(u.rows, encoder, self.work, dataset=u.name, split=self.split, encoder_cfg=self.encoder_cfg,
                    batch_size=self.batch_size, num_workers=self.num_workers, progress=self.progress,
                    max_bad_frac=1.0)
        except FeatureStoreError:
            # Every row of this shard failed; the split-wide check decides whether that is fatal.
            rep_file = partial_path(self.unit_store(u)) / "report.json"
            if not rep_file.exists():
                raise
            report = json.loads(rep_file.read_text(encoding="utf-8"))
            self._write_unit(u, [], np.zeros((0, self.dims[u.modality]), np.float32), report)

    def _write_unit(self, u: Unit, ok_rows: list[Row], x: np.ndarray, report: dict) -> None:
        write_split(
            self.unit_store(u), u.name, self.split,
            {u.modality: {"x": x, "ids": [r.id for r in ok_rows], "groups": [r.group for r in ok_rows],
                          "labels": [r.labels for r in ok_rows]}},
            encoder=self.encoder_meta, report=report)

    # -- packed rows: streamed containers ----------------------------------------------------
    def _run_stream_units(self, units: list[Unit], encoder) -> None:
        ds = _Stream(units, encoder)
        nw = min(self.num_workers, len(units))
        loader = DataLoader(ds, batch_size=self.batch_size, num_workers=nw, collate_fn=collate_list,
                            prefetch_factor=4 if nw else None)
        feats: dict[int, dict[int, np.ndarray]] = defaultdict(dict)
        failed: dict[int, dict[int, dict]] = defaultdict(dict)
        bar = tqdm(total=sum(len(u.rows) for u in units), desc=f"extract {units[0].modality} (stream)",
                   unit="item", disable=not self.progress, dynamic_ncols=True)
        for batch in loader:
            items = [b for b in batch if b[1] != END]
            by_mod: dict[str, list] = defaultdict(list)
            for ui, pos, x, fail in items:
                if fail is not None:
                    failed[ui][pos] = fail
                else:
                    by_mod[units[ui].modality].append((ui, pos, x))
            for m, good in by_mod.items():
                out, bad = encode_batch(encoder, m, [x for _, _, x in good],
                                        [units[ui].rows[pos].id for ui, pos, _ in good])
                for p, ((ui, pos, _), f) in enumerate(zip(good, out)):
                    if p in bad:
                        failed[ui][pos] = bad[p]
                    else:
                        feats[ui][pos] = f
            bar.update(len(items))
            for ui, pos, _, _ in batch:
                if pos == END:
                    self._finish_stream_unit(units[ui], feats.pop(ui, {}), failed.pop(ui, {}))
        bar.close()

    def _finish_stream_unit(self, u: Unit, feats: dict[int, np.ndarray], failed: dict[int, dict]) -> None:
        ok = sorted(feats)
        x = np.stack([feats[p] for p in ok]) if ok else np.zeros((0, self.dims[u.modality]), np.float32)
        report = {"dataset": u.name, "split": self.split,
                  "modalities": {u.modality: modality_counts(len(u.rows), len(ok))},
                  "failed": failure_records(u.modality, u.rows, {u.rows[p].id: f for p, f in failed.items()})}
        self._write_unit(u, [u.rows[p] for p in ok], x.astype(np.float32), report)

    # -- after all ranks: check and merge ----------------------------------------------------
    def report(self) -> dict:
        """The split's report from the finished units; raises if a unit is not finished."""
        missing = [u.name for u in self.units if not self.done(u)]
        if missing:
            raise FeatureStoreError(f"{self.dataset}/{self.split}: {len(missing)} shards are not finished, e.g. "
                                    f"{missing[:3]} under {self.work}; run the extraction again to resume them")
        pos = {m: {r.id: i for i, r in enumerate(rs)} for m, rs in self.rows.items()}
        failed = []
        counts = {m: {"rows": len(rs), "ok": 0, "failed": 0} for m, rs in self.rows.items() if m not in self.skipped}
        for u in self.units:
            rep = json.loads((self.unit_store(u) / "report.json").read_text(encoding="utf-8"))
            c = rep["modalities"][u.modality]
            counts[u.modality]["ok"] += c.get("ok", 0)
            counts[u.modality]["failed"] += c.get("failed", 0)
            failed += rep["failed"]
        failed.sort(key=lambda f: (ushash.MODALITIES.index(f["modality"]), pos[f["modality"]][f["id"]]))
        mods = {m: skipped(n, self.enc_name, m) for m, n in self.skipped.items()}
        mods.update(counts)
        return {"dataset": self.dataset, "split": self.split, "modalities": mods, "failed": failed,
                "shards": {"units": len(self.units), "hash_shards": self.n_shards}}

    def check(self) -> dict:
        """The split's report; raises FeatureStoreError when a modality has too many bad rows."""
        report = self.report()
        for m, c in report["modalities"].items():
            if "skipped" in c:
                continue
            check_bad_rows(report, m, self.max_bad_frac, self.work / "report.json")
        if not any("skipped" not in c for c in report["modalities"].values()):
            raise FeatureStoreError(f"{self.dataset}/{self.split}: no rows for any modality of encoder "
                                    f"{self.enc_name} ({self.enc_modalities}); found {report['modalities']}")
        return report

    def forget_failed_units(self) -> None:
        """Remove the finished units that hold failed rows, so that the next run extracts them again: after a
        split stopped at `max_bad_frac` for a passing cause (a missing optional decoder, an unmounted or
        flaky disk), every later run found those units finished and stopped the same way after the fix."""
        for u in self.units:
            path = self.unit_store(u)
            try:
                failed = json.loads((path / "report.json").read_text(encoding="utf-8"))["failed"]
            except (OSError, ValueError, KeyError):
                continue
            if failed:
                shutil.rmtree(path, ignore_errors=True)

    def merge(self, report: dict) -> FeatureSplit:
        """Write the finished store from the units, in the split's row order, atomically; drop the units."""
        tmp = self.work / "merge"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        tables = {}
        for m, mrows in self.rows.items():
            if m in self.skipped:
                continue
            pos = {r.id: i for i, r in enumerate(mrows)}
            parts = []
            for u in self.units:
                if u.modality != m:
                    continue
                t = open_split(self.unit_store(u), check_finite=False).tables.get(m)
                if t is not None and len(t):
                    parts.append((np.fromiter((pos[i] for i in t.ids), np.int64, len(t)), t.x))
            ok = np.sort(np.concatenate([p for p, _ in parts])) if parts else np.zeros(0, np.int64)
            x = np.lib.format.open_memmap(tmp / f"{m}.npy", mode="w+", dtype=np.float32,
                                          shape=(len(ok), self.dims[m]))
            for p, px in parts:
                x[np.searchsorted(ok, p)] = px
            x.flush()
            ok_rows = [mrows[i] for i in ok]
            tables[m] = {"x": x, "ids": [r.id for r in ok_rows], "groups": [r.group for r in ok_rows],
                         "labels": [r.labels for r in ok_rows]}
        split = write_split(self.out, self.dataset, self.split, tables, self.encoder_meta, report,
                            rows=self.rows_fingerprint)
        del tables
        shutil.rmtree(self.work, ignore_errors=True)
        return split


# ------------------------------------------------------------------------------------------ streaming
def _first(batch):
    return batch[0]


class _Stream(IterableDataset):
    """Yields (unit index, row position, preprocessed | None, failure | None) for each row of its units,
    then (unit index, END, None, None). DataLoader workers split the units, never a unit."""

    def __init__(self, units: list[Unit], encoder):
        self.units, self.encoder = units, encoder

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for ui in range(wid, len(self.units), nw):
            yield from self._unit(ui)

    def _unit(self, ui: int):
        u = self.units[ui]
        want = {mb: p for p, mb in enumerate(u.members)}
        seen: set[int] = set()
        broken = None
        try:
            for member, data in read_container(u.container, want):
                p = want[member]
                if p in seen:
                    continue  # a member repeated inside a tar: the first one counts
                seen.add(p)
                yield (ui, p, *self._decode(u, p, data))
        except Exception as e:  # truncated/corrupt tar, unreadable dataset: the rest of the unit fails
            broken = failure(media.UNREADABLE_CONTAINER, f"{u.container.split(':', 1)[1]}: unreadable after "
                                                         f"{len(seen)} members ({type(e).__name__}: {e})")
        for p in range(len(u.rows)):
            if p not in seen:
                yield ui, p, None, broken or failure_of(
                    media.MediaError(u.rows[p].source, "not found in its container", media.NOT_IN_CONTAINER))
        yield ui, END, None, None

    def _decode(self, u: Unit, p: int, data: bytes):
        src = u.rows[p].source
        if isinstance(data, media.MediaError):  # refused before it was read (MAX_MEMBER_BYTES)
            return None, failure_of(media.MediaError(src, data.reason, data.code))
        if not data:  # a member without bytes (an empty file in the tar, an image cell with no bytes)
            return None, failure_of(media.MediaError(src, "empty member (0 bytes)", media.EMPTY))
        return prepare(self.encoder, u.modality, src, data)


#: The most bytes a tar member may declare to be read: its size comes from the header, and a sparse member
#: (or one of a compressed tar) of a few KB on disk can declare gigabytes of zeros, which reading it whole
#: would allocate. A larger member is refused (over_limit) before any of it is read.
MAX_MEMBER_BYTES = 1 << 30


def read_container(container: str, want: dict[str, int]):
    """(member, bytes) for the wanted members of a container, in the container's own order; for a member
    over MAX_MEMBER_BYTES a MediaError (over_limit) instead of its bytes."""
    scheme, _, rest = container.partition(":")
    if scheme == "tar":
        with tarfile.open(rest, mode="r|*") as tf:  # a stream: one sequential pass
            for ti in tf:
                if ti.isfile() and ti.name in want:
                    if ti.size > MAX_MEMBER_BYTES:
                        yield ti.name, media.MediaError(None, f"tar member declares {ti.size} bytes, over "
                                                              f"{MAX_MEMBER_BYTES} (a sparse or compressed bomb?)",
                                                        media.OVER_LIMIT)
                        continue
                    f = tf.extractfile(ti)
                    yield ti.name, f.read() if f is not None else b""
    elif scheme == "hf":
        from ushash.data.datasets.hf import open_dataset  # decoding a dataset's own format

        # hf:<dir>#<split>, with @<chunk> after the split in a stream unit's name
        ds = open_dataset(container_file(container), rest.rpartition("#")[2].partition("@")[0])
        cols: dict[str, object] = {}
        for member in sorted(want, key=lambda s: int(s.split("/", 1)[0])):
            idx, col = member.split("/", 1)
            if col not in cols:
                import datasets

                cols[col] = ds.cast_column(col, datasets.Image(decode=False)) \
                    if isinstance(ds.features.get(col), datasets.Image) else ds
            v = cols[col][int(idx)][col]
            if isinstance(v, dict):
                data = v.get("bytes") or (Path(v["path"]).read_bytes() if v.get("path") else b"")
            else:
                data = v or b""
            yield member, data
    else:
        raise ValueError(f"unknown container scheme in {container!r}")


# ------------------------------------------------------------------------------------- the entry point
def _extractor(plan: Plan, encoder):
    import pytorch_lightning as pl

    class ShardExtractor(pl.LightningModule):
        """predict over this rank's tasks; the encoder rides along so Lightning places it on the rank's device."""

        def __init__(self):
            super().__init__()
            self.encoder = encoder

        def predict_dataloader(self):
            tasks = plan.tasks(self.global_rank, self.trainer.world_size)
            return DataLoader(tasks, batch_size=1, collate_fn=_first)

        def predict_step(self, task, batch_idx):
            plan.run_task(task, self.encoder)

    return ShardExtractor()


def extract_sharded(rows: list[Row], encoder, root: str | Path, dataset: str, split: str,
                    encoder_cfg: dict | None = None, shards: int = 0, strategy: str = "auto",
                    accelerator: str = "auto", devices=1, num_nodes: int = 1, batch_size: int = 64,
                    num_workers: int = 2, progress: bool = True, max_bad_frac: float = 0.5,
                    shard_rows: int = SHARD_ROWS) -> FeatureSplit:
    """Extract one split in shards with Lightning `predict` (DDP across devices with strategy="ddp").

    Returns the finished store, the same folder and format `extract` writes; a finished store is
    reused, unfinished shards resume. To extract again, delete the store folder.
    """
    import pytorch_lightning as pl

    plan = Plan(rows, encoder, root, dataset, split, encoder_cfg, shards=shards, batch_size=batch_size,
                num_workers=num_workers, progress=progress, max_bad_frac=max_bad_frac, shard_rows=shard_rows)
    if (plan.out / "meta.json").exists():
        if plan.work.exists() and int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0))) == 0:
            shutil.rmtree(plan.work, ignore_errors=True)  # killed after the merge's rename
        return reuse(plan.out, rows, encoder)
    check_unique(rows, f"{dataset}/{split}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(predict_dataloader|does not have many workers|"
                                "GPU available|TPU available|LOCAL_RANK|predict returned None|Total length of).*")
        trainer = pl.Trainer(accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, use_distributed_sampler=False)
        # One process: the whole run holds the store's lock (extract's own), so a second run of the
        # same split waits instead of writing the same shards. Several ranks: rank 0 holds it for the merge.
        with store_lock(plan.out) if trainer.world_size == 1 else contextlib.nullcontext():
            if (plan.out / "meta.json").exists():  # another process finished it while we waited
                return open_split(plan.out)
            trainer.predict(_extractor(plan, encoder), return_predictions=False)
            trainer.strategy.barrier("ushash-shards-extracted")
            try:
                report = plan.check()  # on every rank, so all of them stop on a bad split
            except FeatureStoreError:
                if trainer.is_global_zero and all(plan.done(u) for u in plan.units):  # stopped by bad rows
                    plan.forget_failed_units()
                raise
            if trainer.is_global_zero:
                with store_lock(plan.out) if trainer.world_size > 1 else contextlib.nullcontext():
                    if not (plan.out / "meta.json").exists():
                        plan.merge(report)
            trainer.strategy.barrier("ushash-shards-merged")
    return open_split(plan.out)

