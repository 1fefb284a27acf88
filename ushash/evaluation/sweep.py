"""Baseline sweeps: methods x bits x seeds with Hydra multirun, on one dataset, one evaluation.

    python -m ushash.sweep -m experiment=sweep_tuxpaint64          # the grid is in the experiment file
    python -m ushash.sweep -m experiment=sweep_synthetic bits=16,32 seed=0,1,2 method=itq,lsh
    python -m ushash.sweep experiment=sweep_tuxpaint64 sweep.aggregate_only=true   # re-aggregate, run nothing

Every run (one method, one code length, one seed) is `run_one(cfg)`: it opens the feature store (extracting it
if needed, or writing the synthetic one), fits a no-training method on the training split or trains a method
with the one Lightning loop (checkpoint chosen on the validation split), and evaluates on the test split with
`ushash.evaluation.retrieval` / `ushash.eval`. It writes
`experiments/<name>/runs/<method>-<bits>b-s<seed>-<settings digest>/result.json`, with the content digests of
the three stores it read (`FeatureSplit.content`); the settings digest covers the code, the numerical
packages and the CPU model too (`ushash.core.provenance.made_by`), so a run whose result exists for the same settings, the same
code, packages and CPU and the same features is skipped, so an interrupted sweep resumes (a trained run cut mid-training resumes from its last.ckpt), and
a run with other settings gets a folder of its own. A result computed from other features (a store
made again after a change to decoding, say) is not reused: its folder is moved to `experiments/<name>/stale/`
and the run is done again. At the end of a multirun a Hydra callback aggregates
the runs it launched into `results.json`, `results.md` and the plots: in `experiments/<name>/` when the
multirun is the experiment's grid as written, else (a sub-grid, another setting) in
`experiments/<name>/variants/<overrides>-<digest>/`, so the committed tables change only when the full
experiment is rerun. `sweep.aggregate_only=true` re-aggregates the recorded grid without running anything.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf, open_dict

from ushash.config import to_dict
from ushash.core import metrics
from ushash.core.codes import check_bits
from ushash.core.io import atomic_write, exclusive, set_aside, settings_digest, write_json
from ushash.core.provenance import made_by
from ushash.data.store import FeatureSplit, open_split, store_path
from ushash.evaluation import report, retrieval
from ushash.hashing import methods
from ushash.hashing.methods.base import NotApplicable

log = logging.getLogger(__name__)
SPLITS = ("train", "val", "test")
CURVE_KEYS = ("p_at_k", "pr", "p_h2", "p_h2_retrieved")  # kept apart from the rows in result.json
DEFAULTS = {"name": None, "aggregate_only": False, "synthetic": None, "threads": None,
            "k": 10, "denominator": "min", "protocols": ["paired", "label"]}
PROTOCOL_DOC = {
    "paired": "relevant = the query's own pairs (same group)",
    "label": "relevant = shares at least one class label",
}


# ---------------------------------------------------------------------------------------------- settings

def sweep_settings(cfg: DictConfig) -> dict:
    s = dict(DEFAULTS)
    s.update(to_dict(cfg.get("sweep")) or {})
    # a sweep's tables, plots and selection read the tie-aware mAP@10 (the KeyError came after every run)
    if int(s["k"]) != 10:
        raise ValueError(f"sweep.k={s['k']}: a sweep's tables report mAP@10, R@1/R@10 and P@10; evaluate another k "
                         f"with python -m ushash.eval ckpt=... k={s['k']}")
    if s["denominator"] not in ("min", "all"):
        raise ValueError(f"sweep.denominator={s['denominator']}: a sweep reports the tie-aware mAP@10, which only "
                         f"min and all have (found's Z depends on the order of ties); use min or all, or "
                         f"python -m ushash.eval ckpt=... denominator={s['denominator']}")
    if not s["name"]:
        s["name"] = f"{cfg.data.name}-{cfg.encoder.name}"
    return s


def exp_dir(cfg: DictConfig) -> Path:
    return Path(cfg.paths.experiments_dir) / str(sweep_settings(cfg)["name"])


def run_key(method: str, bits: int, seed: int) -> str:
    return f"{method}-{int(bits)}b-s{int(seed)}"


def run_path(exp: Path, key: str, dg: str) -> Path:
    """experiments/<name>/runs/<method>-<bits>b-s<seed>-<digest>: one folder per settings."""
    return Path(exp) / "runs" / f"{key}-{dg[:8]}"


def store_digests(splits: dict[str, FeatureSplit]) -> dict[str, str]:
    """The content digest of each split's store: what a run's result is computed from, recorded beside it."""
    return {sp: splits[sp].content for sp in SPLITS}


def read_record(f: Path) -> dict | None:
    """A run's result.json or settings.json; None when absent or unreadable (an interrupted write)."""
    try:
        return json.loads(f.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def run_settings(cfg: DictConfig) -> dict:
    """What a run's result depends on (its digest): its settings, the code, numerical packages and CPU model
    that compute it (`provenance.made_by`: a run of other code, under another numpy or on another CPU is made
    again, not reused); a
    trained run also depends on the network, the trainer, the shared space's settings and early stopping
    (`training.training_settings`)."""
    spec = methods.get(cfg.method.name)
    s = sweep_settings(cfg)
    out = {"method": {"name": spec.name, "args": to_dict(cfg.method.get("args"))}, "bits": int(cfg.bits),
           "seed": int(cfg.seed), "data": to_dict(cfg.data), "encoder": to_dict(cfg.encoder),
           "synthetic": s["synthetic"], "eval": {k: s[k] for k in ("k", "denominator", "protocols")},
           "made_by": made_by()}
    if s["synthetic"]:
        out.pop("data"), out.pop("encoder")
    if spec.kind == "trained":
        out["model"] = to_dict(cfg.model)
        out["max_epochs"] = int(cfg.trainer.max_epochs)
        from ushash.hashing.training import training_settings
        out["training"] = training_settings(cfg)
    return out


# ---------------------------------------------------------------------------------------------- data

def open_splits(cfg: DictConfig) -> dict[str, FeatureSplit]:
    """train/val/test feature stores: the synthetic ones (written once per parameter set) or run_extract's."""
    syn = sweep_settings(cfg)["synthetic"]
    if syn:
        from ushash.data import synthetic
        syn = dict(syn)
        name = f"synthetic-{settings_digest(syn, 8)}"
        root = Path(cfg.paths.features_dir)
        paths = {sp: store_path(root, name, sp, synthetic.ENCODER["name"], synthetic.ENCODER["fingerprint"]) for sp in SPLITS}
        if all((p / "meta.json").exists() for p in paths.values()):
            return {sp: open_split(p) for sp, p in paths.items()}
        sizes = {sp: int(syn.pop(f"n_{sp}")) for sp in SPLITS}
        return synthetic.write_synthetic(root, dataset=name, sizes=sizes, **syn)
    from ushash.data.extract import run_extract
    return run_extract(cfg, splits=list(SPLITS))


# ---------------------------------------------------------------------------------------------- one run

def run_one(cfg: DictConfig, splits: dict[str, FeatureSplit] | None = None) -> dict:
    """Fit or train one method at one code length and seed, evaluate it on the test split, write result.json.
    Returns the result (read back from disk when the run was already done with the same settings)."""
    s = sweep_settings(cfg)
    if s["threads"]:
        import torch
        torch.set_num_threads(int(s["threads"]))
    check_bits(cfg.bits)  # before any extraction
    spec = methods.get(cfg.method.name)
    key = run_key(spec.name, cfg.bits, cfg.seed)
    settings = run_settings(cfg)
    dg = settings_digest(settings)
    run_dir = run_path(exp_dir(cfg), key, dg)  # named by its settings: a variant never replaces another's run
    # one process at a time per run: a second sweep over the same grid waits, then finds the run done
    with exclusive(run_dir.with_name(run_dir.name + ".lock"), f"the sweep's run {key}"):
        return _make_run(cfg, spec, s, key, settings, dg, run_dir, splits)


def _make_run(cfg: DictConfig, spec, s: dict, key: str, settings: dict, dg: str, run_dir: Path,
              splits: dict[str, FeatureSplit] | None) -> dict:
    """`run_one` under the run's lock: its stored result when it is done over these stores, else the run made."""
    result_file = run_dir / "result.json"
    splits = splits or open_splits(cfg)
    stores = store_digests(splits)  # what the result is computed from
    # the stores the folder's run read: its result's, else (a run cut before evaluation) its settings'
    done = read_record(result_file)
    recorded = (done or read_record(run_dir / "settings.json") or {}).get("stores")
    if run_dir.exists() and recorded != stores:  # the same settings over other features (a store made again)
        aside = set_aside(run_dir, run_dir.parents[1] / "stale")  # out of runs/, which the tables read
        log.warning(f"{key}: the stored run used other features than the stores now give ({recorded or 'not recorded'}"
                    f" vs {stores}); it is run again (not resumed), the old run kept in {aside}")
    elif done is not None and done.get("digest") == dg:
        log.info(f"{key}: done already, skipped ({result_file})")
        return done
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "settings.json", json.loads(json.dumps({**settings, "stores": stores}, default=str)))
    t0 = time.perf_counter()
    train, test = splits["train"], splits["test"]
    extra = {}
    if spec.kind == "fitted":
        model = methods.build(spec.name, bits=int(cfg.bits), seed=int(cfg.seed), **settings["method"]["args"])
        try:
            model.fit(train, splits["val"])  # fitted on train; val only chooses the space's "auto" settings
        except NotApplicable as e:  # recorded, so the sweep goes on and the tables say why the cell is empty
            result = {"key": key, "method": spec.name, "kind": spec.kind, "bits": int(cfg.bits), "seed": int(cfg.seed),
                      "digest": dg, "stores": stores, "status": "not_applicable", "reason": str(e)}
            write_json(result_file, result)
            log.info(f"{key}: not applicable: {e}")
            return result
        entries = {spec.name: (spec.title, model)}
        extra["val_score"] = round(retrieval.selection_score(splits["val"], model), 6)   # what a sweeper optimises
        extra["space"] = model.describe()
        extra["space_choice"] = {k: v for k, v in model.space.choice.items() if k != "candidates"}
        if getattr(model.space, "shared_axes", None) is not None:
            extra["shared_axes"] = int(model.space.shared_axes)
    else:
        from ushash.hashing.module import load_checkpoint
        from ushash.hashing.training import run_train
        tcfg = cfg.copy()
        with open_dict(tcfg):
            tcfg.paths.checkpoints_dir = str(run_dir.parent)
            tcfg.run_name = run_dir.name
        out = run_train(tcfg, splits={"train": train, "val": splits["val"]})
        module = load_checkpoint(out["best"])
        entries = {spec.name: (spec.title, module.code_method())}
        if spec.name == "ushash":  # its own continuous upper bound: the head's embedding z
            entries["ushash_float"] = (f"US-HASH float z ({module.hparams.dim}-d, cosine)", module.float_method())
        extra.update({"val_map@10": out["val_map@10"], "val_score": out["val_score"], "best_epoch": out["best_epoch"],
                      "val_scores": out["val_scores"], "checkpoint": Path(out["best"]).name})
        if "start" in out:  # model.prototypes_from=val: which closed-form start was kept, every start's val score
            extra.update({"start": out["start"], "starts": out["starts"]})
        if out["space"]:
            extra["space_choice"] = out["space"]
    rows, curves, outputs = [], [], {}
    for name, (title, fn) in entries.items():
        reps = retrieval.represent(test, fn)
        for r in retrieval.evaluate(test, reps={name: reps}, k=int(s["k"]), protocols=tuple(s["protocols"]),
                                    denominator=str(s["denominator"]), curves=True):
            curve = {key: r.pop(key) for key in CURVE_KEYS if key in r}
            rows.append(r)
            curves.append({key: r[key] for key in ("method", "kind", "bits", "direction", "protocol", "n_queries",
                                                   "n_no_relevant", "n_database")} | curve)
        outputs[name] = {"title": title, "kind": next(iter(reps.values()))[0]}
    result = {"key": key, "method": spec.name, "kind": spec.kind, "bits": int(cfg.bits), "seed": int(cfg.seed),
              "digest": dg, "stores": stores, "entries": outputs, "dataset": test.meta["dataset"], "split": "test",
              "encoder": {k: test.meta["encoder"].get(k) for k in ("name", "fingerprint")},
              "fitted_on": train.meta["split"], "n_rows": {m: len(t) for m, t in test.tables.items()},
              "wall_s": round(time.perf_counter() - t0, 2), **extra, "rows": rows, "curves": curves}
    write_json(result_file, result)
    maps = {n: retrieval.mean_map([r for r in rows if r["method"] == n], "paired") for n in outputs}
    log.info(f"{key}: {result['wall_s']:.1f}s, mean paired mAP@10 " + ", ".join(f"{n} {v:.3f}" for n, v in maps.items()))
    return result


