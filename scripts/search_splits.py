"""A search for US-HASH's defaults, each trial scored on several splits of both real sets: the rule a default
changes by (docs/baselines.md) asks for a gain on val on every set, and one split's val decides too little.

    python scripts/search_splits.py [--space search|regularisers] [--trials 30] [--splits 0 1 2] [--seeds 0 1 2] [--heldout]

Optuna's TPE sampler (seeded) proposes settings from one of SPACES: `search` is US-HASH's space in
configs/search.yaml (what `python -m ushash.search` searches), `regularisers` the recipe's other weights and
settings. Trial 0 is the defaults. Every trial trains one run (seed 0) per split
(`data.seed`) of each set (`experiment=sweep_tuxpaint64` and `sweep_emoji64`); its val gain on a set is the mean
over the splits of its val score less the defaults' on the same split, and the objective is the smaller of the
sets' gains: a setting that trades one set for the other scores by the set it loses. Test is never read.

Then the chosen trial and the defaults are trained with every seed on every split, and the report gives per set
the chosen trial's val gain over splits and seeds beside the defaults' seed spread (the std over seeds within a
split, averaged over the splits): the rule's test. With --heldout both are also trained on the held-out set's
splits (`sweep_openclipart64`, made by scripts/openclipart.py) and their test mAP@10 is reported, for reading:
no setting is chosen on that set.

Everything lands in experiments/search/splits-ushash-64b-<digest>/ (the digest covers every run's settings, the
code that makes them included, the space and the sampler seed): study.db (an interrupted search resumes, a
larger --trials continues it), the runs under <set>-<split>/runs/, search.json and search.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from search_cross import search_report  # noqa: E402

SETS = {"tuxpaint": "sweep_tuxpaint64", "emoji": "sweep_emoji64"}
# the spaces searched: "search" is configs/search.yaml's (what `python -m ushash.search` searches: the learning rate,
# temperature, distillation and float weights, moving average); "regularisers" the recipe's other weights and
# settings, each range holding its default
SPACES = {
    "search": None,
    "regularisers": {
        "model.loss.contrastive": {"low": 0.3, "high": 3.0, "log": True},
        "model.loss.quant": {"low": 0.01, "high": 1.0, "log": True},
        "model.loss.balance": {"low": 0.01, "high": 1.0, "log": True},
        "model.loss.decor": {"low": 0.001, "high": 0.1, "log": True},
        "model.loss.proto": {"low": 0.001, "high": 0.1, "log": True},
        "model.beta_end": {"low": 4.0, "high": 64.0, "log": True},
        "model.weight_decay": {"low": 1.0e-5, "high": 1.0e-2, "log": True},
        "model.dropout": {"low": 0.0, "high": 0.3},
        "model.batch_size": {"choices": [64, 128, 256]},
    },
}
HELDOUT = {"openclipart": "sweep_openclipart64"}

log = logging.getLogger("search_splits")


def beyond(gain: float, spread: float) -> bool:
    """The rule a default changes by, on one set: a val gain beyond the defaults' seed spread, compared as the
    tables print them (3 decimals: a gain that reads as the spread is not beyond it)."""
    return round(gain, 3) > round(spread, 3)


def space_report(space: str = "search", root: Path = ROOT) -> dict | None:
    """The report of this search over `space` (experiments/search/splits-ushash-64b-*/search.json), None
    when there is none."""
    return search_report("splits-ushash-64b-*/search.json", lambda r: r.get("space_name", "search") == space, root)


def split_configs(sets: dict[str, list[list[str]]], base: list[str]):
    """{(set, split index): the composed config} for each set's per-split overrides."""
    from ushash.config import compose

    return {(name, i): compose("search", ["method=ushash", *base, *ov]) for name, splits in sets.items()
            for i, ov in enumerate(splits)}


def real_sets(names: dict[str, str], splits: list[int]) -> dict[str, list[list[str]]]:
    return {name: [[f"experiment={exp}", "extract.progress=false", f"data.seed={s}"] for s in splits]
            for name, exp in names.items()}


class Trainer:
    """Runs one setting on one (set, split) and seed, under the study's folder (a run made once is read back)."""

    def __init__(self, cfgs: dict, out: Path):
        from ushash.evaluation.sweep import open_splits

        self.cfgs, self.out = cfgs, out
        self.stores = {key: open_splits(cfg) for key, cfg in cfgs.items()}

    def __call__(self, key, params: dict, seed: int) -> dict:
        from omegaconf import OmegaConf, open_dict

        from ushash.config import to_dict
        from ushash.evaluation.sweep import run_one

        cfg = self.cfgs[key].copy()
        with open_dict(cfg):
            for k, v in params.items():
                OmegaConf.update(cfg, k, v, merge=False)
            cfg.seed = int(seed)
            rel = self.out.relative_to(Path(cfg.paths.experiments_dir))
            cfg.sweep = {**(to_dict(cfg.get("sweep")) or {}), "name": str(rel / f"{key[0]}-{key[1]}")}
        return run_one(cfg, self.stores[key])


