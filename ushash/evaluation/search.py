"""A budgeted search of a trained method's own settings on val, for what stays data-dependent.

    python -m ushash.search experiment=sweep_tuxpaint64 method=ushash [search.trials=24] [seed=0]
    python -m ushash.search experiment=sweep_emoji64 method=pairwise search.trials=40   # continues a study

Optuna's TPE sampler (seeded: `search.sampler_seed`) proposes settings from the method's search space
(`search.space.<method>` in configs/search.yaml: override -> {low, high[, log]} or {choices}). Every trial is
one sweep run (`ushash.evaluation.sweep.run_one`): trained with the one Lightning loop, its checkpoint
chosen on val, scored by the val selection score (`val_score`, what chose the shipped defaults), and
evaluated on test. The sampler sees the val score only; test is read back for the report alone. The first
trial is the method's own settings as composed (the defaults, or whatever the command line set), so the
report puts the chosen trial beside them.

Then the chosen settings and the defaults are each trained with every seed of `search.seeds` (0, 1, 2; the
search's own seed reuses its run), and the report gives both over seeds: val score, test paired and label,
mean ± std. Everything lands in experiments/search/<experiment>-<method>-<bits>b-s<seed>-<digest>/ (the
digest covers the base settings, the space and the sampler seed): `study.db` (SQLite: an interrupted search
resumes, a larger `search.trials` continues it), the runs under `runs/` (a run made once is never trained
again), `search.json`, `search.md` and `history.png`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from ushash.config import to_dict
from ushash.core.io import atomic_write, save_figure, set_aside, settings_digest, write_json
from ushash.data.extract import relative_to_root
from ushash.evaluation import retrieval
from ushash.evaluation.sweep import open_splits, read_record, run_one, run_settings, store_digests, sweep_settings
from ushash.hashing import methods

log = logging.getLogger(__name__)
DEFAULTS = {"trials": 24, "sampler_seed": 0, "seeds": [0, 1, 2], "space": {}}


def search_settings(cfg: DictConfig) -> dict:
    s = dict(DEFAULTS)
    s.update(to_dict(cfg.get("search")) or {})
    return s


def method_space(cfg: DictConfig) -> dict:
    """The method's search space, each dimension checked: {override: {low, high, log} | {choices}}."""
    name = methods.get(cfg.method.name).name
    if methods.get(name).kind != "trained":
        raise ValueError(f"method {name!r} trains nothing: its settings (the shared space's rank and ridge) are "
                         f"already chosen on val; search a trained method (ushash, pairwise, csq, orthohash)")
    space = (search_settings(cfg)["space"] or {}).get(name)
    if not space:
        raise ValueError(f"no search space for method {name!r}: set search.space.{name} (configs/search.yaml)")
    for key, spec in space.items():
        if OmegaConf.select(cfg, key, default="<missing>") == "<missing>":
            raise ValueError(f"search.space.{name}: {key!r} is not a setting of this config")
        ok = ("choices" in spec and len(spec["choices"]) > 0) or (
            {"low", "high"} <= set(spec) and float(spec["low"]) < float(spec["high"])
            and (not spec.get("log") or float(spec["low"]) > 0))
        if not ok:
            raise ValueError(f"search.space.{name}.{key}: give {{choices: [...]}} or {{low, high[, log: true]}} "
                             f"with low < high (and low > 0 on a log scale); got {spec}")
        now = OmegaConf.select(cfg, key)   # the first trial runs the settings as composed: they must be in the space
        inside = now in list(spec["choices"]) if "choices" in spec else (
            isinstance(now, (int, float)) and float(spec["low"]) <= now <= float(spec["high"]))
        if not inside:
            raise ValueError(f"search.space.{name}.{key}: the current setting {now!r} is outside {spec}; the first "
                             f"trial runs the settings as composed, so widen the space or change the setting")
    return space


def _suggest(trial, key: str, spec: dict):
    if "choices" in spec:
        return trial.suggest_categorical(key, list(spec["choices"]))
    low, high = spec["low"], spec["high"]
    if isinstance(low, int) and isinstance(high, int) and not spec.get("log"):
        return trial.suggest_int(key, low, high)
    return trial.suggest_float(key, float(low), float(high), log=bool(spec.get("log")))


def study_dir(cfg: DictConfig, space: dict) -> Path:
    s = search_settings(cfg)
    base = {"run": run_settings(cfg), "space": space, "sampler_seed": int(s["sampler_seed"])}
    name = (f"{sweep_settings(cfg)['name']}-{methods.get(cfg.method.name).name}-{int(cfg.bits)}b-s{int(cfg.seed)}-"
            f"{settings_digest(base, 8)}")
    return Path(cfg.paths.experiments_dir) / "search" / name


