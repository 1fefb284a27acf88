"""Sweeps: one run per (method, bits, seed), resume, aggregation, plots, and the train/test wall."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ushash.evaluation import sweep
from ushash.config import ROOT, compose
from ushash.core.io import settings_digest
from ushash.hashing.methods.base import FittedMethod

SMALL = ["sweep.synthetic.n_train=400", "sweep.synthetic.n_val=80", "sweep.synthetic.n_test=120",
         "sweep.synthetic.n_classes=8", "sweep.threads=1"]


def _cfg(tmp_path, *extra):
    return compose("config", ["experiment=sweep_synthetic", f"paths.root={tmp_path}", *SMALL, *extra])


def test_run_one_writes_a_result_and_skips_it_next_time(tmp_path, caplog):
    caplog.set_level("INFO", logger="ushash")
    cfg = _cfg(tmp_path, "method=itq", "bits=16", "seed=0")
    res = sweep.run_one(cfg)
    f = sweep.run_path(tmp_path / "experiments" / "synthetic", "itq-16b-s0", res["digest"]) / "result.json"
    assert f.exists() and res["fitted_on"] == "train" and res["split"] == "test"
    assert {r["protocol"] for r in res["rows"]} == {"paired", "label"}
    assert {r["direction"] for r in res["rows"]} == {"I→T", "T→I", "I→A", "A→I", "T→A", "A→T"}
    pr = res["curves"][0]["pr"]
    assert len(pr["precision"]) == 17 and pr["recall"][-1] == pytest.approx(1.0)  # radius = bits retrieves all
    mtime = f.stat().st_mtime_ns
    again = sweep.run_one(cfg)
    assert "done already" in caplog.text
    assert f.stat().st_mtime_ns == mtime and again["digest"] == res["digest"]
    # a changed setting is a different run: it is redone, not mixed up with the stored one
    changed = sweep.run_one(_cfg(tmp_path, "method=itq", "bits=16", "seed=0", "method.args.common_dim=64"))
    assert changed["digest"] != res["digest"] and f.exists()  # in a folder of its own: the first run is kept


def test_a_trained_run_digest_holds_the_space_early_stop_and_trainer(tmp_path):
    """A trained method reads the shared space, early stopping and the trainer as well as its model: a run
    under other values of any of them is another run, not one "done already"."""
    base = settings_digest(sweep.run_settings(_cfg(tmp_path, "method=ushash", "bits=16", "seed=0")))
    for o in ("space.reg=3.0", "space.max_rank=16", "early_stop.patience=1", "+trainer.gradient_clip_val=0.01",
              "model.batch_size=32"):
        assert settings_digest(sweep.run_settings(_cfg(tmp_path, "method=ushash", "bits=16", "seed=0", o))) != base, o
    # how a run reports is not a setting
    assert settings_digest(sweep.run_settings(_cfg(tmp_path, "method=ushash", "bits=16", "seed=0",
                                                "trainer.log_every_n_steps=1"))) == base


def test_a_run_of_other_code_or_packages_is_made_again(tmp_path, caplog, monkeypatch):
    """The settings digest covers the code, the numerical packages and the CPU model (provenance.made_by): a
    stored run made by other training code, under another numpy or on another CPU, is not served as this one's."""
    caplog.set_level("INFO", logger="ushash")
    cfg = _cfg(tmp_path, "method=itq", "bits=16", "seed=0")
    res = sweep.run_one(cfg)
    assert sweep.run_settings(cfg)["made_by"]["code"] == sweep.made_by()["code"]
    real = sweep.made_by()
    for other in ({**real, "code": "0" * 16}, {**real, "versions": {**real["versions"], "numpy": "0.0"}},
                  {**real, "cpu": "another CPU"}):
        monkeypatch.setattr(sweep, "made_by", lambda other=other: other)
        caplog.clear()
        again = sweep.run_one(cfg)
        assert "done already" not in caplog.text and again["digest"] != res["digest"]


