"""The adaptive policies against their fixed alternatives, each on a stream made for it.

    python -m ushash.cachesim scenario=adaptive_ttl        # or scenario=qos

- adaptive_ttl: a TTL cache (memory is freed when entries expire; no byte bound, like a Redis without
  maxmemory or a GPU-resident table) shares its memory with the model, whose own use rises from 60 % to
  80 % between `pressure_from_s` and `pressure_to_s` (bigger batches on the same GPU), and the service's
  p99 rises to `slow_p99_ms` in a slow phase. Fixed TTLs (the base, and the safe 60 s) against
  `adaptive.AdaptiveTTL` with the same base: hit rate, memory in use (peak, seconds at >= 85 % and >= 100 %,
  i.e. out of memory), the TTL given.
- qos: a critical tenant (payments: a small hot set), a normal one, and from `flood_from_s` to
  `flood_to_s` a batch tenant's report export reading keys once each at a high rate, through an L1 of
  `capacity` entries: one plain LRU admitting everything against `qos.QoSLRU` (QoS admission + class-ordered
  eviction): each tenant's hit rate before, during and after the flood.
"""

from __future__ import annotations

import math

import numpy as np

from ushash.serving.cache.adaptive import AdaptiveTTL
from ushash.serving.cache.qos import QoSAdmission, QoSLRU


def _zipf(rng, n_keys: int, s: float, size: int) -> np.ndarray:
    p = 1.0 / np.arange(1, n_keys + 1) ** float(s)
    return rng.choice(n_keys, size=size, p=p / p.sum())


# ---------------------------------------------------------------------------------------------- adaptive TTL
ADAPTIVE = dict(duration_s=900.0, rate=200.0, n_keys=50_000, zipf_s=1.0, entries_per_percent=1000.0,
                model_percent=60.0, pressure_percent=80.0, pressure_from_s=300.0, pressure_to_s=600.0,
                base_p99_ms=80.0, slow_p99_ms=300.0, slow_from_s=700.0, slow_to_s=800.0, base_ttl_s=600.0, seed=0)


def run_adaptive_ttl(p: dict | None = None) -> dict:
    """Fixed TTL (base and 60 s) against adaptive TTL on the memory-pressure stream. Returns
    {settings, runs: {name: summary with a per-second timeline}}."""
    p = {**ADAPTIVE, **(p or {})}
    rng = np.random.default_rng(int(p["seed"]))
    n = int(rng.poisson(p["rate"] * p["duration_s"]))
    t = np.sort(rng.random(n) * p["duration_s"])
    keys = _zipf(rng, int(p["n_keys"]), p["zipf_s"], n)
    runs = {}
    for name in (f"fixed {p['base_ttl_s']:g} s", "fixed 60 s", "adaptive"):
        runs[name] = _replay_ttl(name, t, keys, p)
    return {"settings": p, "runs": runs}


def _replay_ttl(name: str, t: np.ndarray, keys: np.ndarray, p: dict) -> dict:
    """The TTL acts on every entry by its age: an entry is expired once its age reaches the TTL of the
    moment, so a TTL that shrinks under pressure frees memory at once (swept every second)."""
    from collections import deque

    state = {"mem": p["model_percent"], "now": 0.0}

    def model_percent(now):
        return p["pressure_percent"] if p["pressure_from_s"] <= now < p["pressure_to_s"] else p["model_percent"]

    def p99(now):
        return p["slow_p99_ms"] if p["slow_from_s"] <= now < p["slow_to_s"] else p["base_p99_ms"]

    policy = AdaptiveTTL(p["base_ttl_s"], memory=lambda: state["mem"], p99=lambda: p99(state["now"]),
                         clock=lambda: state["now"])
    fixed = None if name == "adaptive" else (60.0 if name == "fixed 60 s" else float(p["base_ttl_s"]))
    created: dict[int, float] = {}
    order: deque = deque()   # (created, key), oldest first
    nb = int(math.ceil(p["duration_s"]))
    req, hits, mem_s, ttl_s = np.zeros(nb), np.zeros(nb), np.zeros(nb), np.zeros(nb)
    sec, ttl = -1, float(p["base_ttl_s"])
    for ti, k in zip(t.tolist(), keys.tolist()):
        s = int(ti)
        if s != sec:
            for x in range(sec + 1, s + 1):
                state["now"] = float(x)
                while order and order[0][0] <= x - ttl:   # the sweep: entries past the TTL free their memory
                    c, kk = order.popleft()
                    if created.get(kk) == c:
                        del created[kk]
                state["mem"] = model_percent(x) + len(created) / p["entries_per_percent"]
                ttl = fixed if fixed is not None else policy.ttl()
                mem_s[x], ttl_s[x] = state["mem"], ttl
            sec = s
        req[s] += 1
        c = created.get(k)
        if c is not None and ti - c < ttl:
            hits[s] += 1
            continue
        created[k] = ti
        order.append((ti, k))
    return {"hit_rate": float(hits.sum() / req.sum()), "peak_memory_percent": float(mem_s.max()),
            "seconds_over_85": int((mem_s >= 85).sum()), "seconds_over_100": int((mem_s >= 100).sum()),
            "mean_ttl_s": float(ttl_s.mean()),
            "pressure_hit_rate": float(hits[int(p["pressure_from_s"]):int(p["pressure_to_s"])].sum()
                                       / req[int(p["pressure_from_s"]):int(p["pressure_to_s"])].sum()),
            "timeline": {"memory_percent": mem_s.tolist(), "ttl_s": ttl_s.tolist(),
                         "hit_rate": (hits / np.maximum(req, 1)).tolist()}}


