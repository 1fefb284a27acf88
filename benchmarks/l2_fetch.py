"""Benchmark: an L2 (Redis) lookup among near-duplicate entries, reading the answers of the nearest candidate and of
the one the hit check chooses (what `RedisStore.find_many` does), against reading every candidate's answer
with it (the read before, `lookup_many(values=None)` then the same choice), in the same run.

Fixed inputs: a redis-server started on a free loopback port; one request code and `n` entries around it
(one at distance 0, the rest at distance 1, as near-duplicates of one request are), each answer `size`
seeded bytes; a 64-bit head with a 16-d payload (`LSHHead`), radius 3. Two cases: the nearest candidate is
served (an exact repeat), and it is refused (of another modality with cross_modal off), so that a candidate at
distance 1 is chosen and its answer read in one more round trip. Each way is timed on the same store, interleaved, a fresh lookup of the L2 each time (no L1);
the bytes Redis sent per lookup are from its `total_net_output_bytes`, less what reading that counter costs.

    ./run bench l2_fetch [--repeats 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ushash.serving.cache import SemanticCache  # noqa: E402
from ushash.serving.cache.lsh import LSHHead  # noqa: E402
from ushash.serving.localhost import LocalRedis  # noqa: E402

CANDIDATES = (1, 8, 32)
SIZES = (1 << 10, 64 << 10)
TENANT, REVISION, RADIUS = "default", "bench", 3


def flip(code: np.ndarray, bit: int) -> np.ndarray:
    out = code.copy()
    out[bit // 8] ^= 1 << (bit % 8)
    return out


def fill(url: str, prefix: str, n: int, size: int, refused: bool):
    """A cache whose L2 holds `n` entries around the request code; (cache, the request Query)."""
    head = LSHHead({"image": 16, "text": 16}, bits=64, dim=16, aligned=True, seed=0, revision=REVISION)
    cache = SemanticCache(head, {"radius": RADIUS, "cross_modal": False, "ttl_s": 0,
                                 "l2": {"url": url, "prefix": prefix, "watermark_check_s": 0.0, "timeout_s": 1.0}})
    rng = np.random.default_rng(n * 7 + size)
    q = rng.integers(0, 256, 8, dtype=np.uint8)
    z = rng.normal(size=16).astype(np.float32)
    for j in range(n):
        code = q if j == 0 else flip(q, j - 1)
        modality = "image" if (j == 0 and refused) else "text"
        cache.store(cache.query_from_code(modality, code, z), rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    return cache, cache.query_from_code("text", q, z)


def every_answer(cache, q):
    """The read before: every candidate's whole entry, then the hit check's choice."""
    l2 = cache.l2
    entries, dists = l2.lookup(TENANT, REVISION, q.code, RADIUS, values=None)
    return l2._served([q], [l2._fits(entries, dists, cache.hit_check.codec)], TENANT, REVISION, cache.hit_check,
                      l2.clock(), 1)[0]


def served_answer(cache, q):
    """What the cache does: the nearest candidate's answer with it, another's once chosen."""
    return cache.l2.find_many([q], TENANT, REVISION, cache.hit_check, cache.l2.clock())[0]


def measure(repeats: int) -> list[dict]:
    try:
        srv = LocalRedis()
    except FileNotFoundError as e:
        raise SystemExit(f"l2_fetch: {e}") from None
    url = srv.url
    sent = lambda: srv.client.info("stats")["total_net_output_bytes"]   # noqa: E731
    with srv:
        a = sent()
        info_cost = sent() - a   # the counter's own reply, which a reading between two counters adds
        rows = []
        for refused in (False, True):
            for n in CANDIDATES:
                if refused and n == 1:
                    continue
                for size in SIZES:
                    cache, q = fill(url, f"b{n}s{size}r{int(refused)}", n, size, refused)
                    ways = {"every answer": every_answer, "served answer": served_answer}
                    want = {name: fn(cache, q) for name, fn in ways.items()}
                    e1, e2 = (want[k].entry for k in ways)
                    assert e1 is not None and e1.id == e2.id and e1.value == e2.value, (n, size, refused)
                    times = {name: [] for name in ways}
                    moved = {}
                    for name, fn in ways.items():
                        before = sent()
                        for _ in range(20):
                            fn(cache, q)
                        moved[name] = (sent() - before - info_cost) / 20
                    for _ in range(repeats):
                        for name, fn in ways.items():
                            t0 = time.perf_counter()
                            fn(cache, q)
                            times[name].append(time.perf_counter() - t0)
                    rows.append({"candidates": n, "size": size, "nearest refused": refused,
                                 **{f"{name} us": statistics.median(v) * 1e6 for name, v in times.items()},
                                 **{f"{name} bytes": moved[name] for name in ways}})
        return rows


def markdown(rows: list[dict], repeats: int) -> str:
    from ushash.core.provenance import machine_summary

    lines = [f"Run {time.strftime('%Y-%m-%d', time.gmtime())} on {machine_summary()}: "
             f"`python benchmarks/l2_fetch.py --repeats {repeats}`, median of {repeats} lookups each way, interleaved; "
             f"Redis on the loopback.",
             "",
             "| candidates | answer size | served | every answer: µs, bytes | served answer: µs, bytes | time ratio | "
             "bytes ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        served = "a candidate at distance 1 (the nearest refused)" if r["nearest refused"] else "the nearest"
        lines.append(f"| {r['candidates']} | {r['size'] >> 10} KB | {served} | "
                     f"{r['every answer us']:.0f}, {r['every answer bytes']:,.0f} | "
                     f"{r['served answer us']:.0f}, {r['served answer bytes']:,.0f} | "
                     f"{r['served answer us'] / r['every answer us']:.2f}x | "
                     f"{r['served answer bytes'] / r['every answer bytes']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=300)
    a = ap.parse_args(argv)
    print(markdown(measure(a.repeats), a.repeats))


if __name__ == "__main__":
    main()
