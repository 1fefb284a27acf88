"""python -m ushash.eval ckpt=checkpoints/<run>/best.ckpt

Loads a checkpoint with no config tree, opens the test split of the feature store it was trained from,
and writes results.json and results.md (every direction, both protocols, codes beside float baselines).
A folder (`out=`) whose results.json holds the tables of other settings is refused, never overwritten, and
directions a separate database cannot run (`database=` a split without one of the modalities) are named in
results.json ("skipped_directions") and under the tables in results.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from ushash.evaluation import report, retrieval
from ushash.core.io import atomic_write, settings_digest, write_json
from ushash.data.extract import resolve_features_dir, stored_split
from ushash.hashing.methods.space import JOINT_SPACE_ENCODERS  # image/text (or audio/text) in one space already
from ushash.hashing.module import load_checkpoint

log = logging.getLogger(__name__)


def methods_for(module, encoder_name: str) -> dict:
    hp = module.hparams
    from ushash.hashing import methods as registry
    title = registry.get(hp.get("method", "ushash")).title
    methods = {f"{title} {hp.bits}-bit codes": module.code_method(),
               f"float z ({title} head, {hp.dim}-d)": module.float_method()}
    if encoder_name in JOINT_SPACE_ENCODERS:
        methods["float (raw encoder embedding)"] = lambda m, x: ("float", np.asarray(x, dtype=np.float32))
    return methods


def default_out(prov: dict, cfg, settings: dict) -> str:
    """`<run>/<checkpoint file>-<split>[-vs-<database>]-<digest>`: keyed by everything that made the tables (the
    checkpoint's bytes, the splits, k, the denominator, the protocols), so another checkpoint of the same run
    (last.ckpt beside best.ckpt, or a retrained one), another split or other settings never overwrite them."""
    run = prov.get("run_name", Path(str(cfg.ckpt)).parent.name)
    name = f"{Path(str(cfg.ckpt)).stem}-{settings['split']}"
    if settings["database"] != settings["split"]:
        name += f"-vs-{settings['database']}"
    return f"{run}/{name}-{settings_digest(settings)}"


def check_out(out: Path, settings: dict) -> None:
    """Refuse a folder whose results.json holds the tables of other settings (another checkpoint, split,
    database, k, denominator or protocols) or cannot be read: `out=` names any folder, and writing there
    silently replaced another evaluation's tables. The same settings again may overwrite (the same tables)."""
    prev = out / "results.json"
    if not prev.exists():
        return
    fix = f"pass another out= or remove {prev}"
    try:
        recorded = json.loads(prev.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FileExistsError(f"{prev} exists and cannot be read as the results of an evaluation ({e}); {fix}") from e
    ours = json.loads(json.dumps(settings))  # as results.json records them (lists, not tuples)
    theirs = recorded.get("settings") if isinstance(recorded, dict) else None
    if not isinstance(theirs, dict):
        raise FileExistsError(f"{prev} exists and records no evaluation settings (not the results of ushash.eval?); "
                              f"{fix}")
    if theirs == ours:
        return
    diffs = []
    for key in sorted(set(ours) | set(theirs)):
        if theirs.get(key) == ours.get(key):
            continue
        if key == "checkpoint_sha256":
            diffs.insert(0, f"another checkpoint ({recorded.get('checkpoint', '?')}, sha256 "
                            f"{str(theirs.get(key))[:12]}…; this one is {str(ours.get(key))[:12]}…)")
        else:
            diffs.append(f"{key} {theirs.get(key)!r} there, {ours.get(key)!r} here")
    raise FileExistsError(f"{out} already holds the tables of other settings: {'; '.join(diffs)}; "
                          f"not overwriting them: {fix}")


def skipped_note(skipped: list[dict]) -> str:
    """The line under results.md's tables naming the directions that are not in them, and why."""
    line = retrieval.skipped_summary(skipped)
    return f"*{line[0].upper()}{line[1:]}.*"


def run_eval(cfg: DictConfig) -> dict:
    ckpt = Path(str(cfg.ckpt))
    raw = ckpt.read_bytes() if ckpt.is_file() else None   # read once: the tables are keyed by the bytes loaded
    module = load_checkpoint(ckpt, data=raw)
    prov = module.hparams.provenance or {}
    enc = prov["encoder"]
    db_name = cfg.get("database")
    settings = {"checkpoint_sha256": hashlib.sha256(raw).hexdigest(), "split": cfg.split, "database": db_name or cfg.split,
                "k": int(cfg.k), "denominator": str(cfg.denominator), "protocols": list(cfg.protocols)}
    out = Path(cfg.out) if cfg.out else Path(cfg.paths.experiments_dir) / "eval" / default_out(prov, cfg, settings)
    check_out(out, settings)   # before the work: a folder holding other tables is refused now, not after
    features_dir = resolve_features_dir(prov, cfg)
    split = stored_split(prov, cfg.split, features_dir)
    database = stored_split(prov, db_name, features_dir) if db_name and db_name != cfg.split else None
    skipped: list[dict] = []
    rows = retrieval.evaluate(split, methods_for(module, enc["name"]), k=int(cfg.k), database=database,
                              protocols=tuple(cfg.protocols), denominator=str(cfg.denominator), skipped=skipped)
    out.mkdir(parents=True, exist_ok=True)
    against = f" against the {db_name} split" if database is not None else ""
    title = (f"{prov['dataset']} / {cfg.split} split{against}, encoder {enc['name']} ({enc['fingerprint']}), "
             f"{module.hparams.bits} bits")
    table = report.eval_tables(rows, k=int(cfg.k), title=title)
    if skipped:
        table += "\n" + skipped_note(skipped) + "\n"
    result = {"checkpoint": str(cfg.ckpt), "dataset": prov["dataset"], "split": cfg.split,
              "database": db_name or cfg.split, "encoder": enc,
              "bits": module.hparams.bits, "settings": settings, "tie_rule": "ascending database index",
              "skipped_directions": skipped, "rows": rows}
    check_out(out, settings)   # again: another evaluation may have written there while this one ran
    write_json(out / "results.json", result)
    atomic_write(out / "results.md", table + "\n")
    log.info("%s", table)
    log.info("wrote %s and results.md", out / "results.json")
    codes_name = next(iter(methods_for(module, enc["name"])))
    score = retrieval.headline_map([r for r in rows if r["method"] == codes_name], int(cfg.k))
    return {"out": str(out), "rows": rows, "table": table, "score": score, "skipped_directions": skipped}
