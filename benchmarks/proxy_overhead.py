"""The proxy in front of the real model service: replayed image and text streams, and the proxy's cost on a hit.

    python benchmarks/proxy_overhead.py --export exports/tuxpaint-64b --images data/tuxpaint/stamps \
        [--items 60] [--requests 400] [--repeats 60] [--calibration experiments/budget/tuxpaint-0.01.calibration.json]

Starts the model service (ushash.serving.model_service: EfficientNet-Lite0's ImageNet classifier, and the
ImageNet class a text describes by MiniLM) and the proxy (python -m ushash.proxy) as their own processes on
loopback, then replays two Zipf streams of chat requests through the proxy: images ("what is in this
image" + an image_url data URL; each image as it is or JPEG re-encoded and cropped), then the same stamps'
captions as text-only requests (each as it is or a variant that changes its encoding: ushash.sim.augment's
caption variants, the kind by turns). Correctness is response equivalence: each answer is compared with the
model's own answer for that request (asked directly, off the clock). With `--calibration` (a calibration of
the export, benchmarks/false_hit_budget.py's), both streams also go through a second proxy at its points.
Reported per stream: hit rate, false hits (up to 10 named), model calls and model seconds saved, end-to-end p50/p99
of hits and of misses. Then, in the same run, the same hit
request `--repeats` times, interleaved: through the proxy over HTTP, as a direct in-process lookup of a
cache built from the same export (`check` on the image bytes: the same encoding and search), and as a
direct call of the model service (each over HTTP also with an httpx client, for what a Python caller sees).
The proxy's overhead is measured two ways: per request, its round trip less the lookup's own time inside
the proxy (its `Server-Timing` header), and across processes, its hit p50 less the direct lookup's p50.
Timed requests are prepared bytes on a bare keep-alive connection, so the client's cost is not counted.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ushash.serving.localhost import Connection, free_port, request_bytes, run_loop, wait_until_up  # noqa: E402

PROMPT = "what is in this image"


def chat(png: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return {"model": "efficientnet-lite0-imagenet", "messages": [{"role": "user", "content": [
        {"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": url}}]}]}


def chat_text(text: str) -> dict:
    return {"model": "efficientnet-lite0-imagenet", "messages": [{"role": "user", "content": [
        {"type": "text", "text": text}]}]}


def caption_variants(path: Path, rng, n: int) -> list[str] | None:
    """The stamp's caption (its .txt read as the data set reads it) and `n` variants that change its encoding (the
    kinds of ushash.sim.augment.CAPTION_VARIANTS by turns, from the stamp's place in the list); None without a
    caption."""
    from ushash.data.datasets.tuxpaint import read_caption
    from ushash.sim.augment import CAPTION_VARIANTS, caption_variant

    caption = read_caption(path.with_suffix(".txt"))
    if caption is None:
        return None
    kinds = sorted(CAPTION_VARIANTS)
    start = int(rng.integers(len(kinds)))
    return [caption] + [caption_variant(caption, kinds[(start + k) % len(kinds)], k, rng) for k in range(n)]


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


def lookup_seconds(head: bytes) -> float:
    """The lookup's own time in the proxy, from its answer's `Server-Timing: lookup;dur=<ms>`."""
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"server-timing:"):
            for metric in line.split(b":", 1)[1].split(b","):
                name, _, dur = metric.strip().partition(b";dur=")
                if name == b"lookup":
                    return float(dur) / 1e3
    raise RuntimeError(f"no Server-Timing lookup in the proxy's answer: {head[:300]!r}")


class ModelAnswers:
    """The model's own answer to each request, asked of the model service directly once (off the clock), with
    the seconds it took; `asked`: how many it has asked (calls the model service counts that no stream made)."""

    def __init__(self, client, model_url: str, bodies: dict):
        self.client, self.url, self.bodies, self.known = client, model_url + "/v1/chat/completions", bodies, {}

    @property
    def asked(self) -> int:
        return len(self.known)

    def __call__(self, key) -> tuple[str, float]:
        if key not in self.known:
            r = self.client.post(self.url, json=self.bodies[key])
            self.known[key] = (r.json()["choices"][0]["message"]["content"], float(r.headers["x-model-seconds"]))
        return self.known[key]


async def replay(proxy_url, model_url, stream, posts, model_answer, client) -> dict:
    """One stream through the proxy: each answer against the model's own for that request; the model calls the
    stream made (the service's count over the replay, less the reference answers asked meanwhile)."""
    proxy = await Connection.open(proxy_url)
    m = {"hit_lat": [], "miss_lat": [], "hits": 0, "false": 0, "saved_s": 0.0, "false_examples": []}
    calls0, refs0 = client.get(model_url + "/v1/stats").json()["calls"], model_answer.asked
    for key in stream:
        t0 = time.perf_counter()
        status, head, body = await proxy.request(posts[key])
        dt = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"the proxy answered {status}: {body[:200]!r}")
        ans = json.loads(body)["choices"][0]["message"]["content"]
        truth, secs = model_answer(key)
        if b"\r\nx-cache: hit\r\n" in head.lower():
            m["hits"] += 1
            m["false"] += ans != truth
            if ans != truth and len(m["false_examples"]) < 10:
                m["false_examples"].append({"request": key, "served": ans, "model": truth})
            m["saved_s"] += secs
            m["hit_lat"].append(dt)
        else:
            m["miss_lat"].append(dt)
    proxy.close()
    m["model_calls"] = int(client.get(model_url + "/v1/stats").json()["calls"] - calls0 - (model_answer.asked - refs0))
    return m


