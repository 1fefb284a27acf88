"""Extraction: a dataset's rows through a frozen encoder into the feature store.

    run_extract(cfg)                                   # what `python -m ushash.extract` runs, every split
    extract(rows, encoder, features_dir, dataset, split)  # one split, in this process

`extract` decodes rows in DataLoader workers and encodes them in the main process, filling
`<store>.partial/<modality>.full.npy` row by row; an interrupted extraction resumes from
`<modality>.progress.json`. A row that fails to decode (corrupt image, unreadable audio, empty caption)
or gives non-finite features is recorded in the report and left out of the arrays; pairing is by
`group`, so nothing else shifts. ushash.data.shards extracts a split in shards (and as Lightning DDP)
with the same pieces, defined here once:

    prepare(encoder, modality, source, data)   decode + preprocess one row -> (x, None) | (None, failure)
    encode_batch(encoder, modality, xs, ids)   one forward pass + the finite check
    failure / failure_of / failure_records     a bad row's record, and the report's list of them
    check_bad_rows                             the `max_bad_frac` rule
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

import ushash
from ushash.config import to_dict
from ushash.data import media
from ushash.data.datasets import load_rows
from ushash.data.rows import Row, check_unique
from ushash.data.store import (FP32, FeatureSplit, FeatureStoreError, encoder_meta, encoder_precision, finish,
                               identity_path, libraries, open_split, other_precisions, partial_path, rows_fingerprint,
                               store_identity, store_lock, stores_named, write_json, write_meta, write_rows)
from ushash.core.io import atomic_write
from ushash.encoders import build_encoder

log = logging.getLogger(__name__)

# Failure codes beyond media.CODES (why a row was left out of the store), with their summary phrases.
NON_FINITE_FEATURES = "non_finite_features"
DECODER_ERROR = "decoder_error"
UNKNOWN = "unknown"  # a failure recorded before failures had codes (an older partial extraction)
#: Seconds waited before each new try of the rows whose files the system failed to read (media.UNREADABLE)
#: in an extraction, before they are counted as failed.
READ_RETRY_PAUSES = (2.0, 10.0)
REASONS = {**media.CODES,
           NON_FINITE_FEATURES: "non-finite features (NaN/inf) from the encoder",
           DECODER_ERROR: "decoder error",
           UNKNOWN: "unknown"}


# ---------------------------------------------------------------------------------------------- the verb

def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def decode_workers(value) -> int:
    """DataLoader workers for decoding: an int, or "auto" = one per core left after the encoder's
    main process (1 on 2 cores, where a second worker would take CPU from the forward pass), at most 8."""
    if value == "auto":
        return max(1, min(8, (os.cpu_count() or 2) - 1))
    return int(value)


def run_extract(cfg: DictConfig, splits: list[str] | None = None, encoder=None) -> dict[str, FeatureSplit]:
    """Extract (or reuse) features of each split; returns the opened stores."""
    from ushash.data import shards  # shards builds on this module

    enc_cfg = to_dict(cfg.encoder)
    if encoder is None:
        encoder = build_encoder(enc_cfg).to(resolve_device(cfg.extract.device))
    data = to_dict(cfg.data)
    name = data.pop("name")
    recipe = data.pop("recipe", None) or name  # a manifest names itself (data.name=mine), the recipe stays
    out = {}
    for split in splits or list(cfg.extract.splits):
        rows = load_rows(recipe, split, **data)
        if shards.wanted(cfg.extract, rows):  # extract.shards / strategy / devices, or rows read as a stream
            out[split] = shards.extract_sharded(rows, encoder, cfg.paths.features_dir, dataset=name, split=split,
                                                encoder_cfg=enc_cfg, **shards.options(cfg.extract))
        else:
            out[split] = extract(rows, encoder, cfg.paths.features_dir, dataset=name, split=split,
                                 encoder_cfg=enc_cfg, batch_size=cfg.extract.batch_size,
                                 num_workers=decode_workers(cfg.extract.num_workers), progress=cfg.extract.progress,
                                 max_bad_frac=cfg.extract.max_bad_frac)
        rep = out[split].report
        counts = ", ".join(f"{m} {v.get('ok', 0)}/{v['rows']}" for m, v in rep["modalities"].items())
        log.info("%s/%s: %s ok; %d failed -> %s", name, split, counts, len(rep["failed"]), out[split].path)
        for line in failure_summary(rep["failed"]):
            log.warning("%s/%s: %s", name, split, line)
    return out


def _recipe(provenance: dict) -> tuple[str, dict]:
    """(the data set recipe, its settings less the name) of the data settings `provenance` records."""
    data = dict(provenance.get("data") or {})
    recipe = data.pop("recipe", None) or data.pop("name", None) or provenance["dataset"]
    data.pop("name", None)
    return recipe, data


def listed_fingerprint(provenance: dict, split: str) -> str | None:
    """The rows fingerprint of `split` made again here from the data settings `provenance` records (a
    checkpoint's, an export's source); None where the recipe cannot run here (synthetic data, a manifest or
    media not on this machine, a path an export left out)."""
    recipe, data = _recipe(provenance)
    from ushash.data.datasets import DATASETS
    if recipe not in DATASETS:
        return None
    try:
        return rows_fingerprint(load_rows(recipe, split, **data))
    except (FileNotFoundError, ValueError, TypeError) as e:
        log.info("cannot list the rows of %s/%s here (%s)", provenance["dataset"], split, e)
        return None


def stored_split(provenance: dict, split: str, features_dir: str | Path) -> FeatureSplit:
    """The feature store of `split` for what a checkpoint was trained on (its provenance: dataset, data
    settings, encoder), under `features_dir`.

    The rows are made again from the dataset settings the checkpoint records, so the store found is the one
    of exactly those rows (`rows_fingerprint`): never a store of another manifest or another split seed.
    Where the recipe cannot run here, the rows fingerprint the provenance recorded for the split (`stores`:
    a checkpoint's train and val, an export's every split it could list) names the store. Without either,
    the one store of that dataset, split and encoder is used for synthetic data, and a data set whose rows
    cannot be listed is refused (a store of another manifest of the same name was once used).

    Only a store of the precision the provenance's encoder record says (`encoder_precision`: fp32 unless it
    says fp16 autocast) is used; where only stores of another precision exist, the error names them."""
    enc = provenance["encoder"]
    dataset = provenance["dataset"]
    recipe, data = _recipe(provenance)
    precision = encoder_precision(enc)
    base = store_identity(dataset, split, {"name": enc["name"], "fingerprint": enc["fingerprint"],
                                           "precision": precision})
    from ushash.data.datasets import DATASETS
    fingerprint = listed_fingerprint(provenance, split) or (provenance.get("stores") or {}).get(split)
    if fingerprint:
        identity = {**base, "rows_fingerprint": fingerprint}
        path = identity_path(features_dir, identity)
        if not (path / "meta.json").exists():
            sets = " ".join(f"data.{k}={v}" for k, v in data.items() if v is not None and not isinstance(v, (dict, list)))
            raise FeatureStoreError(
                f"no feature store of {dataset}/{split} for the rows this checkpoint's data settings give, at "
                f"{path} ({precision} features{_other_precisions_note(features_dir, identity)}); "
                f"extract it: python -m ushash.extract data={recipe} data.name={dataset} {sets} "
                f"encoder={enc['name']} extract.splits=[{split}]{_precision_setting(precision)}")
        return open_split(path)
    if recipe in DATASETS:
        raise FeatureStoreError(
            f"cannot list the rows of {dataset}/{split} here (its data, e.g. the manifest, is not where the "
            f"checkpoint's data settings say) and nothing records which store they are; pass the data settings "
            f"that list them (data.path=... for a manifest), so that only the store of exactly those rows is used")
    folder = identity_path(features_dir, base)
    found = stores_named(folder)
    if len(found) != 1:
        raise FeatureStoreError(
            f"{'no' if not found else len(found)} feature store(s) of {dataset}/{split} with encoder "
            f"{enc['name']} ({enc['fingerprint']}, {precision}) under {folder.parent}"
            + (f": {[p.name for p in found]}; pass the folder with features_dir= or remove the others" if found
               else _other_precisions_note(features_dir, base)))
    return open_split(found[0])


def _other_precisions_note(features_dir, identity: dict) -> str:
    """For a missing store: the stores of the same rows (or, without a rows fingerprint, of the same dataset,
    split and encoder) at another precision, which are not used instead: their features differ in the low bits
    from the ones the checkpoint was trained on."""
    rows = "those rows" if identity.get("rows_fingerprint") else "that encoder"
    return "".join(f"; {p} store(s) of {rows} at {', '.join(str(f) for f in found)}, but features of another "
                   f"precision than the checkpoint's are not used"
                   for p, found in other_precisions(features_dir, identity).items())


def _precision_setting(precision: str) -> str:
    """The extract settings that give features of `precision`."""
    return " encoder.amp=false" if precision == FP32 else " extract.device=cuda encoder.amp=true"


def resolve_features_dir(provenance: dict, cfg) -> Path:
    """Where a checkpoint's (or an export's) feature stores are: `cfg.features_dir` when set, else the folder
    it recorded, relative to this project's root `cfg.paths.root` (a checkpoint copied to another clone uses
    that clone's stores)."""
    if cfg.get("features_dir"):
        return Path(cfg.features_dir)
    rec = Path(str(provenance.get("features_dir") or "data/features"))
    return rec if rec.is_absolute() else Path(cfg.paths.root) / rec


