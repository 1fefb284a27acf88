"""US-HASH training on synthetic clustered features: it must beat random-hyperplane codes clearly."""

import json

import numpy as np
from pathlib import Path

import pytest

from ushash.core import codes
from ushash.evaluation import retrieval
from ushash.data import synthetic
from ushash.config import compose
from ushash.evaluation.evaluate import run_eval
from ushash.hashing.module import load_checkpoint
from ushash.hashing.training import run_train


def _cfg(tmp_path, *extra):
    return compose("config", [f"paths.root={tmp_path}", "trainer.accelerator=cpu", "trainer.max_epochs=12",
                              "model.batch_size=128", "bits=32", "trainer.enable_progress_bar=false", *extra])


def _lsh_method(dim, bits, seed=0):
    planes = np.random.default_rng(seed).normal(size=(dim, bits))
    return lambda m, x: ("codes", codes.pack(x @ planes > 0))


def test_trained_codes_beat_random_hyperplanes(tmp_path):
    dims = {"image": 48, "text": 48}
    splits = synthetic.write_synthetic(tmp_path / "features", sizes={"train": 1500, "val": 300, "test": 400},
                                       n_classes=20, dims=dims, aligned=True, noise=0.8)
    cfg = _cfg(tmp_path)
    out = run_train(cfg, splits=splits)
    assert out["val_map@10"] is not None
    module = load_checkpoint(out["best"])
    test = splits["test"]
    rows = retrieval.evaluate(test, {"ushash": module.code_method(), "lsh": _lsh_method(48, 32)},
                              protocols=("paired", "label"))
    def mean(method, protocol):
        return np.mean([r["map@10"] for r in rows if r["method"] == method and r["protocol"] == protocol])
    # Label relevance (20 classes) is the structure this data has; measured here: US-HASH 0.66, LSH 0.42.
    # (Paired relevance on unseen synthetic instances is mostly isotropic noise, which raw-space hyperplanes
    # keep and a head trained on 1,500 groups does not; it is not asserted.)
    assert mean("ushash", "label") > mean("lsh", "label") + 0.15, rows
    # trained bits are used: no bit is constant on the test set
    packed, _ = module.model.encode("image", np.asarray(test.tables["image"].x))
    bal = codes.bit_balance(packed, 32)
    assert ((bal > 0.05) & (bal < 0.95)).all(), bal


def test_checkpoint_describes_itself_and_eval_writes_tables(tmp_path):
    splits = synthetic.write_synthetic(tmp_path / "features", sizes={"train": 300, "val": 100, "test": 100},
                                       n_classes=5, dims={"image": 16, "text": 12, "audio": 8})
    out = run_train(_cfg(tmp_path, "trainer.max_epochs=2"), splits=splits)
    ecfg = compose("eval", [f"paths.root={tmp_path}", f"ckpt={out['last']}"])
    res = run_eval(ecfg)
    dirs = {r["direction"] for r in res["rows"]}
    assert dirs == {"I→T", "T→I", "I→A", "A→I", "T→A", "A→T"}
    assert {r["protocol"] for r in res["rows"]} == {"paired", "label"}
    assert all(r["denominator"] == "min" for r in res["rows"])
    assert "paired" in res["table"] and "label" in res["table"]
    assert Path(res["out"]).parent.parent == tmp_path / "experiments" / "eval"
    assert out["best"] != out["last"]
    assert json.loads((Path(res["out"]) / "results.json").read_text())["settings"]["split"] == "test"
    # every evaluation has its own folder: another split, another checkpoint of the same run, or other
    # settings never overwrite the tables of this one (they did: experiments/eval/<run>/ for all of them)
    others = [run_eval(compose("eval", [f"paths.root={tmp_path}", f"ckpt={out['last']}", *extra]))["out"]
              for extra in (["split=val"], ["k=5"])]
    others.append(run_eval(compose("eval", [f"paths.root={tmp_path}", f"ckpt={out['best']}"]))["out"])
    assert len({res["out"], *others}) == 4, others
    assert run_eval(ecfg)["out"] == res["out"]   # the same evaluation again: the same folder
    # queries from test ranked against another split (the hashing protocol's query set vs database)
    res_db = run_eval(compose("eval", [f"paths.root={tmp_path}", f"ckpt={out['last']}", "database=train"]))
    assert {r["n_database"] for r in res_db["rows"]} == {300}
    assert {r["n_queries"] for r in res_db["rows"]} == {100}
    # the checkpoint holds only plain data: it loads with weights_only=True and rebuilds without Hydra
    import torch
    ck = torch.load(out["last"], weights_only=True, map_location="cpu")
    assert ck["hyper_parameters"]["in_dims"] == {"image": 16, "text": 12, "audio": 8}


