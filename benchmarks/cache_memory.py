"""Benchmark: process memory that `capacity_bytes` must bound, under churn and under many tenants.

Fixed seeded inputs, each scenario in a fresh process (its memory growth is its own):

  churn:    `--puts` puts of random 64-bit codes (INT4 payloads of 128-d z, 24-byte values) into a
            `--capacity` byte cache with a ten-year TTL: almost every put evicts. Prints the entries held,
            the expiry records kept, and the process growth against the capacity.
  tenants:  `--tenants` tenants (config `tenants: null`: any client may name one), one put each, into a
            cache of `--tenant-capacity` bytes; then every entry evicted by a flood into one tenant.
            Prints the tenants whose indexes are held and the process growth per tenant, at the peak
            and after the flood.

    python benchmarks/cache_memory.py [--puts 300000] [--capacity 65536] [--tenants 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

BITS, DIM, SEED = 64, 128, 0
BATCH = 1000   # puts per store_codes call in the churn


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cache(capacity: int):
    from ushash.serving.cache import SemanticCache
    from ushash.serving.cache.lsh import LSHHead
    from ushash.serving.payload import PayloadCodec

    codec = PayloadCodec.uniform(DIM, ("image",), kind="int4", scale="group", group_size=32)
    head = LSHHead({"image": DIM}, bits=BITS, dim=DIM, payload=codec)
    return SemanticCache(head, {"capacity_bytes": capacity, "radius": 3, "ttl_s": 10 * 365 * 86400}), codec


def _entries(rng, codec, n):
    codes = rng.integers(0, 256, size=(n, BITS // 8), dtype=np.uint8)
    z = rng.normal(size=(n, DIM)).astype(np.float32)
    return codes, codec.encode("image", z / np.linalg.norm(z, axis=1, keepdims=True))


def churn(puts: int, capacity: int) -> dict:
    rng = np.random.default_rng(SEED)
    cache, codec = _cache(capacity)
    cache.warm_up()   # the compiled kernels (a fixed cost per process) loaded before any measurement
    codes, payloads = _entries(rng, codec, puts)
    value = "v" * 24
    # the first tenth (rounded up to a whole batch) warms up (first-call allocations), the rest is measured
    warm = -(-(puts // 10) // BATCH) * BATCH
    t0 = time.perf_counter()
    for s in range(0, puts, BATCH):  # store_codes' path, one L1 call per batch
        if s == warm:
            rss0 = rss_bytes()
        cache.store_codes("t", "image", codes[s:s + BATCH], [value] * len(codes[s:s + BATCH]),
                          payloads=payloads[s:s + BATCH], ttl_s=10 * 365 * 86400)
    secs = time.perf_counter() - t0
    grow = rss_bytes() - rss0
    return {"puts": puts, "measured_puts": puts - warm, "capacity": capacity, "entries": len(cache),
            "expiry_records": len(cache.l1._expiry), "bytes_held": cache.policy.used_bytes, "rss_growth": grow,
            "puts_per_s": puts / secs}


def tenants(n: int, capacity: int) -> dict:
    rng = np.random.default_rng(SEED)
    cache, codec = _cache(capacity)
    cache.warm_up()   # the compiled kernels (a fixed cost per process) loaded before any measurement
    codes, payloads = _entries(rng, codec, n)
    nflood = 2 * capacity // 80   # twice what the cache holds: every tenant's entry is evicted
    flood_codes, flood_payloads = _entries(rng, codec, nflood)   # made before any measurement
    warm = n // 10
    for i in range(n):
        if i == warm:
            rss0 = rss_bytes()
        cache.store_codes(f"tenant{i}", "image", codes[i:i + 1], [i], payloads=payloads[i:i + 1])
    peak = rss_bytes() - rss0
    held_peak = cache.l1.tenants
    entries_peak = len(cache)
    cache.store_codes("flood", "image", flood_codes, list(range(nflood)), payloads=flood_payloads)
    after = rss_bytes() - rss0
    return {"tenants": n, "measured_tenants": n - warm, "capacity": capacity, "entries_peak": entries_peak,
            "tenant_indexes_peak": held_peak, "rss_growth_peak": peak, "tenant_indexes_after_flood": cache.l1.tenants,
            "rss_growth_after_flood": after, "entries_after_flood": len(cache)}


def main():
    from ushash.core.provenance import machine_summary
    ap = argparse.ArgumentParser()
    ap.add_argument("--puts", type=int, default=300_000)
    ap.add_argument("--capacity", type=int, default=64 << 10)
    ap.add_argument("--tenants", type=int, default=20_000)
    ap.add_argument("--tenant-capacity", type=int, default=16 << 20)
    ap.add_argument("--one", choices=["churn", "tenants"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.puts < 2 * BATCH:
        ap.error(f"--puts {args.puts}: at least {2 * BATCH} (a tenth, rounded up to a batch of {BATCH}, warms up; "
                 "the rest is measured)")
    if args.one == "churn":
        print(json.dumps(churn(args.puts, args.capacity)))
        return
    if args.one == "tenants":
        print(json.dumps(tenants(args.tenants, args.tenant_capacity)))
        return
    print(f"# cache_memory  {time.strftime('%Y-%m-%d %H:%M')}  {machine_summary()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    base = [sys.executable, __file__, "--puts", str(args.puts), "--capacity", str(args.capacity), "--tenants",
            str(args.tenants), "--tenant-capacity", str(args.tenant_capacity)]
    r = json.loads(subprocess.run(base + ["--one", "churn"], capture_output=True, text=True, check=True).stdout)
    print(f"churn: {r['puts']:,} puts into {r['capacity']:,} B: {r['entries']} entries held ({r['bytes_held']:,} B), "
          f"{r['expiry_records']} expiry records; process growth over the last {r['measured_puts']:,} puts "
          f"{r['rss_growth'] / 1024:.0f} KiB = {r['rss_growth'] / r['capacity']:.1f}x capacity; {r['puts_per_s']:,.0f} puts/s")
    r = json.loads(subprocess.run(base + ["--one", "tenants"], capture_output=True, text=True, check=True).stdout)
    print(f"tenants: {r['tenants']:,} tenants, one entry each, into {r['capacity'] / 2**20:.0f} MiB: "
          f"{r['tenant_indexes_peak']:,} tenant indexes, process growth over the last {r['measured_tenants']:,} "
          f"{r['rss_growth_peak'] / 2**20:.1f} MiB ({r['rss_growth_peak'] / r['measured_tenants']:.0f} B per tenant, its "
          f"entry included); after a flood into one tenant: "
          f"{r['tenant_indexes_after_flood']:,} tenant indexes, {r['entries_after_flood']:,} entries, "
          f"growth {r['rss_growth_after_flood'] / 2**20:.1f} MiB")
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
