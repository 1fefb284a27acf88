"""Benchmark: exact deterministic Hamming kNN + retrieval metrics vs bare faiss kNN.

Fixed seeded inputs: 5,000 queries x 25,000 database codes of 64 bits (queries are noisy copies of
database codes, so results are meaningful and distances tie heavily). Times, in the same run:
  reference: faiss.IndexBinaryFlat.search(queries, k=10)  (ties cut however the heap cuts them)
  ushash:    HammingIndex.search(queries, k=10) + retrieval_report(protocol="paired")
and prints the median of several interleaved repeats and the ratio ushash / reference.

    python benchmarks/eval_search.py [--repeats 7] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import faiss
import numpy as np

from ushash.core.codes import pack
from ushash.core.index import HammingIndex
from ushash.core.metrics import retrieval_report

N_DB, N_Q, BITS, K, SEED = 25_000, 5_000, 64, 10, 0


def make_inputs(seed: int = SEED):
    rng = np.random.default_rng(seed)
    db_groups = rng.integers(0, N_DB // 5, N_DB)  # ~5 database items per group
    centres = rng.standard_normal((N_DB // 5, BITS)).astype(np.float32)
    db = pack(centres[db_groups] + 0.8 * rng.standard_normal((N_DB, BITS)).astype(np.float32))
    q_groups = rng.integers(0, N_DB // 5, N_Q)
    q = pack(centres[q_groups] + 0.8 * rng.standard_normal((N_Q, BITS)).astype(np.float32))
    return q, db, q_groups, db_groups


def timed_interleaved(fns: dict, repeats: int) -> dict:
    """Run each fn once per round, rounds interleaved so machine noise hits all of them alike."""
    times = {name: [] for name in fns}
    outs = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t)
    return {name: (statistics.median(ts), ts, outs[name]) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="faiss OpenMP threads (default: faiss's own)")
    args = ap.parse_args()
    if args.threads:
        faiss.omp_set_num_threads(args.threads)

    q, db, qg, dg = make_inputs()
    flat = faiss.IndexBinaryFlat(BITS)
    flat.add(db)
    index = HammingIndex(db)

    def reference():
        return flat.search(q, K)

    def ushash_eval():
        D, I = index.search(q, K)
        return D, I, retrieval_report(I, qg, dg, "paired", k=K)

    reference(), ushash_eval()  # warm-up
    res = timed_interleaved(
        {"ref": reference, "search": lambda: index.search(q, K), "eval": ushash_eval}, args.repeats
    )
    t_ref, ref_times, (Dr, Ir) = res["ref"]
    t_search, _, (D, I) = res["search"]
    t_us, us_times, (_, _, report) = res["eval"]

    same_d = bool(np.array_equal(D, Dr))
    same_i = float((I == Ir).mean())
    print(f"inputs: {N_Q} queries x {N_DB} db, {BITS}-bit codes, k={K}, seed={SEED}; "
          f"faiss {faiss.__version__}, {faiss.omp_get_max_threads()} OpenMP threads, {os.cpu_count()} CPUs")
    print(f"reference  faiss IndexBinaryFlat.search(k={K}):        median {t_ref * 1e3:8.1f} ms  "
          f"(min {min(ref_times) * 1e3:.1f}, max {max(ref_times) * 1e3:.1f}, n={args.repeats})")
    print(f"ushash     HammingIndex.search(k={K}):                  median {t_search * 1e3:8.1f} ms")
    print(f"ushash     HammingIndex.search + retrieval_report:     median {t_us * 1e3:8.1f} ms  "
          f"(min {min(us_times) * 1e3:.1f}, max {max(us_times) * 1e3:.1f}, n={args.repeats})")
    print(f"ratio      (search + report) / reference:              {t_us / t_ref:8.2f}x")
    print(f"ratio      search / reference:                         {t_search / t_ref:8.2f}x")
    print(f"check      distances equal to faiss: {same_d}; indices equal to faiss: {same_i:.4%} "
          f"(differences can only be tie order)")
    print(f"report     {report}")


if __name__ == "__main__":
    main()
