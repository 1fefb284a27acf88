"""Benchmark: requests/s of the HTTP service (python -m ushash.serve) under a bounded load on loopback.

The parent process writes a small export (random-init 64-bit head over the seeded `tiny` encoder, so
no training and no downloads), starts `python -m ushash.serve` on 127.0.0.1 at a free port, stores
`--entries` entries through POST /v1/store, then runs the load generator as a second process
(this script with --client): `--concurrency` connections, at most `--requests` requests and
`--seconds` seconds per phase, the phases interleaved in `--rounds` rounds. Phases, in the same run:

  reference: GET /healthz (the bare FastAPI + uvicorn stack, no cache work)
  lookup:    POST /v1/lookup with precomputed features (half of them stored ones: hits)
  text:      POST /v1/lookup with a caption (the tiny text encoder + head + cache)
  batch:     POST /v1/lookup_batch with `--batch` rows of features per request (lookups/s = rows/s)

Prints requests/s, latency p50 / p99 per phase, the ratio to the reference, and the CPU time the server
(all its processes) and the load generator spent per request (from /proc).

`--workers 1,2` starts one server per entry (`workers=N`, uvicorn's worker processes), all over one
redis-server started here as their shared L2 (`cache=redis`; a server of one worker too, so that the rows
compare like with like), and interleaves every server's phases in the same rounds. Without --workers:
one server of one worker, L1 only.

    python benchmarks/serve_load.py [--requests 3000] [--concurrency 8] [--seconds 30] [--entries 2000] [--rounds 4]
                                    [--workers 1,2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ushash.serving.localhost import Connection, request_bytes, run_loop

HOST = "127.0.0.1"  # loopback only
ENC_CFG = {"name": "tiny", "dim": 16, "seed": 0}


# ---------------------------------------------------------------------------------------------- client
def _requests(kind: str, n: int, feats: list, batch: int) -> list[bytes]:
    """The phase's requests, made before it is timed (at most n, cycling)."""
    if kind == "healthz":
        return [request_bytes("GET", "/healthz")]
    if kind == "batch":
        starts = [(i * batch) % max(1, len(feats) - batch) for i in range(n)]
        return [request_bytes("POST", "/v1/lookup_batch", json.dumps({"modality": "image", "features": feats[s:s + batch]}).encode())
                for s in starts]
    if kind == "lookup":
        return [request_bytes("POST", "/v1/lookup", json.dumps({"modality": "image", "features": f}).encode())
                for f in feats[:max(1, min(n, len(feats)))]]
    return [request_bytes("POST", "/v1/lookup", json.dumps({"modality": "text", "text": f"a small red fox number {i}"}).encode())
            for i in range(min(n, 500))]


async def _phase(url: str, kind: str, n: int, concurrency: int, seconds: float, feats: list, batch: int = 1,
                 server_pids: tuple = ()) -> dict:
    lat: list[float] = []
    errors = 0
    reqs = _requests(kind, n, feats, batch)
    conns = [await Connection.open(url) for _ in range(concurrency)]
    counter = iter(range(n))

    async def worker(conn):
        nonlocal errors
        for i in counter:
            if time.perf_counter() > deadline:
                return
            t0 = time.perf_counter()
            status, _, _ = await conn.request(reqs[i % len(reqs)])
            lat.append(time.perf_counter() - t0)
            errors += status != 200

    deadline = time.perf_counter() + seconds
    t0, s0, c0 = time.perf_counter(), _cpu_seconds(server_pids), time.process_time()
    await asyncio.gather(*[worker(c) for c in conns])
    wall = time.perf_counter() - t0
    server_cpu, client_cpu = _cpu_seconds(server_pids) - s0, time.process_time() - c0
    for c in conns:
        c.close()
    return {"phase": kind, "lat": lat, "errors": errors, "seconds": wall, "rows": batch if kind == "batch" else 1,
            "server_cpu": server_cpu, "client_cpu": client_cpu}


