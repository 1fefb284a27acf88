"""python -m ushash.export ckpt=checkpoints/<run>/best.ckpt out=exports/<name>: a pickle-free export of a
trained head for the serving cache (ushash/serving/export.py, docs/export.md)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from ushash.config import CONFIG_DIR, quiet_third_party, user_errors
from ushash.serving.export import run_export

quiet_third_party()


@hydra.main(config_path=str(CONFIG_DIR), config_name="export", version_base="1.3")
@user_errors
def main(cfg: DictConfig):
    run_export(cfg)


if __name__ == "__main__":
    main()
