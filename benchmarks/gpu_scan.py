"""Benchmark: the cache's `torch` search backend on a GPU, at 1M, 10M and 100M codes: the one prepared run
for a machine with CUDA (it runs on the CPU too, at small sizes, which is how its test runs it).

Per size, seeded random 64-bit codes in the backend (filled through `add_many`), queries made from stored
codes with 0-3 bits flipped (so that each has hits), radius 3. Measured in the same run:

  cache backend  `ushash.serving.cache.search.TorchBackend`: single-query `search` (p50 / p99 latency,
                 lookups/s) and `search_many` over a batch (lookups/s), the device -> host copy included
  bare scan      the codes as int64 words, XOR and a SWAR popcount in plain torch ops, the hits by
                 `nonzero` (the reference: no slot maps, no alive mask, no batching bound)
  faiss-gpu      `faiss.GpuIndexBinaryFlat` k-NN (k = --k) over the same codes, where faiss has GPUs
                 (faiss-cpu has none: the row says so)
  bandwidth      each scan's code bytes read per second, against a device-to-device copy of the codes
                 measured in the same run (read + write bytes per second): the fraction of the memory
                 bandwidth a scan reaches

Every query's backend results are checked against the bare scan's (the same slots and distances) before
anything is timed; a mismatch stops the run.

    ./run bench gpu_scan [--device cuda] [--sizes 1000000 10000000 100000000] [--queries 200] [--batch 1000]

On a machine with CUDA the plain command is the whole run (not yet run on one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from ushash.serving.cache.search import TorchBackend

BITS = 64
M1, M2, M4 = 0x5555555555555555, 0x3333333333333333, 0x0F0F0F0F0F0F0F0F
H01 = 0x0101010101010101


def popcount64(x: torch.Tensor) -> torch.Tensor:
    """Bits set in each int64 (SWAR; torch's right shift of an int64 is arithmetic, hence the masks)."""
    x = x - ((x >> 1) & M1)               # every mask < 2^63: a plain int64 constant
    x = (x & M2) + ((x >> 2) & M2)
    x = (x + (x >> 4)) & M4
    return ((x * H01) >> 56) & 0xFF       # the product wraps as int64; its top byte is the count


def bare_scan(words: torch.Tensor, q: int, radius: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, distances) of the codes within `radius` of query word q: XOR, popcount, nonzero."""
    d = popcount64(torch.bitwise_xor(words, q))
    pos = torch.nonzero(d <= radius, as_tuple=True)[0]
    return pos, d[pos]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_bandwidth(codes: torch.Tensor, device: torch.device, repeats: int = 5) -> float:
    """Read + write bytes per second of a device-to-device copy of the codes (median of repeats)."""
    out = torch.empty_like(codes)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        out.copy_(codes)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * codes.numel() * codes.element_size() / statistics.median(times[1:])


def _queries(host_codes: np.ndarray, n: int, rng) -> np.ndarray:
    """n stored codes, each with 0-3 of its bits flipped."""
    q = host_codes[rng.integers(0, len(host_codes), n)].copy()
    bits = np.unpackbits(q, axis=1, bitorder="little")
    for row, k in zip(bits, rng.integers(0, 4, n)):
        row[rng.choice(BITS, size=k, replace=False)] ^= 1
    return np.packbits(bits, axis=1, bitorder="little")


def _faiss_gpu(host_codes: np.ndarray, queries: np.ndarray, k: int, repeats: int):
    """(lookups/s of GpuIndexBinaryFlat k-NN over the batch, code bytes read per second), or the reason
    there is none."""
    try:
        import faiss
    except ImportError:
        return "faiss is not installed"
    if not hasattr(faiss, "GpuIndexBinaryFlat") or faiss.get_num_gpus() == 0:
        return "this faiss has no GPU (faiss-cpu); install faiss-gpu"
    res = faiss.StandardGpuResources()
    index = faiss.GpuIndexBinaryFlat(res, BITS)
    index.add(host_codes)
    index.search(queries[:8], k)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        index.search(queries, k)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return len(queries) / t, len(queries) * host_codes.nbytes / t


def measure(n: int, device: torch.device, n_queries: int, batch: int, radius: int, k: int, repeats: int,
            seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    host = rng.integers(0, 256, size=(n, BITS // 8), dtype=np.uint8)
    backend = TorchBackend(BITS, device=str(device))
    t0 = time.perf_counter()
    step = 1 << 20
    for s in range(0, n, step):
        backend.add_many(np.arange(s, min(n, s + step), dtype=np.int64), host[s:s + step])
    _sync(device)
    fill_s = time.perf_counter() - t0
    words = torch.from_numpy(host.view("<i8").reshape(-1)).to(device)
    qs = _queries(host, max(n_queries, batch), rng)
    qwords = qs.view("<i8").reshape(-1).tolist()

    # correctness first: the backend's results are the bare scan's, for every single query used
    for i in range(n_queries):
        slots, dists = backend.search(qs[i], radius)
        pos, d = bare_scan(words, qwords[i], radius)
        want = sorted(zip(d.cpu().tolist(), pos.cpu().tolist()))
        if sorted(zip(dists.tolist(), slots.tolist())) != want:
            raise SystemExit(f"n={n}: query {i}: the backend's results differ from the bare scan's")

    def single(fn):
        lat = []
        for i in range(n_queries):
            _sync(device)
            t = time.perf_counter()
            fn(i)
            _sync(device)
            lat.append(time.perf_counter() - t)
        lat.sort()
        return lat[len(lat) // 2] * 1e6, lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e6, len(lat) / sum(lat)

    cache_p50, cache_p99, cache_rate = single(lambda i: backend.search(qs[i], radius))
    bare_p50, bare_p99, bare_rate = single(lambda i: [t.cpu() for t in bare_scan(words, qwords[i], radius)])
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        backend.search_many(qs[:batch], radius)
        times.append(time.perf_counter() - t)
    batch_rate = batch / statistics.median(times)
    copy_bw = _copy_bandwidth(words, device)
    faiss_row = _faiss_gpu(host, qs[:batch], k, repeats) if device.type == "cuda" else "not run on the CPU"
    code_bytes = n * BITS // 8
    return {"n": n, "fill_s": fill_s, "cache": (cache_p50, cache_p99, cache_rate), "bare": (bare_p50, bare_p99, bare_rate),
            "batch_rate": batch_rate, "copy_bw": copy_bw, "code_bytes": code_bytes, "faiss": faiss_row}


def main(argv=None) -> list[dict]:
    from ushash.core.provenance import cpu_model
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", type=int, nargs="+", default=None,
                    help="codes per run; default 1M 10M 100M on CUDA, 100k 1M on the CPU (a CPU scan of 100M "
                         "codes takes seconds per query and GBs of temporaries)")
    ap.add_argument("--queries", type=int, default=200, help="single-query lookups timed per size")
    ap.add_argument("--batch", type=int, default=1000, help="queries per search_many call and faiss batch")
    ap.add_argument("--radius", type=int, default=3)
    ap.add_argument("--k", type=int, default=16, help="faiss-gpu k-NN's k")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.sizes is None:
        args.sizes = [1_000_000, 10_000_000, 100_000_000] if device.type == "cuda" else [100_000, 1_000_000]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    rows = [measure(n, device, args.queries, args.batch, args.radius, args.k, args.repeats) for n in args.sizes]
    print(f"# gpu_scan  {time.strftime('%Y-%m-%d %H:%M')}  device {device} ({name}), torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs; 64-bit random codes, queries = stored codes with 0-3 bits flipped, radius "
          f"{args.radius}; {args.queries} single queries, batches of {args.batch}; every backend result checked "
          f"against the bare scan")
    print("| codes | fill s | cache backend single p50 / p99 µs | lookups/s | bare scan single p50 / p99 µs | lookups/s "
          "| cache backend search_many lookups/s | faiss-gpu k-NN lookups/s | device copy GB/s (read + write) "
          "| code bytes read GB/s: backend single / bare single / backend batch (fraction of the copy's) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cb = r["code_bytes"]
        reads = [r["cache"][2] * cb, r["bare"][2] * cb, r["batch_rate"] * cb]
        frac = " / ".join(f"{x / 1e9:,.1f} ({x / r['copy_bw']:.2f})" for x in reads)
        fa = r["faiss"] if isinstance(r["faiss"], str) else f"{r['faiss'][0]:,.0f}"
        print(f"| {r['n']:,} | {r['fill_s']:.1f} | {r['cache'][0]:,.0f} / {r['cache'][1]:,.0f} | {r['cache'][2]:,.0f} "
              f"| {r['bare'][0]:,.0f} / {r['bare'][1]:,.0f} | {r['bare'][2]:,.0f} | {r['batch_rate']:,.0f} | {fa} "
              f"| {r['copy_bw'] / 1e9:,.1f} | {frac} |")
    return rows


if __name__ == "__main__":
    main()