async def measure(proxy_url, model_url, streams, posts, model_answer, items, client, a, calibrated_url=None) -> dict:
    """The streams through the proxy (and through the calibrated one, when there is one), then the overhead
    phase: every timed request is prepared bytes over one bare keep-alive connection (the client's own cost, a
    few microseconds, is not the proxy's); the httpx columns time the same requests with an httpx client, for
    what a Python caller sees."""
    m = {kind: await replay(proxy_url, model_url, stream, posts, model_answer, client) for kind, stream in streams.items()}
    if calibrated_url:
        m["calibrated"] = {kind: await replay(calibrated_url, model_url, stream, posts, model_answer, client)
                           for kind, stream in streams.items()}
    stream = streams["image"]

    # overhead on a hit: proxy vs a direct lookup of the same request, interleaved, same run
    import torch

    from ushash.serving.cache import SemanticCache

    torch.set_num_threads(1)  # as the proxy's process (OMP_NUM_THREADS=1): the same encoder work per lookup
    direct = SemanticCache.from_export(ROOT / a.export if not Path(a.export).is_absolute() else a.export,
                                       {"radius": a.radius, "payload_threshold": a.threshold, "cross_modal": False})
    key = stream[0]
    png = items[key[1]][key[2]]
    meta = {"model": "efficientnet-lite0-imagenet", "path": "v1/chat/completions", "stream": False,
            "revision": "", "text": "x"}
    direct.store(png, "answer", "image", metadata=meta)
    direct.check(png, "image", filters=meta)
    body = chat(png)
    # opened after the setup above: the servers close a connection idle for 5 s (uvicorn's keep-alive timeout)
    proxy, model = await Connection.open(proxy_url), await Connection.open(model_url)
    await proxy.request(posts[key])  # make sure it is cached
    for k in ("t_proxy", "t_own", "t_direct", "t_model", "t_httpx", "t_model_httpx"):
        m[k] = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        _, head, _ = await proxy.request(posts[key])
        m["t_proxy"].append(time.perf_counter() - t0)
        assert b"\r\nx-cache: hit\r\n" in head.lower()
        m["t_own"].append(m["t_proxy"][-1] - lookup_seconds(head))
        t0 = time.perf_counter()
        assert direct.check(png, "image", filters=meta)
        m["t_direct"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await model.request(posts[key])
        m["t_model"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        r = client.post(proxy_url + "/v1/chat/completions", json=body)
        m["t_httpx"].append(time.perf_counter() - t0)
        assert r.headers["x-cache"] == "hit"
        t0 = time.perf_counter()
        client.post(model_url + "/v1/chat/completions", json=body)
        m["t_model_httpx"].append(time.perf_counter() - t0)
    proxy.close()
    model.close()
    return m


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
    ap.add_argument("--calibration", default=None,
                    help="a calibration file of the export (benchmarks/false_hit_budget.py's): the streams replayed "
                         "through a second proxy at its points too (`cache.calibration=`)")
    ap.add_argument("--out", default=str(ROOT / "experiments" / "proxy"))
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    files = sorted(Path(a.images).rglob("*.png"))
    files = [files[i] for i in sorted(rng.choice(len(files), size=min(a.items, len(files)), replace=False))]
    items = [variants(f, rng, a.variants) for f in files]
    p = 1.0 / np.arange(1, len(items) + 1) ** a.zipf
    p /= p.sum()
    streams = {"image": [("image", int(i), int(rng.integers(a.variants + 1)))
                         for i in rng.choice(len(items), size=a.requests, p=p)]}
    # the text stream: the same stamps' captions, from a generator of its own (the image stream as it was)
    trng = np.random.default_rng(1)
    captions = [caption_variants(f, trng, a.variants) for f in files]
    texts = [c for c in captions if c is not None]
    pt = 1.0 / np.arange(1, len(texts) + 1) ** a.zipf
    pt /= pt.sum()
    streams["text"] = [("text", int(i), int(trng.integers(a.variants + 1)))
                       for i in trng.choice(len(texts), size=a.requests, p=pt)]
    bodies = {("image", i, v): chat(items[i][v]) for i in range(len(items)) for v in range(len(items[i]))}
    bodies.update({("text", i, v): chat_text(texts[i][v]) for i in range(len(texts)) for v in range(len(texts[i]))})

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
        calibrated_url = None
        if a.calibration:
            cport = free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "ushash.proxy", f"upstream={model_url}",
                                           f"export={a.export}", f"port={cport}", "cache.cross_modal=false",
                                           f"cache.calibration={Path(a.calibration).resolve()}"], env=env, cwd=ROOT))
            calibrated_url = f"http://127.0.0.1:{cport}"
        wait_until_up(model_url + "/v1/stats", procs[0], seconds=300)
        for url, proc in zip((proxy_url, calibrated_url), procs[1:]):
            wait_until_up(url + "/healthz", proc, seconds=300)
        client = httpx.Client(timeout=120)   # off the clock: the reference answers and the warm-ups
        model_answer = ModelAnswers(client, model_url, bodies)
        # warm both (the first encoder calls load weights); not part of the streams
        for warm in (chat(items[0][0]), chat_text(texts[0][0])):
            client.post(model_url + "/v1/chat/completions", json=warm)
            for url in filter(None, (proxy_url, calibrated_url)):
                client.post(url + "/v1/chat/completions", json=warm, headers={"Cache-Control": "no-store"})
        posts = {key: request_bytes("POST", "/v1/chat/completions", json.dumps(bodies[key]).encode())
                 for stream in streams.values() for key in set(stream)}
        m = run_loop(measure(proxy_url, model_url, streams, posts, model_answer, items, client, a, calibrated_url))
    finally:
        for pr in procs:
            pr.terminate()
        for pr in procs:
            try:
                pr.wait(10)
            except subprocess.TimeoutExpired:
                pr.kill()
    from ushash.core.provenance import machine_summary

    def stream_result(kind, m=m):
        r, n = m[kind], len(streams[kind])
        return {"requests": n, "items": len(items) if kind == "image" else len(texts), "hit_rate": r["hits"] / n,
                "hits": r["hits"], "false_hits": r["false"], "false_per_hit": r["false"] / r["hits"] if r["hits"] else 0.0,
                "model_calls": r["model_calls"], "model_calls_saved": r["hits"], "model_seconds_saved": r["saved_s"],
                "hit_p50_ms": pct(r["hit_lat"], 50), "hit_p99_ms": pct(r["hit_lat"], 99),
                "miss_p50_ms": pct(r["miss_lat"], 50), "miss_p99_ms": pct(r["miss_lat"], 99),
                # what a false hit looked like: the request (a caption's text; an image by its stamp), the answer
                # served and the model's own
                "false_examples": [{"request": texts[e["request"][1]][e["request"][2]] if kind == "text" else
                                    f"{files[e['request'][1]].relative_to(a.images)} (variant {e['request'][2]})",
                                    "served": e["served"], "model": e["model"]} for e in r["false_examples"]]}

    res = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": machine_summary(),
           "command": "python benchmarks/proxy_overhead.py " + " ".join(
               f"--{k} {v}" for k, v in vars(a).items() if k not in ("out", "images", "export", "calibration")) +
           f" --export {Path(a.export).name} --images <tuxpaint stamps>" +
           (f" --calibration {Path(a.calibration).name}" if a.calibration else ""),
           "fixed": {"radius": a.radius, "threshold": a.threshold},   # the first proxy's point
           **stream_result("image"),   # the image stream's, at the top level as before the text stream was added
           "text": stream_result("text"),
           **({"calibrated": {"file": Path(a.calibration).name, "target_false_hit_rate":
                              json.loads(Path(a.calibration).read_text())["target_false_hit_rate"],
                              **{kind: stream_result(kind, m["calibrated"]) for kind in streams}}}
              if a.calibration else {}),
           "overhead": {"repeats": a.repeats, "proxy_hit_p50_ms": pct(m["t_proxy"], 50),
                        "direct_lookup_p50_ms": pct(m["t_direct"], 50), "model_direct_p50_ms": pct(m["t_model"], 50),
                        "proxy_minus_lookup_p50_ms": pct(m["t_proxy"], 50) - pct(m["t_direct"], 50),
                        "paired_difference_p50_ms": float(np.median(np.subtract(m["t_proxy"], m["t_direct"])) * 1e3),
                        "proxy_own_p50_ms": pct(m["t_own"], 50), "proxy_own_p99_ms": pct(m["t_own"], 99),
                        "proxy_httpx_hit_p50_ms": pct(m["t_httpx"], 50),
                        "model_httpx_p50_ms": pct(m["t_model_httpx"], 50)}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(markdown(res))
    print(markdown(res))