# ---------------------------------------------------------------------------------------------- aggregation

def _entry_order(name: str) -> tuple:
    order = ["ushash", "ushash_float", "ushash_labels", "pairwise", "csq", "orthohash", "itq", "pca_rotation", "pca_sign", "lsh", "float"]
    return (order.index(name) if name in order else len(order), name)


def load_results(exp: Path, unreadable: list | None = None) -> list[dict]:
    """Every readable runs/*/result.json; the path of each unreadable one is appended to `unreadable`."""
    out = []
    for f in sorted((Path(exp) / "runs").glob("*/result.json")):
        try:
            out.append(json.loads(f.read_text()))
        except json.JSONDecodeError:
            log.warning(f"{f} is unreadable (interrupted write?); left out")
            if unreadable is not None:
                unreadable.append(f)
    return out


#: What a grid's runs may differ in: method x bits x seed (and a trained method's own network and training).
_GRID_AXES = ("method", "bits", "seed", "model", "max_epochs", "training")


def _check_one_grid(exp: Path, results: list[dict]) -> None:
    """Every stored run, aggregated with no grid recorded, must be of one grid: the same features, data,
    evaluation, code and packages for all, and the same settings for the runs of one method but for bits
    and seed (its `settings.json`). A ValueError names what differs: a variant's run (another setting, other
    features) of another seed was averaged into the table as one more seed."""
    def differ(runs: list[tuple[str, dict]], what: str) -> None:
        first_key, first = runs[0]
        for key, st in runs[1:]:
            if st != first:
                keys = sorted(k for k in set(st) | set(first) if st.get(k) != first.get(k))
                raise ValueError(f"{exp / 'runs'} holds runs of more than one grid{what}: {first_key} and {key} "
                                 f"differ in {', '.join(keys)}; aggregate one grid by running the sweep (python -m "
                                 "ushash.sweep -m experiment=...), which records its runs, or move the others out")

    settings = []
    for r in results:
        f = run_path(exp, r["key"], r["digest"]) / "settings.json"
        st = read_record(f) if r.get("digest") else None
        settings.append((r["key"], st if st is not None else {"unrecorded": r["key"]}))
    differ([(k, {a: v for a, v in st.items() if a not in _GRID_AXES}) for k, st in settings], "")
    for name in sorted({r["method"] for r in results}):
        differ([(k, {a: v for a, v in st.items() if a not in ("bits", "seed")}) for (k, st), r in
                zip(settings, results) if r["method"] == name], f" of {name}")