def test_an_evaluation_is_keyed_by_the_checkpoint_bytes_it_loaded(tmp_path, monkeypatch):
    """The checkpoint is read once: replaced while it is evaluated (a retrain writing best.ckpt again), the
    tables still name the bytes that made them (they were hashed from a second read, after loading)."""
    import hashlib

    from ushash.evaluation import evaluate

    splits = synthetic.write_synthetic(tmp_path / "features", sizes={"train": 200, "val": 80, "test": 80},
                                       n_classes=4, dims={"image": 8, "text": 8})
    out = run_train(_cfg(tmp_path, "trainer.max_epochs=1"), splits=splits)
    ckpt = Path(out["last"])
    original = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    loaded = evaluate.load_checkpoint

    def load_then_replace(*a, **kw):
        module = loaded(*a, **kw)
        ckpt.write_bytes(Path(out["best"]).read_bytes() + b"retrained")
        return module

    monkeypatch.setattr(evaluate, "load_checkpoint", load_then_replace)
    res = run_eval(compose("eval", [f"paths.root={tmp_path}", f"ckpt={ckpt}"]))
    assert json.loads((Path(res["out"]) / "results.json").read_text())["settings"]["checkpoint_sha256"] == original


def test_resume_from_last(tmp_path):
    splits = synthetic.write_synthetic(tmp_path / "features", sizes={"train": 200, "val": 80, "test": 80},
                                       n_classes=4, dims={"image": 8, "text": 8})
    first = run_train(_cfg(tmp_path, "trainer.max_epochs=1"), splits=splits)
    import torch
    e1 = torch.load(first["last"], weights_only=True)["epoch"]
    second = run_train(_cfg(tmp_path, "trainer.max_epochs=3"), splits=splits)
    e2 = torch.load(second["last"], weights_only=True)["epoch"]
    assert e2 > e1


def test_bad_checkpoint_is_refused(tmp_path):
    bad = tmp_path / "x.ckpt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable ushash checkpoint"):
        load_checkpoint(bad)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.ckpt")


def test_resume_refuses_other_settings(tmp_path):
    splits = synthetic.write_synthetic(tmp_path / "features", sizes={"train": 120, "val": 40, "test": 40},
                                       n_classes=4, dims={"image": 8, "text": 8})
    run_train(_cfg(tmp_path, "trainer.max_epochs=1"), splits=splits)
    with pytest.raises(ValueError, match="other settings.*temperature"):
        run_train(_cfg(tmp_path, "trainer.max_epochs=2", "model.temperature=0.3"), splits=splits)
    out = run_train(_cfg(tmp_path, "trainer.max_epochs=1", "model.temperature=0.3", "resume=false"), splits=splits)
    assert out["val_map@10"] is not None



@pytest.mark.parametrize("override, name", [("seed=7", "seed"), ("model.batch_size=16", "batch_size"),
                                            ("space.reg=3.0", "space"), ("early_stop.patience=1", "early_stop"),
                                            ("+trainer.gradient_clip_val=0.01", "trainer")])
def test_resume_refuses_settings_outside_the_hyper_parameters(tmp_path, override, name):
    """The seed, batch size, space, early stopping and trainer are not the module's hyper-parameters, yet a
    run resumed under another of them would mix two runs (and last.ckpt would record the second's)."""
    splits = synthetic.write_synthetic(tmp_path / "features", sizes={"train": 120, "val": 40, "test": 40},
                                       n_classes=4, dims={"image": 8, "text": 8})
    run_train(_cfg(tmp_path, "run_name=r", "trainer.max_epochs=1"), splits=splits)  # one folder whatever the seed
    with pytest.raises(ValueError, match=f"other settings \\({name}\\)"):
        run_train(_cfg(tmp_path, "run_name=r", "trainer.max_epochs=2", override), splits=splits)
    # reporting is not a setting: the run resumes
    out = run_train(_cfg(tmp_path, "run_name=r", "trainer.max_epochs=2", "trainer.log_every_n_steps=1"), splits=splits)
    assert len(out["val_scores"]) == 3  # the start and two epochs: the second continued the first