def relative_to_root(path: str | Path, root: str | Path) -> str:
    """`path` relative to the project root when it lies inside it (what checkpoints record), else absolute."""
    path, root = Path(path).resolve(), Path(root).resolve()
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def failure_summary(failed: list[dict], examples: int = 2) -> list[str]:
    """One line per failure reason (its count and the first sources), for the console; report.json has all."""
    by: dict[tuple, list[dict]] = {}
    for f in failed:
        by.setdefault((f.get("modality", ""), f.get("code", "unknown")), []).append(f)
    return [f"{len(fs)} {modality} rows failed ({REASONS.get(code, code)}), e.g. "
            + "; ".join(f"{str(f.get('source', f.get('id', '?')))[:100]}: {str(f.get('reason', ''))[:160]}"
                        for f in fs[:examples])
            for (modality, code), fs in sorted(by.items(), key=lambda kv: -len(kv[1]))]


# ---------------------------------------------------------------------------------------------- shared pieces

def collate_list(batch):
    """DataLoader collate_fn that keeps a batch as the list of its items."""
    return batch


def failure(code: str, reason: str) -> dict:
    """Why one row was left out: a code (a key of REASONS) and the message for people."""
    return {"code": code, "reason": reason}


def failure_of(err: media.MediaError) -> dict:
    return failure(err.code, str(err))