def seed_cell(vals) -> list:
    """[mean, sample std (ddof=1; 0 with one seed), n_seeds] of one table cell over seeds, unrounded: the tables
    round once, where they print (rounded to 5 decimals first, a mean of 0.4484994 printed as 0.449)."""
    vals = [float(v) for v in vals]
    return [float(np.mean(vals)), float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0, len(vals)]


def _per_seed(results: list[dict]) -> dict:
    """(entry, bits) -> seed -> {(protocol, direction, metric): value}; direction "mean" = mean over directions."""
    table: dict = {}
    for res in results:
        for name in res["entries"]:
            vals: dict = {}
            for r in res["rows"]:
                if r["method"] != name:
                    continue
                for m in report.ROW_METRICS:
                    if m in r:
                        vals[(r["protocol"], r["direction"], m)] = r[m]
            for c in res["curves"]:
                if c["method"] != name:
                    continue
                if "p_h2" in c:
                    vals[(c["protocol"], c["direction"], "p_h2")] = c["p_h2"]
            for p, m in {(p, m) for (p, _, m) in vals}:
                dirs = [v for (pp, d, mm), v in vals.items() if pp == p and mm == m]
                vals[(p, "mean", m)] = float(np.mean(dirs))
            table.setdefault((name, res["bits"]), {})[res["seed"]] = vals
    return table