# ---------------------------------------------------------------------------------------------- QoS admission
QOS = dict(duration_s=480.0, capacity=3000, critical_keys=1000, critical_rate=100.0, critical_zipf=0.8,
           normal_keys=20_000, normal_rate=100.0, normal_zipf=1.0, flood_rate=500.0, flood_from_s=120.0,
           flood_to_s=360.0, seed=0)
TENANTS = {"payments": "critical", "search": "normal", "reports": "batch"}


def run_qos(p: dict | None = None) -> dict:
    """One plain LRU against QoS admission on the batch-flood stream."""
    p = {**QOS, **(p or {})}
    rng = np.random.default_rng(int(p["seed"]))
    parts = []
    for tenant, rate, nk, z, t0, t1 in (
            ("payments", p["critical_rate"], p["critical_keys"], p["critical_zipf"], 0.0, p["duration_s"]),
            ("search", p["normal_rate"], p["normal_keys"], p["normal_zipf"], 0.0, p["duration_s"])):
        n = int(rng.poisson(rate * (t1 - t0)))
        parts.append((t0 + rng.random(n) * (t1 - t0), np.full(n, tenant, object), _zipf(rng, int(nk), z, n)))
    n = int(rng.poisson(p["flood_rate"] * (p["flood_to_s"] - p["flood_from_s"])))
    parts.append((p["flood_from_s"] + rng.random(n) * (p["flood_to_s"] - p["flood_from_s"]),
                  np.full(n, "reports", object), np.arange(n)))  # a scan: every key once
    t = np.concatenate([x[0] for x in parts])
    order = np.argsort(t, kind="stable")
    t = t[order]
    tenants = np.concatenate([x[1] for x in parts])[order]
    keys = np.concatenate([x[2] for x in parts])[order]
    runs = {}
    for name, cache in (("plain LRU (admit all)", QoSLRU(int(p["capacity"]))),
                        ("QoS admission", QoSLRU(int(p["capacity"]), QoSAdmission(TENANTS, rng=__import__("random").Random(int(p["seed"])))))):
        runs[name] = _replay_qos(cache, t, tenants, keys, p)
    return {"settings": p, "runs": runs}