def prepare(encoder, modality: str, source: str, data: bytes | None = None):
    """Decode one row, from its `source` or from the `data` bytes read out of its container, and preprocess
    it for `encoder`: (x, None), or (None, failure) when it cannot be decoded."""
    try:
        if data is None:
            raw = media.load(modality, source, sample_rate=encoder.sample_rate, seconds=encoder.audio_seconds)
        else:
            raw = media.decode_bytes(modality, data, source, encoder.sample_rate, encoder.audio_seconds)
        return encoder.preprocess(modality, raw), None
    except media.MediaError as e:
        return None, failure_of(e)
    except Exception as e:  # a decoder bug on one file must not kill a long extraction
        return None, failure(DECODER_ERROR, f"{type(e).__name__}: {e}")


def encode_batch(encoder, modality: str, xs: list, ids: list[str]) -> tuple[np.ndarray, dict[int, dict]]:
    """One forward pass over preprocessed items: float32 features [n, D], and {position: failure} for the
    items whose features are not finite (NaN/inf), which are warned about by id and must not be stored."""
    feats = encoder.encode(modality, encoder.collate(modality, xs)).detach().float().cpu().numpy()
    bad = np.flatnonzero(~np.isfinite(feats).all(axis=1))
    if len(bad):
        warnings.warn(f"{modality}: rejected {len(bad)} rows with NaN/inf features: {[ids[p] for p in bad[:10]]}")
    return feats, {int(p): failure(NON_FINITE_FEATURES, "non-finite features (NaN/inf) from the encoder")
                   for p in bad}


