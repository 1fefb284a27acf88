"""`python -m ushash.eval out=DIR`: a folder holding the tables of other settings is refused, not overwritten;
directions a separate database cannot run are recorded in results.json and results.md, not silently dropped."""

import json
from pathlib import Path

import pytest

from ushash.config import compose
from ushash.data import synthetic
from ushash.data.store import identity_path, store_identity, write_split
from ushash.evaluation import evaluate
from ushash.evaluation.evaluate import run_eval
from ushash.hashing.training import run_train

DIMS = {"image": 16, "text": 12, "audio": 8}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny run (2 epochs, seeded): its root, best and last checkpoints (two different checkpoints)."""
    root = tmp_path_factory.mktemp("eval-out")
    splits = synthetic.write_synthetic(root / "features", sizes={"train": 200, "val": 60, "test": 60},
                                       n_classes=4, dims=DIMS)
    cfg = compose("config", [f"paths.root={root}", "trainer.accelerator=cpu", "trainer.max_epochs=2",
                             "model.batch_size=128", "bits=32", "trainer.enable_progress_bar=false"])
    out = run_train(cfg, splits=splits)
    assert out["best"] != out["last"]
    return root, out


def _eval(root, ckpt, *extra):
    return run_eval(compose("eval", [f"paths.root={root}", f"ckpt={ckpt}", *extra]))


def test_out_holding_another_checkpoints_tables_is_refused_before_evaluating(trained, tmp_path, monkeypatch):
    """out= named a folder and results.json / results.md were written whatever was there: the tables of
    another checkpoint were silently replaced."""
    root, ckpts = trained
    res = _eval(root, ckpts["last"], f"out={tmp_path / 'tables'}")
    before = {n: (tmp_path / "tables" / n).read_bytes() for n in ("results.json", "results.md")}

    def must_not_run(*a, **kw):
        raise AssertionError("evaluated although the folder was refused")

    monkeypatch.setattr(evaluate.retrieval, "evaluate", must_not_run)
    with pytest.raises(FileExistsError) as e:
        _eval(root, ckpts["best"], f"out={tmp_path / 'tables'}")
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "tables") in msg
    assert "another checkpoint" in msg and str(ckpts["last"]) in msg
    assert f"pass another out= or remove {tmp_path / 'tables' / 'results.json'}" in msg
    assert {n: (tmp_path / "tables" / n).read_bytes() for n in before} == before
    assert json.loads(before["results.json"])["checkpoint"] == str(ckpts["last"]) and res["out"] == str(tmp_path / "tables")


def test_out_holding_other_settings_is_refused_and_the_same_settings_overwrite(trained, tmp_path):
    root, ckpts = trained
    out = tmp_path / "tables"
    first = _eval(root, ckpts["last"], f"out={out}")
    for extra, says in ((["k=5"], "k 10 there, 5 here"), (["split=val"], "split 'test' there, 'val' here"),
                        (["denominator=all"], "denominator 'min' there, 'all' here")):
        with pytest.raises(FileExistsError, match="already holds the tables of other settings") as e:
            _eval(root, ckpts["last"], f"out={out}", *extra)
        assert says in str(e.value) and "another checkpoint" not in str(e.value)
    again = _eval(root, ckpts["last"], f"out={out}")   # the same evaluation again: the same tables, rewritten
    assert again["out"] == first["out"] == str(out) and again["rows"] == first["rows"]
    assert json.loads((out / "results.json").read_text())["settings"]["k"] == 10


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"rows": []}'])
def test_out_with_a_results_json_that_cannot_be_read_is_refused(trained, tmp_path, content):
    root, ckpts = trained
    out = tmp_path / "tables"
    out.mkdir()
    (out / "results.json").write_text(content)
    with pytest.raises(FileExistsError, match="pass another out= or remove") as e:
        _eval(root, ckpts["last"], f"out={out}")
    assert str(out / "results.json") in str(e.value)
    assert (out / "results.json").read_text() == content and not (out / "results.md").exists()


def test_a_database_without_audio_records_the_directions_not_evaluated(trained, tmp_path):
    """database= a split with no audio rows: the audio directions vanished from the tables, unannounced."""
    root, ckpts = trained
    dims = {"image": DIMS["image"], "text": DIMS["text"]}
    write_split(identity_path(root / "features", store_identity("synthetic", "noaudio", synthetic.ENCODER)),
                "synthetic", "noaudio", synthetic.clustered(40, 4, dims, seed=7), synthetic.ENCODER)
    res = _eval(root, ckpts["last"], "database=noaudio", f"out={tmp_path / 'vs-noaudio'}")
    assert {r["direction"] for r in res["rows"]} == {"I→T", "T→I", "A→I", "A→T"}
    assert {r["n_database"] for r in res["rows"]} == {40}
    saved = json.loads((tmp_path / "vs-noaudio" / "results.json").read_text())
    methods = list(dict.fromkeys(r["method"] for r in res["rows"]))
    assert saved["skipped_directions"] == res["skipped_directions"] == [
        {"method": m, "direction": d, "reason": "the database split 'noaudio' has no audio rows"}
        for m in methods for d in ("I→A", "T→A")]
    md = (tmp_path / "vs-noaudio" / "results.md").read_text()
    assert "*Not evaluated, so not in the tables: I→A, T→A (the database split 'noaudio' has no audio rows).*" in md
    # the default evaluation (no separate database) skips nothing and says so
    plain = _eval(root, ckpts["last"])
    assert plain["skipped_directions"] == [] and len({r["direction"] for r in plain["rows"]}) == 6
    assert json.loads((Path(plain["out"]) / "results.json").read_text())["skipped_directions"] == []
    assert "Not evaluated" not in (Path(plain["out"]) / "results.md").read_text()