def _replay_qos(cache: QoSLRU, t, tenants, keys, p: dict) -> dict:
    nb = int(math.ceil(p["duration_s"] / 10))
    req = {x: np.zeros(nb) for x in TENANTS}
    hit = {x: np.zeros(nb) for x in TENANTS}
    for ti, ten, k in zip(t.tolist(), tenants.tolist(), keys.tolist()):
        b = int(ti // 10)
        req[ten][b] += 1
        if cache.get(ten, k) is not None:
            hit[ten][b] += 1
        else:
            cache.put(ten, k, 1)
    f0, f1 = int(p["flood_from_s"] // 10), int(p["flood_to_s"] // 10)
    out = {"refused": cache.refused, "evicted": cache.evicted}
    for ten in TENANTS:
        r, h = req[ten], hit[ten]
        out[ten] = {"hit_rate": float(h.sum() / max(1, r.sum())),
                    "before": float(h[:f0].sum() / max(1, r[:f0].sum())),
                    "during": float(h[f0:f1].sum() / max(1, r[f0:f1].sum())),
                    "after": float(h[f1:].sum() / max(1, r[f1:].sum())),
                    "timeline": (h / np.maximum(r, 1)).tolist()}
    return out


# ---------------------------------------------------------------------------------------------- report
COLOURS = {"fixed 600 s": "black", "fixed 60 s": "tab:blue", "adaptive": "tab:green",
           "plain LRU (admit all)": "black", "QoS admission": "tab:green"}


def describe_adaptive(p: dict) -> str:
    return (f"adaptive TTL: {p['rate']:g} req/s over {p['n_keys']} keys (Zipf {p['zipf_s']:g}), a TTL cache sharing "
            f"memory with the model ({p['model_percent']:g} % in use, {p['pressure_percent']:g} % from "
            f"{p['pressure_from_s']:g} to {p['pressure_to_s']:g} s; {p['entries_per_percent']:g} entries = 1 %), "
            f"service p99 {p['base_p99_ms']:g} ms, {p['slow_p99_ms']:g} ms from {p['slow_from_s']:g} to "
            f"{p['slow_to_s']:g} s; base TTL {p['base_ttl_s']:g} s; {p['duration_s']:g} s simulated")


def describe_qos(p: dict) -> str:
    return (f"QoS admission: L1 of {p['capacity']} entries; payments (critical) {p['critical_rate']:g} req/s over "
            f"{p['critical_keys']} keys (Zipf {p['critical_zipf']:g}), search (normal) {p['normal_rate']:g} req/s over "
            f"{p['normal_keys']} keys (Zipf {p['normal_zipf']:g}), reports (batch) {p['flood_rate']:g} req/s of "
            f"keys read once from {p['flood_from_s']:g} to {p['flood_to_s']:g} s; {p['duration_s']:g} s simulated")


def markdown_adaptive(res: dict) -> str:
    p = res["settings"]
    lines = [f"Stream {describe_adaptive(p)}.", "",
             "| TTL | hit rate | hit rate under pressure | peak memory % | seconds >= 85 % | seconds >= 100 % "
             "(out of memory) | mean TTL s |", "|---|---|---|---|---|---|---|"]
    for name, r in res["runs"].items():
        lines.append(f"| {name} | {r['hit_rate']:.3f} | {r['pressure_hit_rate']:.3f} | {r['peak_memory_percent']:.1f} | "
                     f"{r['seconds_over_85']} | {r['seconds_over_100']} | {r['mean_ttl_s']:.0f} |")
    return "\n".join(lines)


def markdown_qos(res: dict) -> str:
    p = res["settings"]
    lines = [f"Stream {describe_qos(p)}.", "",
             "| admission | payments before | payments during the flood | payments after | search before | "
             "search during | search after | reports | refused puts | evictions |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in res["runs"].items():
        pay, se, rep = r["payments"], r["search"], r["reports"]
        lines.append(f"| {name} | {pay['before']:.3f} | {pay['during']:.3f} | {pay['after']:.3f} | {se['before']:.3f} | "
                     f"{se['during']:.3f} | {se['after']:.3f} | {rep['hit_rate']:.3f} | {r['refused']:,} | "
                     f"{r['evicted']:,} |")
    return "\n".join(lines)


def _finish(fig, axes, title: str, path) -> None:
    """The figures' common end: the legend right of the top axes, the title wrapped, saved."""
    import textwrap

    from ushash.core.io import save_figure

    axes[0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def plot_adaptive(res: dict, path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = res["settings"]
    fig, axes = plt.subplots(3, 1, figsize=(11, 8.5), dpi=100, sharex=True)
    for name, r in res["runs"].items():
        tl = r["timeline"]
        x = np.arange(len(tl["memory_percent"]))
        kw = dict(color=COLOURS.get(name), lw=1.6, label=name)
        axes[0].plot(x, tl["memory_percent"], **kw)
        axes[1].plot(x, tl["ttl_s"], **kw)
        hr = np.convolve(tl["hit_rate"], np.ones(10), mode="same") / np.convolve(np.ones(len(x)), np.ones(10), mode="same")
        axes[2].plot(x, hr, **kw)
    for y, lab in ((85, "85 %: TTL <= 60 s"), (100, "100 %: out of memory")):
        axes[0].axhline(y, color="red", ls="--", lw=0.8)
        axes[0].annotate(lab, (0, y), color="red", fontsize=8, va="bottom")
    for ax in axes:
        ax.axvspan(p["pressure_from_s"], p["pressure_to_s"], color="orange", alpha=0.08)
        ax.axvspan(p["slow_from_s"], p["slow_to_s"], color="purple", alpha=0.08)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("memory in use %")
    axes[1].set_ylabel("TTL given, s")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("hit rate (10 s mean)")
    axes[2].set_xlabel("simulated seconds (orange: memory pressure; purple: slow service)")
    _finish(fig, axes, title, path)


def plot_qos(res: dict, path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = res["settings"]
    fig, axes = plt.subplots(2, 1, figsize=(11, 6.5), dpi=100, sharex=True)
    for ax, tenant in zip(axes, ("payments", "search")):
        for name, r in res["runs"].items():
            y = r[tenant]["timeline"]
            ax.plot(np.arange(len(y)) * 10 + 5, y, color=COLOURS.get(name), lw=1.8, marker="o", ms=3, label=name)
        ax.axvspan(p["flood_from_s"], p["flood_to_s"], color="orange", alpha=0.1)
        ax.set_ylabel(f"{tenant} ({TENANTS[tenant]})\nhit rate per 10 s")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[1].set_xlabel("simulated seconds (orange: the batch tenant's report export)")
    _finish(fig, axes, title, path)


def run_policy(name: str, out, run_name: str) -> dict:
    """scenario=adaptive_ttl or qos: the experiment, its table (<name>.md), plot (.png) and results (.json)."""
    from ushash.core.io import atomic_write, write_json

    if name == "adaptive_ttl":
        res, table = run_adaptive_ttl(), None
        table = markdown_adaptive(res)
        plot_adaptive(res, out / f"{name}.png", f"{describe_adaptive(res['settings'])}; run {run_name}")
    else:
        res = run_qos()
        table = markdown_qos(res)
        plot_qos(res, out / f"{name}.png", f"{describe_qos(res['settings'])}; run {run_name}")
    write_json(out / f"{name}.json", res)
    atomic_write(out / f"{name}.md", table + "\n")
    return res