def _mean_curves(results: list[dict], name: str, bits: int, protocol: str) -> dict:
    cs = [c for res in results if res["bits"] == bits for c in res["curves"]
          if c["method"] == name and c["protocol"] == protocol]
    if not cs:
        return {}
    out = {}
    # K values every direction has (a small database, e.g. 10 test sounds, caps K): a mean over a changing set
    # of directions would zig-zag
    ks = sorted(set.intersection(*(set(c["p_at_k"]) for c in cs)), key=int)
    out["p_at_k"] = {k: round(float(np.mean([c["p_at_k"][k] for c in cs])), 5) for k in ks}
    pr = [c for c in cs if "pr" in c]
    if pr:
        # per radius, the mean over the directions (and seeds) where the value is defined: precision where some
        # query retrieves something within r, recall where some query has a relevant item (a direction without
        # used to count as 0, pulling the curve down where few queries retrieve anything)
        defined = {"precision": [np.asarray(c["pr"]["retrieved"]) > 0 for c in pr],
                   "recall": [np.full(len(c["pr"]["recall"]), c.get("n_no_relevant", 0) < c["n_queries"]) for c in pr],
                   "retrieved": [np.ones(len(c["pr"]["retrieved"]), bool) for c in pr]}
        out["pr"] = {}
        for k, ok in defined.items():
            v, ok = np.array([c["pr"][k] for c in pr], float), np.array(ok, bool)
            n = ok.sum(0)
            out["pr"][k] = [round(float(x), 4) for x in np.divide((v * ok).sum(0), n, out=np.zeros(v.shape[1]),
                                                                 where=n > 0)]
    return out


