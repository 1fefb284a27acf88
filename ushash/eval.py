"""python -m ushash.eval ckpt=checkpoints/<run>/best.ckpt

Loads a checkpoint with no config tree, opens the test split of the feature store it was trained from,
and writes results.json and results.md (every direction, both protocols, codes beside float baselines).
"""

from __future__ import annotations

from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig

from ushash import retrieval
from ushash.config import CONFIG_DIR
from ushash.features import open_split, store_path, write_json
from ushash.module import load_checkpoint

JOINT_SPACE_ENCODERS = ("openclip", "hf_clip", "clap")  # image/text (or audio/text) in one space already


def methods_for(module, encoder_name: str) -> dict:
    hp = module.hparams
    methods = {f"US-HASH {hp.bits}-bit codes": module.code_method(),
               f"float z (US-HASH head, {hp.dim}-d)": module.float_method()}
    if encoder_name in JOINT_SPACE_ENCODERS:
        methods["float (raw encoder embedding)"] = lambda m, x: ("float", np.asarray(x, dtype=np.float32))
    return methods


def run_eval(cfg: DictConfig, module=None) -> dict:
    module = module or load_checkpoint(cfg.ckpt)
    prov = module.hparams.provenance or {}
    enc = prov["encoder"]
    features_dir = cfg.features_dir or prov["features_dir"]
    split = open_split(store_path(features_dir, prov["dataset"], cfg.split, enc["name"], enc["fingerprint"]))
    rows = retrieval.evaluate(split, methods_for(module, enc["name"]), k=int(cfg.k),
                              protocols=tuple(cfg.protocols), denominator=str(cfg.denominator))
    run = prov.get("run_name", Path(str(cfg.ckpt)).parent.name)
    out = Path(cfg.out) if cfg.out else Path(cfg.paths.experiments_dir) / "eval" / run
    out.mkdir(parents=True, exist_ok=True)
    title = (f"{prov['dataset']} / {cfg.split} split, encoder {enc['name']} ({enc['fingerprint']}), "
             f"{module.hparams.bits} bits")
    table = retrieval.markdown_table(rows, k=int(cfg.k), title=title)
    result = {"checkpoint": str(cfg.ckpt), "dataset": prov["dataset"], "split": cfg.split, "encoder": enc,
              "bits": module.hparams.bits, "k": int(cfg.k), "tie_rule": "ascending database index", "rows": rows}
    write_json(out / "results.json", result)
    tmp = out / ".results.md.tmp"
    tmp.write_text(table + "\n")
    tmp.replace(out / "results.md")
    print(table)
    print(f"[eval] wrote {out / 'results.json'} and results.md")
    return {"out": str(out), "rows": rows, "table": table}


@hydra.main(config_path=str(CONFIG_DIR), config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_eval(cfg)


if __name__ == "__main__":
    main()
