"""Head training steps/s on cached features, and codes emitted per second.

Fixed inputs: seeded synthetic features (image 1280-d, text 384-d: the offline encoders' widths), 64 bits.
References measured in the same run:
- training: a bare PyTorch loop (same model, the same US-HASH objective written out with the same loss
  functions, same batches gathered before timing for both loops, plain AdamW, and the recipe's moving average of the weights as one
  torch._foreach_lerp_; no Lightning module, no logging, no hyper-parameter lookups). The module's loop
  updates its average as Lightning's WeightAveraging does after each step (torch's AveragedModel);
- codes: a bare matmul + sign + np.packbits of the same features through the same weights.
Each run prints the medians over its repeats and their ratios; with --runs N, N runs (each from a fresh module) and
a markdown table of them with the median ratio and its range (what docs/benchmarks.md publishes: the machines are
shared, and one run's ratio moves by several hundredths).

    ./run bench heads             # one run
    ./run bench heads --runs 7    # the published table
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from torch.optim.swa_utils import AveragedModel

from ushash.core import codes
from ushash.hashing import losses
from ushash.hashing.module import USHashModule


REPEATS = 15   # interleaved repeats per run: one loop of 60 steps lasts about half a second, and the machines are shared


def measure(n=20000, batch=256, steps=60, repeats=REPEATS) -> dict:
    """One run: {"module", "bare"} training steps/s and {"encode", "packbits"} codes/s, medians over `repeats`."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    x = {"image": torch.from_numpy(rng.normal(size=(n, 1280)).astype(np.float32)),
         "text": torch.from_numpy(rng.normal(size=(n, 384)).astype(np.float32))}
    g = torch.arange(n)
    mod = USHashModule({"image": 1280, "text": 384}, bits=64)
    batches = [torch.from_numpy(rng.integers(0, n, size=batch)) for _ in range(steps)]
    # both loops get their batches gathered before the clock starts (what a DataLoader hands over): the
    # module's in the collated form its training_step reads, the bare loop's as plain tensors
    collated = [{m: (x[m][idx], g[idx], torch.ones(len(idx), dtype=torch.bool)) for m in x} for idx in batches]
    plain = [(x["image"][idx], x["text"][idx], g[idx]) for idx in batches]

    # made once, as Lightning's callback does when fitting starts
    averaged = [AveragedModel(mod, use_buffers=True, **cb._kwargs) for cb in mod.configure_callbacks()]

    def module_loop():
        opt = mod.configure_optimizers()["optimizer"]
        mod.train()
        for b in collated:
            loss = mod.training_step(b, 0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            for a in averaged:
                a.update_parameters(mod)

    def bare_loop():
        model, teacher = mod.model, mod.teacher
        scale, fscale = mod.logit_scale, mod.float_logit_scale
        params = list(model.parameters()) + [scale, fscale]
        opt = torch.optim.AdamW(params, lr=1e-3)
        average = [p.detach().clone() for p in params] if averaged else None
        decay = mod.ema_decay() if average is not None else 0.0
        model.train()
        gain = float(np.sqrt(model.dim))
        hp = mod.hparams   # the module's own loss weights, read once (the module looks them up every step)
        w = {k: float(hp[f"w_{k}"]) for k in ("contrastive", "float", "distill", "quant", "balance", "decor", "proto")}
        for xa, xb, gi in plain:
            (za, la), (zb, lb) = model("image", xa), model("text", xb)
            ha, hb = torch.tanh(gain * la), torch.tanh(gain * lb)
            with torch.no_grad():
                ta = torch.nn.functional.normalize(teacher["image"](xa), dim=-1)
                tb = torch.nn.functional.normalize(teacher["text"](xb), dim=-1)
            t, tf = 1 / scale.exp().clamp(max=100), 1 / fscale.exp().clamp(max=100)
            hs = torch.cat([ha, hb])
            loss = (w["contrastive"] * losses.contrastive(ha, hb, gi, gi, t, similarity="cosine")
                    + w["float"] * losses.contrastive(za, zb, gi, gi, tf, similarity="cosine")
                    + w["distill"] * losses.similarity_distillation(ha, hb, ta, tb)
                    + w["quant"] * losses.quantization(hs) + w["balance"] * losses.balance(hs)
                    + w["decor"] * losses.decorrelation(hs) + w["proto"] * losses.prototype(model.prototypes))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if average is not None:
                torch._foreach_lerp_(average, [p.detach() for p in params], 1.0 - decay)

    mod.log = mod.log_dict = lambda *a, **k: None  # no trainer attached: logging is a no-op here
    t_mod, t_bare = [], []
    for _ in range(repeats):
        t0 = time.perf_counter(); module_loop(); t_mod.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); bare_loop(); t_bare.append(time.perf_counter() - t0)
    sm, sb = steps / statistics.median(t_mod), steps / statistics.median(t_bare)

    # codes emitted per second
    feats = x["image"].numpy()
    mod.eval()
    lin = [m for m in mod.model.heads["image"] if isinstance(m, torch.nn.Linear)]
    t_enc, t_ref = [], []
    for _ in range(repeats):
        t0 = time.perf_counter(); packed, _ = mod.model.encode("image", feats); t_enc.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            z = mod.model.embed("image", torch.from_numpy(feats))
            ref = np.packbits((mod.model.logits(z) > 0).numpy(), axis=1, bitorder="little")
        t_ref.append(time.perf_counter() - t0)
    assert (ref == packed).all() and len(lin) == 1
    ce, cr = n / statistics.median(t_enc), n / statistics.median(t_ref)
    assert codes.pack(np.ones((1, 64))).shape == (1, 8)
    return {"module": sm, "bare": sb, "encode": ce, "packbits": cr}


