"""The entry points: a user's mistake is one line and exit status 2; a bug keeps its traceback."""

import logging

import pytest

from ushash.config import user_errors
from ushash.data.store import FeatureStoreError


@pytest.mark.parametrize("err", [ValueError("bits=12 is not a multiple of 8; use 16, 32, 64 or 128"),
                                 FileExistsError("exports/x exists; pass overwrite=true or another out="),
                                 FeatureStoreError("no feature store at data/features/x; run python -m ushash.extract")])
def test_a_mistake_is_one_line_and_status_2(err, caplog, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def main(cfg):
        raise err

    with caplog.at_level(logging.ERROR, logger="ushash"), pytest.raises(SystemExit) as e:
        user_errors(main)({})
    assert e.value.code == 2
    (rec,) = caplog.records
    assert rec.getMessage().startswith(str(err)) and "\n" not in rec.getMessage() and rec.exc_info is None


def test_a_required_setting_left_out_is_one_line_naming_it(caplog, monkeypatch):
    """A `???` key read before it was given (export's ckpt=, serve's export=) is a mistake, not a bug."""
    from omegaconf import MISSING, OmegaConf
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    cfg = OmegaConf.create({"ckpt": MISSING})

    with caplog.at_level(logging.ERROR, logger="ushash"), pytest.raises(SystemExit) as e:
        user_errors(lambda c: c.ckpt)(cfg)
    assert e.value.code == 2
    (rec,) = caplog.records
    assert rec.getMessage().startswith("ckpt is required: add ckpt=... to the command") and "\n" not in rec.getMessage()


def test_a_bug_keeps_its_traceback_and_full_error_shows_mistakes_too(monkeypatch):
    def bug(cfg):
        raise TypeError("unsupported operand")

    with pytest.raises(TypeError):
        user_errors(bug)({})
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")

    def mistake(cfg):
        raise ValueError("bad")

    with pytest.raises(ValueError):
        user_errors(mistake)({})


def test_a_verb_returns_what_main_returns():
    assert user_errors(lambda cfg: 0.5)({}) == 0.5


@pytest.mark.parametrize("verb", ["config", "demo", "eval", "export", "serve", "cachesim", "calibrate", "proxy"])
def test_help_lists_exactly_the_groups_a_verb_reads(verb):
    """`--help` names the verb's own config groups and every option of each, nothing else."""
    import re

    import yaml

    from ushash.config import CONFIG_DIR

    def header(name):
        doc = yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())
        return doc, (doc.get("hydra", {}).get("help", {}).get("header"))

    doc, text = header(verb)
    parents = [d for d in doc["defaults"] if isinstance(d, str) and d not in ("_self_",) and not d.startswith("schema")]
    groups = {next(iter(d)) for d in doc["defaults"] if isinstance(d, dict) and not next(iter(d)).startswith("override")}
    for parent in parents:  # demo extends config
        groups |= {next(iter(d)) for d in header(parent)[0]["defaults"]
                   if isinstance(d, dict) and not next(iter(d)).startswith("override")}
    listed = dict(re.findall(r"^\s+(\w+): (.+)$", text.split("== Config groups (group=option) ==")[1], re.M))
    assert set(listed) == groups
    for g, options in listed.items():
        assert sorted(o.strip() for o in options.split("|")) == sorted(p.stem for p in (CONFIG_DIR / g).glob("*.yaml"))


def test_the_console_shows_only_ushash_info_lines(monkeypatch):
    import logging

    from ushash.config import OwnInfoFilter

    f = OwnInfoFilter()

    def rec(name, level):
        return logging.LogRecord(name, level, __file__, 1, "m", None, None)

    monkeypatch.setattr(logging.getLogger(), "level", logging.WARNING)
    assert f.filter(rec("ushash.train", logging.INFO)) and f.filter(rec("ushash", logging.INFO))
    assert not f.filter(rec("pytorch_lightning.utilities.rank_zero", logging.INFO))  # "GPU available", tips
    assert not f.filter(rec("faiss.loader", logging.INFO)) and not f.filter(rec("ushashx", logging.INFO))
    assert f.filter(rec("pytorch_lightning", logging.WARNING))
    monkeypatch.setattr(logging.getLogger(), "level", logging.DEBUG)  # hydra.verbose=true
    assert f.filter(rec("faiss.loader", logging.INFO))


def readme_verbs():
    """The README's commands, in order: (verb, overrides) from the block under "## The verbs, in order"."""
    from ushash.config import ROOT

    text = (ROOT / "README.md").read_text()
    section = text.split("## The verbs, in order", 1)[1]
    block = next(b for b in section.split("\n\n") if b.startswith("    python -m "))
    out = []
    for line in block.splitlines():
        words = line.split("#", 1)[0].split()
        assert words[:2] == ["python", "-m"] and words[2].startswith("ushash."), line
        out.append((words[2].split(".", 1)[1], [w for w in words[3:] if w != "-m"]))
    return out