def test_a_run_over_other_features_trains_afresh_and_keeps_the_old_one(tmp_path, caplog):
    """Rerun under the same name after the features changed (a store made again): the old run is moved to
    checkpoints/stale/ and the head is trained from its start, not resumed from the old features' weights;
    the same features resume as before."""
    import torch

    caplog.set_level("INFO", logger="ushash")
    sizes = {"train": 120, "val": 40, "test": 40}
    splits = synthetic.write_synthetic(tmp_path / "features", sizes=sizes, n_classes=4, dims={"image": 8, "text": 8})
    first = run_train(_cfg(tmp_path, "trainer.max_epochs=2"), splits=splits)
    prov = torch.load(first["last"], weights_only=True)["hyper_parameters"]["provenance"]
    assert set(prov["content"]) == {"train", "val"}
    other = synthetic.write_synthetic(tmp_path / "other", sizes=sizes, n_classes=4, dims={"image": 8, "text": 8},
                                      centres_seed=7)
    second = run_train(_cfg(tmp_path, "trainer.max_epochs=2"), splits=other)
    assert "resuming from" not in caplog.text and "trained on other features" in caplog.text
    run_dir = Path(first["run_dir"])
    aside = run_dir.parent / "stale" / run_dir.name
    assert (aside / "last.ckpt").exists() and Path(second["run_dir"]) == run_dir
    assert torch.load(aside / "last.ckpt", weights_only=True)["hyper_parameters"]["provenance"] == prov
    run_train(_cfg(tmp_path, "trainer.max_epochs=3"), splits=other)
    assert "resuming from" in caplog.text


def test_a_run_of_other_code_or_packages_trains_afresh_and_keeps_the_old_one(tmp_path, caplog, monkeypatch):
    """Rerun under the same name after the code (or a numerical package) changed: a finished run was returned
    as it was, byte for byte, and a longer one continued the old code's weights under the new. The old run is
    moved to checkpoints/stale/ and the head trained from its start; the same code resumes as before."""
    import torch

    from ushash.hashing import training

    caplog.set_level("INFO", logger="ushash")
    splits = synthetic.write_synthetic(tmp_path / "features", sizes={"train": 120, "val": 40, "test": 40},
                                       n_classes=4, dims={"image": 8, "text": 8})
    first = run_train(_cfg(tmp_path, "trainer.max_epochs=2"), splits=splits)
    made = torch.load(first["last"], weights_only=True)["hyper_parameters"]["provenance"]["made_by"]
    assert made == training.trained_by() and set(made) == {"code", "versions"}
    monkeypatch.setattr(training, "trained_by", lambda: {**made, "code": "0" * 16})
    second = run_train(_cfg(tmp_path, "trainer.max_epochs=2"), splits=splits)
    assert "resuming from" not in caplog.text and "trained by other code or packages" in caplog.text
    run_dir = Path(first["run_dir"])
    assert (run_dir.parent / "stale" / run_dir.name / "last.ckpt").exists()
    assert len(second["val_scores"]) == 3   # trained from its start: the initial weights and two epochs
    run_train(_cfg(tmp_path, "trainer.max_epochs=3"), splits=splits)
    assert "resuming from" in caplog.text


