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

Prints requests/s, latency p50 / p99 per phase and the ratio to the reference.

    python benchmarks/serve_load.py [--requests 3000] [--concurrency 8] [--seconds 30] [--entries 2000] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HOST = "127.0.0.1"  # loopback only
ENC_CFG = {"name": "tiny", "dim": 16, "seed": 0}


# ---------------------------------------------------------------------------------------------- client
async def _phase(url: str, kind: str, n: int, concurrency: int, seconds: float, feats: list, batch: int = 1) -> dict:
    import httpx

    lat: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds
    counter = iter(range(n))

    async def worker(client):
        nonlocal errors
        for i in counter:
            if time.perf_counter() > deadline:
                return
            t0 = time.perf_counter()
            if kind == "healthz":
                r = await client.get(f"{url}/healthz")
            elif kind == "batch":
                s = (i * batch) % max(1, len(feats) - batch)
                r = await client.post(f"{url}/v1/lookup_batch", json={"modality": "image", "features": feats[s:s + batch]})
            elif kind == "lookup":
                r = await client.post(f"{url}/v1/lookup", json={"modality": "image", "features": feats[i % len(feats)]})
            else:
                r = await client.post(f"{url}/v1/lookup", json={"modality": "text", "text": f"a small red fox number {i % 500}"})
            lat.append(time.perf_counter() - t0)
            errors += r.status_code != 200

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
        wall = time.perf_counter() - t0
    return {"phase": kind, "lat": lat, "errors": errors, "seconds": wall, "rows": batch if kind == "batch" else 1}


def _summary(runs: list[dict]) -> dict:
    """One phase's rounds together: requests / wall seconds over all rounds, latency percentiles of all."""
    lat = [x for r in runs for x in r["lat"]]
    wall = sum(r["seconds"] for r in runs)
    a = np.asarray(lat) * 1e3
    rows = runs[0]["rows"]
    return {"phase": runs[0]["phase"], "requests": len(lat), "errors": sum(r["errors"] for r in runs), "seconds": wall,
            "rps": len(lat) / wall, "lookups_per_s": rows * len(lat) / wall, "rows": rows,
            "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)), "rounds": len(runs)}


def client_main(args) -> None:
    feats = json.loads(Path(args.features).read_text())
    kinds = ("healthz", "lookup", "text", "batch")
    runs: dict[str, list] = {k: [] for k in kinds}
    for _ in range(args.rounds):   # the phases interleaved in rounds: machine noise hits them alike
        for kind in kinds:
            n = max(1, args.requests // 20) if kind == "batch" else args.requests
            conc = min(args.concurrency, 2) if kind == "batch" else args.concurrency
            runs[kind].append(asyncio.run(_phase(args.url, kind, max(1, n // args.rounds), conc,
                                                 args.seconds / args.rounds, feats, args.batch)))
    print(json.dumps([_summary(runs[k]) for k in kinds]))


# ---------------------------------------------------------------------------------------------- parent
def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


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
    ap = argparse.ArgumentParser()
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--features", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--entries", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=4, help="phases interleaved in this many rounds")
    ap.add_argument("--server-threads", type=int, default=1,
                    help="OMP_NUM_THREADS of the server: torch's intra-op threads for the head's forward pass")
    args = ap.parse_args()
    args.requests = min(args.requests, 20000)  # bounded load
    args.seconds = min(args.seconds, 120.0)
    if args.client:
        return client_main(args)

    import httpx

    with tempfile.TemporaryDirectory(prefix="ushash-serve-load-") as tmp:
        root = Path(tmp)
        export = _export(root)
        port = _free_port()
        url = f"http://{HOST}:{port}"
        server = subprocess.Popen([sys.executable, "-m", "ushash.serve", f"export={export}", f"host={HOST}",
                                   f"port={port}", "log_level=error", f"hydra.run.dir={root / 'hydra'}"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": str(args.server_threads)})
        try:
            for _ in range(600):
                try:
                    if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            else:
                raise RuntimeError("the server did not come up")
            rng = np.random.default_rng(0)
            stored = rng.normal(size=(args.entries, 16)).round(4)
            with httpx.Client(timeout=30) as c:
                for i, f in enumerate(stored):
                    c.post(f"{url}/v1/store", json={"modality": "image", "features": f.tolist(), "value": {"id": i}})
            fresh = rng.normal(size=(args.entries, 16)).round(4)
            feats = [x.tolist() for pair in zip(stored, fresh) for x in pair]  # alternate hits and misses
            fpath = root / "features.json"
            fpath.write_text(json.dumps(feats))
            r = subprocess.run([sys.executable, __file__, "--client", "--url", url, "--features", str(fpath),
                                "--requests", str(args.requests), "--concurrency", str(args.concurrency),
                                "--seconds", str(args.seconds), "--batch", str(args.batch), "--rounds", str(args.rounds)],
                               capture_output=True, text=True, check=True)
            phases = json.loads(r.stdout.strip().splitlines()[-1])
            metrics = httpx.get(f"{url}/metrics").text
        finally:
            server.terminate()
            server.wait(10)
    hits = next((ln for ln in metrics.splitlines() if ln.startswith('cache_gets_total{result="hit"}')), "")
    print(f"# serve_load  {time.strftime('%Y-%m-%d %H:%M')}  {platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; server and load generator on the same machine, loopback, "
          f"{args.concurrency} connections (batch: 2), <= {args.requests} requests / {args.seconds:.0f} s per phase in "
          f"{args.rounds} interleaved rounds; "
          f"server OMP_NUM_THREADS={args.server_threads}; {hits}")
    ref = phases[0]["rps"]
    print("| phase | rows per request | requests | errors | requests/s | ratio to /healthz | lookups/s | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in phases:
        print(f"| {p['phase']} | {p['rows']} | {p['requests']} | {p['errors']} | {p['rps']:.0f} | {p['rps'] / ref:.2f} | "
              f"{p['lookups_per_s']:,.0f} | {p['p50_ms']:.1f} | {p['p99_ms']:.1f} |")


if __name__ == "__main__":
    main()