def test_the_code_digest_follows_the_sources_results_depend_on(tmp_path):
    from ushash.core import provenance

    for rel in ("hashing/a.py", "serving/cache/b.py", "sim/c.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    d0, r0 = provenance.code_digest.__wrapped__(tmp_path), provenance.runtime_digest.__wrapped__(tmp_path)
    (tmp_path / "serving/cache/b.py").write_text("x = 2\n")   # the cache runtime: no training result reads it
    assert provenance.code_digest.__wrapped__(tmp_path) == d0
    r1 = provenance.runtime_digest.__wrapped__(tmp_path)      # ... but the cache's own results do
    (tmp_path / "sim/c.py").write_text("x = 2\n")
    assert provenance.code_digest.__wrapped__(tmp_path) == d0
    r2 = provenance.runtime_digest.__wrapped__(tmp_path)
    assert len({r0, r1, r2}) == 3
    (tmp_path / "hashing/a.py").write_text("x = 2\n")         # training code: another digest
    assert provenance.code_digest.__wrapped__(tmp_path) != d0
    assert provenance.runtime_digest.__wrapped__(tmp_path) == r2   # and not the runtime's
    assert set(provenance.package_versions()) <= set(provenance.VERSIONED) and "numpy" in provenance.package_versions()


def test_the_cpu_model_is_the_one_cpuinfo_names():
    """made_by's "cpu": another CPU model gave other codes from the same features (provenance's docstring)."""
    from pathlib import Path

    from ushash.core import provenance

    info = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines()
             if ln.startswith("model name")] if info.exists() else []
    cpu = provenance.cpu_model()
    assert cpu and cpu == (names[0] if names else cpu) and provenance.made_by()["cpu"] == cpu


def test_fitted_baseline_never_sees_the_test_split(tmp_path, monkeypatch):
    """The sweep hands a no-training method the training split only, and the test split is not read until
    the fit is over (a tripwire on the test tables)."""
    cfg = _cfg(tmp_path, "method=pca_rotation", "bits=16", "seed=0")
    splits = sweep.open_splits(cfg)
    fitting = {"now": False, "calls": []}

    class Tripwire:
        def __init__(self, split):
            self._split = split

        def __getattr__(self, name):
            if fitting["now"]:
                raise AssertionError(f"test split read during fit ({name})")
            return getattr(self._split, name)

    real_fit = FittedMethod.fit

    def spy(self, train, val=None):
        fitting["now"] = True
        fitting["calls"].append(train.meta["split"])
        try:
            return real_fit(self, train, val)
        finally:
            fitting["now"] = False

    monkeypatch.setattr(FittedMethod, "fit", spy)
    res = sweep.run_one(cfg, splits={**splits, "test": Tripwire(splits["test"])})
    assert fitting["calls"] == ["train"]
    assert res["rows"]
    # train and test share no item (groups are the items)
    tr = set().union(*(set(t.groups) for t in splits["train"].tables.values()))
    te = set().union(*(set(t.groups) for t in splits["test"].tables.values()))
    assert not tr & te


@pytest.mark.parametrize("method", ["itq", "pairwise"])
def test_what_a_sweeper_optimises_is_the_runs_score_on_val_not_test(tmp_path, method):
    """`python -m ushash.sweep` returns `primary_metric` for a Hydra sweeper (Optuna) to optimise: the run's
    selection score on val (a trained method's kept checkpoint's, a fitted one's codes'), recomputed here; it
    was the test split's mean paired mAP@10, so a sweeper chose settings on test."""
    from ushash.evaluation import retrieval
    from ushash.hashing.module import load_checkpoint

    cfg = _cfg(tmp_path, f"method={method}", "bits=16", "seed=0", "trainer.max_epochs=2")
    res = sweep.run_one(cfg)
    val = sweep.open_splits(cfg)["val"]
    if method == "pairwise":
        run_dir = sweep.run_path(tmp_path / "experiments" / "synthetic", "pairwise-16b-s0", res["digest"])
        fn = load_checkpoint(run_dir / "best.ckpt").code_method()
    else:   # the run's fit again (seeded: the same model)
        from ushash.hashing import methods

        settings = sweep.run_settings(cfg)
        splits = sweep.open_splits(cfg)
        fn = methods.build(method, bits=16, seed=0, **settings["method"]["args"])
        fn.fit(splits["train"], splits["val"])
    assert sweep.primary_metric(res) == res["val_score"]
    assert res["val_score"] == pytest.approx(retrieval.selection_score(val, fn), abs=1e-6)
    test_map = np.mean([r["tie_map@10"] for r in res["rows"] if r["protocol"] == "paired" and r["method"] == method])
    assert abs(res["val_score"] - test_map) > 1e-3


