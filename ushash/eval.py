"""python -m ushash.eval ckpt=checkpoints/<run>/best.ckpt: every direction and protocol on the test split
of the checkpoint's own feature store (ushash/evaluation/evaluate.py); returns the codes' mean tie-aware
paired mAP@k (the tie-broken one with denominator=found, which has no tie-aware value)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from ushash.config import CONFIG_DIR, quiet_third_party, user_errors
from ushash.evaluation.evaluate import run_eval

quiet_third_party()


@hydra.main(config_path=str(CONFIG_DIR), config_name="eval", version_base="1.3")
@user_errors
def main(cfg: DictConfig):
    return run_eval(cfg)["score"]


if __name__ == "__main__":
    main()
