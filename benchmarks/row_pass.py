"""Benchmark: one request row through the served head, the compiled row pass against torch's one-row path.

A cache's single request encodes one row of features. Reference, measured in the same run on the same rows:
`ExportedHead.encode` on one row (torch: the export's layers as eval_steps, the unit prototypes, pack).
Measured: `ExportedHead.encode_row` (ushash.serving.rowpass, what the cache's one-row requests run).

Heads: the exports under exports/ named by --exports (the shipped budget exports, a Linear from the
offline encoder's features) with up to --rows rows of their data set's stored features (test, val, then
train splits, from data/features), when both are there; and always a random-init `USHash` default MLP
head over seeded 16-d rows (serve_load's head), a random-init Linear 1280 -> 128 and the default MLP over
1280-d seeded rows. Per head and modality: µs per row (median of --repeats
passes over --rows rows) in a tight loop and with a fixed step of other work between rows (reading a
16 MiB buffer, which evicts the weights from the CPU caches as a server's other work does), the ratio
of the two paths, and how far they agree over every row: rows whose code differs, bits that differ,
the largest |z difference|.

    ./run bench row_pass [--rows 2000] [--repeats 5] [--exports budget-tuxpaint-offline budget-emoji-offline]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ushash.core import codes as codes_lib
from ushash.serving.artifact import load_export

ROOT = Path(__file__).resolve().parents[1]
FLUSH = np.ones(1 << 22, np.float32)        # 16 MiB: more than the last-level cache of the machines measured


def _random_head(root: Path, kind: str):
    from ushash.hashing.heads import USHash
    from ushash.serving.export import write_export

    torch.manual_seed(0)
    if kind == "mlp":
        model = USHash({"image": 16}, bits=64, dim=128).eval()
    elif kind == "wide":
        model = USHash({"image": 1280}, bits=64, dim=128).eval()
    else:
        model = USHash({"image": 1280}, bits=64, dim=128, layers=1).eval()
    return load_export(write_export(model, root / kind, {"name": "synthetic", "fingerprint": "0"}))


def _store_rows(head, dataset: str, modality: str, n: int):
    """Up to n rows of the data set's stored features by the export's encoder: its test split, then val and
    train, each the store of the rows the export records (`source.stores`; every store of the encoder where it
    records none), so stores of older decodes of the same items are not read as more rows (None when there
    are none)."""
    from ushash.data.store import identity_path, store_identity

    recorded = (head.manifest.get("source") or {}).get("stores") or {}
    enc = {"name": head.encoder.name, "fingerprint": head.encoder.fingerprint}
    parts, have = [], 0
    for split in ("test", "val", "train"):
        base = ROOT / "data" / "features" / str(dataset) / split
        paths = ([identity_path(ROOT / "data" / "features", store_identity(dataset, split, enc, recorded[split]))]
                 if split in recorded else sorted(base.glob(f"{head.encoder.name}-{head.encoder.fingerprint}-*")))
        for path in paths:
            f = path / f"{modality}.npy"
            if f.is_file() and have < n:
                parts.append(np.asarray(np.load(f, mmap_mode="r")[:n - have], np.float32))
                have += len(parts[-1])
    return np.concatenate(parts) if parts else None


def _time(fn, rows, flush: bool) -> float:
    """µs per row of fn over the rows, with or without the other work between rows."""
    t_total = 0.0
    for r in rows:
        if flush:
            FLUSH.sum()
        t0 = time.perf_counter()
        fn(r)
        t_total += time.perf_counter() - t0
    return t_total / len(rows) * 1e6


def measure(head, modality: str, rows: np.ndarray, repeats: int) -> dict:
    head.warm_up()
    torch_row = lambda r: head.encode(modality, r[None])      # noqa: E731  the reference
    row_pass = lambda r: head.encode_row(modality, r)         # noqa: E731
    for fn in (torch_row, row_pass):
        _time(fn, rows[:50], False)
    out = {}
    for flush in (False, True):
        ref = [_time(torch_row, rows, flush) for _ in range(repeats)]
        got = [_time(row_pass, rows, flush) for _ in range(repeats)]
        out["flush" if flush else "tight"] = (statistics.median(ref), statistics.median(got))
    codes, z = head.encode(modality, rows)                    # eval's numbers: torch, in batches
    one = [head.encode_row(modality, r) for r in rows]
    one_codes = np.array([np.frombuffer(code, np.uint8) for code, _ in one])
    one_z = np.stack([z1 for _, z1 in one])
    t_one = np.concatenate([head.encode(modality, r[None])[1] for r in rows])   # torch's one-row z
    bits = codes_lib.unpack(codes, head.bits) != codes_lib.unpack(one_codes, head.bits)
    out.update(rows=len(rows), rows_differ=int(bits.any(axis=1).sum()), bits_differ=int(bits.sum()),
               dz_batch=float(np.abs(one_z - z).max()), dz_one=float(np.abs(one_z - t_one).max()),
               dz_torch=float(np.abs(t_one - z).max()))
    return out


def main() -> None:
    from ushash.core.provenance import machine_summary
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--exports", nargs="*", default=["budget-tuxpaint-offline", "budget-emoji-offline"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    cases = []
    with tempfile.TemporaryDirectory(prefix="ushash-row-pass-") as tmp:
        cases.append(("random-init USHash default MLP (16 -> 512 -> 128), seeded rows", _random_head(Path(tmp), "mlp"),
                      "image", rng.normal(size=(args.rows, 16)).astype(np.float32)))
        wide = rng.normal(size=(args.rows, 1280)).astype(np.float32)
        cases.append(("random-init Linear 1280 -> 128, seeded rows", _random_head(Path(tmp), "linear"), "image", wide))
        cases.append(("random-init USHash default MLP over 1280-d (1280 -> 512 -> 128), seeded rows",
                      _random_head(Path(tmp), "wide"), "image", wide))
        for name in args.exports:
            path = ROOT / "exports" / name
            if not (path / "manifest.json").is_file():
                print(f"# {name}: no export at exports/{name} (scripts/budget_heads.py writes it); skipped")
                continue
            head = load_export(path)
            dataset = (head.manifest.get("source") or {}).get("dataset")
            for m in head.modalities:
                rows = _store_rows(head, dataset, m, args.rows)
                if rows is None:
                    print(f"# {name} {m}: no {dataset} test features under data/features; skipped")
                    continue
                ops = " -> ".join(op["op"] for op in head.manifest["head"]["layers"][m])
                cases.append((f"{name} {m} ({ops} {head.in_dims[m]} -> {head.dim}), {dataset} rows", head, m, rows))
        results = [(label, measure(head, m, rows, args.repeats)) for label, head, m, rows in cases]
    print(f"# row_pass  {time.strftime('%Y-%m-%d %H:%M')}  {machine_summary()}, load average "
          f"{os.getloadavg()[0]:.1f}; torch threads 1; medians of {args.repeats} passes over each case's rows")
    print("| head, rows | rows | torch one row µs (tight / between other work) | row pass µs (tight / between) "
          "| ratio torch / row pass (tight / between) | rows whose code differs from eval's | bits differing "
          "| max abs z diff: row pass vs eval's batch / vs torch one row; torch one row vs batch |")
    print("|---|---|---|---|---|---|---|---|")
    for label, r in results:
        (rt, gt), (rf, gf) = r["tight"], r["flush"]
        print(f"| {label} | {r['rows']} | {rt:.1f} / {rf:.1f} | {gt:.1f} / {gf:.1f} | {rt / gt:.2f}x / {rf / gf:.2f}x "
              f"| {r['rows_differ']} | {r['bits_differ']} | {r['dz_batch']:.1e} / {r['dz_one']:.1e}; {r['dz_torch']:.1e} |")


if __name__ == "__main__":
    main()