def _trial_stores(out: Path, trial) -> dict | None:
    """The content digests of the stores a finished trial's run read (its result.json), None when unknown."""
    run = trial.user_attrs.get("run")
    rec = read_record(out / "runs" / run / "result.json") if run else None
    return rec.get("stores") if rec else None


def _test_scores(result: dict) -> dict:
    """{protocol: mean tie-aware test mAP@10 over directions}, None for a protocol the split has no rows of
    (label, for a data set without labels: not measured, not 0)."""
    rows = [r for r in result.get("rows", []) if r["method"] == result["method"]]
    return {p: retrieval.mean_map(rows, p, key="tie_map@10") if any(r["protocol"] == p for r in rows) else None
            for p in ("paired", "label")}


def run_search(cfg: DictConfig) -> dict:
    import optuna

    space = method_space(cfg)
    s = search_settings(cfg)
    trials = int(s["trials"])
    if trials < 1:
        raise ValueError(f"search.trials must be at least 1; got {trials}")
    out = study_dir(cfg, space)
    out.mkdir(parents=True, exist_ok=True)
    splits = open_splits(cfg)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="search", storage=f"sqlite:///{out / 'study.db'}", load_if_exists=True,
                                direction="maximize")
    stores = store_digests(splits)
    other = [t.number for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE
             and _trial_stores(out, t) != stores]
    if other:  # trials scored on other features (a store made again): their val scores choose nothing now
        del study
        aside = set_aside(out, out.parent / "stale")
        log.warning("search: trial(s) %s of the study were run on other features than the stores now give (or their "
                    "runs are gone); the study is searched afresh, the old one kept in %s", other, aside)
        out.mkdir(parents=True, exist_ok=True)
        study = optuna.create_study(study_name="search", storage=f"sqlite:///{out / 'study.db'}", direction="maximize")
    # seeded by the sampler seed and the trials already made: a resumed or continued study does not draw
    # again the points its first session drew (a sampler seeded alike would repeat them)
    study.sampler = optuna.samplers.TPESampler(seed=int(s["sampler_seed"]) * 100_003 + len(study.trials))
    defaults = {key: OmegaConf.select(cfg, key) for key in space}   # the settings as composed: run first
    if not any(t.params == defaults and t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.WAITING)
               for t in study.trials):   # (again, when a session was cut during it)
        study.enqueue_trial(defaults)

    def run(params: dict, seed: int | None = None) -> dict:
        """One sweep run of these settings (and seed), its runs under the study's folder."""
        tcfg = cfg.copy()
        with open_dict(tcfg):
            for key, value in params.items():
                OmegaConf.update(tcfg, key, value, merge=False)
            if seed is not None:
                tcfg.seed = int(seed)
            # the runs under the study's folder (a command without an experiment file has no sweep block)
            tcfg.sweep = {**(to_dict(tcfg.get("sweep")) or {}), "name": str(Path("search") / out.name)}
        return run_one(tcfg, splits)

    def objective(trial) -> float:
        result = run({key: _suggest(trial, key, spec) for key, spec in space.items()})
        trial.set_user_attr("run", f"{result['key']}-{result['digest'][:8]}")
        trial.set_user_attr("test", _test_scores(result))
        log.info("search: trial %d of %d, val score %.4f", trial.number + 1, trials, result["val_score"])
        return float(result["val_score"])

    left = trials - len([t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE])
    if left > 0:
        study.optimize(objective, n_trials=left)
    report = summarise(study, cfg, space, out, defaults)
    # the comparison: the defaults and the chosen settings, each over the seeds (the search's own seed
    # included: its runs are reused)
    report["over_seeds"] = {}
    for label in ("defaults", "chosen"):
        params = report[label]["params"] if report[label] else None
        if params is None:
            continue
        results = [run(params, seed) for seed in s["seeds"]]
        report["over_seeds"][label] = {"seeds": list(s["seeds"]), "val_score": [r["val_score"] for r in results],
                                       "test": [_test_scores(r) for r in results]}
    write_json(out / "search.json", report)
    atomic_write(out / "search.md", markdown(report))
    plot_history(report, out / "history.png")
    log.info("search: chosen on val, trial %d (val %.4f against the defaults' %.4f); %s", report["chosen"]["number"],
             report["chosen"]["val_score"], report["defaults"]["val_score"], out / "search.md")
    return report


