"""Benchmark: SemanticCache L1 lookup latency at 100k and 1M entries vs a bare faiss search of the same codes.

Fixed seeded inputs: `n` 64-bit codes (uniform, or "clustered": 1 + 3 flipped bits around n/50 centres),
each with an int4 payload of a 128-d vector (72 B, the image default) and an 8-byte value. Queries, one
at a time: half are stored codes with 0-3 bits flipped (hits), half random codes (misses). Measured in
the same run, interleaved in rounds so machine noise hits both alike:

  reference: faiss IndexBinaryMultiHash(64, 4, 16).range_search(q, radius + 1), nflip 0, one OpenMP
             thread: the bare search the cache's "mih" backend makes (and IndexBinaryFlat k=1, for scale)
  index:     the bare search of the cache's own backend (`--backend`, default auto = mindex), same codes
  cache:     SemanticCache.lookup(query) with radius 3: search, tombstone filter, expiry and revision
             checks, Bloom filter (misses), policy update, metrics; without and with the payload cosine check

  batches:   SemanticCache.lookup_many on batches of `--batch` queries (with the payload check), as
             lookups/s on one core, against the bare faiss MIH range search of the same batch in one call

Prints p50 / p99 per lookup, the ratio cache / bare faiss, the bytes per entry the cache accounts
(codes + payloads + values) and the process memory per entry (RSS growth while filling, after a warm-up
cache has loaded the compiled kernels: their fixed cost is printed apart); then the
process memory per entry of a default-capacity (256 MiB) cache holding `--small` entries.

    python benchmarks/cache_lookup.py [--sizes 100000 1000000] [--queries 20000] [--codes uniform] [--batch 1000]
                                      [--backend auto] [--ttl-s 0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import faiss
import numpy as np

BITS, DIM, RADIUS, SEED = 64, 128, 3, 0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_codes(n: int, kind: str, rng) -> np.ndarray:
    if kind == "uniform":
        return rng.integers(0, 256, size=(n, BITS // 8), dtype=np.uint8)
    centres = rng.integers(0, 256, size=(max(1, n // 50), BITS // 8), dtype=np.uint8)
    codes = centres[rng.integers(0, len(centres), n)]
    return flip(codes, rng, rng.integers(1, 4, n))


def flip(codes: np.ndarray, rng, nflip: np.ndarray) -> np.ndarray:
    codes = codes.copy()
    for k in range(int(nflip.max(initial=0))):
        rows = np.flatnonzero(nflip > k)
        b = rng.integers(0, BITS, len(rows))
        codes[rows, b // 8] ^= (1 << (b % 8)).astype(np.uint8)
    return codes


def percentiles(lat: list[float]) -> tuple[float, float]:
    a = np.asarray(lat) * 1e6
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def warm_up(head, cfg: dict, codes, payloads) -> int:
    """Load every compiled kernel once (numba's runtime and code are a fixed cost per process, ~tens of
    MB, not a cost per entry) with a throwaway cache of the same config; returns the RSS growth it cost."""
    import gc

    from ushash.serving.cache import SemanticCache

    r0 = rss_bytes()
    k = min(len(codes), 12_000)
    c = SemanticCache(head, {**cfg, "capacity_bytes": 1 << 30})
    c.store_codes("warm", "image", codes[:k], list(range(k)), payloads=payloads[:k])
    qs = [c.query_from_code("image", codes[i], np.ones(DIM, np.float32)) for i in range(8)]
    c.lookup(qs[0], "warm"), c.lookup_many(qs, "warm"), c.lookup(c.query_from_code("image", codes[0]), "warm")
    del c, qs
    gc.collect()
    return rss_bytes() - r0


def bench(n: int, n_queries: int, kind: str, policy: str = "wtinylfu", rounds: int = 5, batch: int = 1000,
          backend: str = "auto", ttl_s: float = 0.0) -> dict:
    from ushash.serving.cache import SemanticCache
    from ushash.serving.cache.lsh import LSHHead
    from ushash.serving.payload import PayloadCodec

    rng = np.random.default_rng(SEED)
    codes = make_codes(n, kind, rng)
    codec = PayloadCodec.uniform(DIM, ("image",), kind="int4", scale="group", group_size=32)
    z = rng.normal(size=(n, DIM)).astype(np.float32)
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    payloads = np.concatenate([codec.encode("image", z[i:i + 65536]) for i in range(0, n, 65536)])
    head = LSHHead({"image": DIM}, bits=BITS, dim=DIM, payload=codec)
    caches = {}
    # capacity: room for every entry (no eviction during the measurement), sized like a real deployment
    cfg = {"capacity_bytes": n * 160, "radius": RADIUS, "backend": backend, "ttl_s": ttl_s, "policy": policy,
           "payload_threshold": -1.0}
    warm = warm_up(head, cfg, codes, payloads)
    values = [int(i) for i in range(n)]   # made before the baseline: this list is the benchmark's, not the cache's
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    cache = SemanticCache(head, cfg)
    cache.store_codes("bench", "image", codes, values, payloads=payloads)
    fill_s = time.perf_counter() - t0
    rss = rss_bytes() - rss0
    caches["cache"] = cache
    # queries: half near stored codes, half random
    pick = rng.integers(0, n, n_queries // 2)
    near = flip(codes[pick], rng, rng.integers(0, 4, len(pick)))
    far = rng.integers(0, 256, size=(n_queries - len(pick), BITS // 8), dtype=np.uint8)
    qcodes = np.concatenate([near, far])
    qz = np.concatenate([z[pick], rng.normal(size=(len(far), DIM)).astype(np.float32)])
    order = rng.permutation(n_queries)
    qcodes, qz = qcodes[order], qz[order]
    q_plain = [cache.query_from_code("image", c) for c in qcodes]
    q_payload = [cache.query_from_code("image", c, zz) for c, zz in zip(qcodes, qz)]

    mh = faiss.IndexBinaryMultiHash(BITS, BITS // 16, 16)
    mh.nflip = 0
    mh.add(codes)
    flat = faiss.IndexBinaryFlat(BITS)
    flat.add(codes)
    faiss.omp_set_num_threads(1)

    index = cache.l1._backends[cache.l1._tenant_ids["bench"]]   # the cache's own index, searched bare
    index.search(qcodes[0], RADIUS)
    lat = {k: [] for k in ("faiss_mih", "faiss_flat_k1", "index", "cache", "cache_payload")}
    hits = 0
    chunk = max(1, n_queries // rounds)
    for r in range(rounds):
        sl = slice(r * chunk, (r + 1) * chunk)
        for q in qcodes[sl]:
            s = time.perf_counter()
            mh.range_search(q[None], RADIUS + 1)
            lat["faiss_mih"].append(time.perf_counter() - s)
        for q in qcodes[sl]:
            s = time.perf_counter()
            index.search(q, RADIUS)
            lat["index"].append(time.perf_counter() - s)
        for q in qcodes[sl][: max(1, chunk // 20)]:  # the flat scan is slow at 1M: a sample
            s = time.perf_counter()
            flat.search(q[None], 1)
            lat["faiss_flat_k1"].append(time.perf_counter() - s)
        for q in q_plain[sl]:
            s = time.perf_counter()
            h = cache.lookup(q, "bench")
            lat["cache"].append(time.perf_counter() - s)
            hits += h is not None
        for q in q_payload[sl]:
            s = time.perf_counter()
            cache.lookup(q, "bench")
            lat["cache_payload"].append(time.perf_counter() - s)
    # batches: lookup_many (payload check on) vs one faiss range_search call for the same batch
    bt = {"faiss_mih_batch": [], "index_batch": [], "cache_batch": []}
    nb = max(1, n_queries // batch)
    for r in range(nb):
        sl = slice(r * batch, (r + 1) * batch)
        s = time.perf_counter()
        mh.range_search(np.ascontiguousarray(qcodes[sl]), RADIUS + 1)
        bt["faiss_mih_batch"].append(time.perf_counter() - s)
        s = time.perf_counter()
        index.search_many(np.ascontiguousarray(qcodes[sl]), RADIUS)
        bt["index_batch"].append(time.perf_counter() - s)
        s = time.perf_counter()
        cache.lookup_many(q_payload[sl], "bench")
        bt["cache_batch"].append(time.perf_counter() - s)
    res = {"n": n, "codes": kind, "fill_s": fill_s, "hit_frac": hits / (chunk * rounds),
           "batch": batch, **{k + "_per_s": batch / float(np.median(v)) for k, v in bt.items()},
           "accounted_bytes_per_entry": cache.policy.used_bytes / n, "rss_bytes_per_entry": rss / n,
           "index_bytes_per_entry": getattr(index, "index_bytes", float("nan")) / n, "backend": backend,
           "warm_up_rss_mb": warm / 2 ** 20}
    for k, v in lat.items():
        res[k] = percentiles(v)
    return res


def small(n: int, policy: str) -> dict:
    """Process memory per entry of a cache at the default capacity holding n entries."""
    from ushash.serving.cache import SemanticCache
    from ushash.serving.cache.lsh import LSHHead
    from ushash.serving.payload import PayloadCodec

    rng = np.random.default_rng(SEED)
    codes = make_codes(n, "clustered", rng)
    codec = PayloadCodec.uniform(DIM, ("image",), kind="int4", scale="group", group_size=32)
    z = rng.normal(size=(n, DIM)).astype(np.float32)
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    payloads = codec.encode("image", z)
    head = LSHHead({"image": DIM}, bits=BITS, dim=DIM, payload=codec)
    values = [int(i) for i in range(n)]
    warm_up(head, {"radius": RADIUS, "policy": policy}, codes, payloads)
    rss0 = rss_bytes()
    cache = SemanticCache(head, {"radius": RADIUS, "policy": policy})
    cache.store_codes("bench", "image", codes, values, payloads=payloads)
    rss = rss_bytes() - rss0
    return {"n": n, "entries": len(cache), "accounted_bytes_per_entry": cache.policy.used_bytes / n,
            "rss_bytes_per_entry": rss / n}


def main():
    from ushash.core.provenance import cpu_model
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--queries", type=int, default=20_000)
    ap.add_argument("--codes", choices=["uniform", "clustered"], nargs="+", default=["uniform", "clustered"])
    ap.add_argument("--policy", default="wtinylfu", choices=["lru", "lfu", "wtinylfu", "lruk"])
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--backend", default="auto", help="the cache's L1 backend (auto = mindex, mih, flat, faiss)")
    ap.add_argument("--small", type=int, default=2500)
    ap.add_argument("--ttl-s", type=float, default=0.0,
                    help="the large caches' ttl_s (0: no expiry; the default config's is 3600: an expiry record per entry)")
    ap.add_argument("--one", nargs=2, metavar=("CODES", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # one configuration in a fresh process, so its memory growth is its own
        if args.one[0] == "small":
            print(json.dumps(small(int(args.one[1]), args.policy)))
        else:
            print(json.dumps(bench(int(args.one[1]), args.queries, args.one[0], args.policy, batch=args.batch,
                                   backend=args.backend, ttl_s=args.ttl_s)))
        return
    print(f"# cache_lookup  {time.strftime('%Y-%m-%d %H:%M')}  {cpu_model()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, faiss {faiss.__version__}")
    print(f"# {BITS}-bit codes, radius {RADIUS}, int4 payload of {DIM}-d z (72 B), 8-byte values; "
          f"latency per single-query lookup in µs; policy {args.policy}")
    print(f"# cache backend {args.backend}, ttl_s {args.ttl_s:g}; ratios against bare faiss MIH measured in the same run, "
          f"interleaved")
    print("| entries | codes | bare faiss MIH p50 / p99 | bare index p50 / p99 | cache p50 / p99 | ratio p50 / p99 | "
          "cache + payload check p50 / p99 | ratio p50 / p99 | faiss flat k=1 p50 | hits | bytes/entry accounted | "
          "RSS bytes/entry | index bytes/entry | fill s | lookup_many /s (batch) | bare faiss MIH batch /s | "
          "bare index batch /s | ratio lookup_many / faiss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for kind in args.codes:
        for n in args.sizes:
            out = subprocess.run([sys.executable, __file__, "--one", kind, str(n), "--queries", str(args.queries),
                                  "--policy", args.policy, "--backend", args.backend, "--batch", str(args.batch),
                                  "--ttl-s", str(args.ttl_s)],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            f50, f99 = r["faiss_mih"]
            c50, c99 = r["cache"]
            p50, p99 = r["cache_payload"]
            i50, i99 = r["index"]
            print(f"| {n:,} | {kind} | {f50:.1f} / {f99:.1f} | {i50:.1f} / {i99:.1f} | {c50:.1f} / {c99:.1f} | "
                  f"{c50 / f50:.2f} / {c99 / f99:.2f} | "
                  f"{p50:.1f} / {p99:.1f} | {p50 / f50:.2f} / {p99 / f99:.2f} | {r['faiss_flat_k1'][0]:.0f} | "
                  f"{r['hit_frac']:.2f} | {r['accounted_bytes_per_entry']:.0f} | {r['rss_bytes_per_entry']:.0f} | "
                  f"{r['index_bytes_per_entry']:.0f} | {r['fill_s']:.0f} | {r['cache_batch_per_s']:,.0f} ({r['batch']}) | "
                  f"{r['faiss_mih_batch_per_s']:,.0f} | {r['index_batch_per_s']:,.0f} | "
                  f"{r['cache_batch_per_s'] / r['faiss_mih_batch_per_s']:.2f} |", flush=True)
            print(f"# warm-up (compiled kernels loaded once per process, before the RSS baseline): "
                  f"{r['warm_up_rss_mb']:.0f} MiB", flush=True)
    out = subprocess.run([sys.executable, __file__, "--one", "small", str(args.small), "--policy", args.policy],
                         capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"# default capacity (256 MiB), {r['entries']:,} entries: {r['accounted_bytes_per_entry']:.0f} B/entry accounted, "
          f"{r['rss_bytes_per_entry']:.0f} B/entry process memory")
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
