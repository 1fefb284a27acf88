"""Benchmark: reading a request's JSON body as the service and the proxy do (`loads_json`: orjson's speed where
orjson reads a body as `json.loads` does), against the scan it replaced (a regular expression looking for a run
of 19 digits, then orjson) and against `json.loads` (the standard library), in the same run.

Fixed inputs: OpenAI-style chat bodies, a text part and an `image_url` data URL holding seeded random bytes
(8 KB, 52 KB: a Tux Paint stamp's size, and 1 MB), base64 as clients send them; a small text-only body; and a
service lookup by a vector of 512 seeded features.
Each reader is timed on the same bytes, interleaved, and the medians printed with the ratio of `loads_json`
to the earlier scan.

    ./run bench json_body [--repeats 200]
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ushash.serving.cache.entries import loads_json  # noqa: E402

SIZES = {"text only": 0, "8 KB image": 8 << 10, "52 KB image": 52 << 10, "1 MB image": 1 << 20}
FEATURES = 512   # and a service lookup by features: one vector of this many floats
_EARLIER = re.compile(rb"[0-9]{19}")


def features_body(seed: int = 0) -> bytes:
    x = np.random.default_rng(seed).normal(size=FEATURES)
    return json.dumps({"modality": "image", "features": [float(v) for v in x]}).encode()


def body(n_image: int, seed: int = 0) -> bytes:
    content = [{"type": "text", "text": "what is in this image"}]
    if n_image:
        data = np.random.default_rng(seed).integers(0, 256, n_image, dtype=np.uint8).tobytes()
        content.append({"type": "image_url",
                        "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}})
    return json.dumps({"model": "m", "temperature": 0, "messages": [{"role": "user", "content": content}]}).encode()


def earlier(raw: bytes):
    """The reader before: the regular expression's scan, then orjson (json.loads where it finds a run)."""
    import orjson

    if _EARLIER.search(raw) is None:
        return orjson.loads(raw)
    return json.loads(raw)


def measure(repeats: int) -> dict:
    readers = {"loads_json": loads_json, "earlier scan + orjson": earlier, "json.loads": json.loads}
    out = {}
    bodies = {label: body(n) for label, n in SIZES.items()}
    bodies[f"{FEATURES} features (service lookup)"] = features_body()
    for label, raw in bodies.items():
        want = json.loads(raw)
        times = {name: [] for name in readers}
        for name, fn in readers.items():   # warm, and every reader reads the body alike
            assert fn(raw) == want, name
        for _ in range(repeats):
            for name, fn in readers.items():
                t0 = time.perf_counter()
                fn(raw)
                times[name].append(time.perf_counter() - t0)
        out[label] = {"bytes": len(raw), **{name: statistics.median(v) * 1e6 for name, v in times.items()}}
    return out


def markdown(res: dict, repeats: int) -> str:
    from ushash.core.provenance import machine_summary

    lines = [f"Run {time.strftime('%Y-%m-%d', time.gmtime())} on {machine_summary()}: "
             f"`python benchmarks/json_body.py --repeats {repeats}`, median of {repeats} reads each, interleaved.",
             "",
             "| body | bytes | `loads_json` (µs) | earlier scan + orjson (µs) | `json.loads` (µs) | "
             "`loads_json` / earlier |",
             "|---|---|---|---|---|---|"]
    for label, r in res.items():
        lines.append(f"| {label} | {r['bytes']:,} | {r['loads_json']:.1f} | {r['earlier scan + orjson']:.1f} | "
                     f"{r['json.loads']:.1f} | {r['loads_json'] / r['earlier scan + orjson']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200)
    a = ap.parse_args(argv)
    print(markdown(measure(a.repeats), a.repeats))


if __name__ == "__main__":
    main()
