"""The budgeted search on val: trial 0 is the method's own settings, the choice is the best val score, a study
resumes and continues, and a trial's run is the sweep's (never trained twice)."""

import json
from pathlib import Path

import pytest

from ushash.config import compose
from ushash.evaluation import search, sweep

SMALL = ["sweep.synthetic.n_train=300", "sweep.synthetic.n_val=80", "sweep.synthetic.n_test=80",
         "sweep.synthetic.n_classes=6", "sweep.threads=1", "trainer.max_epochs=2", "bits=16"]


def _cfg(tmp_path, *extra):
    return compose("search", ["experiment=sweep_synthetic", f"paths.root={tmp_path}", *SMALL, *extra])


def test_search_chooses_on_val_resumes_and_continues(tmp_path, monkeypatch):
    from ushash.hashing import training

    trained = []
    run_train = training.run_train

    def counting(cfg, splits=None):   # every training the search makes
        trained.append((int(cfg.seed), cfg.run_name))
        return run_train(cfg, splits)

    monkeypatch.setattr(training, "run_train", counting)
    cfg = lambda *x: _cfg(tmp_path, "method=pairwise", "search.seeds=[0,1]", *x)
    report = search.run_search(cfg("search.trials=3"))
    assert [t["number"] for t in report["trials"]] == [0, 1, 2]
    assert report["trials"][0]["params"] == {"model.lr": 0.009, "method.args.scale": 0.5, "method.args.w_quant": 0.1,
                                             "model.ema_epochs": 4.0}        # the defaults, as composed
    best = max(t["val_score"] for t in report["trials"])
    assert report["chosen"]["val_score"] == best and report["defaults"]["number"] == 0
    for t in report["trials"]:   # each trial's val score is its run's own, read back from the sweep's result.json
        res = json.loads(next((tmp_path / report["folder"] / "runs").glob(f"{t['run']}/result.json")).read_text())
        assert res["val_score"] == t["val_score"] and set(t["test"]) == {"paired", "label"}
    # 3 trials at seed 0, then seed 1 of the defaults and of the chosen settings (the same run when trial 0 wins)
    chosen_is_default = report["chosen"]["number"] == 0
    assert [s for s, _ in trained] == [0, 0, 0, 1] + ([] if chosen_is_default else [1])
    seeds = report["over_seeds"]
    assert seeds["defaults"]["val_score"][0] == report["defaults"]["val_score"]   # seed 0: the trial's own run
    assert seeds["chosen"]["val_score"][0] == report["chosen"]["val_score"] and len(seeds["chosen"]["test"]) == 2
    assert not Path(report["folder"]).is_absolute()   # relative to the root: a report names no machine's paths
    folder = tmp_path / report["folder"]
    assert {p.name for p in folder.iterdir()} >= {"study.db", "search.json", "search.md", "history.png", "runs"}
    text = (folder / "search.md").read_text()
    assert "chosen" in text and "Over seeds" in text and "seed=0,1,2" in report["seeds_command"]
    # the same search again: nothing trained; a larger budget: only the new trial
    trained.clear()
    again = search.run_search(cfg("search.trials=3"))
    assert trained == [] and again["chosen"] == report["chosen"]
    more = search.run_search(cfg("search.trials=4"))
    assert len(more["trials"]) == 4 and more["folder"] == report["folder"]
    assert [s for s, _ in trained][:1] == [0] and len(trained) in (1, 2)   # the trial, and seed 1 if it is chosen


def test_a_search_on_a_manifest_without_an_experiment_file(tmp_path):
    """A new user's data, brought in through the manifest: no experiment file, no sweep block."""
    import numpy as np
    from PIL import Image

    media = tmp_path / "media"
    media.mkdir()
    rng, recs = np.random.default_rng(0), []
    for i in range(40):
        Image.fromarray(rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)).save(media / f"{i}.png")
        recs.append({"id": f"i{i}", "image": f"{i}.png", "text": f"item number {i} of {i % 4}",
                     "split": ["train", "train", "train", "val", "test"][i % 5]})
    (media / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = compose("search", [f"paths.root={tmp_path}", "data=manifest", f"data.path={media / 'm.jsonl'}",
                             "data.name=mine", "encoder=tiny", "trainer.accelerator=cpu", "trainer.max_epochs=2",
                             "trainer.enable_progress_bar=false", "bits=16", "extract.num_workers=0",
                             "extract.progress=false", "method=ushash", "search.trials=2", "search.seeds=[0]"])
    report = search.run_search(cfg)
    assert len(report["trials"]) == 2 and Path(report["folder"]).parent == Path("experiments") / "search"
    assert Path(report["folder"]).name.startswith("mine-tiny-ushash-16b-s0-")


@pytest.mark.parametrize("extra,space,match", [
    (["method=itq"], None, "trains nothing"),
    (["method=pairwise"], {"model.nope": {"low": 1, "high": 2}}, "not a setting"),
    (["method=pairwise"], {"model.lr": {"low": 2, "high": 1}}, "low < high"),
    (["method=pairwise"], {"model.lr": {"low": 0.0, "high": 1, "log": True}}, "low > 0"),
    (["method=pairwise"], {}, "no search space"),
    (["method=pairwise"], {"model.lr": {"low": 0.01, "high": 0.1}}, "outside"),
    (["method=pairwise"], {"model.ema_epochs": {"choices": [2.0, 8.0]}}, "outside"),
    (["method=pairwise", "search.trials=0"], None, "at least 1")])
def test_a_bad_search_is_refused_with_its_reason(tmp_path, extra, space, match):
    from omegaconf import OmegaConf, open_dict

    cfg = _cfg(tmp_path, *extra)
    if space is not None:
        with open_dict(cfg):
            OmegaConf.update(cfg, "search.space.pairwise", space, merge=False)
    with pytest.raises(ValueError, match=match):
        search.run_search(cfg)


def test_a_split_without_labels_reports_no_label_score_not_zero():
    """A data set without labels (COCO's default) has no label rows: its label mAP was reported as 0.000."""
    from ushash.evaluation import search

    rows = [{"method": "ushash", "protocol": "paired", "direction": d, "tie_map@10": v}
            for d, v in (("I→T", 0.6), ("T→I", 0.4))]
    scores = search._test_scores({"method": "ushash", "rows": rows})
    assert scores == {"paired": 0.5, "label": None}
    assert search.mean_std([scores["label"]] * 3) == "–" and search._num(scores["label"]) == "–"
    both = rows + [{"method": "ushash", "protocol": "label", "direction": "I→T", "tie_map@10": 0.0}]
    assert search._test_scores({"method": "ushash", "rows": both}) == {"paired": 0.5, "label": 0.0}