def aggregate(exp: str | Path, command: str | None = None, wall_s: float | None = None,
              digests: list[str] | None = None, out_dir: str | Path | None = None) -> dict:
    """Aggregate the runs of one grid from experiments/<name>/runs/*/result.json into results.json, results.md
    and the plots, written to `out_dir` (default: the experiment's folder).

    The grid is `digests` (the runs a multirun launched); without them, the runs the existing results.json
    of `out_dir` lists (re-aggregation reproduces the recorded grid); without that, every stored run, refused
    when two of them are the same (method, bits, seed) with other settings."""
    exp = Path(exp)
    out_dir = Path(out_dir) if out_dir else exp
    prev = out_dir / "results.json"
    old = json.loads(prev.read_text()) if prev.exists() else {}
    unreadable: list[Path] = []
    results = load_results(exp, unreadable)
    if digests is None and old.get("runs"):
        digests = [r["digest"] for r in old["runs"] if r.get("digest")] + [r["digest"] for r in
                                                                         old.get("not_applicable", []) if r.get("digest")]
    if digests is not None:
        want = set(digests)
        results = [r for r in results if r.get("digest") in want]
        missing = want - {r.get("digest") for r in results}
        if missing:  # a grid's table without some of its runs would be silently short of seeds or cells
            keys = {r["digest"]: r["key"] for r in old.get("runs", []) + old.get("not_applicable", []) if r.get("digest")}
            named = sorted(keys.get(d, d[:8]) for d in missing)
            raise FileNotFoundError(f"{len(missing)} of the grid's {len(want)} runs have no readable result under "
                                    f"{exp / 'runs'} ({', '.join(named[:5])}{', ...' if len(named) > 5 else ''}); "
                                    "run the sweep again, which makes them again, then aggregate")
    else:
        if unreadable:
            raise FileNotFoundError(f"{len(unreadable)} run result(s) under {exp / 'runs'} are unreadable "
                                    f"({', '.join(f.parent.name for f in unreadable[:5])}); run the sweep again, "
                                    "which makes them again, then aggregate")
    by_key: dict = {}
    for r in results:
        by_key.setdefault(r["key"], []).append(r)
    clash = sorted(k for k, rs in by_key.items() if len(rs) > 1)
    if clash:   # a table cell is one (method, bits, seed): one run would silently stand for the others
        raise ValueError(f"{exp / 'runs'} holds runs of {clash[:3]} with different settings"
                         + ("; a multirun's table keys its runs by method, bits and seed: sweep another setting in "
                            "multiruns of their own (one variant folder each)" if digests is not None else
                            "; aggregate one grid by running the sweep (python -m ushash.sweep -m experiment=...), "
                            "which records its runs"))
    if digests is None:
        _check_one_grid(exp, results)
    not_applicable = [{"key": r["key"], "reason": r["reason"], "digest": r.get("digest")}
                      for r in results if r.get("status") == "not_applicable"]
    results = [r for r in results if r.get("status") != "not_applicable"]
    if not results:
        raise FileNotFoundError(f"no run results under {exp / 'runs'}; run the sweep first")
    if command is None or wall_s is None:
        command = command or old.get("command")
        wall_s = wall_s if wall_s is not None else old.get("sweep_wall_s")
    per_seed = _per_seed(results)
    info = {}
    for res in results:
        for name, e in res["entries"].items():
            info[name] = {"title": e["title"], "output": e["kind"], "method": res["method"], "kind": res["kind"]}
    summary: dict = {}
    for (name, bits), seeds in sorted(per_seed.items(), key=lambda kv: (_entry_order(kv[0][0]), kv[0][1])):
        keys = sorted(set().union(*(set(v) for v in seeds.values())))
        for (protocol, direction, metric) in keys:
            vals = [seeds[s][(protocol, direction, metric)] for s in sorted(seeds) if (protocol, direction, metric) in seeds[s]]
            summary.setdefault(name, {}).setdefault(str(bits), {}).setdefault(protocol, {}).setdefault(metric, {})[direction] = seed_cell(vals)
    curves = {}
    protocols = sorted({r["protocol"] for res in results for r in res["rows"]}, key=lambda p: p != "paired")
    for (name, bits) in per_seed:
        for p in protocols:
            c = _mean_curves(results, name, bits, p)
            if c:
                curves.setdefault(name, {}).setdefault(str(bits), {})[p] = c
    first = results[0]
    den = next((r["denominator"] for r in first["rows"]), "min")
    out = {
        "experiment": exp.name, "dataset": first["dataset"], "split": "test", "encoder": first["encoder"],
        "fitted_on": "train", "n_rows_test": first["n_rows"], "command": command, "sweep_wall_s": wall_s,
        "runs_wall_s": round(sum(r["wall_s"] for r in results), 1), "n_runs": len(results),
        "protocols": {p: f"{PROTOCOL_DOC.get(p, p)}; mAP@10 with {retrieval.DENOMINATOR_DOC.get(den, den)}; "
                         f"queries without a relevant item score 0" for p in protocols},
        "queries": {f"{r['direction']} {r['protocol']}": [r["n_queries"], r["n_no_relevant"], r["n_database"]]
                    for r in first["rows"] if r["method"] == first["method"]},
        "tie_rule": "ascending database index", "tie_doc": metrics.TIE_DOC, "curves_doc": metrics.CURVES_DOC,
        "std": "sample standard deviation over seeds (ddof=1); 0 with one seed",
        "summary_format": "summary[method][bits][protocol][metric][direction] = [mean, std, n_seeds]; direction "
                          "'mean' is the mean over directions, taken per seed first",
        "methods": {n: info[n] for n in sorted(info, key=_entry_order)},
        "runs": [{**{k: r.get(k) for k in ("key", "method", "bits", "seed", "wall_s", "digest", "val_map@10", "val_score",
                                             "best_epoch", "val_scores", "space", "shared_axes", "start", "starts")
                     if r.get(k) is not None},
                  "mean_map@10": {n: {p: retrieval.mean_map([x for x in r["rows"] if x["method"] == n], p)
                                      for p in protocols} for n in r["entries"]}} for r in results],
        "not_applicable": not_applicable, "summary": summary, "curves": curves,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "results.json", out, compact=True)
    atomic_write(out_dir / "results.md", report.markdown(out))
    from ushash.evaluation import plots
    pngs = plots.plot_all(out, out_dir)
    log.info(f"aggregated {len(results)} runs -> {out_dir / 'results.json'}, results.md, {len(pngs)} plots")
    return out