def test_trained_run_resumes_from_its_checkpoint(tmp_path, caplog):
    caplog.set_level("INFO", logger="ushash")
    cfg = _cfg(tmp_path, "method=pairwise", "bits=16", "seed=0", "trainer.max_epochs=2")
    first = sweep.run_one(cfg)
    run_dir = sweep.run_path(tmp_path / "experiments" / "synthetic", "pairwise-16b-s0", first["digest"])
    assert (run_dir / "last.ckpt").exists() and first["val_map@10"] is not None
    (run_dir / "result.json").unlink()  # as if the sweep had been killed after training, before evaluation
    second = sweep.run_one(cfg)
    assert "resuming from" in caplog.text
    a = {(r["direction"], r["protocol"]): r["map@10"] for r in first["rows"]}
    b = {(r["direction"], r["protocol"]): r["map@10"] for r in second["rows"]}
    assert a == b
    from ushash.hashing.module import load_checkpoint
    mod = load_checkpoint(run_dir / "best.ckpt")  # weights_only, no config tree
    assert mod.hparams.method == "pairwise" and mod.hparams.bits == 16


def _perturb(split) -> None:
    """Change one feature of a store in place, as a store made again from other pixels would differ."""
    f = split.path / "image.npy"
    x = np.load(f)
    x[0, 0] += 1.0
    np.save(f, x)


def test_a_result_from_other_features_is_not_reused(tmp_path, caplog):
    """The same settings over a store whose features changed: the stored result is not returned, its folder is
    moved to stale/ (kept, out of the tables' runs) and the run is done again, recording the new stores."""
    caplog.set_level("INFO", logger="ushash")
    cfg = _cfg(tmp_path, "method=itq", "bits=16", "seed=0")
    first = sweep.run_one(cfg)
    exp = tmp_path / "experiments" / "synthetic"
    run_dir = sweep.run_path(exp, "itq-16b-s0", first["digest"])
    assert set(first["stores"]) == {"train", "val", "test"}
    _perturb(sweep.open_splits(cfg)["train"])
    second = sweep.run_one(cfg)
    assert "done already" not in caplog.text and "used other features" in caplog.text
    assert second["digest"] == first["digest"] and second["stores"]["train"] != first["stores"]["train"]
    assert second["stores"]["val"] == first["stores"]["val"]
    aside = exp / "stale" / run_dir.name
    assert json.loads((aside / "result.json").read_text())["stores"] == first["stores"]
    assert [r["stores"] for r in sweep.load_results(exp)] == [second["stores"]]  # the tables read the new run only
    sweep.run_one(cfg)
    assert "done already" in caplog.text  # and that one is reused


def test_an_interrupted_run_over_other_features_is_not_resumed(tmp_path, caplog):
    """A trained run cut before evaluation (no result.json) whose features changed since: trained afresh, not
    resumed from the old features' last.ckpt. A folder from before runs recorded their stores is redone too."""
    caplog.set_level("INFO", logger="ushash")
    cfg = _cfg(tmp_path, "method=pairwise", "bits=16", "seed=0", "trainer.max_epochs=1")
    first = sweep.run_one(cfg)
    exp = tmp_path / "experiments" / "synthetic"
    run_dir = sweep.run_path(exp, "pairwise-16b-s0", first["digest"])
    (run_dir / "result.json").unlink()
    _perturb(sweep.open_splits(cfg)["val"])
    second = sweep.run_one(cfg)
    assert "resuming from" not in caplog.text and (exp / "stale" / run_dir.name / "last.ckpt").exists()
    assert second["stores"]["val"] != first["stores"]["val"]
    # an old-format folder: neither file records the stores
    for name in ("result.json", "settings.json"):
        f = run_dir / name
        f.write_text(json.dumps({k: v for k, v in json.loads(f.read_text()).items() if k != "stores"}))
    caplog.clear()
    sweep.run_one(cfg)
    assert "not recorded" in caplog.text and (exp / "stale" / f"{run_dir.name}-1").exists()