def test_readme_commands_compose_in_order():
    """Every README command is a valid config of its verb, and each checkpoint or export it reads is one an
    earlier command writes (the commands work in the order written)."""
    from ushash.config import compose

    import ushash.serving.service  # noqa: F401  (registers the serve schema)
    import ushash.serving.export  # noqa: F401
    import ushash.sim  # noqa: F401
    import ushash.sim.calibrate  # noqa: F401  (registers the calibrate schema)

    names = {"extract": "config", "train": "config", "sweep": "config", "eval": "eval", "export": "export",
             "serve": "serve", "cachesim": "cachesim", "calibrate": "calibrate"}
    verbs = readme_verbs()
    assert [v for v, _ in verbs] == ["extract", "train", "eval", "export", "cachesim", "calibrate", "serve", "sweep"]
    made: set[str] = set()
    for verb, overrides in verbs:
        cfg = compose(names[verb], overrides)
        if verb == "train":
            made.add(f"checkpoints/{cfg.run_name}/best.ckpt")
        for key in ("ckpt", "export"):
            if key in cfg and cfg[key]:
                assert cfg[key] in made, f"{verb} reads {cfg[key]} before a command writes it"
        if verb == "export":
            made.add(cfg.out)


def test_a_wrong_code_length_is_refused_before_any_extraction(tmp_path, monkeypatch):
    from ushash.config import compose
    from ushash.evaluation import sweep
    from ushash.hashing import training

    def no_extraction(*a, **k):
        raise AssertionError("extraction ran before bits was checked")

    monkeypatch.setattr(training, "run_extract", no_extraction)
    cfg = compose("config", [f"paths.root={tmp_path}", "bits=12"])
    with pytest.raises(ValueError, match="bits must be a multiple of 8"):
        training.run_train(cfg)
    with pytest.raises(ValueError, match="bits must be a multiple of 8"):
        sweep.run_one(compose("config", [f"paths.root={tmp_path}", "bits=12", "experiment=sweep_synthetic"]))


@pytest.mark.parametrize("override, named", [
    ("model.lr=-1", "model.lr=-1.0"), ("model.head_lr=-0.1", "model.head_lr=-0.1"),
    ("model.weight_decay=-1", "model.weight_decay"), ("model.batch_size=0", "model.batch_size=0"),
    ("early_stop.patience=0", "early_stop.patience=0"), ("early_stop.patience=-2", "early_stop.patience=-2"),
    ("model.loss.distill=-1", "model.loss.distill=-1.0"), ("model.beta_start=0", "model.beta_start"),
    ("model.relax=sgn", "model.relax='sgn'"), ("seed=-1", "seed=-1"), ("model.dropout=1.5", "model.dropout"),
    ("model.init=random model.dim=0", "model.dim=0"), ("model.init=random model.layers=0", "model.layers=0"),
    ("model.init=xavier", "model.init='xavier'"), ("trainer.max_epochs=-1", "trainer.max_epochs=-1"),
    ("+trainer.accumulate_grad_batches=2", "trainer.accumulate_grad_batches=2"),
    ("+trainer.val_check_interval=0.5", "trainer.val_check_interval=0.5"),
    ("+trainer.val_check_interval=1", "trainer.val_check_interval=1"),
    ("trainer.precision=bf16-true", "trainer.precision='bf16-true'"),
    ("trainer.precision=64-true", "trainer.precision='64-true'")])
def test_a_bad_training_setting_is_refused_by_name_before_any_extraction(tmp_path, monkeypatch, override, named):
    """These failed deep in torch after the extraction and the closed-form fit (a negative lr, a batch of 0,
    beta_start=0 a ZeroDivisionError traceback, bf16-true or 64-true heads fed float32), or trained without a
    word: a negative head lr or loss weight (gradient ascent), a 0-d or 0-layer head, patience 0 read as "never
    stop" and a negative one as "already stopped", max_epochs=-1 (schedules constant or cycling each epoch),
    accumulated batches (the beta schedule ended at a quarter of its span), validation within an epoch (a
    resumed run drew another order). Each is one line naming the setting, status 2, before anything is
    extracted."""
    from ushash.config import compose
    from ushash.hashing import training

    def no_extraction(*a, **k):
        raise AssertionError("extraction ran before the settings were checked")

    monkeypatch.setattr(training, "run_extract", no_extraction)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    cfg = compose("config", [f"paths.root={tmp_path}", *override.split()])
    with pytest.raises(ValueError) as e:
        training.run_train(cfg)
    assert str(e.value).startswith(named) and "\n" not in str(e.value)
    with pytest.raises(SystemExit) as ex:
        user_errors(training.run_train)(cfg)
    assert ex.value.code == 2


def test_a_trainer_setting_lightning_refuses_is_one_line_and_status_2(caplog, monkeypatch):
    """trainer.devices=0 or an accelerator that is not there: Lightning's MisconfigurationException was a
    traceback with status 1."""
    from lightning_fabric.utilities.exceptions import MisconfigurationException
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def main(cfg):
        raise MisconfigurationException("`Trainer(devices=0)` value is not a valid input using cpu accelerator.")

    with caplog.at_level(logging.ERROR, logger="ushash"), pytest.raises(SystemExit) as e:
        user_errors(main)({})
    assert e.value.code == 2
    (rec,) = caplog.records
    assert "trainer settings (trainer.*)" in rec.getMessage() and "devices=0" in rec.getMessage()
