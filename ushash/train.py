"""python -m ushash.train data=tuxpaint encoder=offline bits=64 [method=pairwise]: train hash heads on
cached features (extracting them first if needed); returns the validation score of the kept checkpoint, so
a Hydra sweeper can optimise it. The recipe and the checkpoints: ushash/hashing/training.py."""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from ushash.config import CONFIG_DIR, quiet_third_party, user_errors
from ushash.hashing.training import run_train

log = logging.getLogger("ushash.train")

quiet_third_party()


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
@user_errors
def main(cfg: DictConfig):
    out = run_train(cfg)
    log.info("best val score %.4f (paired mAP@10 %.4f) at epoch %s: %s", out["val_score"], out["val_map@10"],
             out["best_epoch"], out["best"])
    return out["val_score"]


if __name__ == "__main__":
    main()
