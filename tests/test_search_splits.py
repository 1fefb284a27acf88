"""The defaults' search over splits (scripts/search_splits.py): trial 0 is the defaults, a trial's score is the
smaller of the sets' mean val gains over the splits, the rule's test over seeds is the runs' own numbers, and a
finished study trains nothing again."""

import functools
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import search_splits  # noqa: E402

SMALL = ["experiment=sweep_synthetic", "sweep.synthetic.n_train=240", "sweep.synthetic.n_val=60",
         "sweep.synthetic.n_test=60", "sweep.synthetic.n_classes=6", "sweep.threads=1", "trainer.max_epochs=2",
         "bits=16"]


@pytest.fixture
def sets():
    # two "sets" of two "splits" each: synthetic draws that differ as splits of a real set do
    return {"a": [["sweep.synthetic.noise=0.8"], ["sweep.synthetic.noise=0.9"]],
            "b": [["sweep.synthetic.latent=16"], ["sweep.synthetic.latent=24"]]}


def test_the_search_scores_trials_by_the_smaller_gain_and_tests_the_rule(tmp_path, sets, monkeypatch):
    from ushash.hashing import training

    trained = []
    run_train = training.run_train

    def counting(cfg, splits=None):
        trained.append(int(cfg.seed))
        return run_train(cfg, splits)

    monkeypatch.setattr(training, "run_train", counting)
    base = [*SMALL, f"paths.root={tmp_path}"]
    heldout = {"h": [["sweep.synthetic.noise=1.0"]]}
    rep = search_splits.search_splits(sets, trials=3, seeds=(0, 1), base=base, heldout=heldout)
    assert [t["number"] for t in rep["trials"]] == [0, 1, 2] and rep["defaults"]["number"] == 0
    assert rep["defaults"]["params"]["model.lr"] == 0.009 and rep["defaults"]["gain"] == {"a": 0.0, "b": 0.0}
    folder = tmp_path / rep["folder"]

    def val(key: str, params: dict, seed: int = 0) -> float:   # read back from the run's own result.json
        for f in (folder / key / "runs").glob(f"ushash-16b-s{seed}-*/result.json"):
            r = json.loads(f.read_text())
            settings = json.loads((f.parent / "settings.json").read_text())
            if all(functools.reduce(lambda x, part: x[part], k.split("."), settings) == v for k, v in params.items()):
                return r["val_score"]
        raise AssertionError(f"no run of {params} in {key}")

    d = rep["defaults"]["params"]
    for t in rep["trials"]:
        gains = {s: np.mean([val(f"{s}-{i}", t["params"]) - val(f"{s}-{i}", d) for i in range(2)]) for s in sets}
        assert t["gain"] == pytest.approx(gains, abs=1e-9) and t["objective"] == pytest.approx(min(gains.values()))
    assert rep["chosen"]["objective"] == max(t["objective"] for t in rep["trials"])
    c = rep["chosen"]["params"]
    for s in sets:   # the rule: mean gain over splits and seeds against the defaults' mean within-split spread
        keys = [f"{s}-{i}" for i in range(2)]
        gain = np.mean([np.mean([val(k, c, z) for z in (0, 1)]) - np.mean([val(k, d, z) for z in (0, 1)]) for k in keys])
        spread = np.mean([np.std([val(k, d, z) for z in (0, 1)], ddof=1) for k in keys])
        assert rep["rule"][s] == pytest.approx({"gain": gain, "spread": spread}, abs=1e-9)
    assert rep["passes"] == (rep["chosen"]["number"] != 0 and all(
        round(r["gain"], 3) > round(r["spread"], 3) for r in rep["rule"].values()))
    # the held-out set: test scores of both, over the seeds, never in the choice
    assert set(rep["heldout"]) == {"defaults", "chosen"} and len(rep["heldout"]["chosen"]["h-0"]) == 2
    assert all(set(t) == {"paired", "label"} for t in rep["heldout"]["defaults"]["h-0"])
    md = (folder / "search.md").read_text()
    assert "chosen" in md and "The rule:" in md and "Held out" in md and not Path(rep["folder"]).is_absolute()
    # 4 set-splits x 3 trials at seed 0, then seed 1 of the defaults and of the choice on each; held out: 2 seeds each
    same = rep["chosen"]["number"] == 0
    assert trained.count(0) == 12 + (1 if same else 2) and trained.count(1) == (5 if same else 10)
    trained.clear()
    again = search_splits.search_splits(sets, trials=3, seeds=(0, 1), base=base, heldout=heldout)
    assert trained == [] and again["chosen"] == rep["chosen"] and again["rule"] == rep["rule"]


@pytest.mark.parametrize("name", sorted(search_splits.SPACES))
def test_every_space_names_real_settings_and_holds_the_defaults(name):
    """Trial 0 runs the defaults, so each space must hold them (method_space refuses a range that does not)."""
    from omegaconf import open_dict

    from ushash.config import compose
    from ushash.evaluation.search import method_space

    cfg = compose("search", ["method=ushash"])
    if search_splits.SPACES[name] is not None:
        with open_dict(cfg):
            cfg.search.space.ushash = search_splits.SPACES[name]
    assert set(method_space(cfg)) == set(search_splits.SPACES[name] or cfg.search.space.ushash)


def test_the_published_report_is_the_one_its_settings_accept_and_two_are_refused(tmp_path):
    """Which report a block publishes was the newest by file time: a clone dates every file alike, so with two
    reports of one search the published one was whichever the checkout wrote last."""
    def write(folder, space_name):
        (tmp_path / "experiments" / "search" / folder).mkdir(parents=True)
        (tmp_path / "experiments" / "search" / folder / "search.json").write_text(
            json.dumps({"space_name": space_name, "folder": folder}))

    assert search_splits.space_report("search", tmp_path) is None
    write("splits-ushash-64b-aaaa", "search")
    write("splits-ushash-64b-bbbb", "regularisers")
    assert search_splits.space_report("search", tmp_path)["folder"] == "splits-ushash-64b-aaaa"
    assert search_splits.space_report("regularisers", tmp_path)["folder"] == "splits-ushash-64b-bbbb"
    write("splits-ushash-64b-cccc", "search")            # the same search again, with other settings
    with pytest.raises(SystemExit, match="2 search reports match .*splits-ushash-64b-aaaa, splits-ushash-64b-cccc; "
                                         "move away all but the one to publish"):
        search_splits.space_report("search", tmp_path)
