"""Tables of results, as markdown: `ushash.eval`'s per-direction table and a sweep's results.md.

Every table names its protocol, its mAP denominator and how ties are counted (metrics.TIE_DOC: the
tie-aware expectation is the headline, the tie-broken value is shown beside it)."""

from __future__ import annotations

import numpy as np

from ushash.core import metrics
from ushash.evaluation.retrieval import DENOMINATOR_DOC

ROW_METRICS = ("tie_map@10", "map@10", "tie_R@1", "tie_R@10", "tie_P@10")   # from retrieval.evaluate rows
METRICS = (*ROW_METRICS, "p_h2")
METRIC_NAMES = {"tie_map@10": "mAP@10", "map@10": "mAP@10 (tie-broken)", "tie_R@1": "R@1", "tie_R@10": "R@10",
                "tie_P@10": "P@10", "p_h2": "P@H≤2"}




def eval_tables(rows: list[dict], k: int = 10, title: str | None = None) -> str:
    """Per protocol: one line per (method, direction) with tie-aware mAP@k, the tie-broken mAP@k, R@1, R@5 and
    R@10 (tie-aware) and the query count; then one line per method with the means over directions."""
    out = []
    if title:
        out.append(f"### {title}\n")
    for protocol in sorted({r["protocol"] for r in rows}, key=lambda p: p != "paired"):
        prow = [r for r in rows if r["protocol"] == protocol]
        den = prow[0]["denominator"]
        tie = f"tie_map@{k}" in prow[0]
        out.append(f"Protocol: **{protocol}** relevance, mAP@{k} with {DENOMINATOR_DOC.get(den, den)}; "
                   + (f"{metrics.TIE_DOC}; tie-broken: ties by ascending database index.\n" if tie else
                      "ties broken by ascending database index.\n"))
        cols = ([(f"tie_map@{k}", f"mAP@{k}"), (f"map@{k}", f"mAP@{k} tie-broken")] if tie else [(f"map@{k}", f"mAP@{k}")])
        cols += [(f"tie_R@{K}" if tie else f"R@{K}", f"R@{K}") for K in (1, 5, 10) if f"R@{K}" in prow[0]]
        out.append("| method | direction | " + " | ".join(c for _, c in cols) + " | queries |")
        out.append("|---|---|" + "---|" * (len(cols) + 1))
        for name in dict.fromkeys(r["method"] for r in prow):
            mr = [r for r in prow if r["method"] == name]
            for r in mr:
                out.append(f"| {name} | {r['direction']} | " + " | ".join(f"{r[key]:.3f}" for key, _ in cols)
                           + f" | {r['n_queries']} |")
            out.append(f"| {name} | **mean** | " + " | ".join(f"**{np.mean([r[key] for r in mr]):.3f}**" for key, _ in cols)
                       + " | |")
        out.append("")
    return "\n".join(out)


def cells(agg: dict):
    """Flatten the nested summary: yields dicts {method, bits, protocol, metric, direction, mean, std, n}."""
    for method, by_bits in agg["summary"].items():
        for bits, by_p in by_bits.items():
            for protocol, by_m in by_p.items():
                for metric, by_d in by_m.items():
                    for direction, (mean, std, n) in by_d.items():
                        yield {"method": method, "bits": int(bits), "protocol": protocol, "metric": metric,
                               "direction": direction, "mean": mean, "std": std, "n": n}


SUMMARY_COLUMNS = (("paired", "tie_map@10"), ("label", "tie_map@10"), ("paired", "map@10"), ("paired", "tie_R@1"),
                   ("paired", "tie_R@10"), ("label", "tie_P@10"), ("label", "p_h2"))