def _cpu_seconds(pids) -> float:
    """CPU seconds (user + system) the processes `pids` have used so far, from /proc (NaN elsewhere)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _summary(runs: list[dict]) -> dict:
    """One phase's rounds together: requests / wall seconds over all rounds, latency percentiles of all."""
    lat = [x for r in runs for x in r["lat"]]
    wall = sum(r["seconds"] for r in runs)
    a = np.asarray(lat) * 1e3
    rows = runs[0]["rows"]
    return {"phase": runs[0]["phase"], "requests": len(lat), "errors": sum(r["errors"] for r in runs), "seconds": wall,
            "rps": len(lat) / wall, "lookups_per_s": rows * len(lat) / wall, "rows": rows,
            "server_cpu_ms": 1e3 * sum(r["server_cpu"] for r in runs) / len(lat),
            "client_cpu_ms": 1e3 * sum(r["client_cpu"] for r in runs) / len(lat),
            "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)), "rounds": len(runs)}


def client_main(args) -> None:
    feats = json.loads(Path(args.features).read_text())
    kinds = ("healthz", "lookup", "text", "batch")
    servers = json.loads(args.servers)      # [{"label", "url", "pids"}]
    runs: dict[tuple, list] = {(sv["label"], k): [] for sv in servers for k in kinds}
    for _ in range(args.rounds):   # the phases interleaved in rounds: machine noise hits them alike
        for sv in servers:
            for kind in kinds:
                n = max(1, args.requests // 20) if kind == "batch" else args.requests
                conc = min(args.concurrency, 2) if kind == "batch" else args.concurrency
                runs[sv["label"], kind].append(run_loop(_phase(
                    sv["url"], kind, max(1, n // args.rounds), conc, args.seconds / args.rounds, feats, args.batch,
                    _descendants(sv["pids"]))))
    print(json.dumps([{"server": label, **_summary(r)} for (label, _), r in runs.items()]))


def _descendants(pids) -> tuple:
    """`pids` and every process below them (uvicorn's workers), from /proc (just `pids` elsewhere)."""
    try:
        parent = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    pass
    except OSError:
        return tuple(pids)
    out, todo = set(), list(pids)
    while todo:
        p = todo.pop()
        out.add(p)
        todo += [c for c, pp in parent.items() if pp == p and c not in out]
    return tuple(sorted(out))


# ---------------------------------------------------------------------------------------------- parent
def _export(root: Path) -> Path:
    import torch

    from ushash.encoders import build_encoder
    from ushash.serving.export import write_export
    from ushash.hashing.heads import USHash

    enc = build_encoder({**ENC_CFG, "device": "cpu"})
    torch.manual_seed(0)
    model = USHash(dict(enc.dims), bits=64, dim=128).eval()
    return write_export(model, root / "export", {"name": "tiny", "fingerprint": enc.fingerprint, "config": ENC_CFG})


def main() -> None:
    from ushash.core.provenance import machine_summary
    ap = argparse.ArgumentParser()
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--servers", default="[]", help=argparse.SUPPRESS)
    ap.add_argument("--features", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--entries", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=4, help="phases interleaved in this many rounds")
    ap.add_argument("--workers", default="",
                    help="comma-separated worker counts, one server each over a shared redis-server (e.g. 1,2)")
    ap.add_argument("--server-threads", type=int, default=1,
                    help="the server's threads= (torch's intra-op threads for the head's forward pass) and OMP_NUM_THREADS")
    args = ap.parse_args()
    args.requests = min(args.requests, 20000)  # bounded load
    args.seconds = min(args.seconds, 120.0)
    if args.client:
        return client_main(args)

    import httpx

    workers = [int(w) for w in args.workers.split(",")] if args.workers else [1]
    if args.workers and not shutil.which("redis-server"):
        raise SystemExit("--workers needs redis-server (the workers' shared L2)")
    from ushash.serving.localhost import LocalRedis, free_port, wait_until_up

    with tempfile.TemporaryDirectory(prefix="ushash-serve-load-") as tmp:
        root = Path(tmp)
        export = _export(root)
        procs, servers, sv_procs, redis = [], [], [], None
        try:
            l2, redis = [], LocalRedis(host=HOST) if args.workers else None
            for k, w in enumerate(workers):
                if redis:   # one database each: the servers do not share entries
                    l2 = ["cache=redis", f"cache.l2.url=redis://{HOST}:{redis.port}/{k}"]
                port = free_port(HOST)
                proc = subprocess.Popen([sys.executable, "-m", "ushash.serve", f"export={export}", f"host={HOST}",
                                         f"port={port}", f"workers={w}", f"threads={args.server_threads}", *l2, "log_level=error",
                                         f"hydra.run.dir={root / f'hydra{k}'}"],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, "OMP_NUM_THREADS": str(args.server_threads)})
                procs.append(proc)
                sv_procs.append(proc)
                label = f"{w} worker{'s' if w > 1 else ''}" + (", Redis L2" if redis else "")
                servers.append({"label": label, "url": f"http://{HOST}:{port}", "pids": [proc.pid], "workers": w})
            rng = np.random.default_rng(0)
            stored = rng.normal(size=(args.entries, 16)).round(4)
            fresh = rng.normal(size=(args.entries, 16)).round(4)
            for sv, proc in zip(servers, sv_procs):
                wait_until_up(f"{sv['url']}/healthz", proc)
                with httpx.Client(timeout=30) as c:
                    for i, f in enumerate(stored):
                        c.post(f"{sv['url']}/v1/store", json={"modality": "image", "features": f.tolist(),
                                                              "value": {"id": i}})
            feats = [x.tolist() for pair in zip(stored, fresh) for x in pair]  # alternate hits and misses
            fpath = root / "features.json"
            fpath.write_text(json.dumps(feats))
            r = subprocess.run([sys.executable, __file__, "--client", "--features", str(fpath),
                                "--requests", str(args.requests), "--concurrency", str(args.concurrency),
                                "--seconds", str(args.seconds), "--batch", str(args.batch), "--rounds", str(args.rounds),
                                "--servers", json.dumps(servers)],
                               capture_output=True, text=True, check=True)
            phases = json.loads(r.stdout.strip().splitlines()[-1])
            hits = []
            for sv in servers:
                metrics = httpx.get(f"{sv['url']}/metrics").text
                line = next((ln for ln in metrics.splitlines() if ln.startswith('cache_gets_total{result="hit"}')), "")
                hits.append(f"{sv['label']}: {line}" + (" (one worker's count)" if sv["workers"] > 1 else ""))
        finally:
            for proc in reversed(procs):
                proc.terminate()
                proc.wait(30)
            if redis:
                redis.stop()
    print(f"# serve_load  {time.strftime('%Y-%m-%d %H:%M')}  {machine_summary()}, load average "
          f"{os.getloadavg()[0]:.1f}; server and load generator on the same machine, loopback, "
          f"{args.concurrency} connections (batch: 2), <= {args.requests} requests / {args.seconds:.0f} s per phase in "
          f"{args.rounds} interleaved rounds; "
          f"server OMP_NUM_THREADS={args.server_threads}; {'; '.join(hits)}")
    print("| server | phase | rows per request | requests | errors | requests/s | ratio to /healthz | lookups/s | p50 ms "
          "| p99 ms | server CPU ms/request | client CPU ms/request |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in phases:
        ref = next(q["rps"] for q in phases if q["server"] == p["server"] and q["phase"] == "healthz")
        print(f"| {p['server']} | {p['phase']} | {p['rows']} | {p['requests']} | {p['errors']} | {p['rps']:.0f} | "
              f"{p['rps'] / ref:.2f} | {p['lookups_per_s']:,.0f} | {p['p50_ms']:.1f} | {p['p99_ms']:.1f} | "
              f"{p['server_cpu_ms']:.2f} | {p['client_cpu_ms']:.2f} |")


if __name__ == "__main__":
    main()
