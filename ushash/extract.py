"""python -m ushash.extract data=tuxpaint encoder=offline: fill the feature store for every split."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from ushash.config import CONFIG_DIR, quiet_third_party, user_errors
from ushash.data.extract import run_extract

quiet_third_party()


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
@user_errors
def main(cfg: DictConfig):
    splits = run_extract(cfg)
    return float(sum(len(s.tables[m]) for s in splits.values() for m in s.tables))


if __name__ == "__main__":
    main()
