"""Train and export the heads the false-hit budget is measured on, from the shipped training defaults.

    python scripts/budget_heads.py [--data tuxpaint emoji] [--encoder offline]
    python scripts/budget_heads.py --override model.loss.margin=10 --name margin --out experiments/budget-heads-margin

Per data set: `python -m ushash.extract data=<d> encoder=<e>` (train, val and test; stores that exist are
reused), `python -m ushash.train data=<d> encoder=<e>` (no other override: bits, seed and the recipe are
the defaults of configs/ and ushash/config.py), then `python -m ushash.export` of its best.ckpt to
exports/budget-<d>-<e> (a stable name the benchmarks read). `--override KEY=VALUE` (repeatable) trains a
variant of the recipe instead, named `--name` in its run and export (exports/budget-<d>-<e>-<name>), so a
variant never replaces the shipped defaults' heads. The run's folder is named after a hash of the
resolved training config, of the code, numerical packages and CPU model that train it (`ushash.core.provenance.made_by`)
and of the content of the train and val stores (`FeatureSplit.content`)
(checkpoints/budget-<d>-<e>-<bits>b-s<seed>-<hash>), so

- a rerun with the same defaults and features skips a finished run and resumes an interrupted one (its last.ckpt);
- a rerun after the defaults, the code, a numerical package or the features changed (a store made again after a
  change to decoding) trains a new head in a new folder (never resumes the old one's weights), and the export is replaced by it.

A run is finished when its folder has `done.json` (written after training returns); the export is redone
when its revision is not the one recorded there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# keys of the resolved config that do not change the head (where things go, whether to resume)
NOT_RECIPE = ("paths", "run_name", "resume", "extract", "eval", "sweep", "search", "logger")


def config_key(overrides: list[str], stores: dict | None = None) -> tuple[str, dict]:
    """(12 hex digits of sha256 of the resolved training config and the training features' content digests
    `stores`, that config) for these overrides."""
    from omegaconf import OmegaConf

    from ushash.config import compose

    from ushash.core.provenance import made_by

    cfg = OmegaConf.to_container(compose("config", overrides), resolve=False)
    recipe = {k: v for k, v in cfg.items() if k not in NOT_RECIPE}
    # the code, numerical packages and CPU that train the head are part of what made it (provenance.made_by)
    blob = json.dumps({**recipe, "made_by": made_by(), **({"stores": stores} if stores else {})}, sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12], recipe


def extract_stores(overrides: list[str]) -> dict:
    """Extract (or reuse) every split's features, as `python -m ushash.extract <overrides>` does (the benchmarks
    replay val and test); returns {split: content digest} of the train and val stores the head learns from."""
    from ushash.config import compose
    from ushash.data.extract import run_extract
    splits = run_extract(compose("config", overrides))
    return {sp: splits[sp].content for sp in ("train", "val")}


def export_name(data: str, encoder: str, name: str | None = None) -> str:
    return f"budget-{data}-{encoder}" + (f"-{name}" if name else "")


def build(data: str, encoder: str, variant: tuple[str, ...] = (), name: str | None = None) -> dict:
    if variant and not name:
        raise SystemExit("budget_heads: --override trains a variant of the defaults; name it with --name")
    overrides = [f"data={data}", f"encoder={encoder}", *variant]
    stores = extract_stores(overrides)
    key, recipe = config_key(overrides, stores)
    run = f"{export_name(data, encoder, name)}-{recipe['bits']}b-s{recipe['seed']}-{key}"
    run_dir = ROOT / "checkpoints" / run
    done = run_dir / "done.json"
    py = sys.executable
    if not done.exists():
        print(f"[budget_heads] train {run}", flush=True)
        subprocess.run([py, "-m", "ushash.train", *overrides, f"run_name={run}"], cwd=ROOT, check=True)
        done.write_text(json.dumps({"overrides": overrides, "config_key": key, "stores": stores, "recipe": recipe},
                                   indent=1) + "\n")
    else:
        print(f"[budget_heads] {run}: trained (done.json)", flush=True)
    state = json.loads(done.read_text())
    out = ROOT / "exports" / export_name(data, encoder, name)
    manifest = out / "manifest.json"
    current = json.loads(manifest.read_text()).get("revision") if manifest.exists() else None
    if current is None or current != state.get("revision") or \
            json.loads(manifest.read_text()).get("source", {}).get("run_name") != run:
        print(f"[budget_heads] export {run} -> {out.relative_to(ROOT)}", flush=True)
        subprocess.run([py, "-m", "ushash.export", f"ckpt=checkpoints/{run}/best.ckpt",
                        f"out=exports/{out.name}", "overwrite=true"], cwd=ROOT, check=True)
        state["revision"] = json.loads(manifest.read_text())["revision"]
        state["export"] = f"exports/{out.name}"
        done.write_text(json.dumps(state, indent=1) + "\n")
    else:
        print(f"[budget_heads] {out.relative_to(ROOT)}: up to date (revision {current})", flush=True)
    return {"data": data, "run": run, "export": state["export"], "revision": state["revision"], **best_of(run_dir)}


def best_of(run_dir: Path) -> dict:
    """The kept checkpoint's validation score and epoch (BestOnVal's state in last.ckpt)."""
    import torch

    ck = torch.load(run_dir / "last.ckpt", map_location="cpu", weights_only=True)
    s = (ck.get("callbacks") or {}).get("BestOnVal") or {}
    return {"val_score": round(float(s["best"]), 4) if s.get("best") is not None else None,
            "best_epoch": s.get("best_epoch"), "epochs_run": ck.get("epoch")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", nargs="+", default=["tuxpaint", "emoji"])
    ap.add_argument("--encoder", default="offline")
    ap.add_argument("--out", default=str(ROOT / "experiments" / "budget-heads"))
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="a training override of the defaults (repeatable); needs --name")
    ap.add_argument("--name", default=None, help="the variant's name in its runs and exports")
    a = ap.parse_args(argv)
    built = []
    for d in a.data:
        built.append(build(d, a.encoder, tuple(a.override), a.name))
        print(json.dumps(built[-1]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(built, indent=1) + "\n")
    lines = ["| data | training run (checkpoints/) | export | revision | val score of best.ckpt (epoch) |",
             "|---|---|---|---|---|"]
    for b in built:
        lines.append(f"| {b['data']} | `{b['run']}` | `{b['export']}` | `{b['revision']}` | "
                     f"{b['val_score']} ({b['best_epoch']} of {b['epochs_run']}) |")
    (out / "results.md").write_text(
        f"Commands per data set: `python -m ushash.extract data=<d> encoder={a.encoder}`, `python -m ushash.train "
        f"data=<d> encoder={a.encoder} {' '.join(a.override) + ' ' if a.override else ''}run_name=<run>` "
        f"({'the shipped defaults but for ' + ', '.join(a.override) if a.override else 'the shipped defaults'}: "
        f"the run name is the only other override), `python -m ushash.export ckpt=checkpoints/<run>/best.ckpt "
        f"out=<export> overwrite=true`.\n\n"
        + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