def markdown(r: dict) -> str:
    o = r["overhead"]
    fixed = f"fixed defaults (radius {r['fixed']['radius']}, threshold {r['fixed']['threshold']})"
    rows = [(f"image, {fixed}", r), (f"text, {fixed}", r["text"])]
    if r.get("calibrated"):
        c = r["calibrated"]
        at = f"calibrated (budget {c['target_false_hit_rate']}, `{c['file']}`)"
        rows += [(f"image, {at}", c["image"]), (f"text, {at}", c["text"])]
    return "\n".join([
        f"Run {r['date']} on {r['machine']}: `{r['command']}`", "",
        f"Streams: {r['requests']} chat requests over {r['items']} Tux Paint stamps (Zipf), each image as it is or "
        f"JPEG re-encoded and cropped; then {r['text']['requests']} text-only requests over {r['text']['items']} of "
        "their captions, each as it is or a variant that changes its encoding (word order, synonyms, a typo, a "
        "template, re-casing without the final stop); answers compared with the model's own answer for that request.", "",
        "| stream, operating point | requests | hits | hit rate | false hits | model calls made | model calls saved | model seconds saved | "
        "hit p50 / p99 ms | miss p50 / p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {name} | {x['requests']} | {x['hits']} | {x['hit_rate']:.3f} | {x['false_hits']} | {x['model_calls']} | "
          f"{x['model_calls_saved']} | {x['model_seconds_saved']:.1f} | {x['hit_p50_ms']:.1f} / {x['hit_p99_ms']:.1f} | "
          f"{x['miss_p50_ms']:.1f} / {x['miss_p99_ms']:.1f} |" for name, x in rows), "",
        *([f"The false hits, each a request served an answer the model gives another request (at most 10 per stream): "
           + "; ".join(f"{name}: `{e['request']}` served \"{e['served']}\", the model's own \"{e['model']}\""
                       for name, x in rows for e in x.get("false_examples", [])) + ".", ""]
          if any(x["false_hits"] for _, x in rows) else []),
        f"The same hit, {o['repeats']} times, interleaved in the same run (p50 ms). Over HTTP: prepared request "
        "bytes on a keep-alive connection (the client's cost is not the proxy's); the httpx columns send the same "
        "request with an httpx client, as a Python caller would:", "",
        "| through the proxy (HTTP) | direct lookup in process (`check` on the image bytes) | proxy - lookup | "
        "median of the paired differences | the model service called directly | proxy, httpx client | "
        "model service, httpx client |",
        "|---|---|---|---|---|---|---|",
        f"| {o['proxy_hit_p50_ms']:.2f} | {o['direct_lookup_p50_ms']:.2f} | {o['proxy_minus_lookup_p50_ms']:.2f} | "
        f"{o['paired_difference_p50_ms']:.2f} | {o['model_direct_p50_ms']:.2f} | {o['proxy_httpx_hit_p50_ms']:.2f} | "
        f"{o['model_httpx_p50_ms']:.2f} |", "",
        "The proxy's own time on each of those hits, timed in the same request: its round trip less the lookup's "
        "time inside the proxy (its `Server-Timing: lookup;dur=`: encoding, search and check), so what is left is "
        "the HTTP exchange, the JSON and base64, the thread hop and the answer:", "",
        "| proxy's own time p50 ms | p99 ms |", "|---|---|",
        f"| {o['proxy_own_p50_ms']:.2f} | {o['proxy_own_p99_ms']:.2f} |", ""])


if __name__ == "__main__":
    main()