def test_resume_takes_a_setting_the_checkpoint_predates_as_its_default(tmp_path):
    """A checkpoint written before an option existed (no such hyper-parameter in it) resumes under that
    option's default, and is refused under another value."""
    import torch
    splits = synthetic.write_synthetic(tmp_path / "features", sizes={"train": 120, "val": 40, "test": 40},
                                       n_classes=4, dims={"image": 8, "text": 8})
    out = run_train(_cfg(tmp_path, "trainer.max_epochs=1"), splits=splits)
    last = Path(out["last"])
    ck = torch.load(last, map_location="cpu", weights_only=True)
    del ck["hyper_parameters"]["distill_kernel"]
    torch.save(ck, last)
    assert run_train(_cfg(tmp_path, "trainer.max_epochs=2"), splits=splits)["val_map@10"] is not None
    with pytest.raises(ValueError, match="other settings.*distill_kernel"):
        run_train(_cfg(tmp_path, "trainer.max_epochs=3", "model.distill_kernel=angular"), splits=splits)


def test_a_checkpoint_from_before_the_weight_average_resumes_only_as_it_was_trained(tmp_path):
    """A checkpoint saved before `ema_epochs` existed trained without a weight average, and its
    `head_lr: None` meant lr / 10 (init gcca), not lr as now: resuming it under the new defaults, or under
    its old lr alone, is refused (the heads' rate and the average would change mid-run); passing the values
    it was trained with resumes it."""
    import torch
    splits = synthetic.write_synthetic(tmp_path / "features", sizes={"train": 120, "val": 40, "test": 40},
                                       n_classes=4, dims={"image": 8, "text": 8})
    old = ["model.lr=0.001", "model.head_lr=0.0001", "model.ema_epochs=null"]
    out = run_train(_cfg(tmp_path, "trainer.max_epochs=1", *old), splits=splits)
    last = Path(out["last"])
    ck = torch.load(last, map_location="cpu", weights_only=True)
    del ck["hyper_parameters"]["ema_epochs"]
    ck["hyper_parameters"]["head_lr"] = None
    torch.save(ck, last)
    with pytest.raises(ValueError, match=r"other settings \(ema_epochs, head_lr, lr\)"):
        run_train(_cfg(tmp_path, "trainer.max_epochs=2"), splits=splits)
    with pytest.raises(ValueError, match=r"other settings \(ema_epochs, head_lr\)"):
        run_train(_cfg(tmp_path, "trainer.max_epochs=2", "model.lr=0.001"), splits=splits)
    resumed = run_train(_cfg(tmp_path, "trainer.max_epochs=2", *old), splits=splits)
    assert torch.load(resumed["last"], map_location="cpu", weights_only=True)["epoch"] == 2


class _Cut(Exception):
    pass


def _cut_at_epoch(monkeypatch, epoch):
    """Make run_train's Trainer raise at the start of training epoch `epoch` (0-based): a run killed there."""
    import pytorch_lightning as pl

    from ushash.hashing import training

    class Cut(pl.Callback):
        def on_train_epoch_start(self, trainer, module):
            if trainer.current_epoch == epoch:
                raise _Cut(f"cut at epoch {epoch}")

    class Trainer(pl.Trainer):
        def __init__(self, *a, callbacks=(), **k):
            super().__init__(*a, callbacks=[*callbacks, Cut()], **k)

    monkeypatch.setattr(training.pl, "Trainer", Trainer)


def test_a_run_cut_mid_training_resumes_to_the_model_an_uncut_run_makes(tmp_path, monkeypatch):
    """last.ckpt is written after every validation (Lightning's ModelCheckpoint without a top-k wrote it only
    when fit ended, so a run killed mid-training had nothing to resume and started over), and it holds the
    random state the run draws from next (the loader's shuffle, the batcher's row choice): resumed, the run
    trains the same weights and records the same val scores as one that was never cut."""
    import torch

    splits = synthetic.write_synthetic(tmp_path / "features", sizes={"train": 200, "val": 60, "test": 20},
                                       n_classes=4, dims={"image": 8, "text": 8, "audio": 6})
    cfg = ["trainer.max_epochs=4", "bits=16", "model.batch_size=32", "early_stop.patience=null"]
    whole = run_train(_cfg(tmp_path, "run_name=whole", *cfg), splits=splits)
    with monkeypatch.context() as m:
        _cut_at_epoch(m, 2)
        with pytest.raises(_Cut):
            run_train(_cfg(tmp_path, "run_name=cut", *cfg), splits=splits)
    last = tmp_path / "checkpoints" / "cut" / "last.ckpt"
    assert last.exists(), "a run cut after two epochs left no last.ckpt"
    assert torch.load(last, weights_only=True)["epoch"] == 1
    resumed = run_train(_cfg(tmp_path, "run_name=cut", *cfg), splits=splits)
    assert resumed["val_scores"] == whole["val_scores"]
    a, b = torch.load(whole["last"], weights_only=True), torch.load(resumed["last"], weights_only=True)
    assert (a["epoch"], a["global_step"]) == (b["epoch"], b["global_step"])
    for key in ("state_dict", "current_model_state"):
        for k, v in a[key].items():
            assert torch.equal(b[key][k], v), (key, k)


