"""Benchmark and measure cache-entry payloads (ushash/serving/payload/): fp32, fp16, int4, int4 + sparse top-k.

    python benchmarks/payload.py quality --ckpt checkpoints/<run>/best.ckpt [--candidates 32]
    python benchmarks/payload.py quality --synthetic            # trains a small head on ushash.data.synthetic data
    python benchmarks/payload.py speed [--n-db 100000] [--queries 2000] [--candidates 100]

quality: on the evaluation split of a checkpoint's feature store, through an export of the head (the
serving path, ushash.serving.artifact): bytes per entry; reconstruction cosine of z; retrieval mAP@10 when each
query's top-C Hamming candidates are re-ranked by cosine between the query's fp32 z and the candidates'
decoded payloads (every direction, paired and label relevance); throughput of dequantize + re-rank. The
references are measured in the same run: the same candidates re-ranked by fp32 payloads, Hamming order
without re-ranking, and exhaustive fp32 cosine over the whole database.

speed: seeded random unit vectors (dim 128): encode and decode throughput per format, re-rank throughput
against the fp32 re-rank of the same candidates (the reference), and the memory a million entries need
(64-bit code + payload) against fp32. Medians of interleaved repeats.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ushash.serving.payload import PayloadCodec, describe

SETTINGS = {  # name -> settings for every modality (None: the modality-aware defaults)
    "fp32": {"kind": "fp32"},
    "fp16": {"kind": "fp16"},
    "int4 (group 32)": {"kind": "int4", "scale": "group", "group_size": 32},
    "int4 (channel)": {"kind": "int4", "scale": "channel"},
    "int4+sparse top64 (group 32)": {"kind": "int4", "scale": "group", "group_size": 32, "topk": 64},
    "int4+sparse top32 (group 32)": {"kind": "int4", "scale": "group", "group_size": 32, "topk": 32},
    "defaults (image int4, text/audio fp16)": None,
}
REFERENCE = "fp32"


def machine() -> str:
    from ushash.core.provenance import cpu_model
    import torch
    return (f"{cpu_model()}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}, numpy {np.__version__}, "
            f"torch {torch.__version__}, torch threads {torch.get_num_threads()}")


def median_time(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def make_codec(name: str, dim: int, modalities, calib: dict | None = None) -> PayloadCodec:
    s = SETTINGS[name]
    codec = PayloadCodec.default(dim, modalities) if s is None else PayloadCodec.uniform(dim, modalities, **s)
    if any(f.uses_channel_scales for f in codec.formats.values()):
        codec.fit(calib)
    return codec


# ---------------------------------------------------------------------------------------------- quality

def _synthetic_checkpoint(work: Path) -> str:
    from ushash.data import synthetic
    from ushash.config import compose
    from ushash.hashing.training import run_train

    splits = synthetic.write_synthetic(work / "data" / "features", sizes={"train": 3000, "val": 300, "test": 1000},
                                       n_classes=20, dims={"image": 64, "text": 48, "audio": 32}, noise=0.6)
    cfg = compose("config", [f"paths.root={work}", "trainer.accelerator=cpu", "trainer.max_epochs=12", "bits=64",
                             "model.batch_size=256", "trainer.enable_progress_bar=false", "seed=0"])
    return run_train(cfg, splits=splits)["best"]


def quality(args) -> None:
    from ushash.serving import artifact
    from ushash.core import metrics
    from ushash.evaluation import retrieval
    from ushash.serving.export import write_export
    from omegaconf import OmegaConf

    from ushash.config import ROOT
    from ushash.data.extract import resolve_features_dir, stored_split
    from ushash.core.index import HammingIndex, cosine_search
    from ushash.hashing.module import load_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="ushash-payload-"))
    ckpt = args.ckpt or _synthetic_checkpoint(tmp)
    module = load_checkpoint(ckpt)
    prov = module.hparams.provenance or {}
    enc = prov["encoder"]
    # the checkpoint's own stores: its recorded folder, relative to the project it was trained in
    where = OmegaConf.create({"features_dir": args.features_dir, "paths": {"root": str(ROOT if args.ckpt else tmp)}})
    fdir = resolve_features_dir(prov, where)
    split, train = stored_split(prov, args.split, fdir), stored_split(prov, "train", fdir)
    # the serving path: export the head and compute codes and z through ushash.serving.artifact
    head = artifact.load_export(write_export(module.model.eval(), tmp / "export", enc))
    mods = [m for m in split.modalities if m in head.modalities]
    codes = {m: head.codes(m, np.asarray(split.tables[m].x)) for m in mods}
    z = {m: head.embed(m, np.asarray(split.tables[m].x)) for m in mods}
    calib = {m: head.embed(m, np.asarray(train.tables[m].x[:20000])) for m in mods}
    groups = retrieval._group_ids(split)
    labels = retrieval._label_matrix(split)
    protocols = ("paired", "label") if labels is not None else ("paired",)
    dirs = retrieval.directions(mods)
    C, K = args.candidates, args.k
    cands = {(q, d): HammingIndex(codes[d]).search(codes[q], min(C, len(codes[d])))[1] for q, d in dirs}

    def maps(ranked: dict) -> dict:
        out = {}
        for p in protocols:
            vals = [metrics.retrieval_report(ranked[(q, d)], groups[q], groups[d], protocol=p, k=K, ks=(1,),
                                             q_labels=labels[q] if p == "label" else None,
                                             db_labels=labels[d] if p == "label" else None)[f"map@{K}"]
                    for q, d in dirs]
            out[p] = float(np.mean(vals))
        return out

    n_rows = sum(len(z[m]) for m in mods)
    title = (f"{prov['dataset']} / {args.split} split ({', '.join(f'{m} {len(z[m])}' for m in mods)} rows), encoder "
             f"{enc['name']} ({enc['fingerprint']}), {head.bits}-bit codes, payload = head z ({head.dim}-d); "
             f"top-{C} Hamming candidates re-ranked to mAP@{K}, directions {', '.join(retrieval.direction_name(q, d) for q, d in dirs)}")
    rows = []
    rows.append({"setting": "Hamming order, no re-rank (reference)", **maps({k: v[:, :K] for k, v in cands.items()})})
    rows.append({"setting": "exhaustive fp32 cosine on z, no Hamming (reference)",
                 **maps({(q, d): cosine_search(z[q], z[d], min(K, len(z[d])))[1] for q, d in dirs})})
    def cand_pairs(q, d):
        c = cands[(q, d)]
        valid = (c >= 0).ravel()
        return np.repeat(np.arange(len(c)), c.shape[1])[valid], c.ravel()[valid]

    pairs = {k: cand_pairs(*k) for k in cands}
    # what verification compares: cosine(query z, decoded entry) over every (query, Hamming candidate) pair
    cos_ref = {(q, d): np.einsum("nd,nd->n", z[q][pairs[(q, d)][0]], z[d][pairs[(q, d)][1]]) for q, d in dirs}
    codecs, recs = {}, {}
    for name in SETTINGS:
        codec = codecs[name] = make_codec(name, head.dim, mods, calib)
        rec = recs[name] = {m: codec.encode(m, z[m]) for m in mods}
        cos = np.concatenate([codec.cosine(z[m], m, rec[m]) for m in mods])
        ranked = {(q, d): codec.rerank(z[q], d, cands[(q, d)], rec[d], k=K)[1] for q, d in dirs}
        sizes = sorted({codec.nbytes(m) for m in mods})
        per_mod = (" / ".join(f"{m} {codec.nbytes(m)}" for m in mods) if len(sizes) > 1 else str(sizes[0]))
        dcos = np.concatenate([np.abs(codec.cosine(z[q][pairs[(q, d)][0]], d, rec[d][pairs[(q, d)][1]])
                                      - cos_ref[(q, d)]) for q, d in dirs])
        rows.append({"setting": name, "bytes": per_mod, "entry": " / ".join(str(s + head.bits // 8) for s in sizes),
                     "cos_mean": float(cos.mean()), "cos_min": float(cos.min()), "dcos_mean": float(dcos.mean()),
                     "dcos_max": float(dcos.max()), **maps(ranked)})
    # throughput of dequantize + re-rank of every direction's candidates; rounds interleaved over settings
    n_c = sum(int((cands[k] >= 0).sum()) for k in cands)
    times = {name: [] for name in SETTINGS}
    for _ in range(args.repeats):
        for name, codec in codecs.items():
            t = time.perf_counter()
            for q, d in dirs:
                codec.rerank(z[q], d, cands[(q, d)], recs[name][d], k=K)
            times[name].append(time.perf_counter() - t)
    speeds = {name: n_c / statistics.median(ts) for name, ts in times.items()}
    for r in rows:
        if r["setting"] in speeds:
            r["cands_per_s"] = speeds[r["setting"]]
    ref = speeds[REFERENCE]
    print(f"### {title}\n")
    print(f"{n_rows} payload rows; date {time.strftime('%Y-%m-%d')}; machine: {machine()}\n")
    heads_ = ["setting", "payload B/entry", "entry B (code+payload)", "recon. cos mean", "recon. cos min",
              "verify |Δcos| mean / max"]
    heads_ += [f"mAP@{K} {p} (re-ranked)" for p in protocols] + ["dequant+re-rank cand/s", f"vs {REFERENCE}"]
    print("| " + " | ".join(heads_) + " |")
    print("|" + "---|" * len(heads_))
    for r in rows:
        if "bytes" not in r:
            cells = [r["setting"], "–", "–", "–", "–", "–"] + [f"{r[p]:.3f}" for p in protocols] + ["–", "–"]
        else:
            cells = [r["setting"], r["bytes"], r["entry"], f"{r['cos_mean']:.4f}", f"{r['cos_min']:.4f}",
                     f"{r['dcos_mean']:.4f} / {r['dcos_max']:.4f}"]
            cells += [f"{r[p]:.3f}" for p in protocols] + [f"{r['cands_per_s']:,.0f}", f"{r['cands_per_s'] / ref:.2f}x"]
        print("| " + " | ".join(cells) + " |")
    print()
    for name, codec in codecs.items():
        print(f"- {name}: " + "; ".join(f"{m} {codec[m].name}: {describe(codec[m])}" for m in mods))
    print(f"\nverify |Δcos|: |cosine(query z, decoded candidate) - cosine(query z, candidate z)| over all "
          f"{sum(len(v) for v in cos_ref.values()):,} (query, Hamming candidate) pairs: how far quantization moves "
          f"the number a verification threshold is applied to")
    print(f"throughput: {n_c:,} candidates (all directions) decoded and re-ranked per round, median of "
          f"{args.repeats} rounds interleaved over the settings; reference {REFERENCE}")
    shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- speed

def speed(args) -> None:
    rng = np.random.default_rng(0)
    dim = 128
    db = rng.standard_normal((args.n_db, dim)).astype(np.float32)
    db /= np.linalg.norm(db, axis=1, keepdims=True)
    q = db[rng.integers(0, args.n_db, args.queries)] + 0.1 * rng.standard_normal((args.queries, dim)).astype(np.float32)
    cand = rng.integers(0, args.n_db, (args.queries, args.candidates))
    enc_x = db[: args.encode_rows]
    formats = {name: make_codec(name, dim, ("image",), {"image": db[:20000]})["image"]
               for name in SETTINGS if SETTINGS[name] is not None}
    recs = {name: f.encode(db) for name, f in formats.items()}
    results = {}
    for _ in range(1):  # warm-up pass
        for name, f in formats.items():
            f.rerank(q[:50], cand[:50], recs[name], k=10)
    times = {name: {"enc": [], "dec": [], "rr": [], "one": []} for name in formats}
    n_one = min(200, args.queries)
    for _ in range(args.repeats):       # interleaved: machine noise hits every format alike
        for name, f in formats.items():
            t = time.perf_counter(); f.encode(enc_x); times[name]["enc"].append(time.perf_counter() - t)
            rows = recs[name][: args.encode_rows]
            t = time.perf_counter(); f.decode(rows); times[name]["dec"].append(time.perf_counter() - t)
            t = time.perf_counter(); f.rerank(q, cand, recs[name], k=10); times[name]["rr"].append(time.perf_counter() - t)
            t = time.perf_counter()
            for i in range(n_one):  # the cache's case: one query, its candidates, one call
                f.rerank(q[i], cand[i:i + 1], recs[name], k=10)
            times[name]["one"].append((time.perf_counter() - t) / n_one)
    for name in formats:
        results[name] = {k: statistics.median(v) for k, v in times[name].items()}
    ref = results[REFERENCE]
    n = args.encode_rows
    print(f"### Payload speed and memory: {args.n_db:,} database vectors (dim {dim}), {args.queries:,} queries x "
          f"{args.candidates} candidates, re-rank to top 10; encode/decode {n:,} vectors; median of {args.repeats} "
          f"interleaved repeats\n")
    print(f"date {time.strftime('%Y-%m-%d')}; machine: {machine()}; reference: {REFERENCE} (records are raw "
          f"float32, decode is a byte view)\n")
    print("| format | payload B | encode vec/s | decode vec/s | re-rank queries/s (batched) | re-rank cand/s | "
          f"re-rank vs {REFERENCE} | one-query re-rank µs | 1M entries (64-bit code + payload) | memory vs {REFERENCE} |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    mem_ref = 1_000_000 * formats[REFERENCE].entry_bytes(64)
    for name, f in formats.items():
        r = results[name]
        mem = 1_000_000 * f.entry_bytes(64)
        print(f"| {name} ({f.name}) | {f.nbytes} | {n / r['enc']:,.0f} | {n / r['dec']:,.0f} | "
              f"{args.queries / r['rr']:,.0f} | {args.queries * args.candidates / r['rr']:,.0f} | "
              f"{ref['rr'] / r['rr']:.2f}x | {r['one'] * 1e6:,.0f} | {mem / 2**20:,.1f} MiB | {mem / mem_ref:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    qa = sub.add_parser("quality")
    src = qa.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt")
    src.add_argument("--synthetic", action="store_true")
    qa.add_argument("--split", default="test")
    qa.add_argument("--features-dir", default=None)
    qa.add_argument("--candidates", type=int, default=32)
    qa.add_argument("--k", type=int, default=10)
    qa.add_argument("--repeats", type=int, default=15)
    sp = sub.add_parser("speed")
    sp.add_argument("--n-db", type=int, default=100_000)
    sp.add_argument("--queries", type=int, default=2000)
    sp.add_argument("--candidates", type=int, default=100)
    sp.add_argument("--encode-rows", type=int, default=50_000)
    sp.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    {"quality": quality, "speed": speed}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
