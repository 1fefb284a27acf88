"""python -m ushash.cachesim export=exports/<name>: replay a request stream through the caches
(ushash/sim/, docs/cache.md)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from ushash.config import CONFIG_DIR
from ushash.sim.cachesim import run_cachesim


@hydra.main(config_path=str(CONFIG_DIR), config_name="cachesim", version_base="1.3")
def main(cfg: DictConfig):
    run_cachesim(cfg)


if __name__ == "__main__":
    main()