def failure_records(modality: str, rows: list[Row], failed: dict[str, dict]) -> list[dict]:
    """The report's entries for the failed rows among `rows` ({row id: failure}), in row order."""
    return [{"modality": modality, "id": r.id, "source": _short(r.source), "reason": f["reason"], "code": f["code"]}
            for r in rows for f in [failed.get(r.id)] if f]


def modality_counts(n_rows: int, n_ok: int) -> dict:
    """The report's {"rows", "ok", "failed"} of one modality."""
    return {"rows": n_rows, "ok": n_ok, "failed": n_rows - n_ok}


def skipped(n_rows: int, encoder_name: str, modality: str) -> dict:
    """The report's entry for a modality the encoder cannot encode."""
    return {"rows": n_rows, "skipped": f"encoder {encoder_name} has no {modality} tower"}


def check_bad_rows(report: dict, modality: str, max_bad_frac: float, report_file: Path) -> None:
    """The `max_bad_frac` rule, on one modality of an extraction report: when no row is left or more than
    `max_bad_frac` of them failed, write the report to `report_file` (if its folder exists) and raise
    FeatureStoreError, summarising the failures by reason."""
    c = report["modalities"][modality]
    if c["ok"] > 0 and c["failed"] <= max_bad_frac * c["rows"]:
        return
    reasons = sorted({REASONS.get(f.get("code"), REASONS[UNKNOWN]) for f in report["failed"]
                      if f["modality"] == modality})[:5]
    if report_file.parent.exists():
        write_json(report_file, report)
    raise FeatureStoreError(
        f"{report['dataset']}/{report['split']}: {c['failed']} of {c['rows']} {modality} rows failed (limit "
        f"{max_bad_frac:.0%}); reasons include {reasons}. Full list: {report_file}. Check the data root.")


def _short(source: str, n: int = 200) -> str:
    """`source` for the report: at most `n` characters, and writable as UTF-8 JSON (a caption may hold a lone
    surrogate, which is why it failed: written as its escape)."""
    source = source if len(source) <= n else source[: n - 3] + "..."
    return source.encode("utf-8", "backslashreplace").decode("utf-8")


# ---------------------------------------------------------------------------------------------- one process

def extract(rows: list[Row], encoder, root: str | Path, dataset: str, split: str, encoder_cfg: dict | None = None,
            batch_size: int = 64, num_workers: int = 2, progress: bool = True, max_bad_frac: float = 0.5,
            overwrite: bool = False, flush_every: int = 20) -> FeatureSplit:
    """Extract features for `rows` once; a finished store is reused, an unfinished one resumed."""
    identity = store_identity(dataset, split, encoder_meta(encoder, encoder_cfg), rows_fingerprint(rows))
    out = identity_path(root, identity)
    if out.exists() and not overwrite:
        return reuse(out, rows, encoder)
    check_unique(rows, f"{dataset}/{split}")
    with store_lock(out):
        if out.exists() and not overwrite:  # another process finished it while we waited
            return reuse(out, rows, encoder)
        return _extract_locked(rows, encoder, out, identity, batch_size, num_workers, progress, max_bad_frac,
                               flush_every)


#: Rows per modality of a reused store encoded again where the libraries here are not those it was made with.
REUSE_SAMPLE = 4
#: In a store: the library versions under which a sample of its rows was encoded again and gave its features.
VERIFIED = "verified.json"


