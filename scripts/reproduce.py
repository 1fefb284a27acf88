"""Regenerate every published table of README.md and docs/ from the current code: ./run reproduce [STEP ...]

Each step runs its commands (the same ones the docs quote), then `publish` writes each generated table into
its marked block (<!-- reproduce:NAME --> ... <!-- /reproduce:NAME -->) with the command, the date and the
machine. Steps resume: sweeps skip finished runs, so an interrupted reproduce continues where it stopped.

    ./run reproduce                 # every step, then publish
    ./run reproduce sweep_emoji     # one step, then publish
    ./run reproduce readme          # the README's verbs in the order written (after the demo)
    ./run reproduce publish         # only rewrite the blocks from the results already on disk
    ./run reproduce reaggregate     # the sweep tables again from their recorded runs (no training), then publish

A step's stamp (experiments/reproduce/<step>.json: command, date, machine, versions) records the digests of
the results its blocks are published from, and of the results of the steps it needs as it read them. publish
writes nothing while any results on disk are not the ones their stamp describes (rewritten by a command run
outside reproduce, or a failed run) or were made from other results of a step they need (budget_heads run
again under the cache benchmarks): it names each and the steps to rerun, so a page never states one run's
provenance over another run's numbers, or one head's table beside numbers measured on another.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# the false-hit budgets calibrated and measured (docs/cache.md), and the one the cache's bars are set at (issue 13:
# target_false_hit_rate=0.01), whose per-pair evidence the block shows
BUDGETS = (0.005, 0.01, 0.02, 0.05)
BAR_BUDGET = 0.01
# step -> the command it runs (as the docs quote it; "python X.py" for a script, else a module)
STEPS = {
    "demo": "python -m ushash.demo",
    "sweep_emoji": "python -m ushash.sweep -m experiment=sweep_emoji",
    "sweep_tuxpaint": "python -m ushash.sweep -m experiment=sweep_tuxpaint",
    "sweep_tuxpaint64": "python -m ushash.sweep -m experiment=sweep_tuxpaint64",
    "sweep_emoji64": "python -m ushash.sweep -m experiment=sweep_emoji64",
    "sweep_synthetic": "python -m ushash.sweep -m experiment=sweep_synthetic",
    # a real set no default or option was chosen on, through the manifest (docs/baselines.md "A held-out set")
    "openclipart": "python scripts/openclipart.py",
    "sweep_openclipart64": "python -m ushash.sweep -m experiment=sweep_openclipart64",
    "payload_tuxpaint": "python benchmarks/payload.py quality --ckpt checkpoints/demo-tuxpaint-offline-64b-s0/best.ckpt",
    "payload_synthetic": "python benchmarks/payload.py quality --synthetic",
    "payload_speed": "python benchmarks/payload.py speed",
    # head training steps/s against the bare loop, and codes/s (docs/benchmarks.md)
    "heads_speed": "python benchmarks/heads.py --runs 7",
    # faiss's ITQTransform against the registry's ITQ (ITQ's own alternation) in the same space (docs/baselines.md)
    "itq_check": "python scripts/itq_check.py",
    "export_demo": "python -m ushash.export ckpt=checkpoints/demo-tuxpaint-offline-64b-s0/best.ckpt out=exports/demo-tux64 "
                   "overwrite=true",  # the export follows the demo checkpoint, which a reproduce may train again
    "cachesim_tuxpaint": "python -m ushash.cachesim export=exports/demo-tux64 out=experiments/cachesim/demo-tuxpaint64",
    # the cache in front of a real model (docs/cache.md): heads from the shipped training defaults, then the
    # false-hit budget on val -> test, real GPTCache on the same streams, and the proxy in front of the model
    "budget_heads": "python scripts/budget_heads.py --data tuxpaint emoji",
    "false_hit_budget": "python benchmarks/false_hit_budget.py --export exports/budget-tuxpaint-offline "
                        f"--export exports/budget-emoji-offline --budgets {' '.join(map(str, BUDGETS))} "
                        f"--detail {BAR_BUDGET} --out experiments/budget",
    "gptcache_compare": "python benchmarks/gptcache/compare.py --export exports/budget-tuxpaint-offline "
                        "--export exports/budget-emoji-offline --calibrations experiments/budget --out experiments/gptcache",
    # the calibration's rules (CalibrationSettings.prefer) compared on val alone: calibrated on one half of val's
    # items, replayed on the other
    "calibration_rules": "python scripts/calibration_rules.py --export exports/budget-tuxpaint-offline "
                         "--export exports/budget-emoji-offline --out experiments/calibration-rules",
    # the hit check's request side: its fp32 z (shipped) or its own payload, on the same heads and streams
    "payload_query": "python benchmarks/payload_query.py --export exports/budget-tuxpaint-offline "
                     "--export exports/budget-emoji-offline --out experiments/payload_query",
    "proxy_overhead": "python benchmarks/proxy_overhead.py --export exports/budget-tuxpaint-offline "
                      "--images data/tuxpaint/stamps --calibration experiments/budget/tuxpaint-0.01.calibration.json "
                      "--out experiments/proxy",
    # what handing the encoding to a worker thread costs the proxy's event loop, Workers against to_thread
    "offload": "python benchmarks/offload.py",
    # what reading a request's JSON body costs, loads_json against the scan it replaced and json.loads
    "json_body": "python benchmarks/json_body.py",
    # what an L2 lookup among near-duplicates reads and costs, the served answers only against every candidate's
    "l2_fetch": "python benchmarks/l2_fetch.py",
    # what hostile bodies cost the service with its bounds and with each lifted (docs/cache.md)
    "hostile_input": "python benchmarks/hostile_input.py",
    # the failure modes and the adaptive policies in simulated time (docs/cache.md), tables and plots in docs/failures
    "failures": "python -m ushash.cachesim scenario=all out=docs/failures",
    "adaptive_ttl": "python -m ushash.cachesim scenario=adaptive_ttl out=docs/failures",
    "qos": "python -m ushash.cachesim scenario=qos out=docs/failures",
    # heads trained with the Hamming margin between items (an option, not a default), for the cache-key question
    "budget_heads_margin": "python scripts/budget_heads.py --data tuxpaint emoji --override model.loss.margin=10 "
                           "--name margin --out experiments/budget-heads-margin",
}
# US-HASH codes as a cache key (docs/baselines.md): each set of budget heads, codes only at radius 2, beside LSH codes
# of their z. Heads -> (the step that trains them, their export's suffix); a step per (heads, set): cachekey_<heads><set>
CACHEKEY_HEADS = {"": ("budget_heads", ""), "margin_": ("budget_heads_margin", "-margin")}
CACHEKEY_SETS = ("tuxpaint", "emoji")


def cachekey_step(heads: str, dataset: str) -> str:
    return f"cachekey_{heads}{dataset}"


def cachekey_results(heads: str, dataset: str) -> str:
    return f"experiments/cachesim/cachekey-{heads.replace('_', '-')}{dataset}64"


for _h, (_, _suffix) in CACHEKEY_HEADS.items():
    for _d in CACHEKEY_SETS:
        STEPS[cachekey_step(_h, _d)] = (f"python -m ushash.cachesim export=exports/budget-{_d}-offline{_suffix} "
                                        f"cache.radius=2 methods=[exact,lsh_codes_only,ushash,ushash_codes_only] "
                                        f"out={cachekey_results(_h, _d)}")
# the budgeted search on val (docs/baselines.md "A budgeted search on val"): every trained method alike, both real
# sets at 64 bits, then the choice and the defaults over seeds 0-2
sys.path.insert(0, str(ROOT / "scripts"))
from search_cross import SETS as _SEARCH, cross_overrides, set_search  # noqa: E402
from search_splits import SPACES as SPLITS_SPACES, beyond, space_report as splits_report  # noqa: E402

SEARCH_SETS = {d: exp_file for d, (exp_file, _) in _SEARCH.items()}
SEARCH_METHODS = ("ushash", "pairwise", "csq", "orthohash")
SEARCH_TRIALS = 24
for _set, _exp in SEARCH_SETS.items():
    for _m in SEARCH_METHODS:
        STEPS[f"search_{_set}_{_m}"] = f"python -m ushash.search experiment={_exp} method={_m} search.trials={SEARCH_TRIALS}"
    # the other set's US-HASH choice trained on this one (scripts/search_cross.py), over seeds 0-2
    STEPS[f"search_cross_{_set}"] = f"python scripts/search_cross.py --to {_set}"
SEARCH_STEPS = {f"search_{_set}_{_m}": (_set, _m) for _set in SEARCH_SETS for _m in SEARCH_METHODS}
# step -> (the set trained on, the set whose choice it is (None: the other), the split): `search_cross.cross_overrides`
CROSS_STEPS = {f"search_cross_{_set}": (_set, None, 0) for _set in SEARCH_SETS}
# steps run first (once per reproduce) when a step is asked for: they resume, so a finished one costs seconds
NEEDS = {
    "export_demo": ["demo"],              # the demo's checkpoint (PRODUCES)
    "payload_tuxpaint": ["demo"],
    "cachesim_tuxpaint": ["export_demo"],  # its export
    "search_cross_tuxpaint": ["search_emoji_ushash"],
    "search_cross_emoji": ["search_tuxpaint_ushash"],
    "sweep_openclipart64": ["openclipart"],   # its manifest, fetched and written
    "false_hit_budget": ["budget_heads"],
    "gptcache_compare": ["budget_heads", "false_hit_budget"],
    "proxy_overhead": ["budget_heads", "false_hit_budget"],   # the heads, and the calibration at their points
    "payload_query": ["budget_heads"],
    "calibration_rules": ["budget_heads"],
    **{cachekey_step(_h, _d): [trained_by] for _h, (trained_by, _) in CACHEKEY_HEADS.items() for _d in CACHEKEY_SETS},
}
# what a step makes that is not committed but that a later step reads (a checkpoint, an export): their digests go
# into the step's stamp ("produced") and into the stamp of a step that needs it ("made_from"), so that running the
# step again marks every step made from its earlier files (the demo's were read by three steps that said nothing)
PRODUCES = {"demo": ["checkpoints/demo-tuxpaint-offline-64b-s0/best.ckpt"],
            "export_demo": ["exports/demo-tux64/manifest.json", "exports/demo-tux64/weights.safetensors"]}
# the recipe's ablation (docs/baselines.md "Ablation"): each option of the US-HASH recipe changed alone, on both
# real sets at 64 bits; label -> the overrides (the shipped defaults first). A step per (set, row), each a
# variant multirun of the set's 64-bit experiment (aggregated under its variants/ folder).
ABLATION_SEEDS = "0"  # one seed: the ablation costs a 64-bit training per row and set
ABLATION_SETS = {"tuxpaint": ("sweep_tuxpaint64", "tuxpaint-offline-64b"), "emoji": ("sweep_emoji64", "emoji-offline-64b")}
ABLATIONS = {
    "shipped defaults": "",
    "no distillation (model.loss.distill=0)": "model.loss.distill=0",
    "fixed temperature 0.84 (model.learn_temperature=false)": "model.learn_temperature=false",
    "random-init 2-layer MLP (model.init=random model.layers=2)": "model.init=random model.layers=2",
    "angular distillation target (model.distill_kernel=angular)": "model.distill_kernel=angular",
    "distillation within modalities too (model.distill_pairs=all)": "model.distill_pairs=all",
    "batches of 512 groups (model.batch_size=512)": "model.batch_size=512",
    "label-supervised positives (method=ushash_labels; reads labels)": "method=ushash_labels",
    "LSH start (model.prototypes_from=lsh)": "model.prototypes_from=lsh",
    "start chosen on val after training from each (model.prototypes_from=val)": "model.prototypes_from=val",
    "no moving average of the weights (model.ema_epochs=null)": "model.ema_epochs=null",
    "a longer moving average (model.ema_epochs=8)": "model.ema_epochs=8",
    "the first recipe's rates: 1e-3, heads 1e-4 (model.lr=0.001 model.head_lr=0.0001)": "model.lr=0.001 model.head_lr=0.0001",
    "contrastive temperature starting at 0.1 (model.temperature=0.1)": "model.temperature=0.1",
    "a Hamming margin between items' codes, 8 of 64 bits (model.loss.margin=10)": "model.loss.margin=10",
}


def ablation_overrides(label: str) -> list[str]:
    extra = ABLATIONS[label].split()
    method = next((o for o in extra if o.startswith("method=")), "method=ushash")
    return [method, f"seed={ABLATION_SEEDS}", *[o for o in extra if not o.startswith("method=")]]


def ablation_step(dataset: str, i: int) -> str:
    return f"ablation_{dataset}_{i}"


for _set, (_exp, _) in ABLATION_SETS.items():
    for _i, _label in enumerate(ABLATIONS):
        STEPS[ablation_step(_set, _i)] = f"python -m ushash.sweep -m experiment={_exp} {' '.join(ablation_overrides(_label))}"

# the ablation's rows that score higher on val on both sets with its one seed, again over 3 seeds (docs/baselines.md
# "The ablation's gains over 3 seeds"): the test of the rule a default changes by (higher on both sets' val by more
# than the defaults' own seed spread). A step per (set, row), named by the row's ablation index.
RECHECK_SEEDS = "0,1,2"
RECHECK = ("angular distillation target (model.distill_kernel=angular)",
           "no moving average of the weights (model.ema_epochs=null)",
           "a longer moving average (model.ema_epochs=8)",
           "a Hamming margin between items' codes, 8 of 64 bits (model.loss.margin=10)")


def recheck_overrides(label: str) -> list[str]:
    method, _, *rest = ablation_overrides(label)   # the ablation's row with 3 seeds
    return [method, f"seed={RECHECK_SEEDS}", *rest]


def recheck_step(dataset: str, label: str) -> str:
    return f"recheck_{dataset}_{list(ABLATIONS).index(label)}"


for _set, (_exp, _) in ABLATION_SETS.items():
    for _label in RECHECK:
        STEPS[recheck_step(_set, _label)] = f"python -m ushash.sweep -m experiment={_exp} {' '.join(recheck_overrides(_label))}"

# the trained baselines at the other code lengths (docs/baselines.md "The trained baselines, 16 to 128 bits"): a
# variant of each set's bits experiment, beside its published US-HASH and no-training rows
TRAINED_BITS = ["method=pairwise,csq,orthohash", "bits=16,32,128"]
BITS_SETS = {"tuxpaint": ("sweep_tuxpaint", "tuxpaint-offline-bits"), "emoji": ("sweep_emoji", "emoji-offline-bits")}
for _set, (_exp, _) in BITS_SETS.items():
    STEPS[f"trained_bits_{_set}"] = f"python -m ushash.sweep -m experiment={_exp} {' '.join(TRAINED_BITS)}"

# the start chosen on val, 3 seeds (docs/baselines.md "Which closed-form start"): a variant of each set's 64-bit experiment
START_VAL = ["method=ushash", "seed=0,1,2", "model.prototypes_from=val"]
for _set, (_exp, _) in ABLATION_SETS.items():
    STEPS[f"start_val_{_set}"] = f"python -m ushash.sweep -m experiment={_exp} {' '.join(START_VAL)}"

# the previous recipe against the shipped one, 3 seeds (docs/baselines.md "The recipe against the previous one"): a
# variant of each set's 64-bit and bits experiments, beside the experiments' own US-HASH runs (the shipped defaults)
PREVIOUS_RECIPE = ["method=ushash", "seed=0,1,2", "model.lr=0.003", "model.temperature=0.5", "model.loss.distill=10",
                   "model.loss.float=0.5"]
PREVIOUS_LABEL = "previous (lr 3e-3, temperature 0.5, distill 10, float 0.5)"
LATE_EPOCH = 5  # the later epochs' mean val score: from this epoch on (the best epoch's score is their maximum)
PREVIOUS_BITS = [*PREVIOUS_RECIPE, "bits=16,32,128"]  # the same at the other lengths, beside the bits experiments
for _set, (_exp, _) in ABLATION_SETS.items():
    STEPS[f"previous_recipe_{_set}"] = f"python -m ushash.sweep -m experiment={_exp} {' '.join(PREVIOUS_RECIPE)}"
for _set, (_exp, _) in BITS_SETS.items():
    STEPS[f"previous_bits_{_set}"] = f"python -m ushash.sweep -m experiment={_exp} {' '.join(PREVIOUS_BITS)}"

# the 64-bit bars' three methods again, 3 seeds, on the machine this step runs on (docs/baselines.md "The 64-bit
# bars on another machine"): the same code and commands, the heads trained there (over the feature stores it holds,
# extracted there where it has none); on the published runs' CPU model the sweep reads those runs back instead
RERUN64 = ["method=ushash,itq,float", "seed=0,1,2"]
for _set, (_exp, _) in ABLATION_SETS.items():
    STEPS[f"rerun64_{_set}"] = f"python -m ushash.sweep -m experiment={_exp} {' '.join(RERUN64)}"

# the 64-bit bars' three methods on other splits of the same items (data.seed: which items land in val and test),
# 3 seeds each (docs/baselines.md "What another split moves"): the s.e. beside a margin is over training seeds on
# one split; these say what the split itself moves
SPLIT_SEEDS = (1, 2)
# the held-out set (its experiment and folder): its 64-bit rows in the bars table, read as the issue's two sets'
# are (not one of its bars), and its other splits
HELDOUT_SETS = {"openclipart": ("sweep_openclipart64", "openclipart-offline-64b")}
SPLIT_SETS = {**ABLATION_SETS, **HELDOUT_SETS}


def split_overrides(data_seed: int) -> list[str]:
    return ["method=ushash,itq,float", "seed=0,1,2", f"data.seed={data_seed}"]


for _set, (_exp, _) in SPLIT_SETS.items():
    for _s in SPLIT_SEEDS:
        STEPS[f"split_{_set}_{_s}"] = f"python -m ushash.sweep -m experiment={_exp} {' '.join(split_overrides(_s))}"
        if _set in HELDOUT_SETS:
            NEEDS[f"split_{_set}_{_s}"] = [f"{_set}"]   # its manifest, fetched and written
# each set's US-HASH search choice on the other splits of both sets (scripts/search_cross.py --data-seed), beside the
# defaults' runs of the same splits (split_<set>_<seed>): does a choice's gain on val hold on another split?
for _choice in SEARCH_SETS:
    for _to in SEARCH_SETS:
        for _s in SPLIT_SEEDS:
            _step = f"search_split_{_choice}_{_to}_{_s}"
            STEPS[_step] = f"python scripts/search_cross.py --from {_choice} --to {_to} --data-seed {_s}"
            CROSS_STEPS[_step] = (_to, _choice, _s)
            NEEDS[_step] = [f"search_{_choice}_ushash", f"split_{_to}_{_s}"]

# the defaults searched over splits (scripts/search_splits.py): every trial on 3 splits of both sets, then the
# choice and the defaults over seeds 0-2, and on the held-out set's splits (read, never chosen on)
def splits_step(space: str) -> str:
    return "search_splits" if space == "search" else f"search_splits_{space}"


for _space in SPLITS_SPACES:
    STEPS[splits_step(_space)] = ("python scripts/search_splits.py --trials 40 --heldout"
                                  + ("" if _space == "search" else f" --space {_space}"))
    NEEDS[splits_step(_space)] = ["openclipart"]

# a step that is a variant multirun of an experiment: step -> (its experiment's folder, the variant's overrides);
# its results are the variant folder's (ushash.evaluation.sweep.variant_dir)
VARIANT_STEPS = {
    **{ablation_step(_set, _i): (_exp, ablation_overrides(_label))
       for _set, (_, _exp) in ABLATION_SETS.items() for _i, _label in enumerate(ABLATIONS)},
    **{recheck_step(_set, _label): (_exp, recheck_overrides(_label))
       for _set, (_, _exp) in ABLATION_SETS.items() for _label in RECHECK},
    **{f"trained_bits_{_set}": (_exp, TRAINED_BITS) for _set, (_, _exp) in BITS_SETS.items()},
    **{f"start_val_{_set}": (_exp, START_VAL) for _set, (_, _exp) in ABLATION_SETS.items()},
    **{f"previous_recipe_{_set}": (_exp, PREVIOUS_RECIPE) for _set, (_, _exp) in ABLATION_SETS.items()},
    **{f"previous_bits_{_set}": (_exp, PREVIOUS_BITS) for _set, (_, _exp) in BITS_SETS.items()},
    **{f"rerun64_{_set}": (_exp, RERUN64) for _set, (_, _exp) in ABLATION_SETS.items()},
    **{f"split_{_set}_{_s}": (_exp, split_overrides(_s)) for _set, (_, _exp) in SPLIT_SETS.items() for _s in SPLIT_SEEDS},
}

# a markdown file a step writes, published as it is: block -> (file, step, the markdown)
RESULT_BLOCKS = {
    "cachesim-tuxpaint": ("docs/cache.md", "cachesim_tuxpaint", "experiments/cachesim/demo-tuxpaint64/results.md"),
    "budget-heads": ("docs/cache.md", "budget_heads", "experiments/budget-heads/results.md"),
    "false-hit-budget": ("docs/cache.md", "false_hit_budget", "experiments/budget/results.md"),
    "gptcache": ("docs/cache.md", "gptcache_compare", "experiments/gptcache/results.md"),
    "proxy": ("docs/cache.md", "proxy_overhead", "experiments/proxy/results.md"),
    "payload-query": ("docs/cache.md", "payload_query", "experiments/payload_query/results.md"),
    "calibration-rules": ("docs/cache.md", "calibration_rules", "experiments/calibration-rules/results.md"),
    **{f"failures-{s}": ("docs/cache.md", "failures", f"docs/failures/{s}.md") for s in ("penetration", "breakdown", "avalanche")},
    "adaptive-ttl": ("docs/cache.md", "adaptive_ttl", "docs/failures/adaptive_ttl.md"),
    "qos": ("docs/cache.md", "qos", "docs/failures/qos.md"),
    "budget-heads-margin": ("docs/baselines.md", "budget_heads_margin", "experiments/budget-heads-margin/results.md"),
    **{f"cachekey-{_h.replace('_', '-')}{_d}": ("docs/baselines.md", cachekey_step(_h, _d),
                                               f"{cachekey_results(_h, _d)}/results.md")
       for _h in CACHEKEY_HEADS for _d in CACHEKEY_SETS},
}
# a step whose printed markdown is published as is: step -> (file, block)
PRINTED_BLOCKS = {
    "payload_tuxpaint": ("docs/payloads.md", "payload-tuxpaint"),
    "payload_synthetic": ("docs/payloads.md", "payload-synthetic"),
    "payload_speed": ("docs/payloads.md", "payload-speed"),
    "heads_speed": ("docs/benchmarks.md", "heads-speed"),
    "itq_check": ("docs/baselines.md", "itq-check"),
    "hostile_input": ("docs/cache.md", "hostile-input"),
    "offload": ("docs/benchmarks.md", "offload"),
    "json_body": ("docs/benchmarks.md", "json-body"),
    "l2_fetch": ("docs/benchmarks.md", "l2-fetch"),
}
# a sweep's summary: block -> (file, experiment, step)
SWEEP_BLOCKS = {
    "tuxpaint-64b": ("docs/baselines.md", "tuxpaint-offline-64b", "sweep_tuxpaint64"),
    "emoji-64b": ("docs/baselines.md", "emoji-offline-64b", "sweep_emoji64"),
    "tuxpaint-bits": ("docs/baselines.md", "tuxpaint-offline-bits", "sweep_tuxpaint"),
    "emoji-bits": ("docs/baselines.md", "emoji-offline-bits", "sweep_emoji"),
    "synthetic-bits": ("docs/baselines.md", "synthetic", "sweep_synthetic"),
    "openclipart-64b": ("docs/baselines.md", "openclipart-offline-64b", "sweep_openclipart64"),
}


def machine() -> str:
    from ushash.core.provenance import cpu_model
    cores = os.cpu_count()
    try:
        import torch
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except ImportError:  # pragma: no cover
        gpu = "no GPU"
    return f"{cores} {platform.machine()} cores ({cpu_model()}), {gpu}"


#: the packages whose versions the published numbers depend on (linear algebra, training, search)
def versions() -> str:
    """The installed versions of provenance.VERSIONED, e.g. "torch 2.14.1, numpy 2.4.6, ..." (a package not
    installed is left out): the same code gives other numbers under another numpy or scipy (GCCA's
    eigensolver, ITQ's iterations), so each table says what it was made with."""
    from ushash.core.provenance import package_versions

    return ", ".join(f"{name.removesuffix('-cpu').replace('pytorch-', '')} {v}" for name, v in package_versions().items())


def argv_of(command: str) -> list[str]:
    words = command.split()[1:]
    return [sys.executable, *words]


def run_step(name: str) -> None:
    line = STEPS[name]
    print(f"[reproduce] {name}: {line}", flush=True)
    t0 = time.perf_counter()
    log = ROOT / "experiments" / "reproduce" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    # printed into a file of its own, which becomes the step's log only when the command succeeds: a failed or
    # interrupted run once left its partial output as the log that publish prints
    new = log.with_name(f"{name}.new.log")
    with open(new, "w") as out, open(log.with_suffix(".err"), "w") as err:
        rc = subprocess.call(argv_of(line), cwd=ROOT, stdout=out, stderr=err)
    stamp = {"command": line, "date": datetime.date.today().isoformat(), "machine": machine(),
             "versions": versions(), "wall_s": round(time.perf_counter() - t0, 1), "returncode": rc}
    if not rc:
        outputs, made_from, made = digests(name), {n: {**digests(n), **produced(n)} for n in NEEDS.get(name, [])}, \
            produced(name)
        old = stamp_record(name)
        # a step with no result files made its log: the same log is the same result
        same_log = not outputs and old and old.get("log_sha256") == hashlib.sha256(new.read_bytes()).hexdigest()
        if (outputs or same_log) and old and not old.get("returncode") and (
                old["command"], old.get("outputs"), old.get("made_from", {}), old.get("produced", {})) == (
                line, outputs, made_from, made):
            # a run that resumed (a step asked for by another) or repeated its results byte for byte: the stamp and
            # the log of the run that made them stay (a resume's seconds are not the step's wall time)
            if same_log:
                os.replace(new, log)   # the same bytes (a fresh clone has no log: they are ignored)
            else:
                new.unlink()
            print(f"[reproduce] {name}: its results are the ones its stamp describes ({old['date']}); the stamp is kept",
                  flush=True)
            return
        os.replace(new, log)
        stamp["outputs"], stamp["made_from"] = outputs, made_from
        if made:
            stamp["produced"] = made
        stamp["log_sha256"] = hashlib.sha256(log.read_bytes()).hexdigest()
    log.with_suffix(".json").write_text(json.dumps(stamp, indent=1) + "\n")
    if rc:
        raise SystemExit(f"[reproduce] {name} failed (exit {rc}); its output: {new}, {log.with_suffix('.err')}")


def run_readme() -> None:
    """The README's verbs, in the order written, for real (the sweep is its own step; serve is started,
    asked /healthz and stopped)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## The verbs, in order", 1)[1]
    block = next(b for b in section.split("\n\n") if b.startswith("    python -m "))
    for line in block.splitlines():
        words = line.split("#", 1)[0].split()
        verb = words[2]
        if verb == "ushash.sweep":
            continue
        if verb == "ushash.export":   # a rerun replaces the export the last one made (a fresh clone has none)
            words = [*words, "overwrite=true"]
        print(f"[reproduce] readme: {' '.join(words)}", flush=True)
        if verb == "ushash.serve":
            import urllib.request
            proc = subprocess.Popen([sys.executable, *words[1:]], cwd=ROOT)
            try:
                for _ in range(120):
                    time.sleep(1)
                    try:
                        with urllib.request.urlopen("http://127.0.0.1:8470/healthz", timeout=2) as r:
                            print(f"[reproduce] serve: /healthz {r.status}", flush=True)
                            break
                    except OSError:
                        if proc.poll() is not None:
                            raise SystemExit("[reproduce] readme: serve exited before answering /healthz")
                else:
                    raise SystemExit("[reproduce] readme: serve did not answer /healthz in 120 s")
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            continue
        rc = subprocess.call([sys.executable, *words[1:]], cwd=ROOT)
        if rc:
            raise SystemExit(f"[reproduce] readme: `{' '.join(words)}` failed (exit {rc})")


def outputs_of(step: str) -> list[str]:
    """The files of `step` that publish reads (repository-relative): the markdown of its result and sweep
    blocks, of its variant folder or of its search report, and the JSON beside each (results.md's
    results.json, <name>.md's <name>.json)."""
    mds = [md for _, s, md in RESULT_BLOCKS.values() if s == step]
    mds += [f"experiments/{exp}/results.md" for _, exp, s in SWEEP_BLOCKS.values() if s == step]
    from ushash.evaluation.sweep import variant_dir

    variant = VARIANT_STEPS.get(step)
    if step in CROSS_STEPS:   # a set's choice, as the step found it (None: no report of that set)
        got = cross_overrides(*CROSS_STEPS[step])
        variant = got and (_SEARCH[CROSS_STEPS[step][0]][1], got[1])
    if variant:
        mds.append(str(variant_dir(ROOT / "experiments" / variant[0], variant[1]).relative_to(ROOT) / "results.md"))
    if step in SEARCH_STEPS:   # the report of its set and method: the one search_body publishes
        rep = set_search(*SEARCH_STEPS[step])
        if rep is not None:
            mds.append(f"{rep['folder']}/search.md")
    for space in SPLITS_SPACES:   # the report search_splits_body publishes
        if step == splits_step(space) and (rep := splits_report(space)) is not None:
            mds.append(f"{rep['folder']}/search.md")
    return sorted({p for md in mds for p in (md, str(Path(md).with_suffix(".json")))})


def sha256s(paths) -> dict[str, str]:
    """{file: sha256} of those of the (repository-relative) files that exist."""
    return {p: hashlib.sha256((ROOT / p).read_bytes()).hexdigest() for p in paths if (ROOT / p).is_file()}


def digests(step: str) -> dict[str, str]:
    """{file: sha256} of the files of `outputs_of(step)` that exist."""
    return sha256s(outputs_of(step))


def produced(step: str) -> dict[str, str]:
    """{file: sha256} of the files of PRODUCES[step] that exist (not committed: as this checkout holds them)."""
    return sha256s(PRODUCES.get(step, []))


def unstamped() -> tuple[list[str], list[str]]:
    """(why, step) for every step whose results on disk its stamp does not describe: no stamp, a failed last
    run, a stamp without digests, results changed since the stamp, or results made from other results of a
    step it needs than the ones here. A step none of whose results are here is not listed (its blocks are
    left as they are)."""
    problems, steps, read = [], [], {}

    def current(step: str) -> dict[str, str]:   # each step's files read once (a needed step's by every step after it)
        if step not in read:
            read[step] = digests(step)
        return read[step]

    def made(step: str) -> dict[str, str]:   # what a step needed is now: its results, and what its last run produced
        return {**current(step), **((stamp_record(step) or {}).get("produced") or {})}

    # every step with results publish reads (`outputs_of`): a step left out of this list (the searches over splits
    # were) had its report published under the stamp of another run
    for step in sorted(STEPS):
        now, rec = current(step), stamp_record(step)
        if not now and not (rec and NEEDS.get(step)):   # nothing of it here, and nothing it was made from to check
            continue
        if rec is None:
            why = "no stamp: these results were not made by ./run reproduce"
        elif rec.get("returncode"):
            why = f"its last run ({rec.get('date')}) failed with exit {rec['returncode']}"
        elif "outputs" not in rec:
            why = "its stamp records no digests of its results"
        elif rec["outputs"] != now:
            changed = sorted(p for p in set(rec["outputs"]) | set(now) if rec["outputs"].get(p) != now.get(p))
            why = f"{', '.join(changed)} changed since its run of {rec.get('date')} (made outside ./run reproduce?)"
        else:
            other = [n for n in NEEDS.get(step, []) if rec.get("made_from", {}).get(n) != made(n)]
            if not other:
                continue
            why = f"it was made from other {' and '.join(other)} results than the ones here"
        problems.append(f"{step}: {why}")
        steps.append(step)
    order = list(STEPS)   # a step after the steps it needs, as ./run reproduce runs them
    return problems, sorted(steps, key=lambda s: order.index(s) if s in order else len(order))


def stamp_record(step: str) -> dict | None:
    """What run_step wrote of a step's run (command, date, machine, versions, wall time), or None."""
    f = ROOT / "experiments" / "reproduce" / f"{step}.json"
    return json.loads(f.read_text()) if f.exists() else None


def tie_cell(summ_bits: dict, protocol: str) -> str:
    """'mean ± std' of a sweep summary's tie-aware mAP@10 over directions, at one length (summary[method][bits])."""
    return "{:.3f} ± {:.3f}".format(*summ_bits[protocol]["tie_map@10"]["mean"][:2])


def tie_mean(summary: dict, method: str, bits: int, protocol: str) -> float:
    """A sweep summary's tie-aware mAP@10, mean over directions and seeds."""
    return summary[method][str(bits)][protocol]["tie_map@10"]["mean"][0]


def made_on(steps: list[str]) -> str:
    """The machines and package versions the steps ran on, as their stamps recorded them (not this process's:
    a publish on another machine must not restate the runs' provenance), e.g. "2 x86_64 cores, no GPU,
    torch 2.14.1, ..."; distinct ones joined by "; "."""
    seen = []
    recs = list(filter(None, map(stamp_record, steps)))
    for rec in recs:
        made = ", ".join(x for x in (rec["machine"], rec.get("versions")) if x)
        if made not in seen:
            seen.append(made)
    again = reaggregated(recs)
    return "; ".join(seen + [again] if again else seen)


def made_when(steps: list[str], undated: str = "") -> str:
    """"<the dates the steps ran>; <made_on(steps)>", as a generated block's first line states them."""
    dates = sorted({rec["date"] for rec in filter(None, map(stamp_record, steps))})
    return f"{', '.join(dates) or undated}; {made_on(steps)}"


def reaggregated(recs: list[dict]) -> str:
    """"tables re-aggregated from those runs on <dates> (./run reproduce reaggregate)" where a stamp says so."""
    dates = sorted({r["aggregated"]["date"] for r in recs if r.get("aggregated")})
    return f"tables re-aggregated from those runs on {', '.join(dates)} (`./run reproduce reaggregate`)" if dates else ""


def stamp_of(step: str) -> str:
    s = stamp_record(step)
    if s is None:
        return ""
    wall = f"{s['wall_s']:.0f} s" if s["wall_s"] < 120 else f"{s['wall_s'] / 60:.0f} min"
    made_with = f", {s['versions']}" if s.get("versions") else ""
    again = f"; {reaggregated([s])}" if s.get("aggregated") else ""
    return f"`{s['command']}` ({s['date']}, {s['machine']}{made_with}, {wall} wall{again})"


def replace_block(path: Path, name: str, body: str) -> bool:
    text = path.read_text(encoding="utf-8")
    pat = re.compile(rf"(<!-- reproduce:{re.escape(name)} -->\n).*?(<!-- /reproduce:{re.escape(name)} -->)", re.S)
    if not pat.search(text):
        print(f"[reproduce] {path.name}: no block {name!r}; left as is", flush=True)
        return False
    path.write_text(pat.sub(lambda m: m.group(1) + body.rstrip() + "\n" + m.group(2), text), encoding="utf-8")
    return True


def sweep_body(exp: str, step: str) -> str | None:
    res = ROOT / "experiments" / exp / "results.md"
    if not res.exists():
        return None
    md = res.read_text(encoding="utf-8")
    summary = md.split("## Summary", 1)[1].split("\n## ", 1)[0] if "## Summary" in md else md
    return (f"Generated by {stamp_of(step) or '`' + STEPS[step] + '`'}; full tables and plots: "
            f"`experiments/{exp}/results.md`.\n\n#### Summary" + summary)


def printed_log(step: str) -> Path | None:
    """The log a step's printed block is made from, where its stamp describes it: the step's last run
    succeeded and, where the stamp records the log's digest, the log is that one; else None (publish leaves
    the block as it is)."""
    log = ROOT / "experiments" / "reproduce" / f"{step}.log"
    rec = stamp_record(step)
    if not log.exists() or rec is None or rec.get("returncode"):
        return None
    if "log_sha256" in rec and hashlib.sha256(log.read_bytes()).hexdigest() != rec["log_sha256"]:
        return None
    return log


def demo_body() -> str | None:
    log = printed_log("demo")
    if log is None:
        return None
    lines = [l.split("] ", 1)[-1] if l.startswith("[") else l
             for l in log.read_text(encoding="utf-8", errors="replace").splitlines()]
    keep = [l for l in lines if l.strip().startswith(("|", "Protocol", "#"))]
    if not keep:
        return None
    out: list[str] = []
    for l in keep:  # a blank line between a heading or protocol line and a table, as markdown needs
        if out and (l.startswith("|") != out[-1].startswith("|")):
            out.append("")
        out.append(l)
    return f"Printed by {stamp_of('demo')}:\n\n" + "\n".join(out)


def printed_body(step: str) -> str | None:
    log = printed_log(step)
    if log is None or not log.read_text().strip():
        return None
    text = re.sub(r"^### ", "#### ", log.read_text(encoding="utf-8").strip(), flags=re.M)
    return f"Printed by {stamp_of(step)}:\n\n" + text


def ablation_body() -> str | None:
    """The ablation table: per row and set, the val selection score and the test mAP@10 (paired, label) of
    US-HASH's codes, mean ± std over the seeds run (each row's variant folder)."""
    sys.path.insert(0, str(ROOT))
    from ushash.evaluation.sweep import variant_dir
    head = ("| recipe | " + " | ".join(f"{s} val score | {s} test paired | {s} test label" for s in ABLATION_SETS)
            + " |\n|---|" + "---|---|---|" * len(ABLATION_SETS))
    rows, steps = [], []
    for i, label in enumerate(ABLATIONS):
        cells = []
        for dataset, (_, exp) in ABLATION_SETS.items():
            folder = variant_dir(ROOT / "experiments" / exp, ablation_overrides(label))
            res = folder / "results.json"
            if not res.exists():
                cells += ["–"] * 3
                continue
            agg = json.loads(res.read_text())
            vals = [run["val_score"] for run in agg["runs"] if run.get("val_score") is not None]
            summ = agg["summary"][ablation_overrides(label)[0].split("=", 1)[1]]["64"]
            fmt = lambda m: f"{m[0]:.3f} ± {m[1]:.3f}" if m[2] > 1 else f"{m[0]:.3f}"
            cells += [(f"{np.mean(vals):.3f} ± {np.std(vals, ddof=1):.3f}" if len(vals) > 1 else f"{vals[0]:.3f}")
                      if vals else "–",
                      fmt(summ["paired"]["tie_map@10"]["mean"]), fmt(summ["label"]["tie_map@10"]["mean"])]
            steps.append(ablation_step(dataset, i))
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    if all("–" in r for r in rows):
        return None
    n = len(ABLATION_SEEDS.split(","))
    return (f"Generated by `./run reproduce` steps `ablation_<set>_<row>` (each `python -m ushash.sweep -m "
            f"experiment=sweep_<set>64 method=ushash seed={ABLATION_SEEDS} <row's overrides>`; {made_when(steps)}"
            f"). US-HASH's codes at 64 bits, " + (f"mean ± std over {n} seeds" if n > 1 else "one seed (0)")
            + "; val score: the selection "
            "criterion on the val split (what chose the defaults); test: tie-aware mAP@10, mean over directions.\n\n"
            + head + "\n" + "\n".join(rows))


def recheck_body() -> str | None:
    """The ablation's one-seed gains over 3 seeds: per set, the shipped defaults (the 64-bit experiment's US-HASH
    runs) and each row of RECHECK (its variant), with the val score, its gain over the defaults' beside their seed
    spread, the later epochs' mean val and test mAP@10; then the rule's verdict per row, and the ablation's rows
    that score higher on both sets with one seed but are not rechecked (RECHECK is written by hand)."""
    sys.path.insert(0, str(ROOT))
    from ushash.evaluation.search import mean_std as ms
    from ushash.evaluation.sweep import variant_dir

    def read(res: Path) -> dict | None:
        if not res.exists():
            return None
        agg = json.loads(res.read_text())
        runs = [r for r in agg["runs"] if r["method"] == "ushash" and r.get("val_scores")]
        return {"val": [r["val_score"] for r in runs], "late": [np.mean(r["val_scores"][LATE_EPOCH:]) for r in runs],
                "summ": agg["summary"]["ushash"]["64"]}

    rows, steps, gains = [], [], {label: {} for label in RECHECK}
    for dataset, (_, exp) in ABLATION_SETS.items():
        base = read(ROOT / "experiments" / exp / "results.json")
        found = {label: read(variant_dir(ROOT / "experiments" / exp, recheck_overrides(label)) / "results.json")
                 for label in RECHECK}
        if base is None or not any(found.values()):
            continue
        steps.append(ABLATION_SETS[dataset][0])
        spread = float(np.std(base["val"], ddof=1))
        for label, got in [("shipped defaults", base), *found.items()]:
            if got is None:
                continue
            gain = "–"
            if got is not base:
                steps.append(recheck_step(dataset, label))
                g = float(np.mean(got["val"]) - np.mean(base["val"]))
                gains[label][dataset] = (g, spread)
                gain = f"{g:+.3f} ({spread:.3f})"
            rows.append(f"| {label} | {dataset} | {len(got['val'])} | {ms(got['val'])} | {gain} | {ms(got['late'])} | "
                        f"{tie_cell(got['summ'], 'paired')} | {tie_cell(got['summ'], 'label')} |")
    if not rows:
        return None
    verdicts = []
    for label, by_set in gains.items():
        if not by_set:
            continue
        passes = len(by_set) == len(ABLATION_SETS) and all(beyond(g, sp) for g, sp in by_set.values())
        verdicts.append(f"- {label}: {'passes' if passes else 'does not pass'} ("
                        + ", ".join(f"{d} {g:+.3f} against {sp:.3f}" for d, (g, sp) in by_set.items()) + ")")
    # the ablation's rows higher than its defaults' row on val on every set, with its one seed
    one_seed = {}
    for label in ABLATIONS:
        vals = []
        for dataset, (_, exp) in ABLATION_SETS.items():
            res = variant_dir(ROOT / "experiments" / exp, ablation_overrides(label)) / "results.json"
            got = json.loads(res.read_text()) if res.exists() else None
            vals.append(np.mean([r["val_score"] for r in got["runs"] if r.get("val_score") is not None])
                        if got else None)
        one_seed[label] = vals
    ref = one_seed.pop("shipped defaults", None)
    higher = [label for label, vals in one_seed.items() if ref and None not in ref and None not in vals
              and all(v > r for v, r in zip(vals, ref))]
    missing = [label for label in higher if label not in RECHECK]
    return (f"Generated by `./run reproduce` steps `sweep_<set>64` and `recheck_<set>_<row>` (each `python -m ushash.sweep "
            f"-m experiment=sweep_<set>64 method=ushash seed={RECHECK_SEEDS} <row's overrides>`, <row> the row's "
            f"index in the ablation table, the shipped defaults 0; {made_when(steps)}). US-HASH's "
            "codes at 64 bits, mean ± std over the seeds; "
            "val score: the kept checkpoint's; against the defaults: the gain in mean val score, beside the defaults' "
            f"own seed spread (std); later epochs: the mean val score of epochs {LATE_EPOCH} onwards; test: tie-aware "
            "mAP@10, mean over directions.\n\n"
            "| recipe | set | seeds | val score | against the defaults (their spread) | later epochs' val | test paired | "
            "test label |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
            + "\n\nBy the rule (higher on val on both sets, by more than the defaults' seed spread on each):\n"
            + "\n".join(verdicts)
            + ("\n\nThe ablation's rows higher on val on both sets with one seed, not rechecked here: "
               + "; ".join(missing) + "." if missing else
               "\n\nEvery row of the ablation that scores higher on val on both sets with one seed is rechecked here."))


def start_val_body() -> str | None:
    """Per set: every seed's val score from each start and the start kept, then the kept heads' test mAP@10
    (mean ± std over seeds) beside the 64-bit experiment's ITQ, the float space and US-HASH with the
    shipped defaults (the ITQ start), all on the same test split."""
    sys.path.insert(0, str(ROOT))
    from ushash.evaluation.sweep import run_path, variant_dir
    lines, stamps = [], []
    for dataset, (published, exp) in ABLATION_SETS.items():
        folder = variant_dir(ROOT / "experiments" / exp, START_VAL)
        base = ROOT / "experiments" / exp / "results.json"
        if not (folder / "results.json").exists() or not base.exists():
            continue
        agg, ref = json.loads((folder / "results.json").read_text()), json.loads(base.read_text())
        runs = {run["seed"]: run_path(ROOT / "experiments" / exp, run["key"], run["digest"]) / "result.json"
                for run in agg["runs"]}
        if not all(f.exists() for f in runs.values()):  # the per-run results are not committed (a fresh clone)
            print(f"[reproduce] start-val: the runs of {folder} are not here; block left as is", flush=True)
            return None
        step = ROOT / "experiments" / "reproduce" / f"start_val_{dataset}.json"
        made = json.loads(step.read_text())["date"] if step.exists() else \
            datetime.date.fromtimestamp((folder / "results.json").stat().st_mtime)
        # the rows quote the 64-bit experiment's ITQ, float space and defaults too: its run's date and machine as well
        on, ref_rec = made_on([f"start_val_{dataset}", published]), stamp_record(published)
        ref_made = f" (the 64-bit experiment beside it: {ref_rec['date']})" if ref_rec else ""
        stamps.append(f"{dataset}: {made}{ref_made}, {agg['runs_wall_s'] / 60:.0f} min of training summed over its runs"
                      f"{', ' + on if on else ''}")
        kept = []
        for seed in sorted(runs):
            run = next(r for r in agg["runs"] if r["seed"] == seed)
            res = json.loads(runs[seed].read_text())
            kept.append(res.get("start"))
            tie = {p: np.mean([r["tie_map@10"] for r in res["rows"] if r["method"] == "ushash" and r["protocol"] == p])
                   for p in ("paired", "label")}
            lines.append(f"| {dataset} | {run['seed']} | " + " | ".join(f"{res['starts'][s]:.4f}" for s in ("itq", "lsh"))
                         + f" | {res.get('start')} | {tie['paired']:.3f} | {tie['label']:.3f} |")
        cell = lambda summ, m, p: tie_cell(summ[m]["64"], p)
        val_p, val_l = cell(agg["summary"], "ushash", "paired"), cell(agg["summary"], "ushash", "label")
        itq_p, flt_p = ref["summary"]["itq"]["64"]["paired"]["tie_map@10"]["mean"][0], \
            ref["summary"]["float"]["64"]["paired"]["tie_map@10"]["mean"][0]
        mean_p = agg["summary"]["ushash"]["64"]["paired"]["tie_map@10"]["mean"][0]
        lines.append(f"| **{dataset}, kept heads** | 3 seeds | | | {kept.count('lsh')} of 3 lsh | **{val_p}** | **{val_l}** |")
        lines.append(f"| {dataset}, shipped defaults (ITQ start), ITQ, float space | same test split | | | | "
                     f"{cell(ref['summary'], 'ushash', 'paired')}; ITQ {itq_p:.3f}; float {flt_p:.3f} | "
                     f"{cell(ref['summary'], 'ushash', 'label')}; ITQ "
                     f"{ref['summary']['itq']['64']['label']['tie_map@10']['mean'][0]:.3f} |")
        lines.append(f"| {dataset}: kept heads against the bars | | | | | ITQ {mean_p - itq_p:+.3f}; "
                     f"{times(mean_p / flt_p)} float | |")
    if not lines:
        return None
    return (f"Generated by `./run reproduce start_val_tuxpaint start_val_emoji` (each `python -m ushash.sweep -m "
            f"experiment=sweep_<set>64 {' '.join(START_VAL)}`; {'; '.join(stamps)}). US-HASH at 64 bits trained "
            "from each closed-form start, the start with the higher val score kept; test: tie-aware mAP@10, mean "
            "over directions.\n\n| set | seed | val score, ITQ start | val score, LSH start | kept | test paired | "
            "test label |\n|---|---|---|---|---|---|---|\n" + "\n".join(lines))


def previous_recipe_body() -> str | None:
    """Per set and code length: the shipped recipe's 3 seeds (the 64-bit and the bits experiments' US-HASH
    runs) against the previous recipe's (their variants): the kept checkpoint's val score, the mean val score
    of the later epochs (not a maximum over noisy epochs), and test mAP@10, each mean ± std over the seeds."""
    sys.path.insert(0, str(ROOT))
    from ushash.evaluation.sweep import variant_dir
    ms = lambda xs: f"{np.mean(xs):.4f} ± {np.std(xs, ddof=1):.4f}"
    rows, steps = [], []
    for dataset in ABLATION_SETS:
        grids = [(ABLATION_SETS[dataset][1], PREVIOUS_RECIPE, f"sweep_{dataset}64", f"previous_recipe_{dataset}"),
                 (BITS_SETS[dataset][1], PREVIOUS_BITS, f"sweep_{dataset}", f"previous_bits_{dataset}")]
        for exp, overrides, base_step, prev_step in grids:
            base = ROOT / "experiments" / exp / "results.json"
            prev = variant_dir(ROOT / "experiments" / exp, overrides) / "results.json"
            if not (base.exists() and prev.exists()):
                continue
            steps += [base_step, prev_step]
            found = {label: json.loads(res.read_text()) for label, res in (("shipped", base), (PREVIOUS_LABEL, prev))}
            for bits in sorted({int(b) for b in found[PREVIOUS_LABEL]["summary"]["ushash"]}):
                for label, agg in found.items():
                    runs = [r for r in agg["runs"] if r["method"] == "ushash" and r["bits"] == bits and r.get("val_scores")]
                    summ = agg["summary"]["ushash"][str(bits)]
                    rows.append(f"| {dataset} | {bits} | {label} | {len(runs)} | {ms([r['val_score'] for r in runs])} | "
                                f"{ms([np.mean(r['val_scores'][LATE_EPOCH:]) for r in runs])} | {tie_cell(summ, 'paired')} | "
                                f"{tie_cell(summ, 'label')} |")
    if not rows:
        return None
    return (f"Generated by `./run reproduce` steps `sweep_<set>64`, `sweep_<set>`, `previous_recipe_<set>` and "
            f"`previous_bits_<set>` (`python -m ushash.sweep -m experiment=sweep_<set>64 {' '.join(PREVIOUS_RECIPE)}`, and "
            f"`experiment=sweep_<set>` with `bits=16,32,128`; {made_when(steps)}). US-HASH's codes, "
            f"mean ± std over the seeds; val score: the kept checkpoint's (the best epoch's); later epochs: the mean val "
            f"score of epochs {LATE_EPOCH} onwards; test: tie-aware mAP@10, mean over directions.\n\n"
            "| set | bits | recipe | seeds | val score | later epochs' val | test paired | test label |\n"
            "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))


def trained_bits_body() -> str | None:
    """Per set, the trained baselines' summary rows at 16, 32 and 128 bits (the variant's results.md)."""
    sys.path.insert(0, str(ROOT))
    from ushash.evaluation.sweep import variant_dir
    parts = []
    for dataset, (_, exp) in BITS_SETS.items():
        res = variant_dir(ROOT / "experiments" / exp, TRAINED_BITS) / "results.md"
        if not res.exists():
            continue
        md = res.read_text(encoding="utf-8")
        summary = md.split("## Summary", 1)[1].split("\n## ", 1)[0] if "## Summary" in md else md
        parts.append(f"Generated by {stamp_of(f'trained_bits_{dataset}') or '`' + STEPS[f'trained_bits_{dataset}'] + '`'}; "
                     f"full tables: `{res.relative_to(ROOT)}`.\n\n#### {dataset}: summary" + summary.rstrip())
    return "\n\n".join(parts) or None


def search_body() -> str | None:
    """Per set and trained method, the search report (experiments/search/<experiment>-<method>-64b-s0-*/
    search.json): the trial chosen on val, and the defaults and the choice over seeds, val score and test
    mAP@10 (tie-aware, paired and label), mean ± std."""
    sys.path.insert(0, str(ROOT))
    from ushash.evaluation.search import mean_std, override_value

    rows, steps = [], []
    for dataset in SEARCH_SETS:
        for method in SEARCH_METHODS:
            rep = set_search(dataset, method)
            if rep is None:
                continue
            steps.append(f"search_{dataset}_{method}")
            seeds = rep.get("over_seeds", {})
            cells = []
            for label in ("defaults", "chosen"):
                rec = seeds.get(label)
                cells += ([mean_std(rec["val_score"]), mean_std([t.get("paired") for t in rec["test"]]),
                           mean_std([t.get("label") for t in rec["test"]])] if rec else ["–"] * 3)
            chosen = rep["chosen"]
            what = "the defaults" if rep["defaults"] and chosen["number"] == rep["defaults"]["number"] else \
                ", ".join(f"`{k}={override_value(v)}`" for k, v in chosen["params"].items())
            rows.append(f"| {dataset} | {method} | {len(rep['trials'])} | {chosen['number']}: {what} | "
                        + " | ".join(cells) + f" | {trials_read(rep['trials'])} | `{Path(rep['folder']).name}` |")
    if not rows:
        return None
    cross = cross_table(steps)
    return (f"Generated by `./run reproduce` steps `search_<set>_<method>` (each `python -m ushash.search "
            f"experiment=sweep_<set>64 method=<method> search.trials={SEARCH_TRIALS}`; {made_when(steps, 'undated')}"
            f"). {SEARCH_TRIALS} trials at seed 0 chosen on val; then the defaults and the chosen "
            "settings each over seeds 0, 1, 2: val score (the selection criterion), test tie-aware mAP@10 mean over "
            "directions, mean ± std over the seeds. Every trial, with its test scores for reading only: "
            "`experiments/search/<folder>/search.md`.\n\n"
            "| set | method | trials | chosen on val (trial: settings) | defaults: val | test paired | test label "
            "| chosen: val | test paired | test label | trials: distinct val scores; val-test paired correlation; "
            "best test paired trial | folder |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(rows) + cross)


def trials_read(trials: list[dict]) -> str:
    """What a search's trials say of val as a guide to test (for reading; test chose nothing): how many
    distinct val scores, the correlation of val score and test paired mAP@10 over the trials, and which
    trial scored best on test paired."""
    val = np.array([t["val_score"] for t in trials], dtype=float)
    paired = np.array([t["test"]["paired"] for t in trials], dtype=float)
    distinct = len(np.unique(val.round(6)))
    corr = f"{np.corrcoef(val, paired)[0, 1]:.2f}" if distinct > 1 and paired.std() > 0 else "–"
    return f"{distinct}; {corr}; {trials[int(np.argmax(paired))]['number']}"


def cross_table(steps: list[str]) -> str:
    """Each set's US-HASH choice trained on the other set over seeds 0-2 (`search_cross_<set>`, a variant of the
    set's 64-bit experiment), beside that set's defaults over the same seeds (its own search's)."""
    from ushash.evaluation.search import mean_std
    from ushash.evaluation.sweep import variant_dir

    rows = []
    for to in SEARCH_SETS:
        got, own = cross_overrides(to), set_search(to)
        if got is None or own is None:
            continue
        other, overrides = got
        res = variant_dir(ROOT / "experiments" / _SEARCH[to][1], overrides) / "results.json"
        if not res.exists() or "defaults" not in own.get("over_seeds", {}):
            continue
        agg = json.loads(res.read_text())
        summ = agg["summary"]["ushash"]["64"]
        d = own["over_seeds"]["defaults"]
        rows.append(f"| {to} | {other}'s choice | {mean_std([r['val_score'] for r in agg['runs']])} | "
                    f"{tie_cell(summ, 'paired')} | {tie_cell(summ, 'label')} | "
                    f"{mean_std(d['val_score'])} | {mean_std([t['paired'] for t in d['test']])} | "
                    f"{mean_std([t['label'] for t in d['test']])} |")
        steps.append(f"search_cross_{to}")
    if not rows:
        return ""
    return ("\n\nEach set's US-HASH choice trained on the other set (`python scripts/search_cross.py --to <set>`: "
            "the sweep over seeds 0, 1, 2), beside that set's defaults over the same seeds:\n\n"
            "| set | settings | val score | test paired | test label | defaults: val score | test paired | test label |\n"
            "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))


def decimals(x: float, side, least: int, most: int = 6) -> int:
    """How many decimals to print `x` with beside a verdict: `least`, more (up to `most`) where fewer would round
    it to the other side (`side(rounded) != side(x)`: 0.89996 printed "0.900x" beside "missed")."""
    k = least
    while k < most and side(round(x, k)) != side(x):
        k += 1
    return k


def amount(m: float, least: int) -> str:
    """A margin a bar was met or missed by, never printed as 0 when it is not ("missed by 0.0000")."""
    return f"{m:.{decimals(m, lambda v: v == 0, least)}f}"


def versus(a: float, b: float, least: int = 3) -> str:
    """"a vs b", with the decimals that keep their order (never "0.487 vs 0.487" beside "missed")."""
    k = max(decimals(a, lambda v: v >= b, least), decimals(b, lambda v: a >= v, least))
    return f"{a:.{k}f} vs {b:.{k}f}"


def times(x: float, bar: float = 0.9) -> str:
    """A ratio against its bar as the tables print it, "0.97x": 2 decimals, more where 2 would round it onto the
    bar from the other side (0.897 is "0.897x", not "0.90x" beside "missed")."""
    return f"{x:.{decimals(x, lambda v: v >= bar, 2)}f}x"


def short_of(x: float, bar: float = 0.9) -> str:
    """The verdict of a ratio against its bar: "met", or "**missed by 0.13x**" (more decimals where 2 show 0)."""
    return "met" if x >= bar else f"**missed by {amount(bar - x, 2)}x**"


def rerun64_body() -> str | None:
    """Per set: the 64-bit bars (paired >= ITQ + 0.03 and >= 0.9x the float space, label >= ITQ) from the
    published experiment and from its rerun on another machine (`rerun64_<set>`), each with its machine and
    date from its stamp."""
    sys.path.insert(0, str(ROOT))
    from ushash.evaluation.sweep import variant_dir

    def row(dataset, s, rec, what):
        us, itq, flt = (tie_mean(s, m, 64, "paired") for m in ("ushash", "itq", "float"))
        ul, il = tie_mean(s, "ushash", 64, "label"), tie_mean(s, "itq", 64, "label")
        cpu = rec["machine"].split(" cores (", 1)[-1].rsplit("), ", 1)[0]
        gain = us - itq
        return (f"| {dataset} | {what}: {cpu}, {rec['date']} | {us:.3f} | "
                f"{itq:.3f} | {gain:+.{decimals(gain, lambda v: v >= 0.03, 3)}f} ({'met' if gain >= 0.03 else 'missed'}) | "
                f"{flt:.3f} | {times(us / flt)} ({'met' if us / flt >= 0.9 else 'missed'}) | {versus(ul, il)} "
                f"({'met' if ul >= il else 'missed'}) |")

    def runs(results: dict) -> set:
        """The runs a sweep's table read, by key and settings digest (the digest names the CPU model)."""
        return {(x["key"], x["digest"]) for x in results["runs"]}

    rows, cmds, resumed = [], [], []
    for dataset, (published, exp) in ABLATION_SETS.items():
        base = ROOT / "experiments" / exp / "results.json"
        again = variant_dir(ROOT / "experiments" / exp, RERUN64) / "results.json"
        step, rec_base = f"rerun64_{dataset}", stamp_record(published)
        rec = stamp_record(step)
        if not (base.exists() and again.exists() and rec and rec_base):
            continue
        base_res, again_res = json.loads(base.read_text()), json.loads(again.read_text())
        if runs(again_res) <= runs(base_res):
            # on the published runs' CPU model the sweep resumes them: nothing was trained again (such a "rerun"
            # was once shown as one, with the date and machine of the step that read them back)
            resumed.append(f"{dataset} ({rec['date']})")
            continue
        rows.append(row(dataset, base_res["summary"], rec_base, "published"))
        rows.append(row(dataset, again_res["summary"], rec, "rerun"))
        cmds.append(stamp_of(step))
    if resumed and not rows:
        return ("No rerun on another machine is recorded: the last `./run reproduce rerun64_tuxpaint rerun64_emoji` "
                f"({', '.join(resumed)}) ran on the CPU model of the published runs, where the sweep reads those runs back "
                "(a run is keyed by its settings and the CPU model) instead of training them again. Run it on another "
                "CPU model to fill this table.")
    if not rows:
        return None
    return ("Generated by `./run reproduce rerun64_tuxpaint rerun64_emoji` (" + "; ".join(cmds) + "), beside the "
            "published 64-bit experiments above. Tie-aware mAP@10, mean over directions and 3 seeds; the same code, "
            "commands and defaults, the heads trained on the machine named over the feature stores it held (the float "
            "space reads the features alone: an equal float score says they are the same features).\n\n"
            "| set | run | US-HASH paired | ITQ paired | US-HASH - ITQ (bar +0.03) | float space | US-HASH / float "
            "(bar 0.9x) | label, US-HASH vs ITQ |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))


def split_body() -> str | None:
    """Per set (SPLIT_SETS): the 64-bit bars' margins on the published split (data.seed=0, the experiment) and on
    SPLIT_SEEDS' splits (their variants), each over 3 training seeds, then their mean and range over the splits."""
    sys.path.insert(0, str(ROOT))
    from ushash.evaluation.sweep import variant_dir
    rows, steps = [], []
    for dataset, (step0, exp) in SPLIT_SETS.items():
        found = [(0, ROOT / "experiments" / exp / "results.json", step0)] + [
            (d, variant_dir(ROOT / "experiments" / exp, split_overrides(d)) / "results.json", f"split_{dataset}_{d}")
            for d in SPLIT_SEEDS]
        found = [(d, json.loads(f.read_text()), st) for d, f, st in found if f.exists()]
        if len(found) < 2:
            continue
        margins = {"paired": [], "label": [], "ratio": []}
        for d, agg, st in found:
            steps.append(st)
            s = agg["summary"]
            us, itq, flt = (tie_mean(s, m, 64, "paired") for m in ("ushash", "itq", "float"))
            ul, il = tie_mean(s, "ushash", 64, "label"), tie_mean(s, "itq", 64, "label")
            margins["paired"].append(us - itq)
            margins["label"].append(ul - il)
            margins["ratio"].append(us / flt)
            n = agg.get("n_rows_test", {}).get("image", "")
            rows.append(f"| {dataset} | {d}{' (published)' if d == 0 else ''} | {n} | {us:.3f} | {itq:.3f} | "
                        f"{us - itq:+.3f} (s.e. {se_diff(s, 64, 'paired', 'ushash', 'itq'):.3f}) | {flt:.3f} | "
                        f"{times(us / flt)} | {ul - il:+.3f} (s.e. {se_diff(s, 64, 'label', 'ushash', 'itq'):.3f}) |")
        span = lambda xs, f: f"{f(np.mean(xs))} ({f(min(xs))} to {f(max(xs))})"
        rows.append(f"| **{dataset}** | **{len(found)} splits: mean (range)** | | | | "
                    f"**{span(margins['paired'], lambda x: f'{x:+.3f}')}** | | "
                    f"**{span(margins['ratio'], times)}** | **{span(margins['label'], lambda x: f'{x:+.3f}')}** |")
    if not rows:
        return None
    return (f"Generated by `./run reproduce` steps `sweep_<set>64` and `split_<set>_<data.seed>` (each `python -m "
            f"ushash.sweep -m experiment=sweep_<set>64 {' '.join(split_overrides(0)[:-1])} data.seed=<data.seed>`; "
            f"{made_when(steps)}). US-HASH with the shipped defaults, ITQ and the float space at 64 "
            "bits on other splits of the same items (`data.seed`: which items land in val and test; 0 is the "
            "published split), each over training seeds 0, 1, 2; tie-aware mAP@10, mean over directions; s.e.: of "
            "the difference of the two seed means, over training seeds on that split.\n\n"
            "| set | split (data.seed) | test images | US-HASH paired | ITQ paired | US-HASH - ITQ (bar +0.03) | "
            "float space | US-HASH / float (bar 0.9x) | label: US-HASH - ITQ (bar >= 0) |\n"
            "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))


def search_split_body() -> str | None:
    """Each set's US-HASH search choice against the defaults, on each split of each set, over seeds 0-2: on the
    published split from the search's own report (its set) or `search_cross_<set>` (the other set), on the
    others from `search_split_<choice>_<set>_<seed>` beside the defaults' runs of `split_<set>_<seed>`; val score
    (what a choice is made by), its gain, and test paired mAP@10; then the gain's mean and range over the splits."""
    sys.path.insert(0, str(ROOT))
    from ushash.evaluation.search import mean_std as ms
    from ushash.evaluation.sweep import variant_dir

    def runs_of(res: Path) -> tuple[list[float], float] | None:   # (US-HASH's val scores, its test paired mean)
        if not res.exists():
            return None
        agg = json.loads(res.read_text())
        return ([r["val_score"] for r in agg["runs"] if r["method"] == "ushash" and r.get("val_score") is not None],
                tie_mean(agg["summary"], "ushash", 64, "paired"))

    rows, steps = [], []
    for choice in SEARCH_SETS:
        mine = set_search(choice)
        if mine is None:
            continue
        for to in SEARCH_SETS:
            own, exp = set_search(to), ROOT / "experiments" / _SEARCH[to][1]
            if own is None:
                continue
            found = []
            steps += [f"search_{choice}_ushash", f"search_{to}_ushash"]   # the reports read
            published = (own["over_seeds"]["chosen"] if to == choice else None), own["over_seeds"]["defaults"]
            if to != choice and (cross := cross_overrides(to, choice)) is not None:
                got = runs_of(variant_dir(exp, cross[1]) / "results.json")
                published = ({"val_score": got[0], "test": [{"paired": got[1]}]} if got else None), published[1]
                if got:
                    steps.append(f"search_cross_{to}")
            if published[0] is not None:
                found.append((0, *[(o["val_score"], float(np.mean([t["paired"] for t in o["test"]]))) for o in published]))
            for d in SPLIT_SEEDS:
                got = cross_overrides(to, choice, d)
                c = got and runs_of(variant_dir(exp, got[1]) / "results.json")
                b = runs_of(variant_dir(exp, split_overrides(d)) / "results.json")
                if c and b:
                    found.append((d, c, b))
                    steps += [f"search_split_{choice}_{to}_{d}", f"split_{to}_{d}"]
            if len(found) < 2:
                continue
            gains = []
            for d, (cv, ct), (bv, bt) in found:
                gains.append(float(np.mean(cv) - np.mean(bv)))
                rows.append(f"| {choice}'s | {to} | {d}{' (published)' if d == 0 else ''} | {ms(cv)} | {ms(bv)} | "
                            f"{gains[-1]:+.3f} | {ct:.3f} / {bt:.3f} |")
            rows.append(f"| **{choice}'s** | **{to}** | **{len(found)} splits: mean (range)** | | | **{np.mean(gains):+.3f} "
                        f"({min(gains):+.3f} to {max(gains):+.3f})** | |")
    if not rows:
        return None
    return (f"Generated by `./run reproduce` steps `search_<set>_ushash`, `search_cross_<set>`, `split_<set>_<seed>` and "
            f"`search_split_<choice>_<set>_<seed>` (each `python scripts/search_cross.py --from <choice> --to <set> "
            f"--data-seed <seed>`; {made_when(steps)}). Each set's US-HASH search choice (\"A budgeted "
            "search on val\") against the shipped defaults on each split of each set (`data.seed`; 0 is the published split), "
            "over training seeds 0, 1, 2: val score (what a choice is made by), mean ± std; its gain over the "
            "defaults'; test: tie-aware paired mAP@10, mean over directions and seeds.\n\n"
            "| choice | trained on | split (data.seed) | val score | defaults' val score | gain | test paired: choice / "
            "defaults |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows))


def search_splits_body(space: str = "search") -> str | None:
    """The report of `search_splits` over `space` (experiments/search/splits-ushash-64b-*/search.md), as it is."""
    rep, step = splits_report(space), splits_step(space)
    if rep is None:
        return None
    text = re.sub(r"^#+ ", "#### ", (ROOT / rep["folder"] / "search.md").read_text(encoding="utf-8").strip(), flags=re.M)
    return f"Generated by `./run reproduce {step}` (`{STEPS[step]}`; {made_when([step])}):\n\n{text}"


def se_diff(summary: dict, bits: int, protocol: str, *methods: str) -> float:
    """The standard error of the difference of the methods' seed means (tie-aware mAP@10), from each one's
    spread over its seeds in a sweep summary."""
    cells = [summary[m][str(bits)][protocol]["tie_map@10"]["mean"] for m in methods]
    return math.sqrt(sum(sd ** 2 / n for _, sd, n in cells))


def bars_body() -> str | None:
    """US-HASH against the bars of its issue, from the published tables' own results: at 64 bits (3 seeds)
    paired mAP@10 >= ITQ + 0.03 and >= 0.9 x the float shared space, label >= ITQ; at 16, 32 and 128 bits
    >= ITQ on both protocols; as a cache key (codes only, radius 2) false hits per request <= LSH codes of z.
    Each cell: the numbers, the margin, met or missed. A held-out set (HELDOUT_SETS) adds its 64-bit rows."""
    def diff(summary, bits, protocol, u, i, bar=0.0, ref="itq"):  # "+0.005, s.e. 0.011": on the verdict's side of bar
        return (f"{u - i:+.{decimals(u - i, lambda v: v >= bar - 1e-9, 3)}f}, "
                f"s.e. {se_diff(summary, bits, protocol, 'ushash', ref):.3f}")

    def verdict(margin: float) -> str:
        return "met" if margin >= -1e-9 else f"**missed by {amount(-margin, 3)}**"

    rows, sources = [], []
    sets = [(d, exp64, d) for d, (_, exp64) in ABLATION_SETS.items()] + [
        (d, exp64, f"{d} (held out)") for d, (_, exp64) in HELDOUT_SETS.items()]
    for dataset, exp64, name in sets:
        f64, fbits = (ROOT / "experiments" / exp64 / "results.json",
                      ROOT / "experiments" / BITS_SETS[dataset][1] / "results.json" if dataset in BITS_SETS else None)
        if not f64.exists():
            continue
        s = json.loads(f64.read_text())["summary"]
        us, itq, flt = (tie_mean(s, m, 64, "paired") for m in ("ushash", "itq", "float"))
        rows.append(f"| {name} | 64 bits, paired >= ITQ + 0.03 | {us:.3f} vs ITQ {itq:.3f} ({diff(s, 64, 'paired', us, itq, 0.03)}) | "
                    f"{verdict(us - itq - 0.03)} |")
        rows.append(f"| {name} | 64 bits, paired >= 0.9 x float space | {us:.3f} of {flt:.3f} ({times(us / flt)}, "
                    f"s.e. {se_diff(s, 64, 'paired', 'ushash', 'float') / flt:.2f}x) | {short_of(us / flt)} |")
        ul, il = tie_mean(s, "ushash", 64, "label"), tie_mean(s, "itq", 64, "label")
        rows.append(f"| {name} | 64 bits, label >= ITQ | {versus(ul, il)} ({diff(s, 64, 'label', ul, il)}) | {verdict(ul - il)} |")
        sources.append(f"`experiments/{exp64}/results.json`")
        if fbits is not None and fbits.exists():
            b = json.loads(fbits.read_text())["summary"]
            for bits in (16, 32, 128):
                for p in ("paired", "label"):
                    u, i = tie_mean(b, "ushash", bits, p), tie_mean(b, "itq", bits, p)
                    rows.append(f"| {name} | {bits} bits, {p} >= ITQ | {versus(u, i)} ({diff(b, bits, p, u, i)}) | {verdict(u - i)} |")
            sources.append(f"`experiments/{BITS_SETS[dataset][1]}/results.json`")
        key = ROOT / "experiments" / "cachesim" / f"cachekey-{dataset}64" / "results.json"
        if key.exists():
            by = {r["method"]: r for r in json.loads(key.read_text())["rows"]}
            u = next(r for m, r in by.items() if m.startswith("US-HASH") and m.endswith(" only"))
            lsh = next(r for m, r in by.items() if m.startswith("LSH") and m.endswith(" only"))
            rows.append(f"| {name} | cache key, radius 2, codes only: false hits / request <= LSH codes of z | "
                        f"{u['false_hit_rate']:.4f} vs {lsh['false_hit_rate']:.4f} (hit rate {u['hit_rate']:.3f} vs "
                        f"{lsh['hit_rate']:.3f}) | "
                        + ("met" if u["false_hit_rate"] <= lsh["false_hit_rate"]
                           else f"**missed by {amount(u['false_hit_rate'] - lsh['false_hit_rate'], 4)}**") + " |")
            sources.append(f"`{key.relative_to(ROOT)}`")
    if not rows:
        return None
    return ("Computed by `./run reproduce publish` from " + ", ".join(sources) + " (the tables above; tie-aware "
            "mAP@10, mean over directions and 3 seeds; the shipped defaults, every baseline's space chosen on val; s.e.: "
            "the standard error of the difference of the two seed means, from each method's spread over its seeds, "
            "which says how far a margin is from noise; a set marked held out is not one of the issue's sets: no default or "
            "option was chosen on it).\n\n"
            "| set | bar | US-HASH vs reference | |\n|---|---|---|---|\n" + "\n".join(rows))


def cache_bars_body() -> str | None:
    """The cache's bars (docs/cache.md "The bars"), from the false-hit budget's, GPTCache comparison's and
    proxy's results.json, at BAR_BUDGET: test false hits per hit <= the budget (95 % upper bound), headroom
    captured >= 60 %, hit rate >= real GPTCache's at no more false hits per hit (GPTCache's threshold chosen on
    test: its best case), and the proxy's saving and overhead."""
    budget, gpt, proxy = (ROOT / "experiments" / d / "results.json" for d in ("budget", "gptcache", "proxy"))
    if not budget.exists():
        return None
    rows: dict[str, dict[str, str]] = {}
    sets = []
    for r in json.loads(budget.read_text())["results"]:
        sets.append(r["dataset"])
        for b, res in r["budgets"].items():
            if float(b) != BAR_BUDGET:   # the other budgets are the block's rows, not bars
                continue
            t, cap = res["test"], float(b)
            rows.setdefault(f"test false hits per hit <= {cap:.0%} (95 % upper bound)", {})[r["dataset"]] = (
                ("met" if t["false_per_hit_upper"] <= cap else "**missed**") +
                f": {t['false_hits']} of {t['hits']:,} hits (upper {t['false_per_hit_upper']:.3%})")
            h = t["headroom_captured"]
            rows.setdefault("headroom captured >= 60 %", {})[r["dataset"]] = (
                (f"met by {amount((h - 0.6) * 100, 1)} points" if h >= 0.6 else f"**missed** by {amount((0.6 - h) * 100, 1)} points")
                + f": {h:.1%} (hit rate {t['hit_rate']:.4f}; exact {t['exact_hit_rate']:.4f}, oracle {t['oracle_hit_rate']:.4f})")
    if gpt.exists():
        for r in json.loads(gpt.read_text())["results"]:
            for emb, e in r["embeddings"].items():
                for b, u in r["ushash"].items():
                    if float(b) != BAR_BUDGET:
                        continue
                    ok = [p for p in e["sweep"] if p["test_false_per_hit"] <= u["false_per_hit"]]
                    best = max(ok, key=lambda p: p["test_hit_rate"]) if ok else None
                    name = {"z": "export z", "features": "raw encoder features"}.get(emb, emb)
                    if best is None:
                        cell = "met: no GPTCache threshold reaches ushash's test false hits per hit"
                    else:
                        gap = u["hit_rate"] - best["test_hit_rate"]
                        cell = (("met" if gap >= 0 else f"**missed** by {amount(-gap, 4)}") +
                                f": GPTCache {best['test_hit_rate']:.4f} (cos >= {best['cosine']:.3f}, chosen on test) "
                                f"against ushash {u['hit_rate']:.4f}, at <= {u['false_per_hit']:.4f} false per hit")
                    rows.setdefault(f"hit rate >= real GPTCache's at the same false-hit rate, {name}", {})[r["dataset"]] = cell
    if proxy.exists():
        p = json.loads(proxy.read_text())
        o = p["overhead"]
        data = "tuxpaint" if "tuxpaint" in p["command"] else sets[0]
        cal = p.get("calibrated")   # the streams at the calibrated points where the run had them
        at = (("images", cal["image"]), ("texts", cal["text"])) if cal else (("images", p), ("texts", p.get("text")))
        rows.setdefault("proxy: model calls saved, p50 / p99 of hits and misses" +
                        (f" (at the calibrated points, budget {cal['target_false_hit_rate']})" if cal else ""), {})[data] = "; ".join(
            f"{name}: {x['model_calls_saved']} of {x['requests']} calls saved (hit rate {x['hit_rate']:.2f}, "
            f"{x['false_hits']} false answers), {x['model_seconds_saved']:.0f} model-seconds; hits {x['hit_p50_ms']:.0f} / "
            f"{x['hit_p99_ms']:.0f} ms, misses {x['miss_p50_ms']:.0f} / {x['miss_p99_ms']:.0f} ms"
            for name, x in at if x)
        d = o["proxy_own_p50_ms"]
        rows.setdefault("proxy adds <= 2 ms p50 on a hit over the lookup", {})[data] = (
            ("met" if d <= 2 else f"**missed** by {amount(d - 2, 1)} ms") +
            f": {d:.2f} ms, the hit's round trip less the lookup's own time in the proxy, per request (p99 "
            f"{o['proxy_own_p99_ms']:.2f} ms); across processes, proxy {o['proxy_hit_p50_ms']:.1f} ms against a direct "
            f"lookup {o['direct_lookup_p50_ms']:.1f} ms in the same run ({o['proxy_minus_lookup_p50_ms']:+.1f} ms)")
    stamps = "; ".join(s for s in (stamp_of(x) for x in ("false_hit_budget", "gptcache_compare", "proxy_overhead")) if s)
    return (f"Computed by `./run reproduce publish` from `experiments/budget`, `experiments/gptcache` and "
            f"`experiments/proxy` (the tables above: {stamps}).\n\n| bar | " + " | ".join(sets) + " |\n|---|"
            + "---|" * len(sets) + "\n" + "\n".join(f"| {bar} | " + " | ".join(c.get(d, "-") for d in sets) + " |"
                                           for bar, c in rows.items()))


# a block made from several steps' outputs: its function -> (file, block)
MADE_BLOCKS = {demo_body: ("README.md", "demo"), ablation_body: ("docs/baselines.md", "ablation"),
               trained_bits_body: ("docs/baselines.md", "trained-bits"), start_val_body: ("docs/baselines.md", "start-val"),
               previous_recipe_body: ("docs/baselines.md", "previous-recipe"), recheck_body: ("docs/baselines.md", "recheck"),
               search_body: ("docs/baselines.md", "search"),
               bars_body: ("docs/baselines.md", "bars"), rerun64_body: ("docs/baselines.md", "rerun64"),
               split_body: ("docs/baselines.md", "splits"), search_split_body: ("docs/baselines.md", "search-splits"),
               search_splits_body: ("docs/baselines.md", "splits-search"),
               functools.partial(search_splits_body, "regularisers"): ("docs/baselines.md", "splits-search-regularisers"),
               cache_bars_body: ("docs/cache.md", "cache-bars")}


def blocks() -> list[tuple[str, str]]:
    """Every (file, block) publish writes."""
    return ([(doc, name) for name, (doc, _, _) in SWEEP_BLOCKS.items()] + list(PRINTED_BLOCKS.values())
            + [(doc, name) for name, (doc, _, _) in RESULT_BLOCKS.items()] + list(MADE_BLOCKS.values()))


def publish() -> None:
    problems, steps = unstamped()
    if problems:
        raise SystemExit("[reproduce] publish wrote nothing: results their stamps do not describe\n  "
                         + "\n  ".join(problems) + f"\nrerun: ./run reproduce {' '.join(steps)}")
    for name, (doc, exp, step) in SWEEP_BLOCKS.items():
        body = sweep_body(exp, step)
        if body:
            replace_block(ROOT / doc, name, body)
    for step, (doc, name) in PRINTED_BLOCKS.items():
        body = printed_body(step)
        if body:
            replace_block(ROOT / doc, name, body)
    for name, (doc, step, md) in RESULT_BLOCKS.items():
        res = ROOT / md
        if res.exists():
            text = re.sub(r"^#+ ", "#### ", res.read_text(encoding="utf-8").strip(), flags=re.M)
            replace_block(ROOT / doc, name, f"Generated by {stamp_of(step) or '`' + STEPS[step] + '`'}:\n\n{text}")
    for make, (doc, name) in MADE_BLOCKS.items():
        body = make()
        if body:
            replace_block(ROOT / doc, name, body)


def reaggregate() -> list[str]:
    """`./run reproduce reaggregate`: every sweep table made again from the runs its step recorded, by this
    code's aggregation (`ushash.evaluation.sweep.aggregate` over the grid each results.json lists), without
    training or evaluating anything: for a change of how runs are summarised or printed. Only a step whose
    results are the ones its stamp describes is re-aggregated, and only when every run of each of its grids
    is on disk; its stamp keeps the run's command, date and machine, and records the re-aggregation (date,
    code digest) and the new results' digests. Returns the steps re-aggregated; the others are named."""
    from ushash.core.provenance import code_digest
    from ushash.evaluation.sweep import aggregate

    problems, stale = unstamped()
    done = []
    for step in STEPS:
        tables = [ROOT / p for p in outputs_of(step) if p.endswith("results.json") and (ROOT / p).is_file()
                  and "tie_rule" in json.loads((ROOT / p).read_text(encoding="utf-8"))]   # a sweep's aggregate
        if not tables:
            continue
        if step in stale:
            print(f"[reproduce] reaggregate: {step} left as it is: {next(p for p in problems if p.startswith(step + ':'))}")
            continue
        folders = [t.parent for t in tables]
        try:
            for folder in folders:   # a variant's table is aggregated from its experiment's runs
                aggregate(folder.parent.parent if folder.parent.name == "variants" else folder, out_dir=folder)
        except FileNotFoundError as e:   # a grid's run missing: aggregate wrote nothing for that table
            print(f"[reproduce] reaggregate: {step} not re-aggregated: {e}")
            continue
        rec = stamp_record(step)
        rec["outputs"] = digests(step)
        rec["aggregated"] = {"date": datetime.date.today().isoformat(), "code": code_digest()}
        stamp = ROOT / "experiments" / "reproduce" / f"{step}.json"
        stamp.write_text(json.dumps(rec, indent=1) + "\n")
        print(f"[reproduce] reaggregate: {step}: {', '.join(str(f.relative_to(ROOT)) for f in folders)}", flush=True)
        done.append(step)
    return done


def main(argv: list[str]) -> None:
    steps = argv or ["demo", "readme", *[s for s in STEPS if s != "demo"], "publish"]
    unknown = [s for s in steps if s not in STEPS and s not in ("readme", "publish", "reaggregate")]
    if unknown:
        raise SystemExit(f"unknown step(s) {unknown}; steps: {list(STEPS)}, readme, reaggregate and publish")
    done: set[str] = set()

    def run_with_needs(s: str) -> None:
        for n in NEEDS.get(s, []):
            if n not in done:
                run_with_needs(n)
        if s not in done:
            run_step(s)
            done.add(s)

    for s in steps:
        if s == "readme":
            run_readme()
        elif s == "reaggregate":
            reaggregate()
        elif s != "publish":
            run_with_needs(s)
    publish()


if __name__ == "__main__":
    main(sys.argv[1:])