def study_folder(cfgs: dict, space: dict, sampler_seed: int) -> Path:
    from ushash.core.io import settings_digest
    from ushash.evaluation.sweep import run_settings

    first = next(iter(cfgs.values()))
    base = {"runs": {f"{k[0]}-{k[1]}": run_settings(c) for k, c in sorted(cfgs.items())}, "space": space,
            "sampler_seed": int(sampler_seed)}
    return Path(first.paths.experiments_dir) / "search" / f"splits-ushash-{int(first.bits)}b-{settings_digest(base, 8)}"


def search_splits(sets: dict[str, list[list[str]]], trials: int = 30, seeds=(0, 1, 2), sampler_seed: int = 0,
                  heldout: dict[str, list[list[str]]] | None = None, base: list[str] = (), space: str = "search") -> dict:
    """The study over `space` (a name of SPACES), the chosen trial and the defaults over seeds (and on the held-out
    splits); returns the report (also written as search.json and search.md in the study's folder)."""
    import numpy as np
    import optuna
    from omegaconf import OmegaConf, open_dict

    from ushash.core.io import atomic_write, write_json
    from ushash.data.extract import relative_to_root
    from ushash.evaluation.search import _suggest, _test_scores, method_space

    if trials < 1:
        raise ValueError(f"--trials must be at least 1; got {trials}")
    cfgs = split_configs(sets, list(base))
    first = next(iter(cfgs.values()))
    if SPACES[space] is not None:   # checked as the search's own space is (each range holds the default)
        with open_dict(first):
            first.search.space.ushash = SPACES[space]
    space_name, space = space, method_space(first)
    defaults = {k: OmegaConf.select(first, k) for k in space}
    out = study_folder(cfgs, space, sampler_seed)
    out.mkdir(parents=True, exist_ok=True)
    train = Trainer(cfgs, out)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="splits", storage=f"sqlite:///{out / 'study.db'}", load_if_exists=True,
                                direction="maximize")
    study.sampler = optuna.samplers.TPESampler(seed=int(sampler_seed) * 100_003 + len(study.trials))
    if not any(t.params == defaults for t in study.trials):
        study.enqueue_trial(defaults)

    def scores(params: dict) -> dict:   # seed 0 on every split
        return {f"{k[0]}-{k[1]}": float(train(k, params, 0)["val_score"]) for k in cfgs}

    ref = scores(defaults)   # what every trial's gain is against (trial 0, the defaults, reads these runs back)

    def gains(val: dict) -> dict:
        return {name: float(np.mean([val[f"{name}-{i}"] - ref[f"{name}-{i}"] for i in range(len(sp))]))
                for name, sp in sets.items()}

    def objective(trial) -> float:
        val = scores({k: _suggest(trial, k, spec) for k, spec in space.items()})
        g = gains(val)
        trial.set_user_attr("val", val)
        trial.set_user_attr("gain", g)
        log.info("trial %d of %d: val gain %s", trial.number + 1, trials, ", ".join(f"{n} {v:+.4f}" for n, v in g.items()))
        return min(g.values())

    left = trials - len([t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE])
    if left > 0:
        study.optimize(objective, n_trials=left)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    rows = [{"number": t.number, "params": t.params, "objective": t.value, "val": t.user_attrs["val"],
             "gain": t.user_attrs["gain"]} for t in done]
    chosen = max(rows, key=lambda r: (r["objective"], -r["number"]))
    default_row = next(r for r in rows if r["params"] == defaults)
    report = {"method": "ushash", "bits": int(first.bits), "sets": sets, "space_name": space_name, "space": space,
              "sampler_seed": sampler_seed,
              "trials": rows, "defaults": default_row, "chosen": chosen, "seeds": list(seeds),
              "folder": relative_to_root(out, first.paths.root)}
    # over seeds: the defaults and the chosen trial, every seed on every split (seed 0 is the trial's own run)
    over = {}
    for label in ("defaults", "chosen"):
        params = report[label]["params"]
        runs = {f"{k[0]}-{k[1]}": {int(s): train(k, params, s) for s in seeds} for k in cfgs}
        over[label] = {key: {"val": [r[s]["val_score"] for s in seeds], "test": [_test_scores(r[s]) for s in seeds]}
                       for key, r in runs.items()}
    report["over_seeds"] = over
    report["rule"] = {}
    for name, sp in sets.items():
        keys = [f"{name}-{i}" for i in range(len(sp))]
        gain = float(np.mean([np.mean(over["chosen"][k]["val"]) - np.mean(over["defaults"][k]["val"]) for k in keys]))
        spread = float(np.mean([np.std(over["defaults"][k]["val"], ddof=1) for k in keys])) if len(seeds) > 1 else 0.0
        report["rule"][name] = {"gain": gain, "spread": spread}
    report["passes"] = chosen["number"] != default_row["number"] and all(
        beyond(r["gain"], r["spread"]) for r in report["rule"].values())
    if heldout:
        hcfgs = split_configs(heldout, list(base))
        htrain = Trainer(hcfgs, out)
        report["heldout"] = {label: {f"{k[0]}-{k[1]}": [_test_scores(htrain(k, report[label]["params"], s)) for s in seeds]
                                     for k in hcfgs} for label in ("defaults", "chosen")}
    write_json(out / "search.json", report)
    atomic_write(out / "search.md", markdown(report))
    log.info("chosen trial %d (objective %+.4f); passes the rule: %s; %s", chosen["number"], chosen["objective"],
             report["passes"], out / "search.md")
    return report


