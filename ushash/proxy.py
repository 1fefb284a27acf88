"""python -m ushash.proxy upstream=http://127.0.0.1:PORT export=exports/<name> [port=8471]: the caching
reverse proxy in front of an inference service (ushash/serving/proxy.py, docs/cache.md)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from ushash.config import CONFIG_DIR, quiet_third_party, user_errors
from ushash.serving.proxy import run_proxy

quiet_third_party()


@hydra.main(config_path=str(CONFIG_DIR), config_name="proxy", version_base="1.3")
@user_errors
def main(cfg: DictConfig):
    run_proxy(cfg)


if __name__ == "__main__":
    main()
