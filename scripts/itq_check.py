"""faiss's ITQTransform against the registry's ITQ (ITQ's own alternation, `itq_rotation`, Gong & Lazebnik), in
the same shared space, with the same centring and L2 normalisation before their PCA, on the real sets' feature
stores. Per set, code length and seed: the training split's quantisation loss ||sign(P) - P||^2 and the test
split's tie-aware mAP@10 (paired and label, mean over directions), beside PCA with a random rotation; mean (and,
for mAP, the sample standard deviation) over the seeds. Prints a markdown table.

    python scripts/itq_check.py [--experiment sweep_tuxpaint64 sweep_emoji64] [--bits 16 32 64 128] [--seeds 0 1 2]

The space is the one each experiment's sweep fits (its data and encoder, the space's settings chosen on val).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def quantisation_loss(p: np.ndarray) -> float:
    return float(((np.sign(p) - p) ** 2).sum())


def compare(splits: dict, bits: int, seed: int) -> dict:
    """{"faiss": (loss, paired, label), "itq": (...), "pca_rotation": (None, paired, label)} of one length and seed."""
    import faiss

    from ushash.core import codes
    from ushash.evaluation import retrieval
    from ushash.hashing import methods
    from ushash.hashing.methods.itq import normalised_rows

    tr, va, te = splits["train"], splits["val"], splits["test"]
    m = methods.build("itq", bits, seed=seed).fit(tr, va)
    y = m.space.train_embeddings(tr).astype(np.float64)
    theirs = faiss.ITQTransform(y.shape[1], bits, True)   # centres and L2-normalises, PCA, 50 iterations
    theirs.itq.seed = seed
    theirs.train(np.ascontiguousarray(y, dtype=np.float32))
    lt = theirs.pca_then_itq
    a = faiss.vector_to_array(lt.A).reshape(lt.d_out, lt.d_in).astype(np.float64)   # [bits, dim]
    yn = normalised_rows(y, m.mean)

    def encode(modality, x):
        return "codes", codes.pack(theirs.apply(np.ascontiguousarray(m.space.transform(modality, x), dtype=np.float32)) > 0)

    pca_rotation = methods.build("pca_rotation", bits, seed=seed).fit(tr, va)
    out = {}
    for name, fn, loss in (("faiss", encode, quantisation_loss(yn @ a.T)),
                           ("itq", m, quantisation_loss(yn @ m.rotation().astype(np.float64).T)),
                           ("pca_rotation", pca_rotation, None)):
        rows = retrieval.evaluate(te, {name: fn}, protocols=("paired", "label"))   # label: where the split has labels
        label = retrieval.mean_map(rows, "label", key="tie_map@10") if any(r["protocol"] == "label" for r in rows) else None
        out[name] = (loss, retrieval.headline_map(rows), label)
    return out


def cell(values) -> str:
    """"mean ± std" over the seeds, as the sweep tables print a cell (`seed_cell`); "-" with none."""
    from ushash.evaluation.sweep import seed_cell

    v = [x for x in values if x is not None]
    return "{:.3f} ± {:.3f}".format(*seed_cell(v)[:2]) if v else "-"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--experiment", nargs="+", default=["sweep_tuxpaint64", "sweep_emoji64"])
    ap.add_argument("--bits", nargs="+", type=int, default=[16, 32, 64, 128])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    args = ap.parse_args(argv)
    from ushash.config import compose
    from ushash.evaluation.sweep import open_splits

    print("Per set and code length, mean over seeds " + ", ".join(map(str, args.seeds)) + ": the training split's "
          "quantisation loss ||sign(P) - P||^2 of faiss's ITQTransform and of the registry's ITQ (ITQ's alternation, "
          "`itq_rotation`) in the same space, each after its PCA of the same rows (50 iterations each, lower is "
          "better), and the test split's tie-aware mAP@10, mean over directions (± sample std over the seeds), of "
          "their codes and of PCA with a random rotation.\n")
    print("| set | bits | loss: faiss | loss: ITQ | paired: faiss | paired: ITQ | paired: PCA + random rotation | "
          "label: faiss | label: ITQ | label: PCA + random rotation |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for exp in args.experiment:
        cfg = compose("config", [f"experiment={exp}", "extract.progress=false"])
        splits = open_splits(cfg)
        for bits in args.bits:
            runs = [compare(splits, bits, seed) for seed in args.seeds]
            col = {k: list(zip(*(r[k] for r in runs))) for k in runs[0]}
            print(f"| {cfg.data.name} | {bits} | {np.mean(col['faiss'][0]):.0f} | {np.mean(col['itq'][0]):.0f} | "
                  + " | ".join(cell(col[k][i]) for i in (1, 2) for k in ("faiss", "itq", "pca_rotation")) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
