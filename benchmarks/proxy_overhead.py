"""The proxy in front of the real model service: a replayed image stream, and the proxy's cost on a hit.

    python benchmarks/proxy_overhead.py --export exports/tuxpaint-64b --images data/tuxpaint/stamps \
        [--items 60] [--requests 400] [--repeats 60]

Starts the EfficientNet-Lite0 ImageNet classifier (ushash.serving.model_service) and the proxy
(python -m ushash.proxy) as their own processes on loopback, then replays a Zipf stream of chat requests
("what is in this image" + an image_url data URL; each image as it is or JPEG re-encoded and cropped)
through the proxy. Correctness is response equivalence: each answer is compared with the model's own
answer for that request (asked directly, off the clock). Reported: hit rate, false hits, model calls and
model seconds saved, end-to-end p50/p99 of hits and of misses. Then, in the same run, the same hit
request `--repeats` times, interleaved: through the proxy over HTTP, as a direct in-process lookup of a
cache built from the same export (`check` on the image bytes: the same encoding and search), and as a
direct call of the model service. The proxy's overhead is its hit p50 minus the direct lookup's p50.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ushash.serving.localhost import free_port, wait_until_up  # noqa: E402

PROMPT = "what is in this image"


def chat(png: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return {"model": "efficientnet-lite0-imagenet", "messages": [{"role": "user", "content": [
        {"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": url}}]}]}


def variants(path: Path, rng, n: int) -> list[bytes]:
    from PIL import Image

    from ushash.sim.augment import jpeg_crop

    img = Image.open(path).convert("RGB")
    out = []
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    out.append(buf.getvalue())
    for _ in range(n):
        v, _ = jpeg_crop(img, rng, 0.85, 60)
        b = io.BytesIO()
        v.save(b, format="PNG")
        out.append(b.getvalue())
    return out


def pct(xs, q):
    return float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else float("nan")


def main(argv=None):
    import httpx

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--items", type=int, default=60)
    ap.add_argument("--variants", type=int, default=2)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--radius", type=int, default=3)
    ap.add_argument("--threshold", type=float, default=0.98)
    ap.add_argument("--out", default=str(ROOT / "experiments" / "proxy"))
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    files = sorted(Path(a.images).rglob("*.png"))
    files = [files[i] for i in sorted(rng.choice(len(files), size=min(a.items, len(files)), replace=False))]
    items = [variants(f, rng, a.variants) for f in files]
    p = 1.0 / np.arange(1, len(items) + 1) ** a.zipf
    p /= p.sum()
    stream = [(int(i), int(rng.integers(a.variants + 1))) for i in rng.choice(len(items), size=a.requests, p=p)]

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    mport, pport = free_port(), free_port()
    procs = []
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "ushash.serving.model_service", f"port={mport}",
                                       "threads=1"], env=env, cwd=ROOT))
        procs.append(subprocess.Popen([sys.executable, "-m", "ushash.proxy", f"upstream=http://127.0.0.1:{mport}",
                                       f"export={a.export}", f"port={pport}", f"cache.radius={a.radius}",
                                       f"cache.payload_threshold={a.threshold}", "cache.cross_modal=false"],
                                      env=env, cwd=ROOT))
        model_url, proxy_url = f"http://127.0.0.1:{mport}", f"http://127.0.0.1:{pport}"
        wait_until_up(model_url + "/v1/stats", procs[0], seconds=300)
        wait_until_up(proxy_url + "/healthz", procs[1], seconds=300)
        client = httpx.Client(timeout=120)
        ref: dict = {}

        def model_answer(i, v):
            if (i, v) not in ref:
                t0 = time.perf_counter()
                r = client.post(model_url + "/v1/chat/completions", json=chat(items[i][v]))
                ref[(i, v)] = (r.json()["choices"][0]["message"]["content"], float(r.headers["x-model-seconds"]),
                               time.perf_counter() - t0)
            return ref[(i, v)]

        # warm both (the first encoder call loads weights); not part of the stream
        client.post(model_url + "/v1/chat/completions", json=chat(items[0][0]))
        client.post(proxy_url + "/v1/chat/completions", json=chat(items[0][0]), headers={"Cache-Control": "no-store"})
        hit_lat, miss_lat = [], []
        hits = false = 0
        saved_s = 0.0
        for i, v in stream:
            t0 = time.perf_counter()
            r = client.post(proxy_url + "/v1/chat/completions", json=chat(items[i][v]))
            dt = time.perf_counter() - t0
            ans = r.json()["choices"][0]["message"]["content"]
            truth, secs, _ = model_answer(i, v)
            if r.headers.get("x-cache") == "hit":
                hits += 1
                false += ans != truth
                saved_s += secs
                hit_lat.append(dt)
            else:
                miss_lat.append(dt)
        stats = client.get(model_url + "/v1/stats").json()

        # overhead on a hit: proxy vs a direct lookup of the same request, interleaved, same run
        import torch

        from ushash.serving.cache import SemanticCache

        torch.set_num_threads(1)  # as the proxy's process (OMP_NUM_THREADS=1): the same encoder work per lookup
        direct = SemanticCache.from_export(ROOT / a.export if not Path(a.export).is_absolute() else a.export,
                                           {"radius": a.radius, "payload_threshold": a.threshold, "cross_modal": False})
        i0, v0 = stream[0]
        png = items[i0][v0]
        meta = {"model": "efficientnet-lite0-imagenet", "path": "v1/chat/completions", "stream": False,
                "revision": "", "text": "x"}
        direct.store(png, "answer", "image", metadata=meta)
        direct.check(png, "image", filters=meta)
        body = chat(png)
        client.post(proxy_url + "/v1/chat/completions", json=body)  # make sure it is cached
        t_proxy, t_direct, t_model = [], [], []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            r = client.post(proxy_url + "/v1/chat/completions", json=body)
            t_proxy.append(time.perf_counter() - t0)
            assert r.headers["x-cache"] == "hit"
            t0 = time.perf_counter()
            assert direct.check(png, "image", filters=meta)
            t_direct.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            client.post(model_url + "/v1/chat/completions", json=body)
            t_model.append(time.perf_counter() - t0)
    finally:
        for pr in procs:
            pr.terminate()
        for pr in procs:
            try:
                pr.wait(10)
            except subprocess.TimeoutExpired:
                pr.kill()
    n = len(stream)
    res = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "command": "python benchmarks/proxy_overhead.py " + " ".join(
               f"--{k} {v}" for k, v in vars(a).items() if k not in ("out", "images", "export")) +
           f" --export {Path(a.export).name} --images <tuxpaint stamps>",
           "requests": n, "items": len(items), "hit_rate": hits / n, "hits": hits, "false_hits": false,
           "false_per_hit": false / hits if hits else 0.0,
           "model_calls": int(stats["calls"]) - 2 - len(ref),  # less the two warm-ups and the reference calls
           "model_calls_saved": hits, "model_seconds_saved": saved_s,
           "hit_p50_ms": pct(hit_lat, 50), "hit_p99_ms": pct(hit_lat, 99),
           "miss_p50_ms": pct(miss_lat, 50), "miss_p99_ms": pct(miss_lat, 99),
           "overhead": {"repeats": a.repeats, "proxy_hit_p50_ms": pct(t_proxy, 50),
                        "direct_lookup_p50_ms": pct(t_direct, 50), "model_direct_p50_ms": pct(t_model, 50),
                        "proxy_minus_lookup_p50_ms": pct(t_proxy, 50) - pct(t_direct, 50),
                        "paired_difference_p50_ms": float(np.median(np.subtract(t_proxy, t_direct)) * 1e3)}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(markdown(res))
    print(markdown(res))


def markdown(r: dict) -> str:
    o = r["overhead"]
    return "\n".join([
        f"Run {r['date']} on {r['machine']}: `{r['command']}`", "",
        f"Stream: {r['requests']} chat requests over {r['items']} Tux Paint stamps (Zipf), each image as it is or "
        f"JPEG re-encoded and cropped; answers compared with the model's own answer for that request.", "",
        "| requests | hits | hit rate | false hits | model calls made | model calls saved | model seconds saved | "
        "hit p50 / p99 ms | miss p50 / p99 ms |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {r['requests']} | {r['hits']} | {r['hit_rate']:.3f} | {r['false_hits']} | {r['model_calls']} | "
        f"{r['model_calls_saved']} | {r['model_seconds_saved']:.1f} | {r['hit_p50_ms']:.1f} / {r['hit_p99_ms']:.1f} | "
        f"{r['miss_p50_ms']:.1f} / {r['miss_p99_ms']:.1f} |", "",
        f"The same hit, {o['repeats']} times, interleaved in the same run (p50 ms):", "",
        "| through the proxy (HTTP) | direct lookup in process (`check` on the image bytes) | proxy - lookup | "
        "median of the paired differences | the model service called directly |",
        "|---|---|---|---|---|",
        f"| {o['proxy_hit_p50_ms']:.2f} | {o['direct_lookup_p50_ms']:.2f} | {o['proxy_minus_lookup_p50_ms']:.2f} | "
        f"{o['paired_difference_p50_ms']:.2f} | {o['model_direct_p50_ms']:.2f} |", ""])


if __name__ == "__main__":
    main()