def table(runs: list[dict], started: str, ended: str, batch=256, repeats=REPEATS) -> str:
    """The runs as a markdown table, each ratio's median and range below it."""
    from ushash.core.provenance import machine_summary
    train = [r["module"] / r["bare"] for r in runs]
    emit = [r["encode"] / r["packbits"] for r in runs]
    lines = [f"### Head training steps/s and codes/s: {len(runs)} runs, each the median of {repeats} interleaved repeats",
             "",
             f"{started} to {ended} UTC; {machine_summary()}, torch {torch.__version__}, torch threads {torch.get_num_threads()}; "
             f"fixed inputs: seeded 1280-d image + 384-d text features, batch {batch}, 64 bits, the shipped recipe",
             "",
             "| run | US-HASH module steps/s | bare loop steps/s | training ratio | `USHash.encode` codes/s "
             "| bare forward + `np.packbits` codes/s | codes ratio |",
             "|---|---|---|---|---|---|---|"]
    for i, (r, a, b) in enumerate(zip(runs, train, emit), 1):
        lines.append(f"| {i} | {r['module']:.1f} | {r['bare']:.1f} | {a:.2f}x | {r['encode']:,.0f} | {r['packbits']:,.0f} | {b:.2f}x |")
    lines += ["",
              f"Training: median ratio **{statistics.median(train):.2f}x** (range {min(train):.2f}-{max(train):.2f}x); "
              f"codes: median ratio {statistics.median(emit):.2f}x (range {min(emit):.2f}-{max(emit):.2f}x)."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1, help="runs, each from a fresh module (default 1)")
    args = ap.parse_args()
    if args.runs < 1:
        raise SystemExit(f"--runs {args.runs}: expected at least 1")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    started, runs = time.strftime("%Y-%m-%d %H:%M", time.gmtime()), []
    for _ in range(args.runs):
        r = measure()
        runs.append(r)
        if args.runs == 1:
            print(f"training, batch 256, 64 bits: US-HASH module {r['module']:.1f} steps/s; bare loop (same objective) "
                  f"{r['bare']:.1f} steps/s; ratio {r['module'] / r['bare']:.2f}x")
            print(f"codes: USHash.encode {r['encode']:,.0f} codes/s; bare forward + packbits {r['packbits']:,.0f} codes/s; "
                  f"ratio {r['encode'] / r['packbits']:.2f}x")
    if args.runs > 1:
        print(table(runs, started, time.strftime("%H:%M", time.gmtime())))


if __name__ == "__main__":
    main()
