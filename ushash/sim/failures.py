"""The design's cache failure modes, reproduced and defended, in simulated time.

    python -m ushash.cachesim scenario=avalanche            # or penetration, breakdown, all

Clients send requests (Poisson or generalised-Pareto arrivals, Zipf-popular keys, a share of never-seen
valid keys) to a cache in front of a service (`downstream.Downstream`: a concurrency limit, a bounded
queue, lognormal service times). A request is answered by the cache (a fresh hit, or a stale entry where
a defence allows it), or it waits for a computation (at most `timeout_s`); an error (timeout, refused by
the full queue, the breaker open without a stale entry) is retried by the client up to `retries` times
after an exponential backoff. A computation whose caller gave up still runs and still stores its answer.

Scenarios (the trigger starts at `trigger_s`):
- penetration: a flood of requests for keys that do not exist (`flood_rate` for `flood_s`); their
  answer ("no such item") is never cached, so every one falls through to the service;
- breakdown: one key takes `hot_share` of the traffic and costs `hot_median_s` to compute; it was
  written at t = 0 with `hot_ttl_s` and expires under load: a herd recomputes it;
- avalanche: the warm cache's entries were all written together (`ttl_s` before `trigger_s`), so they
  expire together under load: the hit rate collapses, the service queues, clients time out and retry.
Every scenario has a calm twin without its trigger (no flood; the hot key does not expire; entries
written at spread times), run with the defaults: the steady state the p99 is compared with.

The defences (`DefencesConfig`), on the real objects of ushash.serving.cache: single-flight (one
computation per key, the others wait for it), the Bloom filter of existing keys (`KeyFilter`), TTL jitter
and XFetch early refresh (`Freshness`), stale-while-revalidate and serve-stale-on-error (`StalePolicy`),
and the compute circuit breaker (`ComputeBreaker`, pybreaker). Each scenario runs with all of them off,
with each one alone, and with the defaults (all on).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from dataclasses import dataclass, field

import numpy as np

from ushash.serving.cache.freshness import Freshness
from ushash.serving.cache.protection import ComputeBreaker, KeyFilter, StalePolicy
from ushash.sim.config import DefencesConfig, FailuresConfig, check_failures_settings
from ushash.sim.downstream import Downstream, EventLoop, arrivals

log = logging.getLogger(__name__)

SCENARIOS = ("penetration", "breakdown", "avalanche")
POLICY_RUNS = ("adaptive_ttl", "qos")   # scenario=adaptive_ttl | qos: ushash/sim/policies.py
DEFENCES = ("single_flight", "bloom", "ttl_jitter", "early_refresh", "serve_stale", "swr", "breaker")
INVALID = 1 << 40     # keys from here on do not exist
NOVEL = 1 << 30       # never-seen valid keys are numbered from here


def defences(which: str, defaults: DefencesConfig | None = None) -> DefencesConfig:
    """'defaults' (all on as configured), 'off' (all off), or one name of DEFENCES alone."""
    d = defaults or DefencesConfig()
    off = dataclasses.replace(d, single_flight=False, bloom=False, ttl_jitter=0.0, xfetch_beta=0.0, swr_s=0.0,
                              stale_if_error_s=0.0, breaker=False)
    if which == "defaults":
        return d
    if which == "off":
        return off
    one = {"single_flight": dict(single_flight=True), "bloom": dict(bloom=True),
           "ttl_jitter": dict(ttl_jitter=d.ttl_jitter), "early_refresh": dict(xfetch_beta=d.xfetch_beta),
           "serve_stale": dict(stale_if_error_s=d.stale_if_error_s), "swr": dict(swr_s=d.swr_s),
           "breaker": dict(breaker=True)}
    if which not in one:
        raise ValueError(f"unknown defence {which!r}; choose off, defaults or one of {DEFENCES}")
    return dataclasses.replace(off, **one[which])


@dataclass
class _Request:
    __slots__ = ("key", "t0", "attempts", "done")
    key: int
    t0: float
    attempts: int
    done: bool


@dataclass
class _Flight:
    key: int
    start: float
    background: bool = False
    budgeted: bool = False
    finished: bool = False
    timed_out: bool = False
    waiters: list = field(default_factory=list)


class FailureSim:
    """One run: a scenario (or its calm twin) under one set of defences."""

    def __init__(self, scenario: str, f: FailuresConfig, d: DefencesConfig, calm: bool = False):
        if scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r}; choose one of {SCENARIOS}")
        check_failures_settings(f, scenario)
        self.scenario, self.f, self.d, self.calm = scenario, f, d, calm
        seed = int(f.seed)
        self.rng = np.random.default_rng(seed)
        self.loop = EventLoop()
        self.down = Downstream(self.loop, f.workers, f.queue_limit, f.service_sigma, np.random.default_rng(seed + 1))
        self.fresh = Freshness(f.ttl_s, d.ttl_jitter, d.xfetch_beta, rng=random.Random(seed + 2))
        self.stale = StalePolicy(d.swr_s, d.swr_max_inflight, d.stale_if_error_s)
        self.breaker = ComputeBreaker(d.breaker_fail_max, d.breaker_reset_s, clock=lambda: self.loop.now) \
            if d.breaker else None
        self.filter = None
        self.cache: dict[int, list[float]] = {}   # key -> [expires, compute seconds]
        self.flights: dict[int, _Flight] = {}     # single-flight registry (and background refreshes)
        self.refreshing: set[int] = set()
        self.retry_rng = random.Random(seed + 3)
        self.counts = {k: 0 for k in ("hit", "stale", "stale_on_error", "computed", "not_found", "refused_unknown",
                                      "error", "attempts", "refreshes")}
        self.lat: list[float] = []
        self.lat_t: list[float] = []
        self.hit_t: list[float] = []

    # ------------------------------------------------------------------ the stream
    def _stream(self) -> tuple[np.ndarray, np.ndarray]:
        f, rng = self.f, self.rng
        t = arrivals(f.rate, 0.0, f.duration_s, rng, f.arrivals, f.gpd_shape)
        p = 1.0 / np.arange(1, f.n_keys + 1) ** float(f.zipf_s)
        hot = self.scenario == "breakdown"
        if hot:  # key 0 is the hot key; the others share the rest by Zipf
            p[0] = 0.0
            p = p / p.sum() * (1.0 - f.hot_share)
            p[0] = f.hot_share
        else:
            p /= p.sum()
        keys = rng.choice(f.n_keys, size=len(t), p=p)
        novel = rng.random(len(t)) < f.novel_frac
        keys = np.where(novel, NOVEL + np.arange(len(t)), keys)
        if self.scenario == "penetration" and not self.calm:
            tf = arrivals(f.flood_rate, f.trigger_s, f.trigger_s + f.flood_s, rng, f.arrivals, f.gpd_shape)
            t = np.concatenate([t, tf])
            keys = np.concatenate([keys, INVALID + np.arange(len(tf))])
            order = np.argsort(t, kind="stable")
            t, keys = t[order], keys[order]
        return t, keys

    def _warm(self) -> None:
        """The cache before the run: every key stored once, with its compute time."""
        f, fr = self.f, self.fresh
        together = self.scenario == "avalanche" and not self.calm
        u = np.random.default_rng(int(f.seed) + 4).random(f.n_keys)
        cs = f.service_median_s
        for k in range(f.n_keys):
            written = f.trigger_s - f.ttl_s if together else -u[k] * f.ttl_s
            self.cache[k] = [fr.expiry(written), cs]
        if self.scenario == "breakdown":
            self.cache[0] = [math.inf if self.calm else fr.expiry(0.0, f.hot_ttl_s), f.hot_median_s]

    # ------------------------------------------------------------------ requests
    def _respond(self, r: _Request, t: float, kind: str) -> None:
        if r.done:
            return
        r.done = True
        self.counts[kind] += 1
        self.lat.append(t - r.t0)
        self.lat_t.append(r.t0)
        if kind == "hit":
            self.hit_t.append(r.t0)

    def _ttl(self, key: int) -> float | None:
        return self.f.hot_ttl_s if (key == 0 and self.scenario == "breakdown") else None

    def _attempt(self, r: _Request) -> None:
        now = self.loop.now
        r.attempts += 1
        self.counts["attempts"] += 1
        key = r.key
        e = self.cache.get(key)
        if e is not None:
            exp, cs = e
            if now < exp:
                if self.d.xfetch_beta > 0 and key not in self.refreshing and self.fresh.should_refresh(now, exp, cs):
                    self._refresh(key, budgeted=False)
                return self._respond(r, now + self.f.hit_s, "hit")
            if self.stale.serve_while_revalidating(now, exp):
                if key not in self.refreshing and key not in self.flights and \
                        self.stale.may_revalidate(self.down.in_flight - self.stale.revalidating):
                    self._refresh(key, budgeted=True)
                return self._respond(r, now + self.f.hit_s, "stale")
        if self.filter is not None and key not in self.filter:
            return self._respond(r, now + self.f.hit_s, "refused_unknown")
        fl = self.flights.get(key) if self.d.single_flight else None
        if fl is None:
            fl = _Flight(key, now)
            if self.d.single_flight:
                self.flights[key] = fl
            fl.waiters.append((r, r.attempts))
            self.loop.at(now + self.f.timeout_s, self._client_timeout, r, r.attempts)
            self._compute(fl)
        else:
            fl.waiters.append((r, r.attempts))
            self.loop.at(now + self.f.timeout_s, self._client_timeout, r, r.attempts)

    def _refresh(self, key: int, budgeted: bool) -> None:
        self.counts["refreshes"] += 1
        self.refreshing.add(key)
        fl = _Flight(key, self.loop.now, background=True, budgeted=budgeted)
        if self.d.single_flight:
            self.flights[key] = fl
        self._compute(fl)

    def _compute(self, fl: _Flight) -> None:
        if self.breaker is not None and not self.breaker.allow():
            return self._finish(fl, ok=False, fast=True)
        median = self.f.hot_median_s if (fl.key == 0 and self.scenario == "breakdown") else self.f.service_median_s
        self.down.submit(median, lambda ok: self._finish(fl, ok))
        self.loop.at(self.loop.now + self.f.timeout_s, self._flight_timeout, fl)

    def _flight_timeout(self, fl: _Flight) -> None:
        if not fl.finished and not fl.timed_out:
            fl.timed_out = True
            if self.breaker is not None:
                self.breaker.record(False)

    def _finish(self, fl: _Flight, ok: bool, fast: bool = False) -> None:
        now = self.loop.now
        if fl.finished:
            return
        fl.finished = True
        if self.flights.get(fl.key) is fl:
            del self.flights[fl.key]
        if fl.background:
            self.refreshing.discard(fl.key)
            if fl.budgeted:
                self.stale.revalidated()
        if self.breaker is not None and not fast and not fl.timed_out:
            self.breaker.record(ok)
        exists = fl.key < INVALID
        if ok and exists:
            self.cache[fl.key] = [self.fresh.expiry(now, self._ttl(fl.key)), now - fl.start]
        for r, a in fl.waiters:
            if r.done or r.attempts != a:
                continue
            if ok:
                self._respond(r, now, "computed" if exists else "not_found")
            else:
                self._failed(r)

    def _client_timeout(self, r: _Request, attempt: int) -> None:
        if not r.done and r.attempts == attempt:
            self._failed(r)

    def _failed(self, r: _Request) -> None:
        now = self.loop.now
        e = self.cache.get(r.key)
        if e is not None and self.stale.serve_on_error(now, e[0]):
            return self._respond(r, now, "stale_on_error")
        if r.attempts <= self.f.retries:
            wait = self.f.backoff_s * 2 ** (r.attempts - 1) * (0.5 + self.retry_rng.random())
            self.loop.at(now + wait, self._attempt, r)
        else:
            self._respond(r, now, "error")

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        f = self.f
        t, keys = self._stream()
        if self.d.bloom:
            self.filter = KeyFilter(f.n_keys + len(t), self.d.bloom_fp_rate)
            self.filter.update(range(f.n_keys))
            self.filter.update(int(k) for k in keys if NOVEL <= k < INVALID)  # the catalogue knows new items
        self._warm()
        for ti, k in zip(t.tolist(), keys.tolist()):
            self.loop.at(ti, self._attempt, _Request(k, ti, 0, False))
        self.loop.run()
        self.down.finish_accounting()
        return self._summary(len(t))

    def _summary(self, n: int) -> dict:
        f, c, down = self.f, self.counts, self.down
        lat = np.asarray(self.lat)
        lat_t = np.asarray(self.lat_t)
        nb = int(math.ceil(f.duration_s))
        bins = np.minimum(lat_t.astype(np.int64), nb - 1)
        req_per_s = np.bincount(bins, minlength=nb)
        hits_per_s = np.bincount(np.minimum(np.asarray(self.hit_t, np.int64), nb - 1), minlength=nb)
        p99_per_s = np.zeros(nb)
        order = np.argsort(bins, kind="stable")
        edges = np.searchsorted(bins[order], np.arange(nb + 1))
        for b in range(nb):
            x = lat[order[edges[b]:edges[b + 1]]]
            p99_per_s[b] = np.percentile(x, 99) if len(x) else np.nan
        hit_rate_s = np.where(req_per_s > 0, hits_per_s / np.maximum(req_per_s, 1), np.nan)
        peak_s = np.array([down.peak_per_bin.get(b, 0) for b in range(nb)])
        calls_s = np.array([down.calls_per_bin.get(b, 0) for b in range(nb)])
        served = max(1, len(lat))
        first_misses = n - c["hit"] - c["stale"]
        return {
            "requests": n, "answered": len(lat),
            "hit_rate": c["hit"] / served, "stale_ratio": (c["stale"] + c["stale_on_error"]) / served,
            "error_rate": c["error"] / served, "refused_unknown": c["refused_unknown"],
            "not_found": c["not_found"], "attempts_per_request": c["attempts"] / served,
            "downstream_calls": down.calls, "downstream_refused": down.refused, "refreshes": c["refreshes"],
            "retry_amplification": c["attempts"] / served, "calls_per_miss": down.calls / max(1, first_misses),
            "peak_in_flight": int(down.peak), "limit": int(f.workers),
            "queueing_s": round(down.over_s, 3),
            "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
            "p999_ms": float(np.percentile(lat, 99.9) * 1e3),
            "worst_second_p99_ms": float(np.nanmax(p99_per_s) * 1e3),
            "min_second_hit_rate": float(np.nanmin(hit_rate_s)),
            "breaker_opens": self.breaker.opens if self.breaker is not None else 0,
            "timeline": {"hit_rate": hit_rate_s.tolist(), "p99_ms": (p99_per_s * 1e3).tolist(),
                         "peak_in_flight": peak_s.tolist(), "calls": calls_s.tolist()},
        }


def run_scenario(scenario: str, f: FailuresConfig | None = None, d: DefencesConfig | None = None,
                 configs: tuple[str, ...] = ("off",) + DEFENCES + ("defaults",)) -> dict:
    """The scenario's calm twin with the defaults (the steady state), then the scenario under each set of
    defences. Returns {scenario, steady, runs: {config: summary}, seconds}."""
    f = f or FailuresConfig()
    d = d or DefencesConfig()
    t0 = time.perf_counter()
    steady = FailureSim(scenario, f, d, calm=True).run()
    runs = {}
    for name in configs:
        runs[name] = FailureSim(scenario, f, defences(name, d)).run()
        runs[name]["p99_vs_steady"] = runs[name]["p99_ms"] / steady["p99_ms"]
        log.info("%s / %s: hit rate %.3f, p99 %.0f ms (%.1fx steady), peak in flight %d of %d", scenario, name,
                 runs[name]["hit_rate"], runs[name]["p99_ms"], runs[name]["p99_vs_steady"],
                 runs[name]["peak_in_flight"], f.workers)
    return {"scenario": scenario, "steady": steady, "runs": runs, "seconds": round(time.perf_counter() - t0, 1)}


# ---------------------------------------------------------------------------------------------- report
#: One colour per set of defences, the same in every plot.
COLOURS = {"off": "black", "single_flight": "tab:blue", "bloom": "tab:orange", "ttl_jitter": "tab:olive",
           "early_refresh": "tab:red", "serve_stale": "tab:purple", "swr": "tab:brown", "breaker": "tab:pink",
           "defaults": "tab:green", "steady": "tab:gray"}
LABELS = {"off": "all defences off", "single_flight": "single-flight alone", "bloom": "Bloom filter alone",
          "ttl_jitter": "TTL jitter alone", "early_refresh": "early refresh (XFetch) alone",
          "serve_stale": "serve-stale-on-error alone", "swr": "stale-while-revalidate alone",
          "breaker": "circuit breaker alone", "defaults": "defaults (all on)", "steady": "steady state (calm, defaults)"}


def describe(scenario: str, f: FailuresConfig) -> str:
    trig = {"penetration": f"{f.flood_rate:g} req/s for keys that do not exist from {f.trigger_s:g} s for {f.flood_s:g} s",
            "breakdown": f"a key with {f.hot_share:.0%} of the traffic, {f.hot_median_s:g} s to compute, TTL {f.hot_ttl_s:g} s",
            "avalanche": f"every entry written together, expiring at {f.trigger_s:g} s"}[scenario]
    return (f"{scenario}: {trig}; {f.rate:g} req/s {f.arrivals} over {f.n_keys} keys (Zipf {f.zipf_s:g}, "
            f"{f.novel_frac:.0%} never-seen), TTL {f.ttl_s:g} s, service {f.workers} workers + queue {f.queue_limit}, "
            f"lognormal {f.service_median_s * 1e3:g} ms median (sigma {f.service_sigma:g}), timeout {f.timeout_s:g} s, "
            f"{f.retries} retries, {f.duration_s:g} s simulated")


def markdown(res: dict, f: FailuresConfig) -> str:
    st = res["steady"]
    lines = [f"Scenario {describe(res['scenario'], f)}.", "",
             f"| defences | hit rate | stale served | errors | attempts / request | service calls | peak in flight "
             f"(limit {f.workers}) | time queueing s | p50 ms | p99 ms | p99 / steady | worst 1-s p99 ms | "
             f"lowest 1-s hit rate |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def row(name, r, ratio):
        return (f"| {LABELS[name]} | {r['hit_rate']:.3f} | {r['stale_ratio']:.3f} | {r['error_rate']:.4f} | "
                f"{r['retry_amplification']:.2f} | {r['downstream_calls']:,} | {r['peak_in_flight']} | "
                f"{r['queueing_s']:.1f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {ratio} | "
                f"{r['worst_second_p99_ms']:.0f} | {r['min_second_hit_rate']:.2f} |")

    lines.append(row("steady", st, "1.0"))
    for name, r in res["runs"].items():
        lines.append(row(name, r, f"{r['p99_vs_steady']:.1f}"))
    return "\n".join(lines)


def plot(res: dict, f: FailuresConfig, path, title: str = "") -> None:
    """Per simulated second: hit rate, the service's peak calls in flight (with its limit) and the p99,
    one line per set of defences."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ushash.core.io import save_figure

    fig, axes = plt.subplots(3, 1, figsize=(11, 9), dpi=100, sharex=True)
    runs = {"steady": res["steady"], **res["runs"]}
    x = np.arange(int(math.ceil(f.duration_s))) + 0.5
    for name, r in runs.items():
        tl = r["timeline"]
        lw, ls = (2.4, "-") if name in ("off", "defaults") else ((1.2, ":") if name == "steady" else (1.0, "-"))
        kw = dict(color=COLOURS[name], lw=lw, ls=ls, label=LABELS[name], alpha=0.9)
        axes[0].plot(x, tl["hit_rate"], **kw)
        axes[1].plot(x, np.maximum(tl["peak_in_flight"], 0.8), **kw)
        axes[2].plot(x, tl["p99_ms"], **kw)
    axes[1].axhline(f.workers, color="red", ls="--", lw=1)
    axes[1].annotate(f"limit {f.workers}", (x[-1], f.workers), color="red", fontsize=8, ha="right", va="bottom")
    st = res["steady"]["p99_ms"]
    axes[2].axhline(2 * st, color="red", ls="--", lw=1)
    axes[2].annotate(f"2x steady p99 ({2 * st:.0f} ms)", (x[-1], 2 * st), color="red", fontsize=8, ha="right",
                     va="bottom")
    axes[0].set_ylabel("fresh hit rate")
    axes[1].set_ylabel("service calls in flight\n(peak per second)")
    axes[2].set_ylabel("client p99 ms (per second)")
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("simulated seconds")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.axvline(f.trigger_s, color="grey", lw=0.8)
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    import textwrap

    fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def run_failures(cfg) -> dict:
    """python -m ushash.cachesim scenario=<name|all>: every scenario's runs, written to `out` (default
    experiments/cachesim/scenario-<name>-<digest of the settings>): <scenario>.json, .md and .png."""
    from pathlib import Path

    from ushash.config import to_dict
    from ushash.core.io import atomic_write, settings_digest, write_json

    f = FailuresConfig(**to_dict(cfg.failures))
    d = DefencesConfig(**to_dict(cfg.defences))
    names = SCENARIOS if cfg.scenario == "all" else (str(cfg.scenario),)
    for n in names:
        if n not in SCENARIOS + POLICY_RUNS:
            raise ValueError(f"unknown scenario {n!r}; choose all or one of {SCENARIOS + POLICY_RUNS}")
        if n in SCENARIOS:
            check_failures_settings(f, n)  # before any run writes its results
    if cfg.scenario in POLICY_RUNS:
        # the policy runs are set in ushash/sim/policies.py: failures.* and defences.* (its seed too) changed
        # nothing of them, yet named another output folder
        if f != FailuresConfig() or d != DefencesConfig():
            raise ValueError(f"scenario={cfg.scenario} takes no failures.* or defences.* settings (its runs are set in "
                             f"ushash/sim/policies.py); drop those overrides")
        settings = {"scenario": str(cfg.scenario)}
    else:
        settings = {"scenario": str(cfg.scenario), "failures": dataclasses.asdict(f), "defences": dataclasses.asdict(d)}
    digest = settings_digest(settings, 10)
    name = f"scenario-{cfg.scenario}-{digest}"
    out = Path(cfg.out) if cfg.get("out") else Path(cfg.paths.experiments_dir) / "cachesim" / name
    out = out if out.is_absolute() else Path(cfg.paths.root) / out
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for n in names:
        if n in POLICY_RUNS:  # the adaptive policies against their fixed alternatives (ushash/sim/policies.py)
            from ushash.sim.policies import run_policy
            results[n] = run_policy(n, out, name)
            log.info("%s\n%s", n, (out / f"{n}.md").read_text())
            continue
        res = run_scenario(n, f, d)
        table = markdown(res, f)
        write_json(out / f"{n}.json", {"settings": settings, **res})
        atomic_write(out / f"{n}.md", table + "\n")
        plot(res, f, out / f"{n}.png", title=f"{describe(n, f)}; run {name}")
        log.info("%s\n%s", n, table)
        results[n] = res
    log.info("wrote %s", out)
    return {"out": str(out), "results": results, "score": None}
