"""Sweep plots (matplotlib, Agg backend, PNG) from the aggregated `results.json` of `ushash.sweep`.

- map_vs_bits.png: tie-aware mAP@10 (mean over directions, mean ± std over seeds) against code length, per
  protocol; float methods are horizontal dashed lines (they have no bits). With one code length swept, a bar
  per method instead.
- pr_hamming_<bits>b.png: precision-recall in Hamming ranking (one point per radius 0..bits), per protocol.
- precision_h2.png: precision within Hamming radius 2 (empty retrieval = 0) against code length.
- p_at_k_<bits>b.png: P@K against K at one code length, codes and floats.
Every figure names its experiment, protocol, dataset and split in its title; a method has one colour in
every figure of every experiment (`colour`); the legend sits below the axes, off the data; error bars are
clipped to [0, 1].
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ushash.core.io import save_figure  # noqa: E402

_STYLE = {"float": dict(linestyle="--"), "codes": dict(linestyle="-", marker="o", markersize=4)}


def _series(agg: dict, metric: str, protocol: str, direction: str = "mean") -> dict:
    """method -> sorted [(bits, mean, std)] from summary[method][bits][protocol][metric][direction]."""
    out: dict = {}
    for m, by_bits in agg["summary"].items():
        for bits, by_p in by_bits.items():
            cell = by_p.get(protocol, {}).get(metric, {}).get(direction)
            if cell is not None:
                out.setdefault(m, []).append((int(bits), cell[0], cell[1]))
    return {m: sorted(v) for m, v in out.items()}


def _swept_bits(agg: dict) -> list[int]:
    return sorted({int(b) for m, by_bits in agg["summary"].items() if agg["methods"][m]["output"] == "codes"
                   for b in by_bits})


# one colour per method, the same in every figure (tab10 + tab20's dark half for the rest, by name)
METHOD_COLOURS = {"ushash": "#d62728", "ushash_float": "#ff9896", "pairwise": "#9467bd", "csq": "#8c564b",
                  "orthohash": "#e377c2", "itq": "#1f77b4", "pca_rotation": "#17becf", "pca_sign": "#bcbd22",
                  "lsh": "#7f7f7f", "float": "#2ca02c"}


def colour(method: str):
    if method in METHOD_COLOURS:
        return METHOD_COLOURS[method]
    import zlib
    return plt.get_cmap("tab20b")(zlib.crc32(method.encode()) % 20)


def _colours(agg: dict) -> dict:
    return {m: colour(m) for m in agg["methods"]}


def _title(agg: dict, what: str, protocol: str) -> str:
    return f"{what}\n{agg.get('experiment', '')}: {agg['dataset']} test, {agg['encoder']['name']}; protocol: {protocol}"


def _err(mu, sd):
    """Error bars of ± sd clipped to [0, 1] (a score is never below 0 or above 1)."""
    mu, sd = np.asarray(mu, float), np.asarray(sd, float)
    return np.vstack([np.minimum(sd, mu), np.minimum(sd, 1 - mu)])


def _legend(fig, axes) -> None:
    """One legend for the figure, below the axes, so it never covers a curve."""
    handles: dict = {}
    for ax in axes:
        for h, l in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(l, h)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(4, len(handles)), fontsize=7,
                   frameon=False)


def _grid(n: int):
    fig, axes = plt.subplots(1, n, figsize=(6.2 * n, 4.6), squeeze=False)
    return fig, axes[0]


def _save(fig, path: Path, axes=None) -> Path:
    n = len({l for ax in (axes if axes is not None else fig.axes) for l in ax.get_legend_handles_labels()[1]})
    fig.tight_layout(rect=(0, 0.05 + 0.045 * -(-n // 4), 1, 1))
    if axes is not None:
        _legend(fig, axes)
    return save_figure(fig, path, dpi=72)


def _vs_bits(agg: dict, out: Path, metric: str, label: str, fname: str, codes_only: bool = False) -> Path | None:
    protocols = list(agg["protocols"])
    if not any(_series(agg, metric, p) for p in protocols):
        return None
    col = _colours(agg)
    fig, axes = _grid(len(protocols))
    all_bits = _swept_bits(agg)
    for ax, p in zip(axes, protocols):
        series = {m: pts for m, pts in _series(agg, metric, p).items()
                  if not (codes_only and agg["methods"][m]["output"] == "float")}
        if len(all_bits) <= 1:  # one code length: a bar per method, no line with one point
            names = list(series)
            mu = [float(np.mean([v for _, v, _ in series[m]])) for m in names]
            sd = [float(np.mean([e for _, _, e in series[m]])) for m in names]
            ax.barh(range(len(names)), mu, xerr=_err(mu, sd), color=[col[m] for m in names], capsize=3)
            ax.set_yticks(range(len(names)), [agg["methods"][m]["title"] for m in names], fontsize=7)
            ax.invert_yaxis()
            ax.set_xlabel(label)
            bits_txt = f"{all_bits[0]} bits" if all_bits else "floats"
            ax.set_title(_title(agg, f"{label} at {bits_txt}, mean over directions", p), fontsize=9)
            ax.grid(alpha=0.3, axis="x")
            continue
        for m, pts in series.items():
            meta = agg["methods"][m]
            if meta["output"] == "float" and meta["kind"] == "fitted":  # no bits: one horizontal line
                ax.axhline(float(np.mean([v for _, v, _ in pts])), color=col[m], label=meta["title"], **_STYLE["float"])
                continue
            b, mu, sd = (np.array(x) for x in zip(*pts))
            ax.errorbar(b, mu, yerr=_err(mu, sd), color=col[m], label=meta["title"], capsize=3, **_STYLE[meta["output"]])
        ax.set_xscale("log", base=2)
        if all_bits:
            ax.set_xticks(all_bits, [str(b) for b in all_bits])
        ax.set_xlabel("bits")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.set_title(_title(agg, f"{label} vs code length (mean over directions)", p), fontsize=9)
        ax.grid(alpha=0.3)
    return _save(fig, out / fname, axes if len(all_bits) > 1 else [])


def plot_pr(agg: dict, out: Path, bits: int) -> Path | None:
    protocols = list(agg["protocols"])
    col = _colours(agg)
    have = [(m, c[str(bits)]) for m, c in agg["curves"].items() if str(bits) in c]
    if not any("pr" in v for _, c in have for v in c.values()):
        return None
    fig, axes = _grid(len(protocols))
    for ax, p in zip(axes, protocols):
        for m, c in have:
            pr = c.get(p, {}).get("pr")
            if pr:
                ax.plot(pr["recall"], pr["precision"], color=col[m], label=agg["methods"][m]["title"], marker=".",
                        markersize=3)
        ax.set_xlabel("recall")
        ax.set_ylabel("precision")
        ax.set_xlim(0, 1.02)
        ax.set_ylim(0, 1.02)
        ax.set_title(_title(agg, f"PR in Hamming ranking, {bits} bits (radius 0..{bits})", p), fontsize=9)
        ax.grid(alpha=0.3)
    return _save(fig, out / f"pr_hamming_{bits}b.png", axes)


def plot_p_at_k(agg: dict, out: Path, bits: int) -> Path | None:
    protocols = list(agg["protocols"])
    col = _colours(agg)
    have = [(m, c[str(bits)]) for m, c in agg["curves"].items() if str(bits) in c]
    if not have:
        return None
    fig, axes = _grid(len(protocols))
    for ax, p in zip(axes, protocols):
        for m, c in have:
            pk = c.get(p, {}).get("p_at_k")
            if pk:
                ks = sorted(pk, key=int)
                style = _STYLE[agg["methods"][m]["output"]]
                ax.plot([int(k) for k in ks], [pk[k] for k in ks], color=col[m], label=agg["methods"][m]["title"], **style)
        ax.set_xscale("log")
        ax.set_xlabel("K")
        ax.set_ylabel("P@K")
        ax.set_title(_title(agg, f"P@K, {bits} bits (floats: no bits)", p), fontsize=9)
        ax.grid(alpha=0.3)
    return _save(fig, out / f"p_at_k_{bits}b.png", axes)


def plot_all(agg: dict, out: str | Path, bits: int | None = None) -> list[Path]:
    """Every plot of one aggregated sweep; the per-length plots at `bits` (default: 64 if swept, else the
    largest length swept)."""
    out = Path(out)
    swept = _swept_bits(agg)
    if bits is None or bits not in swept:
        bits = 64 if 64 in swept else (swept[-1] if swept else None)
    made = [_vs_bits(agg, out, "tie_map@10", "mAP@10 (tie-aware)", "map_vs_bits.png"),
            _vs_bits(agg, out, "p_h2", "precision within Hamming radius 2", "precision_h2.png", codes_only=True)]
    if bits is not None:
        made += [plot_pr(agg, out, bits), plot_p_at_k(agg, out, bits)]
    return [p for p in made if p is not None]