def summarise(study, cfg: DictConfig, space: dict, out: Path, defaults: dict) -> dict:
    """The finished trials in order, the defaults' trial and the chosen one: the highest val score, the
    earliest on a tie (test never enters the choice)."""
    import optuna

    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    rows = [{"number": t.number, "params": t.params, "val_score": t.value, "test": t.user_attrs.get("test", {}),
             "run": t.user_attrs.get("run")} for t in done]
    chosen = max(rows, key=lambda r: (r["val_score"], -r["number"]))
    overrides = " ".join(f"{k}={override_value(v, exact=True)}" for k, v in chosen["params"].items())
    exp = experiment_name()
    seeds_cmd = (f"python -m ushash.sweep -m{f' experiment={exp}' if exp else ''} method={cfg.method.name} "
                 f"bits={int(cfg.bits)} seed=0,1,2 {overrides}")
    return {"method": methods.get(cfg.method.name).name, "bits": int(cfg.bits), "seed": int(cfg.seed),
            "experiment": sweep_settings(cfg)["name"], "space": space, "trials": rows,
            "defaults": next((r for r in rows if r["params"] == defaults), None), "chosen": chosen,
            "seeds_command": seeds_cmd, "folder": relative_to_root(out, cfg.paths.root)}


def experiment_name() -> str | None:
    """The `experiment=` option of the command line (None outside Hydra, or with none)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        return HydraConfig.get().runtime.choices.get("experiment")
    except ValueError:
        return None


def override_value(v, exact: bool = False) -> str:
    """A trial's value as an override: exact (repr) for a command that must give the trial's run again, else
    to 4 significant digits for a table."""
    if v is None:
        return "null"
    return (repr(v) if exact else f"{v:.4g}") if isinstance(v, float) else str(v)


def markdown(report: dict) -> str:
    keys = list(report["space"])
    lines = [f"### Search on val: {report['method']}, {report['bits']} bits, seed {report['seed']} "
             f"({report['experiment']}, {len(report['trials'])} trials)", "",
             "Chosen on val: the highest val selection score (the earliest trial on a tie); the defaults' "
             "trial is the method's own settings (trial 0 unless a session was cut during it). Test: "
             "tie-aware mAP@10, mean over directions, read back for this table only (the sampler never "
             "sees it). One seed chooses; the same runs as a sweep:", "",
             f"    {report['seeds_command']}", "",
             "| trial | " + " | ".join(f"`{k}`" for k in keys) + " | val score | test paired | test label | |",
             "|---|" + "---|" * len(keys) + "---|---|---|---|"]
    for r in report["trials"]:
        default = report["defaults"] is not None and r["number"] == report["defaults"]["number"]
        mark = "chosen" if r["number"] == report["chosen"]["number"] else ("defaults" if default else "")
        cells = [override_value(r["params"].get(k)) for k in keys]
        t = r["test"]
        lines.append(f"| {r['number']} | " + " | ".join(cells) + f" | {r['val_score']:.4f} | "
                     f"{_num(t.get('paired'))} | {_num(t.get('label'))} | {mark} |")
    lines += seeds_table(report)
    return "\n".join(lines) + "\n"


def mean_std(xs) -> str:
    """'mean ± std' (sample std) of the values that are not None, to 3 decimals; the value alone for one, – for none."""
    import numpy as np

    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    return f"{np.mean(xs):.3f} ± {np.std(xs, ddof=1):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def seeds_table(report: dict) -> list[str]:
    """The defaults and the chosen settings over the seeds: val score, test paired and label, mean ± std."""
    rows = []
    for label, rec in report.get("over_seeds", {}).items():
        rows.append(f"| {label} (trial {report[label]['number']}) | {len(rec['seeds'])} | {mean_std(rec['val_score'])} | "
                    f"{mean_std([t.get('paired') for t in rec['test']])} | "
                    f"{mean_std([t.get('label') for t in rec['test']])} |")
    if not rows:
        return []
    return ["", "Over seeds (the chosen settings and the defaults, each trained with every seed):", "",
            "| settings | seeds | val score | test paired | test label |", "|---|---|---|---|---|", *rows]


def _num(x) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def plot_history(report: dict, path: Path) -> None:
    """Val score per trial and the best so far, with each trial's test paired mAP@10 beside (for reading, not
    choosing)."""
    from ushash.evaluation.plots import plt

    n = [r["number"] for r in report["trials"]]
    val = [r["val_score"] for r in report["trials"]]
    best = [max(val[: i + 1]) for i in range(len(val))]
    test = [r["test"].get("paired") for r in report["trials"]]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(n, val, "o", ms=4, label="val score (the search's objective)")
    ax.step(n, best, where="post", label="best val so far")
    ax.plot(n, test, "x", ms=4, label="test paired mAP@10 (not used)")
    ax.set_xlabel("trial")
    ax.set_title(f"{report['method']}, {report['bits']} bits: search on val ({report['experiment']})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
