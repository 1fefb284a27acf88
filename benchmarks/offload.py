"""Benchmark: what handing a blocking call to a worker thread costs an event loop, ushash's `Workers` against
`asyncio.to_thread` (the reference), in the same run.

Fixed inputs: an encoder-sized call (a seeded 3x3 convolution over a 64 x 112 x 112 tensor, three times, on one
torch thread: tens of milliseconds of CPU work that leave the caches cold, as a request's encoding does) and an empty
call. Each await is timed on the loop (uvloop, as the servers run) and the call's own time inside the worker;
the handoff is the difference: the wake-up of the worker, the GIL's handoffs both ways, and the machinery on
each side. Calls are interleaved (Workers, to_thread, Workers, ...) with a pause of 2 ms between, and the
medians printed with their ratio.

    ./run bench offload [--calls 60]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ushash.serving.localhost import run_loop  # noqa: E402
from ushash.serving.workers import Workers  # noqa: E402


def encoder_call():
    import torch

    torch.manual_seed(0)
    conv, x = torch.nn.Conv2d(64, 64, 3, padding=1), torch.randn(1, 64, 112, 112)

    def call():
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(3):
                conv(x)
        return time.perf_counter() - t0
    return call


def empty_call():
    t0 = time.perf_counter()
    return time.perf_counter() - t0


async def measure(calls: int) -> dict:
    import torch

    torch.set_num_threads(1)   # as the proxy's process: one torch thread per call
    workers = Workers()
    ways = {"Workers.run": workers.run, "asyncio.to_thread": asyncio.to_thread}
    out = {}
    try:
        for label, fn in (("encoder-sized call", encoder_call()), ("empty call", empty_call)):
            for way in ways.values():   # warm: threads started, torch's kernels loaded
                await way(fn)
            handoff = {name: [] for name in ways}
            own = []
            for _ in range(calls):
                for name, way in ways.items():
                    t0 = time.perf_counter()
                    spent = await way(fn)
                    handoff[name].append(time.perf_counter() - t0 - spent)
                    own.append(spent)
                    await asyncio.sleep(0.002)
            out[label] = {"own_ms": statistics.median(own) * 1e3,
                          **{name: statistics.median(v) * 1e3 for name, v in handoff.items()}}
    finally:
        workers.close()
    return out


def markdown(res: dict, calls: int) -> str:
    from ushash.core.provenance import machine_summary

    lines = [f"Run {time.strftime('%Y-%m-%d', time.gmtime())} on {machine_summary()}: "
             f"`python benchmarks/offload.py --calls {calls}`, {calls} calls of each kind per way, interleaved.",
             "",
             "| call (its own time, median) | handoff, `Workers.run` (ms) | handoff, `asyncio.to_thread` (ms) | ratio |",
             "|---|---|---|---|"]
    for label, r in res.items():
        ratio = r["Workers.run"] / r["asyncio.to_thread"]
        lines.append(f"| {label} ({r['own_ms']:.2f} ms) | {r['Workers.run']:.3f} | {r['asyncio.to_thread']:.3f} | "
                     f"{ratio:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=60)
    a = ap.parse_args(argv)
    print(markdown(run_loop(measure(a.calls)), a.calls))


if __name__ == "__main__":
    main()
