"""python -m ushash.search experiment=sweep_tuxpaint64 method=ushash [search.trials=24]: a budgeted search
of a trained method's settings on val (ushash/evaluation/search.py); returns the chosen trial's val score."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from ushash.config import CONFIG_DIR, quiet_third_party, user_errors
from ushash.evaluation.search import run_search

quiet_third_party()


@hydra.main(config_path=str(CONFIG_DIR), config_name="search", version_base="1.3")
@user_errors
def main(cfg: DictConfig):
    return run_search(cfg)["chosen"]["val_score"]


if __name__ == "__main__":
    main()