def reuse(out: Path, rows: list[Row], encoder) -> FeatureSplit:
    """The finished store at `out`, once it is known to hold what `encoder` computes here. Its key covers the
    encoder's weights, config and precision and the rows, not the code of the libraries that decode,
    tokenise and run the networks nor the tokenizer's files: where their versions and digests here
    (`store.libraries`, `tokenizers`) are not those the store records (or it records none, made before it
    did), REUSE_SAMPLE of its rows per modality, spread over it,
    are encoded again and must give its features (cosine >= 0.9999, norms within 0.1 %). A store that does
    is marked verified for these versions (`VERIFIED`, beside meta.json); one that does not is refused,
    naming the versions that changed, rather than reused as features the code here no longer computes."""
    split = open_split(out)
    here = {**libraries(), **tokenizers(encoder)}
    recorded = split.meta.get("libraries")
    if recorded == here or here in _verified(out / VERIFIED):
        split.checked_tokenizers = tokenizers(encoder)
        return split
    by_id = {(r.modality, r.id): r for r in rows}
    low_cos, far_norm, checked = 1.0, 0.0, 0
    for m, t in split.tables.items():
        if m not in encoder.modalities or not len(t.ids):
            continue
        picks = sorted(set(np.linspace(0, len(t.ids) - 1, min(REUSE_SAMPLE, len(t.ids))).astype(int).tolist()))
        ready = _prepare_rows(encoder, m, [r for i in picks for r in [by_id.get((m, t.ids[i]))] if r is not None])
        at = [i for i in picks if t.ids[i] in ready]
        xs = [ready[t.ids[i]] for i in at]
        if not xs:
            continue
        new = encode_batch(encoder, m, xs, [t.ids[i] for i in at])[0].astype(np.float64)
        old = np.asarray(t.x[at], np.float64)
        nn, no = np.linalg.norm(new, axis=1), np.linalg.norm(old, axis=1)
        cos = np.where(nn * no > 0, (new * old).sum(axis=1) / np.maximum(nn * no, 1e-300), (nn == no).astype(float))
        ratio = np.where(no > 0, nn / np.maximum(no, 1e-300), np.where(nn == 0, 1.0, np.inf))
        low_cos, far_norm = min(low_cos, float(cos.min())), max(far_norm, float(np.abs(ratio - 1.0).max()))
        checked += len(at)
    changed = ", ".join(f"{k} {(recorded or {}).get(k, '?')} -> {v}" for k, v in here.items()
                        if (recorded or {}).get(k) != v) if recorded else "library versions it does not record"
    if not checked:
        log.warning("%s: made with %s; none of its rows could be encoded again here to check it, reused as it is",
                    out, changed)
        return split
    if low_cos < 0.9999 or far_norm > 1e-3:
        raise FeatureStoreError(
            f"{out}: made with {changed}, and of {checked} of its rows encoded again here the lowest cosine to "
            f"its features is {low_cos:.5f} and the largest change of norm {far_norm:.2%}: its features are not "
            f"what this code computes; delete the folder and extract again")
    log.info("%s: made with %s; %d of its rows encode to its features here (lowest cosine %.6f), reused", out,
             changed, checked, low_cos)
    atomic_write(out / VERIFIED, json.dumps(_verified(out / VERIFIED) + [here], indent=1) + "\n")
    split.checked_tokenizers = tokenizers(encoder)
    return split


def tokenizers(encoder) -> dict[str, str]:
    """The digests of `encoder`'s tokenizer files (`Encoder.tokenizer_digests`; {} for an encoder without)."""
    digests = getattr(encoder, "tokenizer_digests", None)
    return digests() if callable(digests) else {}


def _prepare_rows(encoder, modality: str, rows: list[Row]) -> dict[str, object]:
    """{row id: preprocessed input} of the rows that decode: a row inside a container (a tar member, a Hugging
    Face dataset cell: ushash.data.shards.packed_source) read out of it, one pass per container, as sharded
    extraction reads it; a container that cannot be read leaves its rows out."""
    from ushash.data.shards import packed_source, read_container

    out, packed = {}, {}
    for r in rows:
        where = packed_source(r)
        if where is None:
            x, failed = prepare(encoder, modality, r.source)
            if not failed:
                out[r.id] = x
        else:
            packed.setdefault(where[0], {})[where[1]] = r
    for container, members in packed.items():
        try:
            for member, data in read_container(container, {mb: 0 for mb in members}):
                r = members[member]
                if r.id not in out and data and not isinstance(data, media.MediaError):
                    x, failed = prepare(encoder, modality, r.source, data)
                    if not failed:
                        out[r.id] = x
        except Exception as e:   # truncated or unreadable since: its rows are not checked
            log.info("%s: unreadable while checking a reused store (%s: %s)", container, type(e).__name__, e)
    return out