def markdown(report: dict) -> str:
    """The trials (params, per-set val gain over splits) and the rule's test over seeds."""
    from ushash.evaluation.search import mean_std, override_value

    keys, sets = list(report["space"]), list(report["sets"])
    lines = [f"### US-HASH defaults searched over splits: space `{report.get('space_name', 'search')}` "
             f"({len(report['trials'])} trials, "
             f"{', '.join(f'{n}: {len(s)} splits' for n, s in report['sets'].items())})", "",
             "Each trial trains seed 0 on every split; its val gain on a set is the mean over the splits of its val "
             "score less the defaults'; the objective is the smaller gain.", "",
             "| trial | " + " | ".join(f"`{k}`" for k in keys) + " | " + " | ".join(f"val gain, {n}" for n in sets)
             + " | |", "|---|" + "---|" * (len(keys) + len(sets)) + "---|"]
    for r in report["trials"]:
        mark = ("chosen" if r["number"] == report["chosen"]["number"] else
                "defaults" if r["number"] == report["defaults"]["number"] else "")
        lines.append(f"| {r['number']} | " + " | ".join(override_value(r["params"].get(k)) for k in keys) + " | "
                     + " | ".join(f"{r['gain'][n]:+.4f}" for n in sets) + f" | {mark} |")
    lines += ["", f"Over seeds {report['seeds']} on every split: the chosen trial's val gain against the defaults' "
              "seed spread (std over seeds within a split, mean over splits):", "",
              "| set | val gain | defaults' spread | |", "|---|---|---|---|"]
    for n, r in report["rule"].items():
        lines.append(f"| {n} | {r['gain']:+.4f} | {r['spread']:.4f} | "
                     f"{'beyond' if beyond(r['gain'], r['spread']) else 'not beyond'} |")
    lines.append(f"\nThe rule: {'passes' if report['passes'] else 'does not pass'}.")
    if report.get("heldout"):
        lines += ["", "Held out (test tie-aware mAP@10, mean over directions; never chosen on):", "",
                  "| split | defaults paired | chosen paired | defaults label | chosen label |", "|---|---|---|---|---|"]
        for key in report["heldout"]["defaults"]:
            d, c = report["heldout"]["defaults"][key], report["heldout"]["chosen"][key]
            lines.append(f"| {key} | " + " | ".join(mean_std([t.get(p) for t in x]) for p in ("paired", "label")
                                                  for x in (d, c)) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--trials", type=int, default=30, help="trials in all, trial 0 the defaults (more continues a study)")
    ap.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2], help="data.seed of each split")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the rule's test")
    ap.add_argument("--sampler-seed", type=int, default=0)
    ap.add_argument("--heldout", action="store_true", help="also train both on the held-out set's splits (test read)")
    ap.add_argument("--space", choices=sorted(SPACES), default="search", help="the settings searched (SPACES)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="[search_splits] %(message)s")
    log.setLevel(logging.INFO)   # a line per trial; the runs' own lines (Lightning's, the sweep's) stay quiet
    import pytorch_lightning  # noqa: F401  (it sets its loggers' level when imported: quieted after that)

    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from ushash.config import quiet_third_party, user_errors

    quiet_third_party()
    # a bad setting or data that cannot be read: one line naming it, as the verbs do
    user_errors(lambda _: search_splits(real_sets(SETS, args.splits), args.trials, args.seeds, args.sampler_seed,
                                        real_sets(HELDOUT, args.splits) if args.heldout else None,
                                        space=args.space))(None)


if __name__ == "__main__":
    main()
