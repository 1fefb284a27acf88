"""Stored results are never silently short or reused for what did not make them: a grid's tables with a run
missing, a search study resumed over other features."""

import json

import pytest

from ushash.config import compose
from ushash.evaluation import sweep

SMALL = ["sweep.synthetic.n_train=300", "sweep.synthetic.n_val=60", "sweep.synthetic.n_test=80",
         "sweep.synthetic.n_classes=6", "sweep.threads=1"]


def _cfg(tmp_path, *extra):
    return compose("config", ["experiment=sweep_synthetic", f"paths.root={tmp_path}", *SMALL, *extra])


def test_a_grid_with_a_lost_or_unreadable_run_is_not_aggregated_short(tmp_path):
    """Re-aggregating the recorded grid (or the grid a multirun launched) when one of its runs has no readable
    result refuses, naming the run, instead of writing tables silently short of a seed."""
    runs = [sweep.run_one(_cfg(tmp_path, "method=lsh", "bits=16", f"seed={s}")) for s in (0, 1)]
    exp = tmp_path / "experiments" / "synthetic"
    agg = sweep.aggregate(exp, command="c", wall_s=1.0, digests=[r["digest"] for r in runs])
    assert agg["n_runs"] == 2
    before = (exp / "results.md").read_text()
    lost = sweep.run_path(exp, "lsh-16b-s1", runs[1]["digest"]) / "result.json"
    lost.write_text(lost.read_text()[:100])  # truncated (a write by hand, or an old non-atomic one)
    with pytest.raises(FileNotFoundError, match=r"1 of the grid's 2 runs .*lsh-16b-s1.*run the sweep again"):
        sweep.aggregate(exp)  # the recorded grid
    with pytest.raises(FileNotFoundError, match="lsh-16b-s1|1 of the grid's 2"):
        sweep.aggregate(exp, command="c", wall_s=1.0, digests=[r["digest"] for r in runs])
    assert (exp / "results.md").read_text() == before  # the tables of the whole grid are kept
    lost.unlink()
    with pytest.raises(FileNotFoundError, match="lsh-16b-s1"):
        sweep.aggregate(exp)
    # running the sweep again makes the run again; then the grid aggregates whole
    assert sweep.run_one(_cfg(tmp_path, "method=lsh", "bits=16", "seed=1"))["digest"] == runs[1]["digest"]
    assert sweep.aggregate(exp)["n_runs"] == 2


def test_an_unreadable_run_is_not_left_out_of_every_stored_run(tmp_path):
    runs = [sweep.run_one(_cfg(tmp_path, "method=lsh", "bits=16", f"seed={s}")) for s in (0, 1)]
    exp = tmp_path / "experiments" / "synthetic"
    f = sweep.run_path(exp, "lsh-16b-s0", runs[0]["digest"]) / "result.json"
    f.write_text("{")
    with pytest.raises(FileNotFoundError, match="unreadable"):
        sweep.aggregate(exp)
    assert not (exp / "results.json").exists()


def _remake(split, seed=1) -> None:
    """Change a store's features in place, as a store made again from other pixels would differ."""
    import numpy as np

    f = split.path / "image.npy"
    x = np.load(f)
    np.save(f, x + np.random.default_rng(seed).normal(0, 1.0, x.shape).astype(x.dtype))


def test_a_search_study_over_other_features_is_not_resumed(tmp_path, caplog):
    """A study whose trials were scored on other features (a store made again) is set aside and searched
    afresh, not resumed: its val scores would choose among settings by features that are gone, beside
    over-seed runs made on the new ones."""
    from ushash.evaluation import search

    caplog.set_level("INFO", logger="ushash")
    cfg = compose("search", ["experiment=sweep_synthetic", f"paths.root={tmp_path}", *SMALL, "trainer.max_epochs=1",
                             "bits=16", "method=pairwise", "search.seeds=[0]", "search.trials=1"])
    first = search.run_search(cfg)
    assert first["trials"][0]["val_score"] == first["over_seeds"]["defaults"]["val_score"][0]
    _remake(sweep.open_splits(cfg)["val"])
    again = search.run_search(cfg)
    assert "other features" in caplog.text
    # every number of the report is of the features the stores now give: the trial is its seed-0 run
    assert again["trials"][0]["val_score"] == again["over_seeds"]["defaults"]["val_score"][0]
    assert again["trials"][0]["val_score"] != first["trials"][0]["val_score"]
    folder = tmp_path / again["folder"]
    assert (folder.parent / "stale" / folder.name / "study.db").exists()   # the old study kept, out of the way
