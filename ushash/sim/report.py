"""The simulator's report: the run's description, the markdown table, results.json and the sweep plot."""

from __future__ import annotations

import logging
from pathlib import Path

from ushash.config import to_dict
from ushash.core.io import atomic_write, save_figure, settings_digest, write_json

log = logging.getLogger(__name__)


def run_info(cfg, head, pool, dataset: str, cache_cfg: dict, seconds: float) -> dict:
    """What the run was: dataset, head, pool and stream, the cache settings and the replay time."""
    return {"dataset": dataset, "split": str(cfg.split), "revision": head.revision, "bits": int(head.bits),
            "encoder": {"name": head.encoder.name, "fingerprint": head.encoder.fingerprint},
            "classes": int(len(set(pool.cls))), "pool": len(pool), "pool_kinds": pool.counts("kind"),
            "modalities": pool.counts("modality"),
            "variants": pool.variant_note, "stream": to_dict(cfg.stream), "cache": cache_cfg,
            "cosine_threshold": float(cfg.cosine_threshold), "raw_media": bool(cfg.raw_media),
            "replay_seconds": round(seconds, 1)}


#: Settings that do not change a run's results: where things are, how it is shown. Everything else in the
#: config defines the run, and goes into its folder's name.
NOT_DEFINING = ("paths", "out", "progress", "export", "ckpt", "features_dir")


def run_settings(cfg, dataset: str, revision: str, pool: str | None = None) -> dict:
    """Everything that defines a run's results: the config without NOT_DEFINING, plus the dataset, the head's
    revision (which the export path or checkpoint only point to) and the digest of the pool replayed
    (`Pool.digest`: the feature store's rows, which `features_dir` only points to; two stores of one data set
    once shared a folder, the later run overwriting the earlier one's results)."""
    d = {k: v for k, v in to_dict(cfg).items() if k not in NOT_DEFINING}
    return {**d, "dataset": dataset, "revision": str(revision), **({"pool": pool} if pool else {})}


def run_name(cfg, dataset: str, revision: str, pool: str | None = None) -> str:
    """A readable name and a digest of every defining setting: <dataset>-<revision>[-raw][-norev]
    [-<scenario>]-<digest of run_settings>. Two runs share a folder only if every defining setting is equal."""
    settings = run_settings(cfg, dataset, revision, pool)
    digest = settings_digest(settings, 10)
    parts = [dataset, str(revision)]
    if settings.get("raw_media"):
        parts.append("raw")
    if not float((settings.get("stream") or {}).get("revision_change_at") or 0):
        parts.append("norev")
    if settings.get("scenario"):
        parts.append(str(settings["scenario"]))
    return "-".join(parts + [digest])


def output_dir(cfg, dataset: str, revision: str, pool: str | None = None) -> Path:
    """`out`, or experiments/cachesim/<run_name>; a relative path is taken from paths.root."""
    out = Path(cfg.out) if cfg.get("out") else Path(cfg.paths.experiments_dir) / "cachesim" / run_name(
        cfg, dataset, revision, pool)
    return out if out.is_absolute() else Path(cfg.paths.root) / out


def revision_label(stream: dict, where: str = "") -> str:
    """"revision change at 50%{where}", or "no revision change" (revision_change_at 0)."""
    at = float(stream.get("revision_change_at") or 0)
    return f"revision change at {at:.0%}{where}" if at else "no revision change"


def ttl_label(ttl_s) -> str:
    """"TTL 7200 s", or "no TTL (...)" where 0 or None means no expiry (the caches' rule, Freshness)."""
    if not ttl_s:
        return "no TTL (entries never expire)"
    ttl = float(ttl_s)
    return f"TTL {int(ttl) if ttl.is_integer() else ttl} s"   # the typed cache schema makes it a float


def run_title(info: dict, name: str) -> str:
    """A plot title that names the run: data, head, variants, stream and the run's folder name."""
    st = info["stream"]
    rev = revision_label(st)
    media = "raw media" if info.get("raw_media") else "feature perturbations"
    return (f"{info['dataset']}/{info['split']}, {info['bits']}-bit head {info['revision']}, {media}, {rev}, "
            f"Zipf s={st['zipf_s']}, {st['n_requests']} requests\nrun {name}")


def markdown(info: dict, rows: list[dict]) -> str:
    st = info["stream"]
    lines = [f"Stream: {st['n_requests']} requests over {info['classes']} classes ({info['dataset']}/{info['split']}), "
             f"Zipf s={st['zipf_s']}, pool {info['pool']} requests {info['pool_kinds']}, "
             f"{revision_label(st, ' of the stream')}, {ttl_label(info['cache'].get('ttl_s'))} "
             f"at {st['seconds_per_request']} s/request. Variants: {info['variants']}.", "",
             "| method | setting | hit rate | correct, fresh hit rate | false hits / requests | false hits / hits | "
             "oracle hit rate | misses with a correct nearest entry | stale hits | lookup p50 µs | p99 µs | peak bytes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['param']} | {r['hit_rate']:.3f} | {r['valid_hit_rate']:.3f} | "
                     f"{r['false_hit_rate']:.4f} | "
                     f"{r['false_per_hit']:.4f} | {r['oracle_hit_rate']:.3f} | {r['misses_nn_correct']:.3f} | "
                     f"{r['stale_hits']} | {r['lookup_p50_us']:.0f} | {r['lookup_p99_us']:.0f} | {r['peak_bytes']:,} |")
    return "\n".join(lines)


def plot_sweep(sweep: dict, rows: list[dict], path: Path, title: str = "") -> None:
    """Left: hit rate against false-hit rate for every sweep (labels: radius or threshold); right: the
    same with only correct hits from fresh entries on the y axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5), dpi=110, sharex=True)
    for ax, key, ylabel in ((axes[0], "hit_rate", "hit rate (hits / requests)"),
                            (axes[1], "valid_hit_rate", "correct hits from fresh entries / requests")):
        for name, pts in sweep.items():
            x = [p["false_hit_rate"] for p in pts]
            y = [p[key] for p in pts]
            ax.plot(x, y, marker="o", ms=3, label=name)
            for p in pts:
                lab = p.get("radius", p.get("threshold"))
                ax.annotate(f"{lab:g}", (p["false_hit_rate"], p[key]), fontsize=6, xytext=(2, 2),
                            textcoords="offset points")
        for r in rows:
            if r["method"].startswith("exact"):
                ax.plot([r["false_hit_rate"]], [r[key]], "k*", ms=9, label=r["method"])
        if rows:
            ax.axhline(rows[0]["oracle_hit_rate"], color="grey", ls=":", lw=1, label="oracle hit rate")
        ax.set_xlabel("false-hit rate (false hits / requests)")
        ax.set_ylabel(ylabel)
        ax.set_xscale("symlog", linthresh=1e-3)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle(title + "  (point labels: Hamming radius or cosine threshold)", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def write_report(out: Path, info: dict, rows: list[dict], sweep: dict, title: str = "", settings: dict | None = None) -> str:
    """results.json ({info, rows, sweep, settings}), results.md (the table) and sweep.png in `out`; returns
    the table. `settings`: what defines the run (run_settings), kept beside its results."""
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(info, rows)
    write_json(out / "results.json", {"info": info, "rows": rows, "sweep": sweep, "settings": settings or {}})
    atomic_write(out / "results.md", table + "\n")
    plot_sweep(sweep, rows, out / "sweep.png", title=title)
    log.info("%s", table)
    log.info("wrote %s/results.json, results.md, sweep.png", out)
    return table