def summary_table(agg: dict, flat: list | None = None) -> list[str]:
    """One line per method and code length: the mean over directions of the headline metrics."""
    flat = list(cells(agg)) if flat is None else flat
    have = {(r["protocol"], r["metric"]) for r in flat}
    cols = [c for c in SUMMARY_COLUMNS if c in have]
    idx = {(r["method"], r["bits"], r["protocol"], r["metric"]): r for r in flat if r["direction"] == "mean"}
    lines = ["## Summary (mean over directions)", "",
             "| method | bits | " + " | ".join(f"{METRIC_NAMES[m]} {p}" for p, m in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for name, meta in agg["methods"].items():
        bits_list = sorted({r["bits"] for r in flat if r["method"] == name})
        if meta["output"] == "float" and meta["kind"] == "fitted":
            bits_list = bits_list[:1]
        for bits in bits_list:
            shown = str(bits) if meta["output"] == "codes" else ("float" if meta["kind"] == "fitted" else f"float ({bits}-bit run)")
            vals = [idx.get((name, bits, p, m)) for p, m in cols]
            lines.append(f"| {meta['title']} | {shown} | " + " | ".join(
                _fmt(v["mean"], v["std"], v["n"]) if v else "–" for v in vals) + " |")
    return lines + [""]


def _fmt(mean: float, std: float, n: int) -> str:
    return f"{mean:.3f} ± {std:.3f}" if n > 1 else f"{mean:.3f}"


def markdown(agg: dict, which=METRICS) -> str:
    """A sweep's results.md: the summary over directions, then one table per metric and protocol."""
    enc = agg["encoder"]
    seeds = sorted({r["seed"] for r in agg["runs"]})
    lines = [f"# Sweep `{agg['experiment']}`: {agg['dataset']}, test split, encoder {enc['name']} ({enc['fingerprint']})", ""]
    if agg.get("command"):
        lines.append(f"Command: `{agg['command']}`")
    wall = agg.get("sweep_wall_s")
    lines.append(f"Runs: {agg['n_runs']} (seeds {seeds}); compute time of the runs {agg['runs_wall_s']:.0f} s"
                 + (f"; wall time of the sweep command {wall:.0f} s" if wall else "") + ".")
    lines.append("No-training methods are fitted on the training split only (the shared space's settings chosen on "
                 "the validation split); trained ones use the checkpoint chosen on the validation split. Cells: mean ± "
                 + agg["std"] + ". mAP@10, R@K and P@K are " + agg.get("tie_doc", "tie-broken") + "; the tie-broken "
                 "column orders ties by " + agg["tie_rule"] + ".")
    lines.append("")
    for p, doc in agg["protocols"].items():
        lines.append(f"- Protocol **{p}**: {doc}.")
    lines.append(f"- {agg['curves_doc']}")
    if agg.get("not_applicable"):
        reasons = sorted({r["reason"] for r in agg["not_applicable"]})
        lines.append(f"- Not applicable ({len(agg['not_applicable'])} runs, left out of the tables): "
                     + ", ".join(r["key"] for r in agg["not_applicable"]) + ". Why: " + " / ".join(reasons))
    if agg.get("queries"):
        lines.append("- Queries per direction (queries / with no relevant item, scoring 0 / database size): " + "; ".join(
            f"{k} {q}/{z}/{n}" for k, (q, z, n) in agg["queries"].items()) + ".")
    lines.append("")
    names = list(agg["methods"])
    flat = list(cells(agg))
    lines += summary_table(agg, flat)
    for metric in which:
        for p in agg["protocols"]:
            rows = [r for r in flat if r["metric"] == metric and r["protocol"] == p]
            if not rows:
                continue
            dirs = [d for d in dict.fromkeys(r["direction"] for r in rows) if d != "mean"] + ["mean"]
            lines.append(f"## {METRIC_NAMES[metric]}, protocol {p}")
            lines.append("")
            lines.append("| method | bits | " + " | ".join(dirs) + " |")
            lines.append("|---|---|" + "---|" * len(dirs))
            for name in names:
                meta = agg["methods"][name]
                bits_list = sorted({r["bits"] for r in rows if r["method"] == name})
                if meta["output"] == "float" and meta["kind"] == "fitted":
                    bits_list = bits_list[:1]  # no bits: the same float ranking at every swept length
                for bits in bits_list:
                    cell = {r["direction"]: r for r in rows if r["method"] == name and r["bits"] == bits}
                    if meta["output"] == "codes":
                        shown = str(bits)
                    elif meta["kind"] == "fitted":
                        shown = "float"
                    else:
                        shown = f"float ({bits}-bit run)"
                    lines.append(f"| {meta['title']} | {shown} | " + " | ".join(
                        _fmt(cell[d]["mean"], cell[d]["std"], cell[d]["n"]) if d in cell else "–" for d in dirs) + " |")
            lines.append("")
    return "\n".join(lines)
