"""python -m ushash.sweep -m experiment=sweep_tuxpaint: methods x bits x seeds with Hydra multirun
(ushash/evaluation/sweep.py); returns the run's selection score on val (what a Hydra sweeper optimises)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from ushash.config import CONFIG_DIR, quiet_third_party, user_errors
from ushash.evaluation.sweep import primary_metric, run_sweep

quiet_third_party()


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
@user_errors
def main(cfg: DictConfig):
    result = run_sweep(cfg)
    return primary_metric(result) if result and "rows" in result else None


if __name__ == "__main__":
    main()