# ---------------------------------------------------------------------------------------------- Hydra

try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover
    Callback = object


# overrides that leave the experiment's results as they are: which experiment, where files go, CPU threads
NEUTRAL_OVERRIDES = ("experiment", "paths.", "sweep.threads", "hydra.", "trainer.enable_progress_bar")


def variant_overrides(overrides: list[str], hydra_overrides: list[str] = ()) -> list[str]:
    """The command-line overrides that make a multirun something else than its experiment's full grid: any
    task override but the neutral ones, and a Hydra override of the sweeper (`hydra.sweeper.params.bits=16`
    sets the grid as surely as `bits=16` does)."""
    return ([o for o in overrides if not o.lstrip("+~").startswith(NEUTRAL_OVERRIDES)]
            + [o for o in hydra_overrides if o.lstrip("+~").startswith(("hydra.sweeper", "hydra/sweeper"))])


def variant_dir(exp: Path, overrides: list[str]) -> Path:
    """experiments/<name>/variants/<overrides, readable>-<digest>: where a sub-grid or variant is aggregated."""
    import re
    slug = re.sub(r"[^A-Za-z0-9.,=_-]+", "_", "_".join(overrides))[:80]
    return exp / "variants" / f"{slug}-{settings_digest(sorted(overrides), 8)}"