def _verified(path: Path) -> list[dict]:
    """The library versions a store was verified under (`reuse`); none when the file is absent or unreadable."""
    try:
        got = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [v for v in got if isinstance(v, dict)] if isinstance(got, list) else []


class _Decode(Dataset):
    """Decodes and preprocesses rows in DataLoader workers: (index, x, None) or (index, None, failure)."""

    def __init__(self, rows: list[Row], encoder, indices: list[int]):
        self.rows, self.encoder, self.indices = rows, encoder, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int):
        i = self.indices[k]
        row = self.rows[i]
        return (i, *prepare(self.encoder, row.modality, row.source))


def _extract_modality(rows: list[Row], encoder, work: Path, modality: str, batch_size: int,
                      num_workers: int, progress: bool, flush_every: int) -> dict:
    """Fill `work/<m>.full.npy` row by row (resumable). Returns the progress record."""
    dim = encoder.dims[modality]
    prog_file, arr_file = work / f"{modality}.progress.json", work / f"{modality}.full.npy"
    digest = rows_fingerprint(rows)
    prog = json.loads(prog_file.read_text(encoding="utf-8")) if prog_file.exists() else None
    if prog is not None and (prog["rows_digest"] != digest or not arr_file.exists()):
        warnings.warn(f"{work}: the {modality} rows changed since the interrupted run; starting this modality over")
        prog = None
    if prog is None:
        prog = {"rows_digest": digest, "n_rows": len(rows), "done": 0, "ok": [], "failed": {}}
        arr = np.lib.format.open_memmap(arr_file, mode="w+", dtype=np.float32, shape=(len(rows), dim))
        del arr
        write_json(prog_file, prog)
    prog["failed"] = {k: v if isinstance(v, dict) else failure(UNKNOWN, v) for k, v in prog["failed"].items()}
    # The rows an interrupted run could not use are tried again, first: a failure may have been passing (an
    # optional decoder such as cairosvg installed since, a file system that failed a read). They once stayed
    # failed in every resumed run, so an extraction stopped by `max_bad_frac` stopped again after the fix.
    # A row stays in "failed" until it is encoded, so a kill during the retry loses none of them.
    retry = [i for i, r in enumerate(rows[:prog["done"]]) if r.id in prog["failed"]]
    todo = retry + list(range(prog["done"], len(rows)))
    if not todo:
        return prog
    arr = np.load(arr_file, mmap_mode="r+")
    ok = set(prog["ok"])
    bar = tqdm(total=len(rows) + len(retry), initial=prog["done"], desc=f"extract {modality}", unit="item",
               disable=not progress, dynamic_ncols=True)
    _encode_rows(rows, encoder, modality, todo, arr, ok, prog, prog_file, batch_size, num_workers, flush_every, bar)
    bar.close()
    # A file the system failed to read (an I/O error, EIO on a flaky disk or a network file system: not its
    # content) is read again after a pause, READ_RETRY_PAUSES times, before it is counted as failed in a store
    # that, once finished, is reused as it is.
    for pause in READ_RETRY_PAUSES:
        again = [i for i, r in enumerate(rows) if prog["failed"].get(r.id, {}).get("code") == media.UNREADABLE]
        if not again:
            break
        log.warning("%s: %d %s rows could not be read (%s); reading them again in %g s", work, len(again),
                    modality, prog["failed"][rows[again[0]].id]["reason"], pause)
        time.sleep(pause)
        _encode_rows(rows, encoder, modality, again, arr, ok, prog, prog_file, batch_size, 0, flush_every, None)
    return prog


