"""python -m ushash.eval ckpt=checkpoints/<run>/best.ckpt

Loads a checkpoint with no config tree, opens the test split of the feature store it was trained from,
and writes results.json and results.md (every direction, both protocols, codes beside float baselines).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from ushash.core import codes as codes_lib
from ushash.core import metrics
from ushash.evaluation import retrieval
from ushash.config import CONFIG_DIR
from ushash.data.store import FeatureSplit, open_split, store_path, write_json
from ushash.hashing.methods.space import JOINT_SPACE_ENCODERS  # image/text (or audio/text) in one space already
from ushash.hashing.module import load_checkpoint

#: K of the P@K curves; capped at the database size.
P_AT_K = (1, 5, 10, 20, 50, 100)
CURVES_DOC = (
    "Hamming-ranking curves: for each radius r = 0..bits, precision(r) = relevant / retrieved among database items "
    "within Hamming distance r, averaged over the queries that retrieve at least one item (`retrieved` is that "
    "share of queries); recall(r) = relevant within r / all relevant, averaged over queries with a relevant item. "
    "P@H<=2 is precision within radius 2 averaged over all queries, a query that retrieves nothing scoring 0 "
    "(the HashNet/DCH convention). P@K: relevant in the top K / K, ties by ascending database index.")


def methods_for(module, encoder_name: str) -> dict:
    hp = module.hparams
    from ushash.hashing import methods as registry
    title = registry.get(hp.get("method", "ushash")).title
    methods = {f"{title} {hp.bits}-bit codes": module.code_method(),
               f"float z ({title} head, {hp.dim}-d)": module.float_method()}
    if encoder_name in JOINT_SPACE_ENCODERS:
        methods["float (raw encoder embedding)"] = lambda m, x: ("float", np.asarray(x, dtype=np.float32))
    return methods


def _relevance_matrix(protocol: str, q: str, d: str, groups: dict, labels: dict | None, qs: slice) -> np.ndarray:
    if protocol == "paired":
        return groups[q][qs, None] == groups[d][None, :]
    return (labels[q][qs].astype(np.float32) @ labels[d].T.astype(np.float32)) > 0


def ranking_curves(split: FeatureSplit, reps: dict, protocols=("paired", "label"), ks=P_AT_K) -> list[dict]:
    """Per direction and protocol: P@K (codes and floats) and, for codes, the Hamming-radius PR curve and
    P@H<=2 (see CURVES_DOC). reps: modality -> ("codes"|"float", array), from `retrieval.represent`."""
    groups = retrieval._group_ids(split)
    labels = retrieval._label_matrix(split) if "label" in protocols else None
    out = []
    for q, d in retrieval.directions(m for m in split.modalities if m in reps):
        kind, qx = reps[q]
        _, dx = reps[d]
        n = len(dx)
        kmax = min(max(ks), n)
        ks_here = tuple(K for K in ks if K <= n) or (n,)
        I, bits = retrieval.rank(kind, qx, dx, kmax)
        for protocol in protocols:
            if protocol == "label" and labels is None:
                continue
            rel, _ = metrics.relevance(I, groups[q], groups[d], protocol,
                                       labels[q] if protocol == "label" else None,
                                       labels[d] if protocol == "label" else None)
            row = {"kind": kind, "bits": bits, "direction": retrieval.direction_name(q, d), "protocol": protocol,
                   "n_queries": int(len(qx)), "n_database": int(n),
                   "p_at_k": {str(K): v for K, v in metrics.precision_at_k(rel, ks_here).items()}}
            if kind == "codes":
                row.update(_hamming_pr(qx, dx, bits, protocol, q, d, groups, labels))
            out.append(row)
    return out


def _hamming_pr(qx, dx, bits, protocol, q, d, groups, labels) -> dict:
    m, n = len(qx), len(dx)
    within = np.zeros((m, bits + 1), np.int64)
    rel_within = np.zeros((m, bits + 1), np.int64)
    step = max(1, (1 << 22) // max(n, 1))
    for s in range(0, m, step):
        qs = slice(s, min(m, s + step))
        D = codes_lib.hamming(qx[qs], dx)
        R = _relevance_matrix(protocol, q, d, groups, labels, qs)
        b = D.shape[0]
        flat = (np.arange(b)[:, None] * (bits + 1) + D).ravel()
        within[qs] = np.bincount(flat, minlength=b * (bits + 1)).reshape(b, bits + 1)
        rel_within[qs] = np.bincount(flat[R.ravel()], minlength=b * (bits + 1)).reshape(b, bits + 1)
    within, rel_within = within.cumsum(1), rel_within.cumsum(1)
    n_rel = rel_within[:, -1]
    got = within > 0
    prec = np.divide(rel_within, within, out=np.zeros(within.shape), where=got)
    n_got = got.sum(0)
    precision = np.divide(prec.sum(0), n_got, out=np.zeros(bits + 1), where=n_got > 0)
    has_rel = n_rel > 0
    recall = (rel_within[has_rel] / n_rel[has_rel, None]).mean(0) if has_rel.any() else np.zeros(bits + 1)
    r2 = min(2, bits)
    return {"pr": {"precision": [round(float(v), 5) for v in precision],
                   "recall": [round(float(v), 5) for v in recall],
                   "retrieved": [round(float(v), 5) for v in got.mean(0)]},
            "p_h2": float(prec[:, r2].mean()) if m else 0.0, "p_h2_retrieved": float(got[:, r2].mean()) if m else 0.0}


def run_eval(cfg: DictConfig, module=None) -> dict:
    module = module or load_checkpoint(cfg.ckpt)
    prov = module.hparams.provenance or {}
    enc = prov["encoder"]
    features_dir = cfg.features_dir or prov["features_dir"]
    split = open_split(store_path(features_dir, prov["dataset"], cfg.split, enc["name"], enc["fingerprint"]))
    db_name = cfg.get("database")
    database = (open_split(store_path(features_dir, prov["dataset"], db_name, enc["name"], enc["fingerprint"]))
                if db_name and db_name != cfg.split else None)
    rows = retrieval.evaluate(split, methods_for(module, enc["name"]), k=int(cfg.k), database=database,
                              protocols=tuple(cfg.protocols), denominator=str(cfg.denominator))
    run = prov.get("run_name", Path(str(cfg.ckpt)).parent.name)
    out = Path(cfg.out) if cfg.out else Path(cfg.paths.experiments_dir) / "eval" / run
    out.mkdir(parents=True, exist_ok=True)
    against = f" against the {db_name} split" if database is not None else ""
    title = (f"{prov['dataset']} / {cfg.split} split{against}, encoder {enc['name']} ({enc['fingerprint']}), "
             f"{module.hparams.bits} bits")
    table = retrieval.markdown_table(rows, k=int(cfg.k), title=title)
    result = {"checkpoint": str(cfg.ckpt), "dataset": prov["dataset"], "split": cfg.split,
              "database": db_name or cfg.split, "encoder": enc,
              "bits": module.hparams.bits, "k": int(cfg.k), "tie_rule": "ascending database index", "rows": rows}
    write_json(out / "results.json", result)
    tmp = out / ".results.md.tmp"
    tmp.write_text(table + "\n")
    tmp.replace(out / "results.md")
    print(table)
    print(f"[eval] wrote {out / 'results.json'} and results.md")
    codes_name = next(iter(methods_for(module, enc["name"])))
    score = retrieval.mean_map([r for r in rows if r["method"] == codes_name], "paired", key="tie_map@10")
    return {"out": str(out), "rows": rows, "table": table, "score": score}