def grid_size(config: DictConfig) -> int | None:
    """How many jobs a multirun launches (the sweeper's params with the command line's on top)."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        params = {k: str(v) for k, v in (OmegaConf.to_container(config.hydra.sweeper.params) or {}).items()}
        for o in config.hydra.overrides.task:
            k, _, v = o.partition("=")
            params[k.lstrip("+~")] = v
        parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
        n = 1
        for o in parsed:
            if o.is_sweep_override():
                n *= len(list(o.sweep_string_iterator()))
        return n
    except Exception:  # a sweeper with its own search space (Optuna...) has no fixed size
        return None


class AggregateCallback(Callback):
    """Hydra callback: progress per job, and the aggregation of a multirun when its last job ends
    (configs/experiment/sweep_*.yaml). The experiment's folder gets the tables and plots only when the
    multirun is its full grid as written; a sub-grid or a variant (any other override) goes to
    experiments/<name>/variants/<overrides>-<digest>/, so committed results never change by accident."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._t0 = time.perf_counter()
        self._digests: list[str] = []
        self._n = grid_size(config)

    def on_job_end(self, config: DictConfig, job_return=None, **kwargs) -> None:
        try:
            self._digests.append(settings_digest(run_settings(config)))
        except Exception as e:  # a job that failed to compose; Hydra reports it
            log.debug("no digest for the job: %s", e)
        if not hasattr(self, "_t0"):
            return
        done, wall = len(self._digests), time.perf_counter() - self._t0
        eta = f", about {wall / done * (self._n - done) / 60:.0f} min left" if self._n and done < self._n else ""
        log.info(f"sweep: {done}/{self._n or '?'} runs done in {wall / 60:.1f} min{eta}")

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        wall = time.perf_counter() - getattr(self, "_t0", time.perf_counter())
        exp = exp_dir(config)
        extra = variant_overrides(list(config.hydra.overrides.task), list(config.hydra.overrides.hydra))
        out = variant_dir(exp, extra) if extra else exp
        aggregate(exp, command=command_line(), wall_s=round(wall, 1), digests=getattr(self, "_digests", None),
                  out_dir=out)
        if extra:
            log.warning(f"a sub-grid or variant of the experiment ({' '.join(extra)}): results in {out}; "
                        f"the experiment's own tables in {exp} are unchanged")


def command_line() -> str:
    return " ".join(["python -m ushash.sweep", *sys.argv[1:]])


def primary_metric(result: dict) -> float | None:
    """What a Hydra sweeper optimises over runs: the run's selection score on val (`retrieval.SELECTION_DOC`,
    what every choice on val maximises; a trained method's kept checkpoint's), never a test number (it was the
    test split's mean paired mAP@10, so a sweeper tuned on test)."""
    return result.get("val_score")


def run_sweep(cfg: DictConfig) -> dict | None:
    s = sweep_settings(cfg)
    if s["aggregate_only"]:
        return aggregate(exp_dir(cfg))
    result = run_one(cfg)
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    try:
        multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:  # called outside Hydra (tests)
        multirun = False
    if not multirun:
        log.info("one run; tables of a grid come from a multirun (python -m ushash.sweep -m experiment=...)")
    return result
