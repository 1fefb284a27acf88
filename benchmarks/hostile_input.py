"""What hostile bodies cost the service with its bounds, against the same bodies with each bound lifted (the
reference), measured in the same run and process.

    python benchmarks/hostile_input.py [--repeats 3]

Images: the header floods of the bad-input corpus (tests/hostile_corpus.py) at 5.6 MB, what an 8 MB base64
body carries, decoded under the service's media limits (`MediaLimits()`), and under the same limits with
`max_image_segments` lifted; a 1 x 1 PNG of 5.6 MB of EXIF with `max_exif_bytes` lifted; and an SVG drawing a
2048 x 2048 progressive JPEG of 2,000 scans from a data: URI (92 KB) with `max_jpeg_scans` lifted. JSON: 8 MB
bodies (the default `max_body_bytes`) through the service's app in process (`create_app` over a tiny export,
FastAPI's TestClient), with `max_json_values` at its default and lifted. Per case: the answer, CPU seconds
(median of the repeats) and the peak RSS above the level before the request (the process's VmHWM, reset before
each; "n/a" where the kernel does not allow the reset). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))   # the corpus and the tiny export the tests use

BODY = 8 << 20
IMAGE_BYTES = 5_600_000
CLEAR_REFS = "/proc/self/clear_refs"


def status_mb(key: str) -> float | None:
    """A memory line of /proc/self/status (VmHWM, VmRSS) in MB; None where there is no /proc (macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def measure(fn, repeats: int) -> tuple[str, float, float | None]:
    """(fn's answer, median CPU seconds, the largest peak RSS above the level before a call, MB)."""
    can_reset = os.access(CLEAR_REFS, os.W_OK)
    cpus, peaks, answer = [], [], ""
    for _ in range(repeats):
        if can_reset:
            with open(CLEAR_REFS, "w") as f:
                f.write("5")
        before = status_mb("VmRSS")
        t0 = time.process_time()
        answer = fn()
        cpus.append(time.process_time() - t0)
        peak = status_mb("VmHWM") if can_reset else None
        peaks.append(None if peak is None or before is None else max(0.0, peak - before))
    return answer, statistics.median(cpus), (max(peaks) if None not in peaks else None)


def image_cases():
    import hostile_corpus as hc
    from ushash.data import media

    bounded = media.MediaLimits()
    floods = [(name, data, "max_image_segments") for name, data in hc.header_floods(IMAGE_BYTES)]
    others = [("png_exif_metadata", hc.png_with_exif((IMAGE_BYTES - 80) // 8), "max_exif_bytes"),
              ("svg_embedding_a_jpeg_of_2000_scans",
               hc.svg_embedding(hc.progressive_with_scans(1990, side=2048)[0], "image/jpeg", side=64),
               "max_jpeg_scans")]
    for name, data, bound in floods + others:
        lifted = media.MediaLimits(**{bound: None})

        def decode(limits, data=data):
            try:
                img = media.decode_bytes("image", data, None, limits=limits)
                return f"decoded, {img.width} x {img.height}"
            except media.MediaError as e:
                return f"refused ({e.code})"
        yield f"image: {name}", len(data), lambda d=decode: d(bounded), lambda d=decode, l=lifted: d(l)


def json_cases(tmp: str):
    from conftest import write_tiny_export
    from fastapi.testclient import TestClient

    from ushash.serving.cache import SemanticCache
    from ushash.serving.service import create_app

    export = write_tiny_export(Path(tmp) / "tiny-64b")
    clients = {}
    for label, limit in (("bounded", None), ("lifted", 1 << 62)):
        cache = SemanticCache.from_export(export, {"radius": 4})
        app = create_app(cache) if limit is None else create_app(cache, max_json_values=limit)
        clients[label] = TestClient(app)
        clients[label].post("/v1/lookup", json={"modality": "text", "features": [0.1] * 16})   # warm
    head = b'{"modality":"text",'
    bodies = [
        ("/v1/lookup", "features of 0,0,...", head + b'"features":[', b"0,", b"0]}"),
        ("/v1/lookup_batch", "rows of [],[],...", head + b'"features":[', b"[],", b"[]]}"),
        ("/v1/store", "a value of {},{},...", head + b'"text":"a","value":[', b"{},", b"{}]}"),
    ]
    for route, what, start, unit, end in bodies:
        body = start + unit * ((BODY - len(start) - len(end)) // len(unit)) + end

        def post(label, route=route, body=body):
            r = clients[label].post(route, content=body, headers={"content-type": "application/json"})
            return f"{r.status_code}"
        yield f"{route}: {what}", len(body), lambda p=post: p("bounded"), lambda p=post: p("lifted")


def fmt_mb(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hostile-bench-") as tmp:
        for cases in (image_cases(), json_cases(tmp)):
            for name, size, bounded, lifted in cases:
                b, l_ = measure(bounded, args.repeats), measure(lifted, args.repeats)
                rows.append((name, size, b, l_))
    print(f"Each case {args.repeats} times, median CPU; peak RSS above the level before the request, the largest "
          f"of the repeats (MB). The reference is the same request with its bound lifted (`max_image_segments=None` "
          f"for the header floods, `max_exif_bytes=None`, `max_jpeg_scans=None`, `max_json_values=2^62`).\n")
    print("| body | bytes | bounded: answer | CPU s | peak MB | bound lifted: answer | CPU s | peak MB | CPU, lifted / bounded |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, size, (ba, bc, bp), (la, lc, lp) in rows:
        ratio = f"{lc / bc:.0f}x" if bc > 0 else "–"
        print(f"| {name} | {size:,} | {ba} | {bc:.3f} | {fmt_mb(bp)} | {la} | {lc:.3f} | {fmt_mb(lp)} | {ratio} |")


if __name__ == "__main__":
    main()
