"""python -m ushash.serve export=exports/<name> [port=8470]: the HTTP cache service on 127.0.0.1
(ushash/serving/service.py, docs/cache.md)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from ushash.config import CONFIG_DIR, quiet_third_party, user_errors
from ushash.serving.service import run_serve

quiet_third_party()


@hydra.main(config_path=str(CONFIG_DIR), config_name="serve", version_base="1.3")
@user_errors
def main(cfg: DictConfig):
    run_serve(cfg)


if __name__ == "__main__":
    main()