def test_aggregate_tables_and_plots(tmp_path):
    for method in ("lsh", "itq", "float"):
        for bits in (16, 32):
            for seed in (0, 1):
                sweep.run_one(_cfg(tmp_path, f"method={method}", f"bits={bits}", f"seed={seed}"))
    exp = tmp_path / "experiments" / "synthetic"
    agg = sweep.aggregate(exp, command="python -m ushash.sweep -m experiment=sweep_synthetic", wall_s=1.0)
    assert agg["n_runs"] == 12
    cell = agg["summary"]["lsh"]["32"]["label"]["map@10"]["mean"]
    seeds = [json.loads(next((exp / "runs").glob(f"lsh-32b-s{s}-*/result.json")).read_text()) for s in (0, 1)]
    per_seed = [np.mean([r["map@10"] for r in res["rows"] if r["protocol"] == "label"]) for res in seeds]
    assert cell[0] == pytest.approx(np.mean(per_seed), rel=1e-12, abs=1e-15)   # unrounded: tables round once
    assert cell[1] == pytest.approx(np.std(per_seed, ddof=1), rel=1e-12, abs=1e-15) and cell[2] == 2
    md = (exp / "results.md").read_text()
    assert "## mAP@10, protocol paired" in md and "## mAP@10, protocol label" in md and " ± " in md
    assert "Z=min(k, #relevant)" in md and "python -m ushash.sweep" in md
    # once in the summary and once per metric table: tie-aware mAP@10, tie-broken mAP@10, R@1, R@10, P@10, per
    # protocol (P@H≤2 is codes only)
    assert md.count("| float (shared input space, cosine) | float |") == 1 + 5 * 2
    for png in ("map_vs_bits.png", "precision_h2.png", "pr_hamming_32b.png", "p_at_k_32b.png"):
        assert (exp / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # re-aggregation reads the runs again and keeps the recorded command
    before = (exp / "results.md").read_text()
    sweep.run_one(_cfg(tmp_path, "method=lsh", "bits=16", "seed=0", "sweep.synthetic.noise=0.9"))  # another run
    sweep.run_sweep(_cfg(tmp_path, "sweep.aggregate_only=true"))
    assert (exp / "results.md").read_text() == before  # the recorded grid, not every stored run
    (exp / "results.json").unlink()
    with pytest.raises(ValueError, match="different settings"):  # two lsh-16b-s0 runs: which grid is meant?
        sweep.aggregate(exp)
    # a multirun that swept a setting beyond method, bits and seed gives its table both runs' digests: one of
    # the two lsh-16b-s0 runs silently stood for both ("Runs: 2", one value, no ±)
    digests = [json.loads(p.read_text())["digest"] for p in (exp / "runs").glob("lsh-16b-s0-*/result.json")]
    assert len(digests) == 2
    with pytest.raises(ValueError, match=r"different settings; a multirun's table keys its runs by method, bits"):
        sweep.aggregate(exp, digests=digests, out_dir=tmp_path / "variant")
    # with no grid recorded, a run of other settings is refused even where its key is new: a variant's run of
    # another seed was averaged into the table as one more seed
    other = sweep.run_one(_cfg(tmp_path, "method=lsh", "bits=16", "seed=0", "sweep.synthetic.noise=0.9"))
    sweep.set_aside(sweep.run_path(exp, "lsh-16b-s0", other["digest"]), tmp_path / "aside")
    sweep.run_one(_cfg(tmp_path, "method=lsh", "bits=16", "seed=7", "sweep.synthetic.noise=0.9"))
    with pytest.raises(ValueError, match=r"more than one grid: float-16b-s0 and lsh-16b-s7 differ in stores, synthetic"):
        sweep.aggregate(exp)
    sweep.set_aside(next(p for p in (exp / "runs").glob("lsh-16b-s7-*") if p.is_dir()), tmp_path / "aside")  # not its .lock
    sweep.run_one(_cfg(tmp_path, "method=itq", "bits=16", "seed=7", "method.args.common_dim=64"))
    with pytest.raises(ValueError, match=r"more than one grid of itq: itq-16b-s0 and itq-16b-s7 differ in method"):
        sweep.aggregate(exp)
    sweep.set_aside(next(p for p in (exp / "runs").glob("itq-16b-s7-*") if p.is_dir()), tmp_path / "aside")  # not its .lock
    assert sweep.aggregate(exp)["n_runs"] == 12   # the grid alone again


def test_a_seed_cell_is_rounded_once_where_it_is_printed():
    """Cells were rounded to 5 decimals in results.json and to 3 in the tables: a mean of 0.4484994 was
    printed 0.449 (67 of 8,076 cells of the committed sweeps printed one unit off in the third decimal)."""
    from ushash.evaluation import report

    cell = sweep.seed_cell([0.4469994, 0.45])
    assert cell[0] == pytest.approx(0.4484997, abs=1e-12) and cell[2] == 2
    assert report._fmt(*cell).startswith("0.448 ± ")
    assert sweep.seed_cell([0.25]) == [0.25, 0.0, 1]
    assert round(cell[0], 5) == 0.4485 and f"{0.4485:.3f}" == "0.449"   # what the double rounding printed


def test_variant_overrides_and_their_folder(tmp_path):
    task = ["experiment=sweep_tuxpaint64", "paths.root=/x", "sweep.threads=1", "method=ushash,itq", "seed=0"]
    assert sweep.variant_overrides(task) == ["method=ushash,itq", "seed=0"]
    assert sweep.variant_overrides(task[:3]) == []
    # the grid set through Hydra's sweeper is a variant too; Hydra's other overrides are not
    hydra = ["hydra.mode=MULTIRUN", "hydra.sweeper.params.bits=16", "hydra/sweeper=basic"]
    assert sweep.variant_overrides(task[:3], hydra) == ["hydra.sweeper.params.bits=16", "hydra/sweeper=basic"]
    d = sweep.variant_dir(tmp_path, ["method=ushash,itq", "seed=0"])
    assert d.parent == tmp_path / "variants" and d.name.startswith("method=ushash,itq_seed=0-")


@pytest.mark.slow
def test_hydra_multirun_sweep_and_resume(tmp_path):
    """The real command: Hydra multirun over methods x bits x seeds, aggregated at the end; run again, every
    finished run is skipped."""
    cmd = [sys.executable, "-m", "ushash.sweep", "-m", "experiment=sweep_synthetic", f"paths.root={tmp_path}",
           *SMALL, "method=lsh,itq,pairwise", "bits=16,32", "seed=0,1", "trainer.max_epochs=2"]
    committed = tmp_path / "experiments" / "synthetic" / "results.md"
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    exp = tmp_path / "experiments" / "synthetic"
    assert not committed.exists()  # a sub-grid with its own overrides: aggregated among the variants
    variant, = (exp / "variants").iterdir()
    agg = json.loads((variant / "results.json").read_text())
    assert agg["n_runs"] == 12 and agg["sweep_wall_s"] > 0
    assert "sweep: 12/12 runs done" in out.stderr + out.stdout
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("done already") == 12


def test_a_length_a_method_cannot_make_is_recorded_not_fatal(tmp_path):
    # synthetic features have rank 32 per modality (the latent), so the GCCA space has 96 dims: no 128 PCA bits
    res = sweep.run_one(_cfg(tmp_path, "method=pca_sign", "bits=128", "seed=0"))
    assert res["status"] == "not_applicable" and "bits=128 > shared space dim" in res["reason"]
    sweep.run_one(_cfg(tmp_path, "method=lsh", "bits=128", "seed=0"))  # random hyperplanes need no PCA
    agg = sweep.aggregate(tmp_path / "experiments" / "synthetic")
    assert agg["n_runs"] == 1 and agg["not_applicable"][0]["key"] == "pca_sign-128b-s0"
    assert "Not applicable (1 runs" in (tmp_path / "experiments" / "synthetic" / "results.md").read_text()


def test_a_run_another_process_is_making_is_waited_for_not_made_twice(tmp_path):
    """Two sweeps over one grid (two shells, or a rerun while the first runs): the second waits for the run's
    lock and then reads the first's result. Before, both trained it and wrote over each other's folder."""
    import time
    cfg = _cfg(tmp_path, "method=lsh", "bits=16", "seed=0")
    first = sweep.run_one(cfg)
    run_dir = sweep.run_path(tmp_path / "experiments" / "synthetic", "lsh-16b-s0", first["digest"])
    (run_dir / "result.json").unlink()  # the other process is making the run again
    ready = tmp_path / "ready"
    other = subprocess.Popen([sys.executable, "-c", (
        "import json, sys, time; from pathlib import Path; from filelock import FileLock\n"
        "run, ready, res = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])\n"
        "with FileLock(str(run.with_name(run.name + '.lock'))):\n"
        "    ready.touch(); time.sleep(1.5)\n"
        "    (run / 'result.json').write_text(json.dumps({**res, 'made_by': 'the other sweep'}))\n"),
        str(run_dir), str(ready), json.dumps(first)])
    try:
        for _ in range(300):
            if ready.exists() or other.poll() is not None:
                break
            time.sleep(0.05)
        assert ready.exists(), "the other process never took the lock"
        second = sweep.run_one(cfg)
    finally:
        other.wait(timeout=60)
    assert second.get("made_by") == "the other sweep"  # waited, then found it done: not computed again


@pytest.mark.parametrize("override,match", [("+sweep.k=20", r"sweep\.k=20: a sweep's tables report mAP@10"),
                                            ("+sweep.denominator=found", r"sweep\.denominator=found: .*use min or all")])
def test_sweep_settings_its_tables_cannot_report_are_refused_before_a_run(tmp_path, override, match):
    """sweep.k=20 or denominator=found ran, wrote its result, then raised KeyError (map@10, tie_map@10) in the
    run's log line and in the table, every time the sweep was run again."""
    with pytest.raises(ValueError, match=match):
        sweep.run_one(_cfg(tmp_path, "method=itq", "bits=16", "seed=0", override))
    assert not (tmp_path / "experiments").exists()
