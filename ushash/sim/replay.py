"""Replay: a stream through one cache under test, the sweeps over its settings, and the whole run.

`replay` is the accounting of one pass; `sweep` replays the same stream once per setting; `run_cachesim`
builds the head, pool and stream from the config, sweeps every configured cache and writes the report.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np
from omegaconf import DictConfig
from tqdm.auto import tqdm

from ushash.config import to_dict
from ushash.serving.cache import CacheConfig
from ushash.sim.adapters import CacheUnderTest, CosineCache, ExactKeyCache, LSHCodesCache, USHashCache
from ushash.sim.config import check_replay_settings
from ushash.sim.pool import Pool, build_pool
from ushash.sim.report import output_dir, run_info, run_settings, run_title, write_report
from ushash.sim.stream import SimClock, make_stream, revision_change_index

log = logging.getLogger(__name__)

EXACT = "exact key (sha256 of normalised input)"


def replay(cache: CacheUnderTest, stream: np.ndarray, pool: Pool, clock: SimClock, seconds_per_request: float = 1.0,
           revision_change_at: float = 0.0, progress: bool = False, desc: str | None = None) -> dict:
    """Replay `stream` (pool indices) through `cache` as it is (reset it first for an empty one): a miss
    stores the request's pool index as its answer, and a hit is correct when the served answer's member is
    equivalent to the request (same class or same source input: `Pool.source_ids`, the rule of calibration
    and of every other false-hit count). The clock advances `seconds_per_request` per request and is put back at
    the end; a new revision is deployed at `revision_change_at` of the stream (0: never)."""
    cls = np.asarray(pool.cls)
    src = pool.source_ids()

    def equivalent(a: int, b: int) -> bool:
        return cls[a] == cls[b] or src[a] == src[b]

    n = len(stream)
    change = revision_change_index(n, revision_change_at)
    t0 = clock.t
    hits = correct = false = stale = valid = miss_nn_right = misses_with_entries = 0
    oracle = 0
    seen: set[tuple[str, int]] = set()
    lat = np.zeros(n)
    peak = 0
    requests = tqdm(stream.tolist(), desc=desc, unit="req", leave=False, disable=not progress)
    try:
        for t, i in enumerate(requests):
            clock.t = t0 + t * seconds_per_request
            if t == change:
                cache.new_revision()
                seen = set()  # after a model change nothing valid is cached: the oracle starts over
            mine = {("cls", int(cls[i])), ("src", int(src[i]))}
            oracle += not seen.isdisjoint(mine)
            seen |= mine
            s = time.perf_counter()
            out = cache.lookup(i)
            lat[t] = time.perf_counter() - s
            if out.hit:
                hits += 1
                right = equivalent(out.value, i)
                correct += right
                false += not right
                stale += out.stale
                valid += right and not out.stale
            else:
                nv = cache.nearest_value(i)
                if nv is not None:
                    misses_with_entries += 1
                    miss_nn_right += equivalent(nv, i)
                cache.store(i, i)
            if t % 256 == 0 or t + 1 in (change, n):  # and the last state before a revision change, and the end
                peak = max(peak, cache.nbytes)  # on the replay's clock: the baselines count entries by expiry
    finally:
        requests.close()
        clock.t = t0
    return {"requests": n, "hit_rate": hits / n, "false_hit_rate": false / n,
            "false_per_hit": false / hits if hits else 0.0, "correct_hit_rate": correct / n,
            "valid_hit_rate": valid / n,
            "oracle_hit_rate": oracle / n, "stale_hits": int(stale),
            "misses_nn_correct": miss_nn_right / max(1, n - hits),
            "misses_nn_correct_of_nonempty": miss_nn_right / max(1, misses_with_entries),
            "lookup_p50_us": float(np.percentile(lat, 50) * 1e6), "lookup_p99_us": float(np.percentile(lat, 99) * 1e6),
            "peak_bytes": int(peak)}


def sweep(cache: CacheUnderTest, method: str, points: list[tuple[str, dict, dict]], stream: np.ndarray, pool: Pool,
          clock: SimClock, **replay_kw) -> list[dict]:
    """One replay per point (param: the setting as the report shows it, settings: passed to `cache.reset`,
    keys: copied into the result, e.g. {"radius": 3}); returns the results {method, param, **keys, **metrics}."""
    results = []
    for param, settings, keys in points:
        cache.reset(**settings)
        results.append({"method": method, "param": param, **keys,
                        **replay(cache, stream, pool, clock, desc=f"{method}, {param}", **replay_kw)})
    return results


@contextlib.contextmanager
def open_head(cfg: DictConfig) -> Iterator:
    """The head under test: `export` loaded, or `ckpt` exported to a temporary folder that is removed
    when the block ends (whether it ends normally or not)."""
    from ushash.serving.artifact import load_export

    if cfg.get("export"):
        p = Path(str(cfg.export))
        yield load_export(p if p.is_absolute() else Path(cfg.paths.root) / p)
        return
    if not cfg.get("ckpt"):
        raise ValueError("cachesim needs export=<export dir> (python -m ushash.export) or ckpt=<checkpoint>")
    from ushash.hashing.module import load_checkpoint
    from ushash.serving.export import write_export

    module = load_checkpoint(cfg.ckpt)
    prov = module.hparams.provenance or {}
    with tempfile.TemporaryDirectory(prefix="ushash-cachesim-") as tmp:
        path = write_export(module.model.eval(), Path(tmp) / "export", prov.get("encoder") or {},
                            source={k: prov.get(k) for k in ("dataset", "data", "encoder", "features_dir", "stores")})
        yield load_export(path)


def run_cachesim(cfg: DictConfig, head=None, pool: Pool | None = None) -> dict:
    """Build the stream, replay it through every configured cache and sweep point; write the report.
    Returns {out, info, rows, sweep, table, score}; score: US-HASH's hit rate (with the payload check) at
    cache.radius, None when the US-HASH cache is not among `methods`."""
    if cfg.get("scenario"):  # the failure scenarios: no head, simulated time (ushash/sim/failures.py)
        from ushash.sim.failures import run_failures
        return run_failures(cfg)
    check_replay_settings(cfg)
    with contextlib.ExitStack() as stack:
        if head is None:
            head = stack.enter_context(open_head(cfg))
        return _run(cfg, head, pool)


def _run(cfg: DictConfig, head, pool: Pool | None) -> dict:
    dataset = cfg.get("dataset") or (head.manifest.get("source") or {}).get("dataset") or "given"
    if pool is None:
        pool, dataset = build_pool(cfg, head)
    st = cfg.stream
    stream = make_stream(pool, int(st.n_requests), float(st.zipf_s), int(st.seed))
    clock = SimClock()
    cache_cfg = {**to_dict(cfg.cache), "l2": None}
    ttl = cache_cfg.get("ttl_s")
    jitter = float(cache_cfg.get("ttl_jitter", CacheConfig.ttl_jitter))   # the baselines expire as the code caches do
    kw = dict(seconds_per_request=float(st.seconds_per_request), revision_change_at=float(st.revision_change_at),
              progress=bool(cfg.get("progress", True)))
    radius, thr = int(cache_cfg["radius"]), float(cfg.cosine_threshold)
    radii = sorted(set([int(r) for r in cfg.sweep.radii] + [radius]))
    methods = list(cfg.methods)
    rows, sweeps = [], {}
    score = None

    def by_radius(cache, method, payload_check):
        pts = sweep(cache, method, [(f"radius {r}", dict(radius=r, observe_radius=r, payload_check=payload_check),
                                     {"radius": r}) for r in radii], stream, pool, clock, **kw)
        sweeps[method] = pts
        rows.append(next(p for p in pts if p["radius"] == radius))
        return rows[-1]

    t0 = time.perf_counter()
    if "exact" in methods:
        rows += sweep(ExactKeyCache(pool, clock, ttl, jitter), EXACT, [("-", {}, {})], stream, pool, clock, **kw)
    if "cosine" in methods:
        ths = sorted(set([float(x) for x in cfg.sweep.thresholds] + [thr]), reverse=True)
        pts = sweep(CosineCache(head, pool, clock, ttl, threshold=thr, ttl_jitter=jitter),
                    f"float z cosine (GPTCache-like, {head.dim}-d fp32)",
                    [(f"cos >= {th:g}", {"threshold": th}, {"threshold": th}) for th in ths], stream, pool, clock, **kw)
        sweeps["float z cosine"] = pts
        rows.append(next(p for p in pts if p["threshold"] == thr))
    if "lsh" in methods or "lsh_codes_only" in methods:
        lsh = LSHCodesCache(head, pool, cache_cfg, clock, seed=int(st.seed))
        if "lsh" in methods:
            by_radius(lsh, f"LSH {head.bits}-bit codes of z + payload check", True)
        if "lsh_codes_only" in methods:
            by_radius(lsh, f"LSH {head.bits}-bit codes of z only", False)
    if "ushash" in methods:
        us = USHashCache(head, pool, cache_cfg, clock)
        score = by_radius(us, f"US-HASH {head.bits}-bit codes + payload check", True)["hit_rate"]
        if "ushash_codes_only" in methods:
            by_radius(us, f"US-HASH {head.bits}-bit codes only", False)
        if cfg.sweep.get("payload_thresholds"):
            # the other knob: the payload cosine threshold at the configured radius
            ths = sorted(float(x) for x in cfg.sweep.payload_thresholds)
            sweeps[f"US-HASH radius {radius}, payload threshold t"] = sweep(
                us, f"US-HASH radius {radius} + payload cos >= t",
                [(f"payload cos >= {th:g}", dict(payload_check=True, payload_threshold=th), {"threshold": th})
                 for th in ths], stream, pool, clock, **kw)
    info = run_info(cfg, head, pool, dataset, cache_cfg, time.perf_counter() - t0)
    replayed = pool.digest()
    out = output_dir(cfg, dataset, head.revision, replayed)
    table = write_report(out, info, rows, sweeps, title=run_title(info, out.name),
                         settings=run_settings(cfg, dataset, head.revision, replayed))
    return {"out": str(out), "info": info, "rows": rows, "sweep": sweeps, "table": table, "score": score}
