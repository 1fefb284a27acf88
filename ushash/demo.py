"""python -m ushash.demo — the main job on the embedded default data (Tux Paint stamps).

fetch (apt-get download + dpkg -x) -> splits by stamp -> offline encoders -> feature store -> 64-bit
US-HASH training (checkpoint chosen on val) -> evaluation on test, codes beside float baselines.
"""

from __future__ import annotations

import logging
import time

import hydra
from omegaconf import DictConfig, OmegaConf

from ushash.config import CONFIG_DIR, quiet_third_party, user_errors
from ushash.evaluation.evaluate import run_eval
from ushash.data.extract import run_extract
from ushash.hashing.training import run_train

log = logging.getLogger("ushash.demo")


def run_demo(cfg: DictConfig) -> dict:
    t0 = time.perf_counter()
    splits = run_extract(cfg)
    t1 = time.perf_counter()
    trained = run_train(cfg, splits=splits)
    t2 = time.perf_counter()
    eval_cfg = OmegaConf.create({"ckpt": trained["best"], "split": cfg.eval.split, "k": cfg.eval.k,
                                 "denominator": cfg.eval.denominator, "protocols": list(cfg.eval.protocols),
                                 "features_dir": None, "out": None, "paths": OmegaConf.to_container(cfg.paths)})
    result = run_eval(eval_cfg)
    t3 = time.perf_counter()
    log.info(f"extract {t1 - t0:.0f} s, train {t2 - t1:.0f} s, eval {t3 - t2:.1f} s, total {t3 - t0:.0f} s; "
          f"checkpoint {trained['best']} (val mAP@10 {trained['val_map@10']:.3f})")
    return {**result, "train": trained, "seconds": {"extract": t1 - t0, "train": t2 - t1, "eval": t3 - t2}}

quiet_third_party()


@hydra.main(config_path=str(CONFIG_DIR), config_name="demo", version_base="1.3")
@user_errors
def main(cfg: DictConfig) -> None:
    run_demo(cfg)


if __name__ == "__main__":
    main()