def _encode_rows(rows: list[Row], encoder, modality: str, todo: list[int], arr, ok: set, prog: dict, prog_file: Path,
                 batch_size: int, num_workers: int, flush_every: int, bar) -> None:
    """Decode and encode rows[todo] into `arr`, recording each in `ok` or `prog["failed"]`, and `prog` (with
    the array flushed first) every `flush_every` batches and at the end."""
    loader = DataLoader(_Decode(rows, encoder, todo), batch_size=batch_size, num_workers=num_workers,
                        collate_fn=collate_list, shuffle=False,
                        persistent_workers=False, prefetch_factor=4 if num_workers else None)
    for step, batch in enumerate(loader):
        good = [(i, x) for i, x, fail in batch if fail is None]
        for i, _, fail in batch:
            if fail is not None:
                prog["failed"][rows[i].id] = fail
        if good:
            feats, bad = encode_batch(encoder, modality, [x for _, x in good], [rows[i].id for i, _ in good])
            for p, ((i, _), f) in enumerate(zip(good, feats)):
                if p in bad:
                    prog["failed"][rows[i].id] = bad[p]
                else:
                    arr[i] = f
                    ok.add(i)
                    prog["failed"].pop(rows[i].id, None)
        prog["done"] = max(prog["done"], batch[-1][0] + 1)
        if bar is not None:
            bar.update(len(batch))
        if (step + 1) % flush_every == 0 or prog["done"] >= len(rows):
            arr.flush()
            prog["ok"] = sorted(ok)
            write_json(prog_file, prog)
    arr.flush()
    prog["ok"] = sorted(ok)
    write_json(prog_file, prog)


def _extract_locked(rows, encoder, out: Path, identity: dict, batch_size, num_workers, progress, max_bad_frac,
                    flush_every) -> FeatureSplit:
    dataset, split = identity["dataset"], identity["split"]
    work = partial_path(out)
    work.mkdir(parents=True, exist_ok=True)
    report = {"dataset": dataset, "split": split, "modalities": {}, "failed": []}
    meta_mods = {}
    for m in ushash.MODALITIES:
        mrows = [r for r in rows if r.modality == m]
        if not mrows:
            continue
        if m not in encoder.modalities:
            report["modalities"][m] = skipped(len(mrows), encoder.name, m)
            continue
        prog = _extract_modality(mrows, encoder, work, m, batch_size, num_workers, progress, flush_every)
        ok_idx = np.asarray(prog["ok"], dtype=np.int64)
        report["modalities"][m] = modality_counts(len(mrows), len(ok_idx))
        report["failed"] += failure_records(m, mrows, prog["failed"])
        check_bad_rows(report, m, max_bad_frac, work / "report.json")
        full = np.load(work / f"{m}.full.npy", mmap_mode="r")
        final = np.lib.format.open_memmap(work / f"{m}.npy", mode="w+", dtype=np.float32,
                                          shape=(len(ok_idx), full.shape[1]))
        for s in range(0, len(ok_idx), 65536):
            final[s:s + 65536] = full[ok_idx[s:s + 65536]]
        final.flush()
        del final, full
        ok_rows = [mrows[i] for i in ok_idx]
        write_rows(work / f"{m}.rows.jsonl", [r.id for r in ok_rows], [r.group for r in ok_rows],
                   [r.labels for r in ok_rows])
        meta_mods[m] = {"dim": int(encoder.dims[m]), "count": int(len(ok_idx))}
    if not meta_mods:
        raise FeatureStoreError(f"{dataset}/{split}: no rows for any modality of encoder {encoder.name} "
                                f"({encoder.modalities}); found {len(rows)} rows")
    for m in meta_mods:
        (work / f"{m}.full.npy").unlink(missing_ok=True)
        (work / f"{m}.progress.json").unlink(missing_ok=True)
    write_json(work / "report.json", report)
    write_meta(work, identity, meta_mods, tokenizers(encoder))
    return finish(work, out)