def test_a_checkpoint_write_cut_short_leaves_the_previous_last_ckpt_whole(tmp_path, monkeypatch):
    """last.ckpt is written beside itself and renamed into place: a run killed while saving it leaves the
    previous one, readable and resumable (written in place, it was a truncated file the rerun failed on)."""
    import torch
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

    splits = synthetic.write_synthetic(tmp_path / "features", sizes={"train": 120, "val": 40, "test": 40},
                                       n_classes=4, dims={"image": 8, "text": 8})
    first = run_train(_cfg(tmp_path, "trainer.max_epochs=1", "bits=16"), splits=splits)
    before = Path(first["last"]).read_bytes()
    real = TorchCheckpointIO.save_checkpoint

    def killed_while_writing(self, checkpoint, path, storage_options=None):
        if "last" in Path(path).name:
            Path(path).write_bytes(before[: len(before) // 3])
            raise _Cut("killed while writing")
        return real(self, checkpoint, path, storage_options)

    with monkeypatch.context() as m:
        m.setattr(TorchCheckpointIO, "save_checkpoint", killed_while_writing)
        with pytest.raises(_Cut):
            run_train(_cfg(tmp_path, "trainer.max_epochs=2", "bits=16"), splits=splits)
    assert Path(first["last"]).read_bytes() == before
    out = run_train(_cfg(tmp_path, "trainer.max_epochs=2", "bits=16"), splits=splits)
    assert torch.load(out["last"], weights_only=True)["epoch"] == 2


def test_an_unreadable_last_ckpt_is_refused_in_one_line_naming_it(tmp_path):
    """Resuming from a last.ckpt that cannot be read was a traceback from inside torch.load; it is a
    ValueError naming the file and the two ways on, and resume=false trains the run afresh over it."""
    import torch

    splits = synthetic.write_synthetic(tmp_path / "features", sizes={"train": 120, "val": 40, "test": 40},
                                       n_classes=4, dims={"image": 8, "text": 8})
    last = tmp_path / "checkpoints" / "r" / "last.ckpt"
    last.parent.mkdir(parents=True)
    last.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"last.ckpt cannot be read as a checkpoint .*resume=false") as e:
        run_train(_cfg(tmp_path, "run_name=r", "trainer.max_epochs=1", "bits=16"), splits=splits)
    assert "\n" not in str(e.value)
    out = run_train(_cfg(tmp_path, "run_name=r", "trainer.max_epochs=1", "bits=16", "resume=false"), splits=splits)
    assert torch.load(out["last"], weights_only=True)["epoch"] == 1


def test_checkpoints_reach_the_disk_before_they_are_renamed_into_place(tmp_path, monkeypatch):
    """best.ckpt and last.ckpt were renamed into place unsynced: after a power cut the name could hold a short
    or empty file. Each temporary checkpoint is fsynced before its rename."""
    import os

    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc to name the fsynced files")
    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def replace(a, b):
        renamed.append((os.path.realpath(a), Path(b).name, list(synced)))
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    splits = synthetic.write_synthetic(tmp_path / "features", sizes={"train": 60, "val": 30, "test": 30}, n_classes=6,
                                       dims={"image": 8, "text": 8})
    run_train(_cfg(tmp_path, "trainer.max_epochs=1"), splits=splits)
    ckpts = [(a, b, s) for a, b, s in renamed if b in ("best.ckpt", "last.ckpt")]
    assert {b for _, b, _ in ckpts} == {"best.ckpt", "last.ckpt"}
    for tmp, name, before in ckpts:
        assert tmp in before, f"{name} renamed from {tmp} unsynced"
